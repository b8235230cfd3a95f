"""The contract between the HTTP gateway and whatever generates tokens: a
``GenerationBackend`` turns one tokenized request into a stream of
``lyanna.async_engine.TokenDelta`` events, or refuses it with that module's ``BackendBusy``
(429) or ``BackendUnavailable`` (503); both backends are its ``AsyncEngine`` over the embedded
or the remote engine. Backends never touch Prometheus: each delta carries its verification's
facts and the gateway records them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lyanna.async_engine import TokenDelta
from lyanna.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # the gateway applies params.stop on the text; backends may ignore it
    method: str | None = None  # a name from lyanna.drafters.DRAFTERS; None = server default


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
