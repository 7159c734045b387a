"""The engine contract: what a model service asks of the engine that runs its model.

Every engine implements `ModelEngine` — `TorchEngine` (specdec/runtime/torch/),
`LlamaCppEngine` (specdec/runtime/llama_cpp/) and `GraphEngine` (specdec/runtime/graph/) — and
the draft and target services call nothing else: they build their engine
(engines.py, `engine_from_config`), warm it up before they report SERVING, and hand their calls
(`ProposeCall`, `VerifyCall`) to the engine's `drafting` (the draft's γ-step loop) or
`verification` (forward plus acceptance). Those two are where the per-round work lives, so each
engine does it its own way: `SessionEngine` (session_engine.py) gives every engine the host
loops of drafting.py and verification.py, and an engine overrides them where it has better (the
graph engine drafts a batch's chains and decides its acceptance on the device,
graph/device_drafting.py and graph/device_verification.py). This module sits at the bottom of
the runtime: it imports no engine and none of the loops that implement it.

The parts of the contract:
- load and warm up: the constructor loads; `warm_up()` runs every path a first call would take
  (prefill, decode, the engine's own preparations such as CUDA-graph capture) before serving;
- a session's K/V: `begin` (new, or rolled back to the prefix a call assumes, fingerprint
  checked), `keep_path` (a tree's accepted path), `release` (drop), the cache bounds;
- one batched forward over ragged rows (`forward_batch`: per row its own length, positions and,
  for a tree, its mask);
- a target's Medusa-style heads (`serve target --heads`, target_heads.py): `heads` (None without
  them) and `forward_hidden`, forward_batch that also hands out, per row, the hidden states its
  output layer took at the kept positions ([keep_logits, hidden], aligned with the logits), which
  the verifier turns into the heads' proposals; forward_batch itself stays as it is;
- chunked prefill of long inputs (`needs_prefill_steps`, `held_prefix`, `prefill_step`);
- validation before any cache is touched (`check_request`, `check_token_ids`);
- the draft's γ-step loop and verification, as `Drafting` and `Verification` objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

from specdec.maths.draft_q import DraftQ
from specdec.maths.tree import TokenTree
from specdec.runtime.kv_cache import SessionCache, SessionCaches
from specdec.runtime.session_kv import Row
from specdec.types import ModelDescription, Proposal, SamplingParams, Verdict


@dataclass(frozen=True)
class ProposeCall:
    """A validated Propose request."""

    session_id: str
    prefix_len: int
    prefix_hash: int
    new_tokens: list[int]
    gamma: int
    params: SamplingParams
    seed: int
    hints: tuple[int, ...] = ()  # candidate tokens checked in the first forward (may be empty)
    min_confidence: float = 0.0  # stop after a drafted token the draft gave less probability (0 = off)
    uncommitted: int = 0  # trailing tokens of the history that are drafts not yet accepted (a call made ahead)
    cache_salt: str = ""  # mixed into its K/V chunk keys
    tree_nodes: int = 0  # grow a tree of at most this many nodes, gamma deep (0: a chain)


@dataclass(frozen=True)
class VerifyCall:
    """A validated Verify request."""

    session_id: str
    prefix_len: int
    prefix_hash: int
    new_tokens: list[int]
    drafts: list[int]
    draft_q: DraftQ | None  # None when greedy (q is not needed); on the host
    params: SamplingParams
    seed: int
    cache_salt: str = ""  # mixed into its K/V chunk keys
    top_logprobs: int | None = None  # None: no log-probabilities; N: each emitted token's and N more
    tree: TokenTree | None = None  # the drafts as a tree (None: a chain)
    head_candidates: int = 0  # per head, this many proposals for the next round (0: none, or no heads)


class Drafting(Protocol):
    """The draft's per-round work: validate a Propose, then draft a batch of them."""

    engine: "ModelEngine"

    def call(self, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int], gamma: int,
             *args: Any, **kwargs: Any) -> ProposeCall:
        """A validated call (InvalidArgument naming what is wrong); no cache is touched."""

    def propose_batch(self, calls: Sequence[ProposeCall]) -> list[Proposal | Exception]:
        """On the model thread: each call's drafts, drawn with its own seed; a call's failure is
        its own result."""


class Verification(Protocol):
    """The target's per-round work: validate a Verify, then verify a batch of them."""

    engine: "ModelEngine"

    def call(self, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int],
             drafts: list[int], *args: Any, **kwargs: Any) -> VerifyCall:
        """A validated call (InvalidArgument naming what is wrong); no cache is touched."""

    def verify_batch(self, calls: Sequence[VerifyCall]) -> list[Verdict | Exception]:
        """On the model thread: ONE forward over every call's new tokens and drafts, then each
        call's acceptance step with its own seed; a call's failure is its own result."""


@runtime_checkable
class ModelEngine(Protocol):
    """One model, many sessions (module docstring). Its methods run on the model worker thread
    (`release` aside: it may come from another thread and only drops the session's entry)."""

    description: ModelDescription  # what GetModelInfo reports
    tokenizer: Any                 # the model's transformers tokenizer
    device: Any                    # the torch device of the logits forward_batch returns
    caches: SessionCaches          # the sessions' K/V and their bounds
    kv_tier: Any                   # the prefix cache / K/V store (kv_tier.KVTier), or None
    verifies_trees: bool           # forward_batch takes rows with a token tree
    grows_trees: bool              # ... and one whose earlier depths are cached (the draft's trees)
    heads: Any                     # a target's heads (target_heads.TargetHeads), None without --heads

    def warm_up(self) -> None: ...

    def begin(self, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: Sequence[int],
              salt: str = "") -> tuple[SessionCache, Sequence[int]]: ...

    def keep_path(self, entry: SessionCache, base: int, path: Sequence[int]) -> None: ...

    def release(self, session_id: str) -> bool: ...

    def finish(self, keep: str | Iterable[str], extra_bytes: int = 0) -> None: ...

    def forward_batch(self, rows: Sequence[Row]) -> list: ...

    def forward_hidden(self, rows: Sequence[Row]) -> tuple[list, list]: ...

    def needs_prefill_steps(self, new_tokens: Sequence[int]) -> bool: ...

    def held_prefix(self, session_id: str, prefix_len: int, prefix_hash: int) -> Any: ...

    def prefill_step(self, session_id: str, sequence: Sequence[int], upto: int, salt: str = "") -> tuple[int, int]: ...

    def check_request(self, session_id: str, prefix_len: int, new_tokens: Sequence[int], extra: int) -> None: ...

    def check_token_ids(self, ids: Sequence[int], what: str) -> None: ...

    def drafting(self, proposal_top_k: int) -> Drafting: ...

    def verification(self) -> Verification: ...
