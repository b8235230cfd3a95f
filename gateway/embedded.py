"""The embedded backend: drafter and verifier in this process, one engine for every method.

One ``SpecEngine`` holds the target and its KV cache; each method is a drafter registered on
it, so requests that use different methods share every target forward (a mixed-method batch
is one verification). A single worker thread owns the engine (it is not thread-safe, and
torch releases the GIL inside its kernels, so the event loop stays responsive). The event
loop talks to it only through a command queue (submit, abort, stop); the worker admits and
steps the engine and hands every emitted delta to the request's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``. Drafters are built lazily from the registry; the default
method is built at start, falling back along ``fallback_methods`` (logged) when its
checkpoint is missing. A drafter that raises is dropped (its method reports degraded); a
step that fails fails the requests in it, and the engine goes on with new ones. A consumer
that closes its iterator early (client gone) aborts the sequence, which frees its KV slot
and drafter state.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from gateway.backend import (
    BackendBusy,
    BackendUnavailable,
    GenerationRequest,
    StepFacts,
    TokenDelta,
)
from gateway.handover import settle
from lyanna.drafters import (
    DRAFTERS,
    TARGET_ONLY,
    TREE_MODES,
    DraftBudget,
    DraftCapacity,
    make_drafter,
    tree_budget,
)
from lyanna.drafters.base import Drafter, NoDrafter
from lyanna.engine import DrafterError, EngineConfig, SpecEngine
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.scheduler import TREE_MARGIN, Emitted
from lyanna.sequence import Sequence
from lyanna.threads import StepThreads, available_cpus

logger = logging.getLogger(__name__)

METHOD_BUILD_ERRORS = (OSError, ValueError, RuntimeError, KeyError)  # missing/mismatched ckpt


@dataclass(frozen=True, slots=True)
class EmbeddedConfig:
    default_method: str = "lyanna"
    fallback_methods: tuple[str, ...] = ("eagle", "ngram", TARGET_ONLY)
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


@dataclass(slots=True, eq=False)
class _Handle:
    sequence: Sequence  # its method names the drafter that serves it
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

    supports_logprobs = True  # the target's rows are in this process (chat logprobs)

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
        self.max_context = self._max_len - TREE_MARGIN
        self.methods = tuple(DRAFTERS)
        self.default_method = self.config.default_method
        self.engine: SpecEngine | None = None  # built by start()
        self._broken: dict[str, str] = {}  # method -> why it cannot serve (logged in full)
        self._handles: dict[int, _Handle] = {}  # worker thread only
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        # every CPU for each step: the worker lets the event loop send a step's deltas before
        # it starts the next (``handover.settle``), so the OpenMP team never shares a core
        self._threads = StepThreads.serving(self.config.threads, reserved=0)
        self._cpus = available_cpus()
        self._num_waiting = 0  # event loop only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._crashed = False

    # -- GenerationBackend ------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self._build)
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
        crashed = "crashed (see the server log)" if self._crashed else "not running"
        status = {"engine": "ok" if alive else crashed}
        if self.engine is not None:  # copies first: the worker thread may add a method
            status.update({f"method:{m}": "ok" for m in list(self.engine.drafters)})
        # why stays in the server log: exception text can name paths and internals
        status.update({f"method:{m}": "degraded: unavailable" for m in list(self._broken)})
        return status

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if self._thread is None or not self._thread.is_alive() or self._stopping:
            raise BackendUnavailable("the embedded engine is not running")
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
            method=method,
        )
        handle = _Handle(sequence, asyncio.get_running_loop(), asyncio.Queue())
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

    def _build(self) -> None:
        """The engine (target + AR) and the default method, falling back along
        ``fallback_methods`` when it cannot start."""
        config = EngineConfig(self.config.max_running, self._max_len, self.config.rule)
        self.engine = SpecEngine(self.model, NoDrafter(), config, method=TARGET_ONLY)
        self._warm_up(self.engine.drafter)
        configured = self.config.default_method
        for method in dict.fromkeys((configured, *self.config.fallback_methods)):
            if not self._serves(method):
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

    def _serves(self, method: str) -> bool:
        """Whether ``method`` can serve, building its drafter on first use."""
        if method in self.engine.drafters:
            return True
        if method in self._broken:
            return False
        try:
            budget = tree_budget(method, self.model, self.config.tree, self.config.budget)
            capacity = DraftCapacity(self.config.max_running, self._max_len)
            drafter = make_drafter(method, self.model, budget, capacity)
            self._warm_up(drafter)
            self.engine.add_method(method, drafter)
        except METHOD_BUILD_ERRORS as err:
            self._broken[method] = f"{type(err).__name__}: {err}"
            logger.warning("method %r cannot start: %s", method, self._broken[method])
            return False
        logger.info("method %r ready", method)
        return True

    def _warm_up(self, drafter: Drafter) -> None:
        """One short greedy request on a one-slot engine of its own (the shared engine's
        running requests must not step meanwhile): proves the drafter fits the model (a
        checkpoint for another model fails here, not in a client's request) and warms the
        kernels."""
        prompt = [i % self.model.config.vocab_size for i in range(1, 9)]
        engine = SpecEngine(self.model, drafter, EngineConfig(1, len(prompt) + 4 + TREE_MARGIN))
        engine.submit(
            Sequence(next(self._ids), prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        )
        engine.run()

    def _work(self) -> None:
        deadline: float | None = None
        try:
            while True:
                idle = not self.engine.has_work and deadline is None
                for command in self._drain_commands(block=idle):
                    deadline = self._apply(command, deadline)
                if deadline is not None and (not self._handles or time.monotonic() > deadline):
                    break
                self._admit()
                if self.engine.running:
                    self._threads.apply(len(self.engine.running))
                    self._run(self.engine.step)
        except Exception:  # the thread must report its death, not vanish silently
            logger.exception("embedded engine thread crashed")
            self._crashed = True
        self._stopping = True
        reason = BackendUnavailable("the embedded engine stopped")
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
            if self._handles.pop(command.seq_id, None) is not None:
                self.engine.abort(command.seq_id)
            return deadline
        handle = command.handle
        method = handle.sequence.method
        if not self._serves(method):
            self._deliver(handle, BackendUnavailable(f"method {method!r} is unavailable"))
            return deadline
        try:
            self.engine.submit(handle.sequence)
        except ValueError as err:
            self._deliver(handle, err)
            return deadline
        self._handles[handle.sequence.seq_id] = handle
        return deadline

    def _admit(self) -> None:
        """Prefill waiting requests one at a time while slots are free, streaming each first
        token at once (rather than after every prefill and a verification)."""
        while self.engine.waiting and self.engine.scheduler.num_free > 0:
            self._run(lambda: self.engine.admit(limit=1))

    def _run(self, action: Callable[[], list[Emitted]]) -> None:
        """``engine.admit`` or ``engine.step``, then hand every emitted delta to its request."""
        try:
            emitted = action()
        except Exception as err:  # fail the requests in flight, keep serving new ones
            self._fail_in_flight(err)
            return
        loops = set()
        for item in emitted:
            handle = self._handles.get(item.sequence.seq_id)
            if handle is None:
                continue
            loops.add(handle.loop)
            step = None if item.verdict is None else StepFacts.of(item)
            self._deliver(
                handle,
                TokenDelta(
                    token_ids=item.tokens,
                    finish_reason=item.sequence.finish_reason,
                    step=step,
                    prompt_tokens=len(item.sequence.prompt_ids) if step is None else 0,
                    logprobs=item.logprobs,
                ),
            )
            if item.sequence.finished:
                del self._handles[item.sequence.seq_id]
        if self._threads.current >= self._cpus:
            for loop in loops:
                settle(loop)

    def _fail_in_flight(self, err: Exception) -> None:
        """A step failed half-way: every running request fails (503) and is aborted; when a
        drafter raised, its method stops serving (degraded) so it cannot fail the next."""
        logger.error("engine step failed", exc_info=err)
        if isinstance(err, DrafterError):
            self._broken[err.method] = "its drafter failed (see the server log)"
            self.engine.remove_method(err.method)
        failure = BackendUnavailable("engine error (logged)")
        for seq_id in list(self.engine.running):
            self.engine.abort(seq_id)
            handle = self._handles.pop(seq_id, None)
            if handle is not None:
                self._deliver(handle, failure)
        waiting = {s.seq_id for s in self.engine.waiting}
        for seq_id, handle in list(self._handles.items()):  # waiting on a dropped method
            if seq_id not in waiting:
                self._deliver(handle, failure)
                del self._handles[seq_id]

    @staticmethod
    def _deliver(handle: _Handle, item: TokenDelta | Exception) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)
        except RuntimeError:
            logger.debug("event loop closed; dropping a delta for %d", handle.sequence.seq_id)
