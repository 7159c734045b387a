from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftServiceGetModelInfoRequest(_message.Message):
    __slots__ = ("fingerprint_vocab_size",)
    FINGERPRINT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    fingerprint_vocab_size: int
    def __init__(self, fingerprint_vocab_size: _Optional[int] = ...) -> None: ...

class DraftServiceGetModelInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ModelInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "prefix_len", "new_tokens", "num_speculative_tokens", "sampling", "seed", "prefix_hash", "hint_tokens", "min_confidence", "uncommitted_tokens", "cache_salt", "tree_nodes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    HINT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    UNCOMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix_len: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    sampling: _common_pb2.SamplingParams
    seed: int
    prefix_hash: int
    hint_tokens: _containers.RepeatedScalarFieldContainer[int]
    min_confidence: float
    uncommitted_tokens: int
    cache_salt: str
    tree_nodes: int
    def __init__(self, session_id: _Optional[str] = ..., prefix_len: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., prefix_hash: _Optional[int] = ..., hint_tokens: _Optional[_Iterable[int]] = ..., min_confidence: _Optional[float] = ..., uncommitted_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., tree_nodes: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_tokens", "draft_probs", "cached_len", "num_hint_tokens_kept", "restored_tokens", "draft_parents")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_HINT_TOKENS_KEPT_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    cached_len: int
    num_hint_tokens_kept: int
    restored_tokens: int
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., cached_len: _Optional[int] = ..., num_hint_tokens_kept: _Optional[int] = ..., restored_tokens: _Optional[int] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeStreamRequest(_message.Message):
    __slots__ = ("call_id", "request", "timeout_ms", "heartbeat_ms")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request: ProposeRequest
    timeout_ms: int
    heartbeat_ms: int
    def __init__(self, call_id: _Optional[int] = ..., request: _Optional[_Union[ProposeRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ...) -> None: ...

class ProposeStreamResponse(_message.Message):
    __slots__ = ("call_id", "response", "error", "progress")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: ProposeResponse
    error: _common_pb2.StreamCallError
    progress: _common_pb2.StreamCallProgress
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[ProposeResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.StreamCallError, _Mapping]] = ..., progress: _Optional[_Union[_common_pb2.StreamCallProgress, _Mapping]] = ...) -> None: ...

class DraftServiceReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DraftServiceReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
