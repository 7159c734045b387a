"""The two model tiers the coordinator calls: each has its replicas, and each session has its
place on one replica of each."""

from __future__ import annotations

from enum import StrEnum

from specdec.cores import compete
from specdec.types import CoreSharing, ModelDescription


class Tier(StrEnum):
    DRAFT = "draft"    # the draft service: proposes tokens
    TARGET = "target"  # the target service: verifies them


def tiers_compete(setting: CoreSharing, draft: ModelDescription, target: ModelDescription) -> bool:
    """Whether the draft's forwards slow the target's when both run at once (--tiers-share-cores):
    as the setting says, or under auto as the two replicas' CPU placements say."""
    if setting == CoreSharing.AUTO:
        return compete(draft.cpu, target.cpu)
    return setting == CoreSharing.YES
