"""The remote backend: ``gateway.adapter.EngineBackend`` over ``remote_engine.RemoteEngine``
(the drafter and verifier gRPC services; admission, lanes, drafter sync, fallback and resume
are the engine's, its docstring says how)."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway.adapter import EngineBackend
from gateway.backend import BackendUnavailable, GenerationRequest
from lyanna.scheduler import Scheduler
from lyanna.sequence import Sequence
from remote_engine import RemoteConfig, RemoteEngine, Unavailable
from remote_engine.drafter import DrafterLink

__all__ = ["RemoteBackend", "RemoteConfig"]

T = TypeVar("T")


class RemoteBackend(EngineBackend):
    """``GenerationBackend`` over the gRPC services (see the module docstring)."""

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

    # what the services said at start (the engine's view)

    @property
    def default_method(self) -> str:
        return self.engine.default_method

    @property
    def methods(self) -> tuple[str, ...]:
        return self.engine.methods

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def drafter(self) -> DrafterLink | None:
        return self.engine.drafter

    @property
    def num_verified_steps(self) -> int:
        return self.engine.num_verified_steps

    @property
    def num_verify_calls(self) -> int:
        return self.engine.num_verify_calls

    @property
    def num_fallback_steps(self) -> int:
        return self.engine.num_fallback_steps

    @property
    def num_resumed(self) -> int:
        return self.engine.num_resumed

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

    def _sequence(self, request: GenerationRequest, method: str) -> Sequence:
        return Sequence(
            # an id no other client can guess (63 random bits: a collision among even a
            # million live sequences has probability ~1e-7), so none can release another's
            secrets.randbits(63),
            list(request.prompt_ids),
            request.params,
            self._eos,
            self._detokenize,
            method=method,
        )
