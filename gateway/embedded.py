"""The embedded backend: drafter and verifier in this process, one ``SpecEngine`` per method.

A single worker thread owns every engine (engines are not thread-safe, and torch releases the
GIL inside its kernels, so the event loop stays responsive). The event loop talks to it only
through a command queue (submit, abort, stop); the worker steps each engine that has work in
turn and hands every emitted delta to the request's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``. Engines are created lazily from the drafter registry; the
default method's engine is built at start, falling back along ``fallback_methods`` (logged)
when its checkpoint is missing. A consumer that closes its iterator early (client gone) aborts
the sequence, which frees its KV slot and drafter state.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from gateway.backend import (
    BackendBusy,
    BackendUnavailable,
    GenerationRequest,
    StepFacts,
    TokenDelta,
)
from lyanna.drafters import (
    DRAFTERS,
    TREE_MODES,
    DraftBudget,
    DraftCapacity,
    make_drafter,
    tree_budget,
)
from lyanna.engine import Emitted, EngineConfig, SpecEngine
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.stats import SpecStats

logger = logging.getLogger(__name__)

ENGINE_MARGIN = 64  # KV rows SpecEngine.submit keeps free beyond prompt + max_tokens
ENGINE_BUILD_ERRORS = (OSError, ValueError, RuntimeError, KeyError)  # missing/mismatched ckpt


@dataclass(frozen=True, slots=True)
class EmbeddedConfig:
    default_method: str = "lyanna"
    fallback_methods: tuple[str, ...] = ("eagle", "ngram", "ar")
    max_batch: int = 8  # running sequences per engine (the drafters hold state for 16)
    max_len: int = 2048  # KV rows per sequence
    max_waiting: int = 64  # requests waiting for their first token before BackendBusy
    queue_timeout: float = 60.0  # seconds a request may wait for its first token (BackendBusy)
    budget: DraftBudget | None = None  # None = each method's measured default shape
    tree: str = "cost"  # cost: trees sized by the target's cost curve; fixed: the budget
    rule: str | None = None  # acceptance rule at T > 0; None = the drafter scheme's default
    drain_seconds: float = 30.0

    def __post_init__(self) -> None:
        for method in (self.default_method, *self.fallback_methods):
            if method not in DRAFTERS:
                raise ValueError(f"unknown method {method!r}; known: {sorted(DRAFTERS)}")
        if self.tree not in TREE_MODES:
            raise ValueError(f"tree must be one of {TREE_MODES}, got {self.tree!r}")
        if not 1 <= self.max_batch <= 16:
            raise ValueError("max_batch must be in [1, 16]")
        if self.max_len <= 2 * ENGINE_MARGIN or self.max_waiting < 1 or self.drain_seconds < 0:
            raise ValueError("max_len must exceed 128, max_waiting >= 1, drain_seconds >= 0")
        if self.queue_timeout <= 0:
            raise ValueError("queue_timeout must be > 0")


@dataclass(slots=True, eq=False)
class _Handle:
    sequence: Sequence
    method: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(frozen=True, slots=True)
class _Submit:
    handle: _Handle


@dataclass(frozen=True, slots=True)
class _Abort:
    seq_id: int


@dataclass(frozen=True, slots=True)
class _Stop:
    deadline: float


class EmbeddedBackend:
    """``GenerationBackend`` running every method in-process (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        eos_token_ids: frozenset[int],
        config: EmbeddedConfig | None = None,
    ) -> None:
        self.config = config or EmbeddedConfig()
        self.model = model
        self._eos = eos_token_ids
        self._max_len = min(self.config.max_len, model.config.max_position_embeddings)
        self.max_context = self._max_len - ENGINE_MARGIN
        self.methods = tuple(DRAFTERS)
        self.default_method = self.config.default_method
        self._engines: dict[str, SpecEngine] = {}
        self._broken: dict[str, str] = {}  # method -> why its engine could not be built
        self._handles: dict[int, _Handle] = {}  # worker thread only
        self._pending: dict[str, deque[_Handle]] = {}  # accepted, not yet in an engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._num_waiting = 0  # event loop only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._crash: str | None = None

    # -- GenerationBackend ------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self._build_default_engine)
        self._thread = threading.Thread(target=self._work, name="lyanna-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(_Stop(time.monotonic() + self.config.drain_seconds))
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def health(self) -> dict[str, str]:
        alive = self._thread is not None and self._thread.is_alive() and not self._stopping
        status = {"engine": "ok" if alive else (self._crash or "not running")}
        # copies first: the worker thread may add an engine meanwhile
        status.update({f"method:{m}": "ok" for m in list(self._engines)})
        broken = list(self._broken.items())
        status.update({f"method:{m}": f"degraded: {why}" for m, why in broken})
        return status

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if self._thread is None or not self._thread.is_alive() or self._stopping:
            raise BackendUnavailable(self._crash or "the embedded engine is not running")
        method = request.method or self.default_method
        if method not in self.methods:
            raise ValueError(f"unknown method {method!r}; known: {list(self.methods)}")
        vocab = self.model.config.vocab_size
        if any(not 0 <= token < vocab for token in request.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if self._num_waiting >= self.config.max_waiting:
            raise BackendBusy(f"{self._num_waiting} requests are already waiting")
        sequence = Sequence(
            seq_id=next(self._ids),
            prompt_ids=list(request.prompt_ids),
            params=replace(request.params, stop=()),  # the gateway applies stop strings
            eos_token_ids=self._eos,
        )
        handle = _Handle(sequence, method, asyncio.get_running_loop(), asyncio.Queue())
        self._num_waiting += 1
        waiting, finished = True, False
        self._commands.put(_Submit(handle))
        try:
            while not finished:
                item = await self._next(handle, waiting)
                if isinstance(item, Exception):
                    raise item
                if waiting:
                    self._num_waiting -= 1
                    waiting = False
                finished = item.finish_reason is not None
                yield item
        finally:
            if waiting:
                self._num_waiting -= 1
            if not finished:
                self._commands.put(_Abort(sequence.seq_id))

    async def _next(self, handle: _Handle, waiting: bool) -> TokenDelta | Exception:
        """The request's next delta; while it waits for its first one, at most
        ``queue_timeout`` seconds (then BackendBusy, and the caller aborts the request)."""
        if not waiting:
            return await handle.queue.get()
        timeout = self.config.queue_timeout
        try:
            return await asyncio.wait_for(handle.queue.get(), timeout)
        except TimeoutError:
            return BackendBusy(f"no sequence slot became free within {timeout:g} s; retry later")

    # -- worker thread ----------------------------------------------------------------------

    def _build_default_engine(self) -> None:
        configured = self.config.default_method
        for method in dict.fromkeys((configured, *self.config.fallback_methods)):
            engine = self._engine(method)
            if engine is None:
                continue
            if method != configured:
                logger.warning(
                    "default method %r is unavailable (%s); serving %r by default",
                    configured,
                    self._broken[configured],
                    method,
                )
            self.default_method = method
            return
        raise BackendUnavailable(f"no method could start: {self._broken}")

    def _engine(self, method: str) -> SpecEngine | None:
        if method in self._engines:
            return self._engines[method]
        if method in self._broken:
            return None
        engine_config = EngineConfig(self.config.max_batch, self._max_len, self.config.rule)
        try:
            budget = tree_budget(method, self.model, self.config.tree, self.config.budget)
            capacity = DraftCapacity(self.config.max_batch, self._max_len)
            drafter = make_drafter(method, self.model, budget, capacity)
            engine = SpecEngine(self.model, drafter, engine_config)
            self._warm_up(engine)
        except ENGINE_BUILD_ERRORS as err:
            self._broken[method] = f"{type(err).__name__}: {err}"
            logger.warning("method %r cannot start: %s", method, self._broken[method])
            return None
        self._engines[method] = engine
        logger.info("method %r ready", method)
        return engine

    def _warm_up(self, engine: SpecEngine) -> None:
        """One short greedy request: proves the drafter fits the model (a checkpoint for
        another model fails here, not in a client's request) and warms the kernels."""
        prompt = [i % self.model.config.vocab_size for i in range(1, 9)]
        sequence = Sequence(next(self._ids), prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        engine.submit(sequence)
        engine.run()
        engine.stats = SpecStats()

    def _work(self) -> None:
        deadline: float | None = None
        try:
            while True:
                busy = any(self._pending.values()) or any(
                    engine.has_work for engine in self._engines.values()
                )
                for command in self._drain_commands(block=not busy and deadline is None):
                    deadline = self._apply(command, deadline)
                if deadline is not None and (not self._handles or time.monotonic() > deadline):
                    break
                for method, engine in list(self._engines.items()):
                    self._admit(method, engine)
                    if engine.running and method in self._engines:
                        self._run(method, engine, engine.step)
        except Exception as err:  # the thread must report its death, not vanish silently
            logger.exception("embedded engine thread crashed")
            self._crash = f"engine thread crashed: {type(err).__name__}: {err}"
        self._stopping = True
        reason = BackendUnavailable(self._crash or "the server is shutting down")
        late = [c.handle for c in self._drain_commands(block=False) if isinstance(c, _Submit)]
        for handle in [*self._handles.values(), *late]:
            self._deliver(handle, reason)
        self._handles.clear()

    def _drain_commands(self, block: bool) -> list:
        commands = []
        try:
            if block:
                commands.append(self._commands.get(timeout=0.5))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _apply(self, command, deadline: float | None) -> float | None:
        if isinstance(command, _Stop):
            return command.deadline
        if isinstance(command, _Abort):
            handle = self._handles.pop(command.seq_id, None)
            pending = self._pending.get(handle.method) if handle is not None else None
            if pending is not None and handle in pending:
                pending.remove(handle)
            elif handle is not None and handle.method in self._engines:
                self._engines[handle.method].abort(command.seq_id)
            return deadline
        handle = command.handle
        engine = self._engine(handle.method)
        if engine is None:
            why = self._broken[handle.method]
            self._deliver(handle, BackendUnavailable(f"method {handle.method!r}: {why}"))
            return deadline
        self._pending.setdefault(handle.method, deque()).append(handle)
        self._handles[handle.sequence.seq_id] = handle
        return deadline

    def _admit(self, method: str, engine: SpecEngine) -> None:
        """Prefill pending requests one at a time while the engine has room, streaming each
        first token at once (rather than after every prefill and a verification)."""
        pending = self._pending.get(method)
        while pending and len(engine.running) < engine.config.max_batch:
            handle = pending.popleft()
            try:
                engine.submit(handle.sequence)
            except ValueError as err:
                self._deliver(handle, err)
                del self._handles[handle.sequence.seq_id]
                continue
            self._run(method, engine, engine.admit)
            if method not in self._engines:
                return

    def _run(self, method: str, engine: SpecEngine, action: Callable[[], list[Emitted]]) -> None:
        """``engine.admit`` or ``engine.step``, then hand every emitted delta to its request."""
        stats, drafter = engine.stats, engine.drafter
        draft_before, verify_before = stats.draft_seconds, stats.verify_seconds
        resampled_before = getattr(drafter, "num_resampled_accepted", 0)
        try:
            emitted = action()
        except Exception:  # fail this engine's requests, keep serving the others
            logger.exception("engine %r failed; dropping it", method)
            self._engines.pop(method)
            self._pending.pop(method, None)
            for seq_id, handle in list(self._handles.items()):
                if handle.method == method:
                    self._deliver(handle, BackendUnavailable("engine error (logged)"))
                    del self._handles[seq_id]
            return
        # Draft/verify time and re-sampled acceptances are known per micro-batch; the
        # re-sampled count goes to the first verification of the batch so totals add up.
        draft_seconds = stats.draft_seconds - draft_before
        verify_seconds = stats.verify_seconds - verify_before
        resampled = getattr(drafter, "num_resampled_accepted", 0) - resampled_before
        for item in emitted:
            handle = self._handles.get(item.sequence.seq_id)
            if handle is None:
                continue
            step = None
            if item.verdict is not None:
                step = _facts(method, item, resampled, draft_seconds, verify_seconds)
                resampled = 0
            self._deliver(
                handle,
                TokenDelta(
                    token_ids=item.tokens,
                    finish_reason=item.sequence.finish_reason,
                    step=step,
                    prompt_tokens=len(item.sequence.prompt_ids) if step is None else 0,
                ),
            )
            if item.sequence.finished:
                del self._handles[item.sequence.seq_id]

    @staticmethod
    def _deliver(handle: _Handle, item: TokenDelta | Exception) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)
        except RuntimeError:
            logger.debug("event loop closed; dropping a delta for %d", handle.sequence.seq_id)


def _facts(
    method: str, item: Emitted, resampled: int, draft_seconds: float, verify_seconds: float
) -> StepFacts:
    verdict = item.verdict
    return StepFacts(
        method=method,
        num_drafted=sum(verdict.num_drafted_per_depth),
        num_accepted=verdict.num_accepted,
        num_resampled_accepted=resampled,
        draft_seconds=draft_seconds,
        verify_seconds=verify_seconds,
    )
