"""The embedded backend: drafter and verifier in this process, one ``SpecEngine`` for every
method (``lyanna.method_pool``), so requests of different methods share every target forward;
the default method falls back along ``fallback_methods`` (logged). A drafter that raises is
dropped (its method reports degraded) and the engine goes on with new requests."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, replace

from gateway.backend import GenerationRequest
from lyanna.async_engine import AsyncEngine, BackendUnavailable, settle
from lyanna.drafters import DRAFTERS, FALLBACK_METHODS, TREE_MODES, DraftBudget
from lyanna.engine import DrafterError, EngineConfig, SpecEngine
from lyanna.method_pool import MethodPool
from lyanna.model.transformer import Transformer
from lyanna.scheduler import TREE_MARGIN
from lyanna.sequence import Sequence
from lyanna.threads import StepThreads, available_cpus


@dataclass(frozen=True, slots=True)
class EmbeddedConfig:
    default_method: str = "lyanna"
    fallback_methods: tuple[str, ...] = FALLBACK_METHODS
    max_running: int = 8  # sequences decoding at once, all methods together
    max_len: int = 2048  # KV rows per sequence
    max_waiting: int = 64  # requests waiting for their first token before BackendBusy
    queue_timeout: float = 60.0  # seconds a request may wait for its first token (BackendBusy)
    budget: DraftBudget | None = None  # None = each method's measured default shape
    tree: str = "cost"  # cost: trees sized by the target's cost curve; fixed: the budget
    rule: str | None = None  # acceptance rule at T > 0; None = the drafter scheme's default
    drain_seconds: float = 30.0
    threads: int = 0  # compute threads; 0 = every CPU, the event loop served between steps

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
        for method in (self.default_method, *self.fallback_methods):
            if method not in DRAFTERS:
                raise ValueError(f"unknown method {method!r}; known: {sorted(DRAFTERS)}")
        if self.tree not in TREE_MODES:
            raise ValueError(f"tree must be one of {TREE_MODES}, got {self.tree!r}")
        if not 1 <= self.max_running <= 16:
            raise ValueError("max_running must be in [1, 16]")
        if self.max_len <= 2 * TREE_MARGIN or self.max_waiting < 1 or self.drain_seconds < 0:
            raise ValueError("max_len must exceed 128, max_waiting >= 1, drain_seconds >= 0")
        if self.queue_timeout <= 0:
            raise ValueError("queue_timeout must be > 0")


class EmbeddedBackend(AsyncEngine):
    admit_limit = 1  # each prefill streams its first token before the next one runs

    def __init__(
        self,
        model: Transformer,
        eos_token_ids: frozenset[int],
        config: EmbeddedConfig | None = None,
    ) -> None:
        self.config = config or EmbeddedConfig()
        super().__init__(
            self.config.max_waiting, self.config.queue_timeout, self.config.drain_seconds
        )
        self.model = model
        self._eos = eos_token_ids
        self._max_len = min(self.config.max_len, model.config.max_position_embeddings)
        self.max_context = self._max_len - TREE_MARGIN
        self.methods = tuple(DRAFTERS)
        self.default_method = self.config.default_method
        self.engine: SpecEngine | None = None  # built by start(), with self.pool
        self._ids = itertools.count()
        # every CPU for each step: the worker lets the event loop send a step's deltas
        # before it starts the next (``settle``), so the OpenMP team never shares a core
        self._threads = StepThreads.serving(self.config.threads, reserved=0)
        self._cpus = available_cpus()

    async def health(self) -> dict[str, str]:
        status = {"engine": self._alive()}
        if self.engine is not None:  # copies first: the worker thread may add a method
            status.update({f"method:{m}": "ok" for m in list(self.engine.drafters)})
            # why stays in the server log: exception text can name paths and internals
            status.update({f"method:{m}": "degraded: unavailable" for m in list(self.pool.broken)})
        return status

    def _sequence(self, request: GenerationRequest) -> Sequence:
        params = replace(request.params, stop=())  # the gateway applies stop strings
        prompt, method = list(request.prompt_ids), request.method
        return Sequence(next(self._ids), prompt, params, self._eos, method=method)

    def _before_step(self) -> None:
        self._threads.apply(len(self.engine.running))

    def _stepped(self, loops: set[asyncio.AbstractEventLoop]) -> None:
        if self._threads.current >= self._cpus:
            for loop in loops:
                settle(loop)

    # -- worker thread ----------------------------------------------------------------------

    def _build(self) -> None:
        config = EngineConfig(self.config.max_running, self._max_len, self.config.rule)
        self.pool = MethodPool(self.model, config, self.config.tree, self.config.budget)
        self.engine = self.pool.engine
        methods = (self.config.default_method, *self.config.fallback_methods)
        self.default_method = self.pool.first_serving(methods)
        if self.default_method is None:
            raise BackendUnavailable(f"no method could start: {self.pool.broken}")

    def _serves(self, method: str) -> bool:
        return self.pool.serves(method)

    def _step_failed(self, err: Exception) -> None:
        """Also: a drafter that raised stops serving (degraded) so it cannot fail the next
        step; the requests waiting on its method fail."""
        if isinstance(err, DrafterError):
            self.pool.drop(err.method, "its drafter failed (see the server log)")
        super()._step_failed(err)
