"""Drafting whose chain loop runs on the device, one host read per batch (the graph engine).

The host loop (drafting.py) draws each token on the host: a forward, a read of the draws, the
next forward — γ synchronisations per call on a GPU, and every step's launches. `DeviceDrafting`
runs a batch's chains as ONE forward of their new tokens, then the draft loop of the graph
engine (graph/draft_loop.py: S draws and S − 1 one-token forwards, a captured graph on CUDA),
and reads every draft, its q and its confidence back at once. The proposal is the same
(batched_proposal.py: each row's warp, its top-K, renormalised); the draws are inverse-CDF from
each request's own uniforms, so a seeded request reproduces on this engine.

Calls the loop does not cover keep the host loop, in the same batch: calls with hints (their
first step decides how many hints to keep), and sampled calls whose top-k is wider than the
proposal's K. Trees grow as the host loop grows them (tree_drafting.py: one forward per depth,
the same trees node for node) but by the engine's tree loop (graph/tree_loop.py): one forward of
the feeds, then every depth picked and run on the device, one host read per batch instead of
one per call per depth. A call that asks to stop early
(min_confidence) is cut after the first draft below it, as the host loop stops there; the loop
drafted the rest for nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.maths.tree import TREE_WIDTH
from specdec.maths.batched_acceptance import row_uniforms
from specdec.runtime.graph.batched_proposal import RowWarps, fits_on_device
from specdec.runtime.graph.batched_tree_drafting import keep_slots
from specdec.runtime.drafting import ChainDraft, HostDrafting, ProposeCall
from specdec.runtime.kv_cache import SessionCache
from specdec.runtime.session_kv import Row
from specdec.runtime.tree_drafting import finish_tree, growing_on, start_trees
from specdec.types import SparseDist


class DeviceDrafting(HostDrafting):
    """Chains drafted by the engine's device loop; the rest by the host loop (module docstring)."""

    def draft_chains(self, live: list[ChainDraft], rows: list[Row], results: list) -> None:
        vocab = self.engine.vocab_size
        loop = [i for i, d in enumerate(live) if not d.call.hints
                and fits_on_device(d.call.params, self.proposal_top_k, vocab)]
        host = sorted(set(range(len(live))) - set(loop))
        if host:
            super().draft_chains([live[i] for i in host], [rows[i] for i in host], results)
        if loop:
            self._draft_on_device([live[i] for i in loop], [rows[i] for i in loop], results)

    tree_loops = 0  # tree batches grown by the device loop (tests and the bench read it)

    def grow_trees(self, trees: list[tuple[int, SessionCache, Sequence[int], ProposeCall]], results: list) -> None:
        """Every tree of the batch grown by the engine's tree loop (graph/tree_loop.py): ONE
        forward of the feeds, then every depth on the device, one host read; the trees are the
        host loop's (tree_drafting.py), node for node."""
        engine = self.engine
        live, rows = start_trees(trees)
        try:
            logits = engine.forward_batch(rows)  # per row [1, vocab]
            kept = engine.tree_steps([(g.session_id, g.entry) for g in live], torch.cat(logits),
                                     max(g.depths for g in live), [g.params for g in live])
            kept = kept.tolist()  # the batch's one host read: [C][depth][slot] (valid, index, token, score)
        except Exception as exc:  # noqa: BLE001 - every tree call failed with it
            for growing in live:
                growing.entry.crop(growing.base)
                results[growing.index] = exc
            return
        self.tree_loops += 1
        w = min(TREE_WIDTH, engine.vocab_size)  # candidates per frontier row
        for growing, depths in zip(live, kept):
            for slots in depths:
                if not growing_on(growing):
                    break
                keep_slots(growing, slots, w)
            results[growing.index] = finish_tree(engine, growing)

    def _draft_on_device(self, live: Sequence[ChainDraft], rows: Sequence[Row], results: list) -> None:
        engine = self.engine
        try:
            logits = engine.forward_batch(rows)  # per row [1, vocab]
        except Exception as exc:  # noqa: BLE001 - every call in the forward failed with it
            for drafting in live:
                results[drafting.index] = exc
            return
        held = [len(drafting.entry) for drafting in live]  # each history, now all run
        gammas = [drafting.call.gamma for drafting in live]
        try:
            generators = [None if d.call.params.greedy else d.generator for d in live]
            uniforms = row_uniforms(generators, gammas, engine.device)  # [R, γ_max]
            outputs = engine.draft_steps([(d.call.session_id, d.entry) for d in live], torch.cat(logits),
                                         max(gammas), RowWarps.of([d.call.params for d in live]), uniforms)
            drawn = outputs.to_host(len(live), max(gammas))  # the batch's one host read
        except Exception as exc:  # noqa: BLE001 - every call of the loop failed with it
            for drafting, length in zip(live, held):
                engine.keep_drafts(drafting.entry, length, ())  # nothing drafted is kept
                results[drafting.index] = exc
            return
        for drafting, length, steps in zip(live, held, drawn):
            for step in steps[:drafting.call.gamma]:  # [token, confidence, K ids, K probs]
                drafting.add(int(step[0]), _dist(drafting, step), step[1])
                if drafting.stopped:
                    break
            engine.keep_drafts(drafting.entry, length, drafting.tokens[:-1])  # the last draft is not run
            results[drafting.index] = self.proposal(drafting)


def _dist(drafting: ChainDraft, step: list[float]) -> SparseDist:
    """The q a step's draft was drawn from, as the host loop reports it."""
    token = int(step[0])
    if drafting.call.params.greedy:
        return SparseDist.one_hot(token)
    k = (len(step) - 2) // 2
    kept = [(int(i), p) for i, p in zip(step[2:2 + k], step[2 + k:]) if p > 0]
    return SparseDist(tuple(i for i, _ in kept), tuple(p for _, p in kept))
