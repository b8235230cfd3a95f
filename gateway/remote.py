"""The remote backend: ``lyanna.async_engine.AsyncEngine`` over ``remote_engine.RemoteEngine``
(the gRPC services; admission, lanes, drafter sync, fallback and resume are the engine's)."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gateway.backend import GenerationRequest
from lyanna.async_engine import AsyncEngine, BackendUnavailable
from lyanna.sequence import Sequence
from remote_engine import RemoteConfig, RemoteEngine, Unavailable

__all__ = ["RemoteBackend", "RemoteConfig"]

T = TypeVar("T")


class RemoteBackend(AsyncEngine):
    def __init__(
        self,
        config: RemoteConfig,
        eos_token_ids: frozenset[int],
        detokenize: Callable[[list[int]], str],
    ) -> None:
        super().__init__(config.max_waiting, config.queue_timeout, config.drain_seconds)
        self.config = config
        self._eos, self._detokenize = eos_token_ids, detokenize
        self.engine = RemoteEngine(config)

    def __getattr__(self, name: str) -> Any:
        """The engine's view of the services (``default_method``, ``methods``,
        ``max_context``) and its counters (``scheduler``, ``drafter``, ``num_*``)."""
        if name.startswith("_") or name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def on_services(self, make: Callable[[RemoteEngine], Awaitable[T]]) -> Awaitable[T]:
        """``make(engine)`` awaited where the engine's gRPC channels live (its own loop)."""
        return self.engine.submit_io(make)

    def _build(self) -> None:
        try:
            self.engine.start()
        except Unavailable as error:
            self.engine.close()
            raise BackendUnavailable(str(error)) from None

    def _close(self) -> None:
        self.engine.close()

    async def health(self) -> dict[str, str]:
        if self._alive() != "ok":
            return {"engine": self._alive()}
        return await self.on_services(lambda engine: engine.health())

    def _sequence(self, request: GenerationRequest) -> Sequence:
        # an id no other client can guess (63 random bits: a collision among even a million
        # live sequences has probability ~1e-7), so none can release another's
        seq_id, prompt = secrets.randbits(63), list(request.prompt_ids)
        params, method = request.params, request.method
        return Sequence(seq_id, prompt, params, self._eos, self._detokenize, method=method)
