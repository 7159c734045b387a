"""Drafting whose chain loop runs on the device, one host read per batch (the graph engine).

The host loop (drafting.py) draws each token on the host: a forward, a read of the draws, the
next forward — γ synchronisations per call on a GPU, and every step's launches. `DeviceDrafting`
runs a batch's chains as ONE forward of their new tokens, then the draft loop of the graph
engine (graph/draft_loop.py: S draws and S − 1 one-token forwards, a captured graph on CUDA),
and reads every draft, its q and its confidence back at once. The proposal is the same
(batched_proposal.py: each row's warp, its top-K, renormalised); the draws are inverse-CDF from
each request's own uniforms, so a seeded request reproduces on this engine.

Calls with hints (prompt lookup's, the default under auto) run the loop too: their first
forward carries the hints, the host loop's own rule checks them (`_check_hints`: the same
draws from the request's generator, so the hints kept and the token after them are the host
loop's), one more forward runs that token for the calls that draft on, and the loop draws the
γ − 1 after it with the other calls of the batch. Sampled calls whose top-k is wider than the
proposal's K keep the host loop, in the same batch. Trees grow as the host loop grows them
(tree_drafting.py: one forward per depth, the same trees node for node) but by the engine's
tree loop (graph/tree_loop.py): one forward of the feeds, then every depth picked and run on the
device, one host read per batch instead of one per call per depth. A call that asks to stop early
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
        loop = [i for i, d in enumerate(live) if fits_on_device(d.call.params, self.proposal_top_k, vocab)]
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
            logits = engine.forward_batch(rows)  # per row [keep_logits, vocab]: hints + 1 rows with hints
        except Exception as exc:  # noqa: BLE001 - every call in the forward failed with it
            for drafting in live:
                results[drafting.index] = exc
            return
        hinted = [i for i, d in enumerate(live) if d.call.hints]
        try:
            firsts = [logits[i] for i in hinted]
            self._first_step_with_hints([live[i] for i in hinted], firsts)
            for i, row_logits in zip(hinted, firsts):
                logits[i] = row_logits
        except Exception as exc:  # noqa: BLE001 - the calls with hints failed with it; the others draft on
            for i in hinted:
                results[live[i].index] = exc
            live, logits = [d for d in live if not d.call.hints], [r for d, r in zip(live, logits) if not d.call.hints]
        for drafting in live:
            if drafting.done:
                results[drafting.index] = self.proposal(drafting)
        looping = [(d, row) for d, row in zip(live, logits) if not d.done]
        if looping:
            self._loop([d for d, _ in looping], torch.cat([row[-1:] for _, row in looping]), results)

    def _first_step_with_hints(self, live: Sequence[ChainDraft], logits: list[torch.Tensor]) -> None:
        """Calls with hints after their first forward (logits: per call [hints + 1, vocab]): the
        host loop's rule keeps the hints the draft agrees with and draws its own token after them
        (the same draws); one forward runs that token for every call still drafting, and its
        logits replace the call's in `logits` (the loop's first logits)."""
        for drafting, row_logits in zip(live, logits):
            self._check_hints(drafting, row_logits)
        drafting_on = [i for i, d in enumerate(live) if not d.done]
        if drafting_on:
            rows = [Row(live[i].call.session_id, live[i].entry, live[i].tokens[-1:], 1) for i in drafting_on]
            for i, row_logits in zip(drafting_on, self.engine.forward_batch(rows)):  # per row [1, vocab]
                logits[i] = row_logits

    def _loop(self, live: Sequence[ChainDraft], first_logits: torch.Tensor, results: list) -> None:
        """The device loop for calls whose history is run (first_logits [R, vocab]: after it):
        each draws the steps it still needs, in one host read for the batch."""
        engine = self.engine
        held = [len(drafting.entry) for drafting in live]  # each history, now all run
        steps = [drafting.call.gamma + drafting.hints_kept - len(drafting.tokens) for drafting in live]
        try:
            generators = [None if d.call.params.greedy else d.generator for d in live]
            uniforms = row_uniforms(generators, steps, engine.device)  # [R, max steps]
            outputs = engine.draft_steps([(d.call.session_id, d.entry) for d in live], first_logits, max(steps),
                                         RowWarps.of([d.call.params for d in live]), uniforms)
            drawn = outputs.to_host(len(live), max(steps))  # the batch's one host read
        except Exception as exc:  # noqa: BLE001 - every call of the loop failed with it
            for drafting, length in zip(live, held):
                engine.keep_drafts(drafting.entry, length, ())  # nothing drafted is kept
                results[drafting.index] = exc
            return
        for drafting, length, wanted, row in zip(live, held, steps, drawn):
            before = len(drafting.tokens)
            for step in row[:wanted]:  # [token, confidence, K ids, K probs]
                drafting.add(int(step[0]), _dist(drafting, step), step[1])
                if drafting.stopped:
                    break
            engine.keep_drafts(drafting.entry, length, drafting.tokens[before:-1])  # the last draft is not run
            results[drafting.index] = self.proposal(drafting)


def _dist(drafting: ChainDraft, step: list[float]) -> SparseDist:
    """The q a step's draft was drawn from, as the host loop reports it."""
    token = int(step[0])
    if drafting.call.params.greedy:
        return SparseDist.one_hot(token)
    k = (len(step) - 2) // 2
    kept = [(int(i), p) for i, p in zip(step[2:2 + k], step[2 + k:]) if p > 0]
    return SparseDist(tuple(i for i, _ in kept), tuple(p for _, p in kept))
