"""Domain types shared by the services (no gRPC, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from specdec.cores import CpuPlacement
from specdec.errors import InvalidArgument
from specdec.fields import Field

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
INT32_MAX = 2**31 - 1  # the wire's int32 fields
FLOAT32_MAX = 3.4028234663852886e38  # the wire's float fields: the largest finite value
FLOAT32_TINY = 1.1754943508222875e-38  # ... and the smallest normal positive one
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (as in vLLM): 1/T would overflow


class Source(StrEnum):
    """Where a round's proposed tokens come from. A request names one (AUTO lets the
    coordinator pick per round); a round's source is one of the others. On the wire and the
    command line it keeps its old name: the request field and flag `proposer` (--proposer,
    --default-proposer) and the proto enum `Proposer` (PROPOSER_AUTO, ...), values as here."""

    AUTO = "auto"    # per round, whichever source the policy expects to pay most
    DRAFT = "draft"  # the draft model (the draft service)
    # prompt lookup in the session's own history (no model call); its value, the wire enum's
    # PROPOSER_NGRAM and the flags keep the old name "ngram"
    PROMPT_LOOKUP = "ngram"
    NONE = "none"    # no proposals: plain target decoding
    HEADS = "heads"  # the target's Medusa-style heads, read in the round before (no model call)


class CoreSharing(StrEnum):
    """Whether the draft and the target tiers compete for the same CPU cores
    (--tiers-share-cores)."""

    AUTO = "auto"  # as the services report (specdec/cores.py)
    YES = "yes"
    NO = "no"


class Trees(StrEnum):
    """Whether adaptive draft-model rounds may propose token trees the cost model chooses
    (--trees; a request's own tree_nodes holds either way)."""

    AUTO = "auto"  # a tree where its expected tokens per second beat the best chain's
    OFF = "off"    # chains, unless a request asks for a tree


class DraftAhead(StrEnum):
    """Whether a draft-model round asks the draft to go on for the next round while it is
    verified (--draft-ahead)."""

    AUTO = "auto"  # measured: alternating epochs with and without, the faster kept
    ON = "on"
    OFF = "off"


class Quantization(StrEnum):
    """A model's linear layers (--quantize): the draft's, or, as an explicit choice, the target's."""

    AUTO = "auto"  # INT8 on a CPU in a 16- or 32-bit float dtype, else NONE (drafts only)
    NONE = "none"  # as the checkpoint's dtype
    INT8 = "int8"  # weight-only int8 (CPU only)
    INT4 = "int4"  # weight-only 4-bit in groups of 32 inputs (CPU only)


class Backend(StrEnum):
    """The engine a model service runs its model on (--backend)."""

    AUTO = "auto"            # LLAMA_CPP for a .gguf file when llama-cpp-python is installed; GRAPH on
                             # CUDA for the architectures it covers; else TORCH
    TORCH = "torch"          # transformers on torch: a directory, a hub id or a .gguf file (dequantised)
    LLAMA_CPP = "llama.cpp"  # llama.cpp through llama-cpp-python: a .gguf file, served as quantised
    GRAPH = "graph"          # specdec's static-shape Llama / Qwen2 / Mistral over a paged K/V pool,
                             # CUDA graphs captured at start on CUDA (specdec/runtime/graph/)


class KVCacheType(StrEnum):
    """The llama.cpp backend's K/V element type (--kv-cache-type)."""

    F16 = "f16"
    BF16 = "bf16"
    F32 = "f32"
    Q8_0 = "q8_0"


class RpcTransport(StrEnum):
    """How the coordinator's Propose and Verify calls travel (--rpc-transport)."""

    STREAM = "stream"  # multiplexed on one long-lived call stream per replica
    UNARY = "unary"    # one gRPC call each


class DiscoveryKind(StrEnum):
    """How the coordinator finds its replicas (--discovery)."""

    STATIC = "static"          # the --draft / --target address lists
    KUBERNETES = "kubernetes"  # the EndpointSlices of --draft-service / --target-service


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling warp. temperature 0 (or below 1e-5) means greedy (argmax).

    top_k 0 disables top-k; top_p 1.0 disables nucleus sampling.
    """

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 0
    top_p: float = DEFAULT_TOP_P

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise InvalidArgument with an actionable message for out-of-range values."""
        if not 0.0 <= self.temperature <= FLOAT32_MAX:
            raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy) that a float32 holds "
                                  f"(at most {FLOAT32_MAX:.4g}), got {self.temperature}", Field.TEMPERATURE)
        if not 0 <= self.top_k <= INT32_MAX:
            raise InvalidArgument(f"top_k must be in [0, {INT32_MAX}] (0 disables top-k), got {self.top_k}",
                                  Field.TOP_K)
        if not (FLOAT32_TINY <= self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1] (1 disables top-p) and at least {FLOAT32_TINY:.3g} "
                                  f"(a float32 holds nothing smaller), got {self.top_p}", Field.TOP_P)


@dataclass(frozen=True)
class SparseDist:
    """A distribution over the vocabulary; ids not listed have probability 0."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]

    @classmethod
    def one_hot(cls, token: int) -> "SparseDist":
        """All mass on one token: a greedy draft's q, or a deterministic proposal's."""
        return cls((int(token),), (1.0,))


@dataclass(frozen=True)
class Proposal:
    """What a proposal source returns: γ draft tokens and the distribution each came from."""

    draft_tokens: list[int]
    draft_probs: list[SparseDist]
    cached_len: int = 0
    hints_kept: int = 0  # leading draft tokens that are hints the draft agreed with
    restored_tokens: int = 0  # history tokens whose K/V were loaded from chunks, not run
    parents: tuple[int, ...] = ()  # the drafts as a tree: each one's parent, as on the wire (): a chain


MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's limit)
MAX_HEAD_CANDIDATES = 32  # the most candidates per head a Verify may ask a target's heads for


def check_top_logprobs(top: int | None) -> None:
    """None (no log-probabilities) or 0..MAX_TOP_LOGPROBS alternatives per token."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (0: only the emitted "
                              f"token's log-probability), got {top}", Field.TOP_LOGPROBS)


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probabilities at one emitted token's position (specdec/maths/logprobs.py)."""

    token_id: int                            # the emitted token
    logprob: float                           # its log-probability
    top: tuple[tuple[int, float], ...] = ()  # the most likely (token id, log-prob), most likely first


@dataclass(frozen=True)
class Verdict:
    """What the target returns for one round."""

    num_accepted: int
    next_token: int
    is_bonus: bool
    accept_probs: list[float] = field(default_factory=list)
    cached_len: int = 0
    restored_tokens: int = 0  # history tokens whose K/V were loaded from chunks, not run
    logprobs: tuple[TokenLogprobs, ...] = ()  # per committed token, when the call asked for them
    accepted_nodes: tuple[int, ...] = ()  # a tree's accepted nodes, root's child first (empty: a chain's prefix)
    # per head, head 1 first: its top candidates for the position k past next_token (empty:
    # none asked for, or a target without heads)
    head_proposals: tuple["SparseDist", ...] = ()

    def committed(self, draft_tokens: list[int]) -> list[int]:
        """The tokens this round commits: accepted drafts (a tree's accepted path) plus the
        target's own token."""
        if self.accepted_nodes:
            return [draft_tokens[node] for node in self.accepted_nodes] + [self.next_token]
        return list(draft_tokens[: self.num_accepted]) + [self.next_token]


@dataclass(frozen=True)
class ModelDescription:
    """What a model service reports about its model."""

    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    tokenizer_vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context_length: int
    dtype: str
    device: str
    max_speculative_tokens: int
    cpu: CpuPlacement | None = None  # where its forwards run on a CPU (None: on an accelerator)
    verifies_trees: bool = False  # a target that takes draft_parents (a tree of drafts) in Verify
    num_heads: int = 0  # a target's Medusa-style heads (--heads); 0: none
    heads_id: str = ""  # their identity (a digest of their file) while num_heads > 0
    checkpoint_id: str = ""  # the identity of the checkpoint's files (specdec/checkpoint.py); "": a hub id
