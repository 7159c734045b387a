from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetServiceGetModelInfoRequest(_message.Message):
    __slots__ = ("fingerprint_vocab_size",)
    FINGERPRINT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    fingerprint_vocab_size: int
    def __init__(self, fingerprint_vocab_size: _Optional[int] = ...) -> None: ...

class TargetServiceGetModelInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ModelInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "prefix_len", "new_tokens", "draft_tokens", "draft_probs", "sampling", "seed", "prefix_hash", "cache_salt", "top_logprobs", "draft_parents", "head_candidates")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix_len: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    sampling: _common_pb2.SamplingParams
    seed: int
    prefix_hash: int
    cache_salt: str
    top_logprobs: int
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    head_candidates: int
    def __init__(self, session_id: _Optional[str] = ..., prefix_len: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., prefix_hash: _Optional[int] = ..., cache_salt: _Optional[str] = ..., top_logprobs: _Optional[int] = ..., draft_parents: _Optional[_Iterable[int]] = ..., head_candidates: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token", "is_bonus", "accept_probs", "cached_len", "restored_tokens", "logprobs", "accepted_nodes", "head_proposals")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    IS_BONUS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_PROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    HEAD_PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token: int
    is_bonus: bool
    accept_probs: _containers.RepeatedScalarFieldContainer[float]
    cached_len: int
    restored_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    head_proposals: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., is_bonus: _Optional[bool] = ..., accept_probs: _Optional[_Iterable[float]] = ..., cached_len: _Optional[int] = ..., restored_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., head_proposals: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class VerifyStreamRequest(_message.Message):
    __slots__ = ("call_id", "request", "timeout_ms", "heartbeat_ms")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request: VerifyRequest
    timeout_ms: int
    heartbeat_ms: int
    def __init__(self, call_id: _Optional[int] = ..., request: _Optional[_Union[VerifyRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ...) -> None: ...

class VerifyStreamResponse(_message.Message):
    __slots__ = ("call_id", "response", "error", "progress")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: VerifyResponse
    error: _common_pb2.StreamCallError
    progress: _common_pb2.StreamCallProgress
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[VerifyResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.StreamCallError, _Mapping]] = ..., progress: _Optional[_Union[_common_pb2.StreamCallProgress, _Mapping]] = ...) -> None: ...

class TargetServiceReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class TargetServiceReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
