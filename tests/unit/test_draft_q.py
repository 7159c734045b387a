"""The target does not trust the draft's distributions: every bad row is INVALID_ARGUMENT naming it.

Here the unit tests; the other tiers' are in tests/e2e/test_draft_q.py. The tier split shares one description: see tests/e2e/test_draft_q.py.
"""

from __future__ import annotations

import pytest
import torch

from specdec.maths.draft_q import DraftQ
from specdec.errors import InvalidArgument
from specdec.types import SparseDist


def test_rows_stay_sparse_and_residual_uses_only_listed_ids():
    q = DraftQ.from_sparse([SparseDist((2, 0), (0.6, 0.4))], [2], vocab=1000)
    assert q.ids[0].shape == (2,) and float(q.of_drafts[0]) == pytest.approx(0.6)
    p = torch.full((1000,), 1e-3)
    residual = q.residual(0, p)
    assert residual[2] == 0 and residual[0] == 0 and residual[1] == pytest.approx(1e-3)


def test_tolerance_allows_float32_rounding_only():
    DraftQ.from_sparse([SparseDist((1, 2), (0.5000004, 0.4999999))], [1], vocab=10)
    with pytest.raises(InvalidArgument, match="sum to"):
        DraftQ.from_sparse([SparseDist((1, 2), (0.52, 0.5))], [1], vocab=10)
