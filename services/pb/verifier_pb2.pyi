from services.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillItem(_message.Message):
    __slots__ = ("seq_id", "prompt_ids", "params", "return_hidden", "next_token", "prompt_len")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    return_hidden: bool
    next_token: int
    prompt_len: int
    def __init__(self, seq_id: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_hidden: _Optional[bool] = ..., next_token: _Optional[int] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    def __init__(self, items: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("ref", "first_token", "prompt_hidden", "first_logprob")
    REF_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.SeqRef
    first_token: int
    prompt_hidden: _common_pb2.HiddenStates
    first_logprob: _common_pb2.TokenLogprob
    def __init__(self, ref: _Optional[_Union[_common_pb2.SeqRef, _Mapping]] = ..., first_token: _Optional[int] = ..., prompt_hidden: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("results", "forward_seconds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PrefillResult]
    forward_seconds: float
    def __init__(self, results: _Optional[_Iterable[_Union[PrefillResult, _Mapping]]] = ..., forward_seconds: _Optional[float] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("ref", "tree", "return_hidden", "steps", "free_drafts")
    REF_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FREE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.SeqRef
    tree: _common_pb2.TokenTree
    return_hidden: bool
    steps: int
    free_drafts: bool
    def __init__(self, ref: _Optional[_Union[_common_pb2.SeqRef, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., return_hidden: _Optional[bool] = ..., steps: _Optional[int] = ..., free_drafts: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items", "use_data_plane")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    USE_DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    use_data_plane: bool
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ..., use_data_plane: _Optional[bool] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("ref", "committed", "tokens", "num_accepted", "num_drafted_per_depth", "hidden", "num_drafted", "num_steps", "step_accepted", "step_drafted", "logprobs")
    REF_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_PER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEP_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.SeqRef
    committed: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    num_drafted_per_depth: _containers.RepeatedScalarFieldContainer[int]
    hidden: _common_pb2.HiddenStates
    num_drafted: int
    num_steps: int
    step_accepted: _containers.RepeatedScalarFieldContainer[int]
    step_drafted: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, ref: _Optional[_Union[_common_pb2.SeqRef, _Mapping]] = ..., committed: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., num_drafted_per_depth: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., num_drafted: _Optional[int] = ..., num_steps: _Optional[int] = ..., step_accepted: _Optional[_Iterable[int]] = ..., step_drafted: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "forward_seconds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    forward_seconds: float
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., forward_seconds: _Optional[float] = ...) -> None: ...

class CapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CapacityResponse(_message.Message):
    __slots__ = ("free_slots", "total_slots", "max_len", "vocab_size", "hidden_size", "model", "hidden_dtype", "reserved_rows", "free_drafts")
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_ROWS_FIELD_NUMBER: _ClassVar[int]
    FREE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    free_slots: int
    total_slots: int
    max_len: int
    vocab_size: int
    hidden_size: int
    model: str
    hidden_dtype: str
    reserved_rows: int
    free_drafts: bool
    def __init__(self, free_slots: _Optional[int] = ..., total_slots: _Optional[int] = ..., max_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., model: _Optional[str] = ..., hidden_dtype: _Optional[str] = ..., reserved_rows: _Optional[int] = ..., free_drafts: _Optional[bool] = ...) -> None: ...
