"""The batched, on-device acceptance step over token trees
(specdec/maths/batched_tree_acceptance.py) against the reference it implements
(specdec/maths/tree_acceptance.py): greedy walks equal accept_tree_greedy's on many random
trees, and sampled walks accept_tree_sampled's, row by row, given the same uniforms (random
trees, p, sparse q and seeds); sampled output follows p (one pooled chi-square over the first
token and the 2-token path, one-hot and non-one-hot q, trees whose children are all rejected);
and through the graph engine's DeviceVerification, a batch of trees and chains with different seeds
gives each row what it gets alone, greedy rows what the host verifier gives.

Here the service tests; the other tiers' are in tests/unit/test_batched_tree_acceptance.py.
"""

from __future__ import annotations

import pytest

from specdec.config import TargetConfig
from specdec.runtime.graph.device_verification import DeviceVerification
from specdec.runtime.engines import engine_from_config
from specdec.runtime.verification import HostVerification
from specdec.types import SamplingParams, SparseDist
from tests.unit.test_batched_tree_acceptance import VOCAB


@pytest.fixture(scope="module")
def graph_target(small_vocab_models):
    """The 12-token target on the graph engine, float64."""
    return engine_from_config(TargetConfig(model=small_vocab_models["target"], backend="graph", dtype="float64",
                                           kv_cache_bytes=8 << 20))


HISTORY = [5, 9, 1, 3, 10, 7, 2]


def greedy_next(target, tokens: list[int], n: int) -> list[int]:
    """The target's own n greedy tokens after `tokens`."""
    out: list[int] = []
    for _ in range(n):
        entry, feed = target.begin("greedy", 0, 0, tokens + out)
        out.append(int(target.forward("greedy", entry, feed, 1)[-1].argmax()))
        target.release("greedy")
        target.finish(())
    return out


def others(avoid: int, n: int) -> list[int]:
    """n tokens other than `avoid` (siblings the target rejects)."""
    return [t for t in range(VOCAB) if t != avoid][:n]


def rows_of(target) -> list[tuple]:
    """(drafts, parents (empty: a chain), sampling, seed) per row; the greedy trees hold the
    target's own path beside rejected siblings (row 3: five children of the root, the 4th its
    token; row 4: down to a leaf, so a bonus)."""
    a = greedy_next(target, HISTORY + [3], 3)
    b = greedy_next(target, HISTORY + [4], 3)
    return [
        ((4, 6, 8, 1, 2, 3), (0, 0, 0, 1, 1, 4), SamplingParams(temperature=1.0), 11),
        ((4, 6, 8), (), SamplingParams(temperature=0.8, top_k=6), 12),
        ((3, 9, 5, 6, 0), (0, 1, 1, 0, 4), SamplingParams(temperature=1.3), 13),
        ((*others(a[0], 3), a[0], others(a[0], 4)[3], a[1], others(a[2], 1)[0]), (0, 0, 0, 0, 0, 4, 6),
         SamplingParams(temperature=0.0), 14),
        ((b[0], others(b[0], 1)[0], others(b[1], 1)[0], b[1], b[2]), (0, 0, 1, 1, 4), SamplingParams(temperature=0.0),
         15),
    ]


def verify(verifier, rows, prefix="s"):
    """One verify_batch over `rows`, each its own fresh session of HISTORY: (verdict, the
    session's tokens after) per row; q one-hot (as prompt lookup's or a rank-picked tree)."""
    calls = [verifier.call(f"{prefix}{i}", 0, 0, HISTORY + [i], list(drafts),
                           [SparseDist.one_hot(t) for t in drafts] if not params.greedy else [],
                           params, seed, top_logprobs=2, draft_parents=parents)
             for i, (drafts, parents, params, seed) in rows]
    verdicts = verifier.verify_batch(calls)
    kept = [list(verifier.engine.caches.get(call.session_id).tokens) for call in calls]
    for call in calls:
        verifier.engine.release(call.session_id)
    verifier.engine.finish(())
    return list(zip(verdicts, kept))


def test_a_row_decides_alike_alone_and_beside_others_and_greedy_rows_as_the_host(graph_target):
    rows = rows_of(graph_target)
    device = graph_target.verification()
    assert isinstance(device, DeviceVerification)
    together = verify(device, list(enumerate(rows)))
    assert device.decided == {"chains": 1, "trees": 4}  # every row on the device, none on the host
    for i, row in enumerate(rows):
        alone = verify(device, [(i, row)], prefix="alone")
        assert alone == [together[i]], i
    for i, (verdict, kept) in enumerate(together):
        assert not isinstance(verdict, Exception), verdict
        assert kept == HISTORY + [i] + verdict.committed(list(rows[i][0]))[:-1]  # only the accepted path's K/V
        assert len(verdict.logprobs) == verdict.num_accepted + 1
    assert [(v.accepted_nodes, v.is_bonus) for v, _ in together[3:]] == [((3, 5), False), ((0, 3, 4), True)]
    host = verify(HostVerification(graph_target), [(i, rows[i]) for i in (3, 4)])
    assert [together[3], together[4]] == host  # greedy trees: the host walk's path, token, K/V, logprobs


def test_a_tree_too_wide_for_the_device_step_is_decided_on_the_host(graph_target, monkeypatch):
    import specdec.maths.batched_tree_acceptance as module

    monkeypatch.setattr(module, "MAX_POINTS", 4)  # 3 children × (one-hot q + 1) = 6 points: too many
    rows = rows_of(graph_target)
    device = graph_target.verification()
    (verdict, kept), = verify(device, [(0, rows[0])])
    assert device.decided == {"chains": 0, "trees": 0}  # the host walk decided it
    assert kept == HISTORY + [0] + verdict.committed(list(rows[0][0]))[:-1]
    (on_device, _), = verify(device, [(4, rows[4])])  # greedy, two children of a node: 2 × 1 points fit
    assert device.decided["trees"] == 1 and on_device.accepted_nodes == (0, 3, 4)
