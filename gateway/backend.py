"""The contract between the HTTP gateway and whatever generates tokens: a
``GenerationBackend`` turns one tokenized request into a stream of ``TokenDelta`` events
(``gateway.adapter`` over the embedded or the remote engine). Backends never touch
Prometheus: each delta carries its verification's facts and the gateway records them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lyanna.sampling import SamplingParams
from lyanna.step_facts import StepFacts


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # the gateway applies params.stop on the text; backends may ignore it
    method: str | None = None  # a name from lyanna.drafters.DRAFTERS; None = server default


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Newly committed output tokens of one request (empty when only a finish arrives)."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    step: StepFacts | None = None  # None for the first token (it comes from prefill)
    prompt_tokens: int = 0  # set on the first delta
    logprobs: list | None = None  # one lyanna.sampling.TokenLogprob per token (when asked)


class BackendUnavailable(RuntimeError):
    """The verifier (or the embedded engine) cannot serve: the gateway answers 503."""


class BackendBusy(RuntimeError):
    """The waiting queue is full: the gateway answers 429."""


@runtime_checkable
class GenerationBackend(Protocol):
    max_context: int  # prompt + max_tokens must fit (the gateway answers 400 otherwise)
    default_method: str
    methods: tuple[str, ...]  # methods a request may choose

    async def start(self) -> None: ...

    async def stop(self) -> None:  # drains in-flight requests, then frees resources
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Deltas until one has a finish_reason; closing it early cancels the request."""
        ...

    async def health(self) -> dict[str, str]:
        """Component -> "ok" | "degraded: <why>" (still serving) | an error (/health: 503)."""
        ...
