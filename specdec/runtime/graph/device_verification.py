"""Verification whose acceptance step runs on the device for every row of a batch at once.

The host verifier (verification.py) decides row by row and reads each decision back, several
host synchronisations per row (per node of a tree). `DeviceVerification` warps every row's target
logits (rows with the same sampling parameters together) and decides the batch's chains with
batched_acceptance.decide and its trees with batched_tree_acceptance.decide_trees, padded to
the largest of each: one host read per kind for the accepted counts (paths), the next tokens
and the ratios. The log-probabilities a call may ask for are computed after, on the host, as
there, and so is a tree whose q rows are too wide for the device step (MAX_POINTS in
batched_tree_acceptance.py: q rows near a vocabulary wide, which no draft of ours sends). The
rule is the same; the draws differ from the host verifier's (inverse-CDF against multinomial),
so a seeded request reproduces on the same engine, and follows the target's distribution on
every engine.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.maths.sampling import target_probs
from specdec.maths.batched_acceptance import ChainBatch, decide, row_uniforms
from specdec.maths.batched_tree_acceptance import TreeBatch, decide_trees, fits_on_device, tree_layout
from specdec.runtime.generators import make_generator
from specdec.runtime.kv_cache import SessionCache
from specdec.runtime.session_kv import SessionKV
from specdec.runtime.verification import HostVerification, VerifyCall
from specdec.types import SamplingParams, Verdict

Forwarded = tuple[VerifyCall, SessionCache, torch.Tensor]  # a call, its cache, its logits [γ+1, vocab]


class DeviceVerification(HostVerification):
    """Chains decided together on the device, trees likewise (module docstring)."""

    def __init__(self, engine: SessionKV):
        super().__init__(engine)
        self.decided = {"chains": 0, "trees": 0}  # rows decided on the device, per kind (tests count them)

    def accept_rows(self, rows: Sequence[Forwarded]) -> list[Verdict | Exception]:
        verdicts: list[Verdict | Exception | None] = [None] * len(rows)
        on_host = [i for i, (call, _, _) in enumerate(rows) if call.tree is not None and not _tree_fits(call)]
        for i, verdict in zip(on_host, super().accept_rows([rows[i] for i in on_host])):
            verdicts[i] = verdict
        for kind, batch_of, decider, verdict_of in (("chains", chain_batch, decide, self._chain_verdict),
                                                    ("trees", tree_batch, decide_trees, self._tree_verdict)):
            members = [i for i, (call, _, _) in enumerate(rows)
                       if (call.tree is None) == (kind == "chains") and i not in on_host]
            if not members:
                continue
            try:
                decided = decider(batch_of([rows[i] for i in members], self.engine.device)).to_host()
                self.decided[kind] += len(members)
            except Exception as exc:  # noqa: BLE001 - every row of the kind failed with it
                decided = [exc] * len(members)
            for i, decision in zip(members, decided):
                verdicts[i] = decision if isinstance(decision, Exception) else _own(verdict_of, rows[i], decision)
        return verdicts

    def _chain_verdict(self, row: Forwarded, accepted: int, token: int, ratios: list[float]) -> Verdict:
        """The verdict of a chain decided on the device, as the host path makes it (chain_verdict)."""
        return self.chain_verdict(*row, accepted, token, ratios)

    def _tree_verdict(self, row: Forwarded, path: list[int], token: int, is_bonus: bool, tested: int) -> Verdict:
        """The verdict of a tree decided on the device, as the host path makes it (tree_verdict)."""
        return self.tree_verdict(*row, path, token, is_bonus)


def _tree_fits(call: VerifyCall) -> bool:
    """Whether the device step takes this tree (batched_tree_acceptance.fits_on_device)."""
    assert call.tree is not None
    return fits_on_device(call.tree, call.draft_q)


def _own(verdict_of, row: Forwarded, decision: tuple) -> Verdict | Exception:
    """A row's verdict from its decision; a failure (keeping its K/V) is that row's alone."""
    try:
        return verdict_of(row, *decision)
    except Exception as exc:  # noqa: BLE001 - this row's error
        return exc


def chain_batch(rows: Sequence[Forwarded], device: torch.device) -> ChainBatch:
    """The padded batch of chains: p warped per sampling setting, q padded to one width, each
    row's uniforms from its own seed (none for greedy rows)."""
    gammas = [len(call.drafts) for call, _, _ in rows]
    gamma_max = max(gammas)
    p = warped_probs(rows, device)  # [R, γ_max+1, vocab]
    width = max((len(ids) for call, _, _ in rows if call.draft_q is not None for ids in call.draft_q.ids), default=1)
    drafts = torch.zeros((len(rows), gamma_max), dtype=torch.long)  # [R, γ_max]
    q_ids = torch.zeros((len(rows), gamma_max, width), dtype=torch.long)  # [R, γ_max, K]
    q_probs = torch.zeros((len(rows), gamma_max, width))  # [R, γ_max, K]
    for r, (call, _, _) in enumerate(rows):
        drafts[r, :gammas[r]] = torch.tensor(call.drafts, dtype=torch.long)
        if call.draft_q is not None:
            for i, (ids, probs) in enumerate(zip(call.draft_q.ids, call.draft_q.probs)):
                q_ids[r, i, :len(ids)], q_probs[r, i, :len(ids)] = ids, probs
    greedy = [call.params.greedy for call, _, _ in rows]
    generators = [None if g else make_generator(call.seed, device) for g, (call, _, _) in zip(greedy, rows)]
    return ChainBatch(p, _upload(drafts, device), _upload(torch.tensor(gammas), device), _upload(q_ids, device),
                      _upload(q_probs, device), _upload(torch.tensor(greedy), device),
                      row_uniforms(generators, [g + 1 for g in gammas], device))


def tree_batch(rows: Sequence[Forwarded], device: torch.device) -> TreeBatch:
    """The batch of trees: their layout and q (batched_tree_acceptance.tree_layout), p warped
    per sampling setting, each row's n + 1 uniforms from its own seed (none for greedy rows)."""
    trees = [call.tree for call, _, _ in rows]
    assert all(tree is not None for tree in trees)
    layout = tree_layout(trees, [call.draft_q for call, _, _ in rows])
    greedy = [call.params.greedy for call, _, _ in rows]
    generators = [None if g else make_generator(call.seed, device) for g, (call, _, _) in zip(greedy, rows)]
    return TreeBatch(warped_probs(rows, device), layout.to(lambda t: _upload(t, device)),
                     _upload(torch.tensor(greedy), device),
                     row_uniforms(generators, [len(tree) + 1 for tree in trees], device), not all(greedy))


def warped_probs(rows: Sequence[Forwarded], device: torch.device) -> torch.Tensor:
    """[R, L_max, vocab] float32: each row's logits [L, vocab] warped as its request samples
    (greedy: one-hot on the argmax of the logits as they are, as the host verifier's argmax),
    rows of one sampling setting in one call, padded with zeros."""
    lengths = [logits.shape[0] for _, _, logits in rows]
    p = torch.zeros((len(rows), max(lengths), rows[0][2].shape[-1]), device=device)  # [R, L_max, vocab]
    for params, members in _by_params(rows).items():
        probs = target_probs(torch.cat([rows[i][2] for i in members]), params)  # [ΣL, vocab]
        at_row = torch.tensor([i for i in members for _ in range(lengths[i])])  # [ΣL]
        at_position = torch.tensor([k for i in members for k in range(lengths[i])])  # [ΣL]
        p[_upload(at_row, device), _upload(at_position, device)] = probs  # one write, not one per row
    return p


def _by_params(rows: Sequence[Forwarded]) -> dict[SamplingParams, list[int]]:
    groups: dict[SamplingParams, list[int]] = {}
    for i, (call, _, _) in enumerate(rows):
        groups.setdefault(call.params, []).append(i)
    return groups


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without blocking the host (pinned where that helps)."""
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
