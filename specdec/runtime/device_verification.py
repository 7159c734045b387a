"""Verification whose acceptance step runs on the device for every chain of a batch at once.

The host verifier (verification.py) decides row by row and reads each decision back, several
host synchronisations per row. `DeviceVerifier` warps every chain's target logits (rows with
the same sampling parameters together), pads the batch and decides it with
batched_acceptance.decide: one host read per batch for the accepted counts, the next tokens and
the ratios. Trees, and the log-probabilities a call may ask for, keep the host path: they are
decided after, row by row, exactly as there. The rule is the same; the draws differ from the
host verifier's (inverse-CDF against multinomial), so a seeded request reproduces on the same
engine, and follows the target's distribution on every engine.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.maths.sampling import target_probs
from specdec.runtime.batched_acceptance import ChainBatch, decide, row_uniforms
from specdec.runtime.generators import make_generator
from specdec.runtime.kv_cache import SessionCache
from specdec.runtime.verification import Verifier, VerifyCall
from specdec.types import SamplingParams, Verdict

Forwarded = tuple[VerifyCall, SessionCache, torch.Tensor]  # a call, its cache, its logits [γ+1, vocab]


class DeviceVerifier(Verifier):
    """Chains decided together on the device; trees row by row (module docstring)."""

    def accept_rows(self, rows: Sequence[Forwarded]) -> list[Verdict | Exception]:
        chains = [i for i, (call, _, _) in enumerate(rows) if call.tree is None]
        verdicts: list[Verdict | Exception | None] = [None] * len(rows)
        trees = [i for i in range(len(rows)) if rows[i][0].tree is not None]
        for i, verdict in zip(trees, super().accept_rows([rows[i] for i in trees])):
            verdicts[i] = verdict
        if chains:
            try:
                decided = decide(chain_batch([rows[i] for i in chains], self.runner.device)).to_host()
            except Exception as exc:  # noqa: BLE001 - every chain of the batch failed with it
                decided = [exc] * len(chains)
            for i, decision in zip(chains, decided):
                verdicts[i] = decision if isinstance(decision, Exception) else self._chain_verdict(rows[i], *decision)
        return verdicts

    def _chain_verdict(self, row: Forwarded, accepted: int, token: int, ratios: list[float]) -> Verdict:
        """Crop the session after its accepted drafts; the verdict with its log-probabilities."""
        call, entry, logits = row
        entry.crop(len(entry) - len(call.drafts) + accepted)
        emitted = call.drafts[:accepted] + [token]
        return Verdict(accepted, token, accepted == len(call.drafts), ratios, len(entry),
                       self.runner.take_restored(call.session_id),
                       self._logprobs(call, logits, emitted, list(range(len(emitted)))))


def chain_batch(rows: Sequence[Forwarded], device: torch.device) -> ChainBatch:
    """The padded batch of chains: p warped per sampling setting, q padded to one width, each
    row's uniforms from its own seed (none for greedy rows)."""
    gammas = [len(call.drafts) for call, _, _ in rows]
    gamma_max = max(gammas)
    vocab = rows[0][2].shape[-1]
    p = torch.zeros((len(rows), gamma_max + 1, vocab), device=device)  # [R, γ_max+1, vocab]
    for params, members in _by_params(rows).items():
        stacked = torch.cat([rows[i][2] for i in members])  # [Σ(γ+1), vocab]
        probs = torch.softmax(stacked.float(), dim=-1) if params.greedy else target_probs(stacked, params)
        at_row = torch.tensor([i for i in members for _ in range(gammas[i] + 1)])  # [Σ(γ+1)]
        at_position = torch.tensor([k for i in members for k in range(gammas[i] + 1)])  # [Σ(γ+1)]
        p[_upload(at_row, device), _upload(at_position, device)] = probs  # one write, not one per row
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
