from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftScheme(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_SCHEME_UNSPECIFIED: _ClassVar[DraftScheme]
    DRAFT_SCHEME_CHAIN_SAMPLED: _ClassVar[DraftScheme]
    DRAFT_SCHEME_IID: _ClassVar[DraftScheme]
    DRAFT_SCHEME_WITHOUT_REPLACEMENT: _ClassVar[DraftScheme]
    DRAFT_SCHEME_TOPK: _ClassVar[DraftScheme]

class Limit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIMIT_UNSPECIFIED: _ClassVar[Limit]
    LIMIT_MAX_QUIET_STEPS: _ClassVar[Limit]
    LIMIT_MAX_VERIFY_STEPS: _ClassVar[Limit]
    LIMIT_MAX_HOP_SECONDS: _ClassVar[Limit]
DRAFT_SCHEME_UNSPECIFIED: DraftScheme
DRAFT_SCHEME_CHAIN_SAMPLED: DraftScheme
DRAFT_SCHEME_IID: DraftScheme
DRAFT_SCHEME_WITHOUT_REPLACEMENT: DraftScheme
DRAFT_SCHEME_TOPK: DraftScheme
LIMIT_UNSPECIFIED: Limit
LIMIT_MAX_QUIET_STEPS: Limit
LIMIT_MAX_VERIFY_STEPS: Limit
LIMIT_MAX_HOP_SECONDS: Limit

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("tensor", "plane")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    tensor: Tensor
    plane: PlaneRef
    def __init__(self, tensor: _Optional[_Union[Tensor, _Mapping]] = ..., plane: _Optional[_Union[PlaneRef, _Mapping]] = ...) -> None: ...

class PlaneRef(_message.Message):
    __slots__ = ("transfer_id", "row_offset", "num_rows", "total_rows", "mac")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    row_offset: int
    num_rows: int
    total_rows: int
    mac: bytes
    def __init__(self, transfer_id: _Optional[int] = ..., row_offset: _Optional[int] = ..., num_rows: _Optional[int] = ..., total_rows: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class SeqRef(_message.Message):
    __slots__ = ("seq_id", "num_committed")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_committed: int
    def __init__(self, seq_id: _Optional[int] = ..., num_committed: _Optional[int] = ...) -> None: ...

class TokenTree(_message.Message):
    __slots__ = ("tokens", "parents", "scheme", "draft_token_probs", "draft_probs", "vocab_index")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_INDEX_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    scheme: DraftScheme
    draft_token_probs: Tensor
    draft_probs: Tensor
    vocab_index: Tensor
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., scheme: _Optional[_Union[DraftScheme, str]] = ..., draft_token_probs: _Optional[_Union[Tensor, _Mapping]] = ..., draft_probs: _Optional[_Union[Tensor, _Mapping]] = ..., vocab_index: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "max_tokens", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    top_k: int
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., top_k: _Optional[int] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...
