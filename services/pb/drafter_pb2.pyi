from services.pb import common_pb2 as _common_pb2
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
    __slots__ = ("method", "scheme", "needs_hidden", "max_draft_tokens", "max_depth", "top_k")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    NEEDS_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    method: str
    scheme: _common_pb2.DraftScheme
    needs_hidden: bool
    max_draft_tokens: int
    max_depth: int
    top_k: int
    def __init__(self, method: _Optional[str] = ..., scheme: _Optional[_Union[_common_pb2.DraftScheme, str]] = ..., needs_hidden: _Optional[bool] = ..., max_draft_tokens: _Optional[int] = ..., max_depth: _Optional[int] = ..., top_k: _Optional[int] = ...) -> None: ...

class StartItem(_message.Message):
    __slots__ = ("ref", "prompt_ids", "first_token", "prompt_hidden", "params")
    REF_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.SeqRef
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    prompt_hidden: _common_pb2.HiddenStates
    params: _common_pb2.SamplingParams
    def __init__(self, ref: _Optional[_Union[_common_pb2.SeqRef, _Mapping]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., prompt_hidden: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

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

class ProposeItem(_message.Message):
    __slots__ = ("ref", "verified", "want_draft_probs", "quiet")
    REF_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    WANT_DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    QUIET_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.SeqRef
    verified: VerifiedStep
    want_draft_probs: bool
    quiet: _containers.RepeatedCompositeFieldContainer[VerifiedStep]
    def __init__(self, ref: _Optional[_Union[_common_pb2.SeqRef, _Mapping]] = ..., verified: _Optional[_Union[VerifiedStep, _Mapping]] = ..., want_draft_probs: _Optional[bool] = ..., quiet: _Optional[_Iterable[_Union[VerifiedStep, _Mapping]]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("ref", "tree", "num_resampled_accepted", "quiet_steps")
    REF_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    NUM_RESAMPLED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    QUIET_STEPS_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.SeqRef
    tree: _common_pb2.TokenTree
    num_resampled_accepted: int
    quiet_steps: int
    def __init__(self, ref: _Optional[_Union[_common_pb2.SeqRef, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., num_resampled_accepted: _Optional[int] = ..., quiet_steps: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposals", "draft_seconds")
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    draft_seconds: float
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., draft_seconds: _Optional[float] = ...) -> None: ...
