from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CONTEXT_LENGTH: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "tokenizer_fingerprint", "tokenizer_vocab_size", "eos_token_ids", "max_context_length", "dtype", "device", "max_speculative_tokens", "cpu", "verifies_trees", "num_heads", "heads_id", "checkpoint_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    VERIFIES_TREES_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEADS_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    tokenizer_vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context_length: int
    dtype: str
    device: str
    max_speculative_tokens: int
    cpu: CpuPlacement
    verifies_trees: bool
    num_heads: int
    heads_id: str
    checkpoint_id: str
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., tokenizer_vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context_length: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_speculative_tokens: _Optional[int] = ..., cpu: _Optional[_Union[CpuPlacement, _Mapping]] = ..., verifies_trees: _Optional[bool] = ..., num_heads: _Optional[int] = ..., heads_id: _Optional[str] = ..., checkpoint_id: _Optional[str] = ...) -> None: ...

class CpuPlacement(_message.Message):
    __slots__ = ("boot_id", "cores", "threads")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    cores: _containers.RepeatedScalarFieldContainer[int]
    threads: int
    def __init__(self, boot_id: _Optional[str] = ..., cores: _Optional[_Iterable[int]] = ..., threads: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_round", "draft_seconds", "target_seconds", "coordinator_seconds", "draft_prefill_tokens", "target_prefill_tokens", "cache_misses", "accepted_per_position", "fallback_rounds", "target_retries", "draft_rounds", "ngram_rounds", "ngram_draft_tokens", "ngram_accepted_tokens", "rounds_by_gamma", "gamma_per_round", "draft_hint_tokens", "draft_hint_accepted_tokens", "draft_ahead_calls", "draft_ahead_rounds", "draft_restored_tokens", "target_restored_tokens", "tree_rounds", "tree_draft_tokens", "tree_accepted_tokens", "tree_branch_accepted_tokens", "tree_accepted_per_depth", "tree_tokens_per_round", "tree_lookup_tokens", "tree_lookup_accepted_tokens", "heads_rounds", "heads_draft_tokens", "heads_accepted_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_RETRIES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_BY_GAMMA_FIELD_NUMBER: _ClassVar[int]
    GAMMA_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HINT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HINT_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_CALLS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TREE_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_BRANCH_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_ACCEPTED_PER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TREE_TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    TREE_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_LOOKUP_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEADS_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    HEADS_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEADS_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    tokens_per_round: float
    draft_seconds: float
    target_seconds: float
    coordinator_seconds: float
    draft_prefill_tokens: int
    target_prefill_tokens: int
    cache_misses: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    fallback_rounds: int
    target_retries: int
    draft_rounds: int
    ngram_rounds: int
    ngram_draft_tokens: int
    ngram_accepted_tokens: int
    rounds_by_gamma: _containers.RepeatedScalarFieldContainer[int]
    gamma_per_round: _containers.RepeatedScalarFieldContainer[int]
    draft_hint_tokens: int
    draft_hint_accepted_tokens: int
    draft_ahead_calls: int
    draft_ahead_rounds: int
    draft_restored_tokens: int
    target_restored_tokens: int
    tree_rounds: int
    tree_draft_tokens: int
    tree_accepted_tokens: int
    tree_branch_accepted_tokens: int
    tree_accepted_per_depth: _containers.RepeatedScalarFieldContainer[int]
    tree_tokens_per_round: float
    tree_lookup_tokens: int
    tree_lookup_accepted_tokens: int
    heads_rounds: int
    heads_draft_tokens: int
    heads_accepted_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., tokens_per_round: _Optional[float] = ..., draft_seconds: _Optional[float] = ..., target_seconds: _Optional[float] = ..., coordinator_seconds: _Optional[float] = ..., draft_prefill_tokens: _Optional[int] = ..., target_prefill_tokens: _Optional[int] = ..., cache_misses: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., fallback_rounds: _Optional[int] = ..., target_retries: _Optional[int] = ..., draft_rounds: _Optional[int] = ..., ngram_rounds: _Optional[int] = ..., ngram_draft_tokens: _Optional[int] = ..., ngram_accepted_tokens: _Optional[int] = ..., rounds_by_gamma: _Optional[_Iterable[int]] = ..., gamma_per_round: _Optional[_Iterable[int]] = ..., draft_hint_tokens: _Optional[int] = ..., draft_hint_accepted_tokens: _Optional[int] = ..., draft_ahead_calls: _Optional[int] = ..., draft_ahead_rounds: _Optional[int] = ..., draft_restored_tokens: _Optional[int] = ..., target_restored_tokens: _Optional[int] = ..., tree_rounds: _Optional[int] = ..., tree_draft_tokens: _Optional[int] = ..., tree_accepted_tokens: _Optional[int] = ..., tree_branch_accepted_tokens: _Optional[int] = ..., tree_accepted_per_depth: _Optional[_Iterable[int]] = ..., tree_tokens_per_round: _Optional[float] = ..., tree_lookup_tokens: _Optional[int] = ..., tree_lookup_accepted_tokens: _Optional[int] = ..., heads_rounds: _Optional[int] = ..., heads_draft_tokens: _Optional[int] = ..., heads_accepted_tokens: _Optional[int] = ...) -> None: ...

class StreamCallError(_message.Message):
    __slots__ = ("code", "message", "trailing_metadata")
    class TrailingMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    trailing_metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., trailing_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StreamCallProgress(_message.Message):
    __slots__ = ("tokens_done", "tokens_total")
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    tokens_done: int
    tokens_total: int
    def __init__(self, tokens_done: _Optional[int] = ..., tokens_total: _Optional[int] = ...) -> None: ...
