"""The two model tiers the coordinator calls: each has its replicas, and each session has its
place on one replica of each."""

from __future__ import annotations

from enum import StrEnum


class Tier(StrEnum):
    DRAFT = "draft"    # the draft service: proposes tokens
    TARGET = "target"  # the target service: verifies them
