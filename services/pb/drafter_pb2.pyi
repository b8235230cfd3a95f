from services.pb import common_pb2 as _common_pb2
from services.pb import verifier_pb2 as _verifier_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("method", "scheme", "needs_hidden", "max_draft_tokens", "max_depth", "top_k", "verifier_linked", "drafts_in_verifier")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    NEEDS_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_LINKED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_IN_VERIFIER_FIELD_NUMBER: _ClassVar[int]
    method: str
    scheme: _common_pb2.DraftScheme
    needs_hidden: bool
    max_draft_tokens: int
    max_depth: int
    top_k: int
    verifier_linked: bool
    drafts_in_verifier: bool
    def __init__(self, method: _Optional[str] = ..., scheme: _Optional[_Union[_common_pb2.DraftScheme, str]] = ..., needs_hidden: _Optional[bool] = ..., max_draft_tokens: _Optional[int] = ..., max_depth: _Optional[int] = ..., top_k: _Optional[int] = ..., verifier_linked: _Optional[bool] = ..., drafts_in_verifier: _Optional[bool] = ...) -> None: ...

class StartItem(_message.Message):
    __slots__ = ("ref", "prompt_ids", "first_token", "prompt_hidden", "params", "resync")
    REF_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.SeqRef
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    prompt_hidden: _common_pb2.HiddenStates
    params: _common_pb2.SamplingParams
    resync: bool
    def __init__(self, ref: _Optional[_Union[_common_pb2.SeqRef, _Mapping]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., prompt_hidden: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resync: _Optional[bool] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StartItem]
    def __init__(self, items: _Optional[_Iterable[_Union[StartItem, _Mapping]]] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ("num_started",)
    NUM_STARTED_FIELD_NUMBER: _ClassVar[int]
    num_started: int
    def __init__(self, num_started: _Optional[int] = ...) -> None: ...

class VerifiedStep(_message.Message):
    __slots__ = ("committed", "hidden", "next_token", "num_accepted")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    committed: _containers.RepeatedScalarFieldContainer[int]
    hidden: _common_pb2.HiddenStates
    next_token: int
    num_accepted: int
    def __init__(self, committed: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., next_token: _Optional[int] = ..., num_accepted: _Optional[int] = ...) -> None: ...

class StepItem(_message.Message):
    __slots__ = ("ref", "next_token", "draft", "want_draft_probs", "return_hidden", "unseen")
    REF_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    WANT_DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    UNSEEN_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.SeqRef
    next_token: int
    draft: bool
    want_draft_probs: bool
    return_hidden: bool
    unseen: _containers.RepeatedCompositeFieldContainer[VerifiedStep]
    def __init__(self, ref: _Optional[_Union[_common_pb2.SeqRef, _Mapping]] = ..., next_token: _Optional[int] = ..., draft: _Optional[bool] = ..., want_draft_probs: _Optional[bool] = ..., return_hidden: _Optional[bool] = ..., unseen: _Optional[_Iterable[_Union[VerifiedStep, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("items", "use_data_plane", "draft_deadline", "caller_hop_seconds")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    USE_DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    CALLER_HOP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StepItem]
    use_data_plane: bool
    draft_deadline: float
    caller_hop_seconds: float
    def __init__(self, items: _Optional[_Iterable[_Union[StepItem, _Mapping]]] = ..., use_data_plane: _Optional[bool] = ..., draft_deadline: _Optional[float] = ..., caller_hop_seconds: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("verified", "num_resampled_accepted", "quiet_steps")
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    NUM_RESAMPLED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    QUIET_STEPS_FIELD_NUMBER: _ClassVar[int]
    verified: _verifier_pb2.VerifyResult
    num_resampled_accepted: int
    quiet_steps: int
    def __init__(self, verified: _Optional[_Union[_verifier_pb2.VerifyResult, _Mapping]] = ..., num_resampled_accepted: _Optional[int] = ..., quiet_steps: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "draft_seconds", "forward_seconds", "used_data_plane", "handled_seconds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USED_DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    HANDLED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    draft_seconds: float
    forward_seconds: float
    used_data_plane: bool
    handled_seconds: float
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., draft_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., used_data_plane: _Optional[bool] = ..., handled_seconds: _Optional[float] = ...) -> None: ...

class StepDrafted(_message.Message):
    __slots__ = ("draft_seconds",)
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    draft_seconds: float
    def __init__(self, draft_seconds: _Optional[float] = ...) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("drafted", "response")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    drafted: StepDrafted
    response: StepResponse
    def __init__(self, drafted: _Optional[_Union[StepDrafted, _Mapping]] = ..., response: _Optional[_Union[StepResponse, _Mapping]] = ...) -> None: ...
