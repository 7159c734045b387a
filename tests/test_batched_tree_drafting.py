"""A depth of every tree at once on the device (specdec/runtime/graph/batched_tree_drafting.py, as
graph/tree_loop.py runs it): over
many random logits and warps — greedy, sampled with top-k, top-p and temperature, ties — the
trees are the host loop's (tree_drafting.extend), node for node, in order, and so is the cut;
the frontier the device loop (graph/tree_loop.py) carries to the next depth is the host's."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.maths.tree import TREE_WIDTH
from specdec.runtime.graph.batched_proposal import RowWarps
from specdec.runtime.graph.batched_tree_drafting import DepthInputs, keep_slots, next_inputs, pick_depth
from specdec.runtime.tree_drafting import Growing, cut, extend
from specdec.types import SamplingParams

pytestmark = pytest.mark.unit


def depth_inputs(live: list[Growing], rows: int) -> DepthInputs:
    """What a depth's selection reads, from the host's trees (frontiers padded to `rows`)."""
    above, flags, spine = [], [], []
    for g in live:
        pad = rows - len(g.frontier)
        above.append([1.0 if node < 0 else g.scores[node] for node in g.frontier] + [0.0] * pad)
        flags.append([True] * len(g.frontier) + [False] * pad)
        parent = g.spine_parent()
        spine.append(g.frontier.index(parent) if parent in g.frontier else -1)
    return DepthInputs(torch.tensor(above, dtype=torch.float64), torch.tensor(flags), torch.tensor(spine))


def extend_on_device(live: list[Growing], logits: list[torch.Tensor]) -> DepthInputs:
    """A depth of every tree at once as graph/tree_loop.py picks it (`pick_depth`), read back
    and added to the host's trees (`keep_slots`, as DeviceDrafting does); returns what the loop
    carries to the next depth (`next_inputs`)."""
    rows = max(len(g.frontier) for g in live)
    padded = torch.stack([torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0])) for x in logits])  # [C, F, vocab]
    params = [g.params for g in live for _ in range(rows)]
    state = depth_inputs(live, rows)
    kept = pick_depth(padded, state, params, RowWarps.of(params))  # [C, n, 4]
    w = min(TREE_WIDTH, padded.shape[-1])
    for g, slots in zip(live, kept.tolist()):
        keep_slots(g, slots, w)
    return next_inputs(kept, state, w)


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kind = rng.choice(["greedy", "plain", "top_k", "top_p", "both", "wide_k"])
    if kind == "greedy":
        return SamplingParams(temperature=0.0)
    temperature = rng.choice([0.5, 0.7, 1.0, 1.3])
    top_k = {"top_k": rng.randint(1, 4), "both": rng.randint(2, 6), "wide_k": rng.randint(5, vocab + 2)}.get(kind, 0)
    top_p = rng.choice([0.3, 0.6, 0.9]) if kind in ("top_p", "both") else 1.0
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def random_logits(rows: int, vocab: int, rng: random.Random, generator: torch.Generator) -> torch.Tensor:
    """Rows of logits, some with ties (a few values repeated), some peaked."""
    kind = rng.choice(["normal", "ties", "peaked"])
    if kind == "ties":
        return torch.randint(0, 3, (rows, vocab), generator=generator).float()
    logits = torch.randn((rows, vocab), generator=generator) * (8.0 if kind == "peaked" else 1.5)
    return logits


def state(g: Growing) -> tuple:
    return (g.tokens, g.parents, g.scores, g.frontier, g.spine, g.grown)


@pytest.mark.parametrize("seed", range(12))
def test_a_batch_of_trees_grows_as_the_host_loop_grows_each(seed):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    vocab = rng.choice([3, 6, 20, 50])
    calls = rng.randint(1, 5)
    host, device = [], []
    for i in range(calls):
        params, depths, budget = random_params(rng, vocab), rng.randint(1, 5), rng.randint(2, 12)
        host.append(Growing(i, f"s{i}", None, params, depths, budget, base=3))
        device.append(Growing(i, f"s{i}", None, params, depths, budget, base=3))
    while device:
        logits = [random_logits(len(g.frontier), vocab, rng, generator) for g in device]
        for g, row_logits in zip(host, logits):
            extend(g, row_logits)
        carried = extend_on_device(device, logits)
        for h, d in zip(host, device):
            assert state(d) == state(h), (h.params, h.grown)
        # what the device loop carries to the next depth is what the host's trees say it is
        want = depth_inputs(device, TREE_WIDTH)
        assert torch.equal(carried.live, want.live) and torch.equal(carried.spine_row, want.spine_row)
        assert torch.equal(carried.above, want.above)
        keep = [i for i, g in enumerate(device) if g.grown < g.depths and g.frontier]
        for h, d in zip(host, device):
            if d not in [device[i] for i in keep]:
                assert cut(d) == cut(h)
        host, device = [host[i] for i in keep], [device[i] for i in keep]


def test_ties_keep_the_earlier_row_then_the_likelier_rank():
    """Four frontier rows with equal scores and equal logits: the host's stable order."""
    greedy = SamplingParams(temperature=0.0)
    host = Growing(0, "s", None, greedy, 3, 8, base=3)
    device = Growing(0, "s", None, greedy, 3, 8, base=3)
    flat = torch.zeros((1, 8))
    extend(host, flat)
    extend_on_device([device], [flat])
    assert state(device) == state(host)
    assert host.tokens == [0, 1, 2, 3] or len(set(host.tokens)) == 4
    same = torch.zeros((4, 8))
    extend(host, same)
    extend_on_device([device], [same])
    assert state(device) == state(host)
    assert host.parents[4:] == [1, 1, 1, 1]  # the first row's children: ties keep the earlier row
