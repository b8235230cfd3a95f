"""The asyncio adapter over the engine interface (``lyanna.engine.StepLoop``: submit, admit,
step, abort), shared by both backends: the embedded one (``SpecEngine`` in this process) and
the remote one (``remote_engine.RemoteEngine`` over the services).

A single worker thread owns the engine (it is not thread-safe; torch and gRPC release the
GIL, so the event loop stays responsive). The event loop talks to it only through a command
queue (submit, abort, stop); the worker admits and steps the engine and hands every emitted
delta to its request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``. A request that
waits for its first token longer than ``queue_timeout`` gets ``BackendBusy`` (429), as does
one that finds ``max_waiting`` requests waiting. Closing a request's iterator early (client
gone) aborts its sequence, which frees its KV slot and drafter state. A stop drains: the
worker goes on until every request finished or ``drain_seconds`` passed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.backend import (
    BackendBusy,
    BackendUnavailable,
    GenerationRequest,
    StepFacts,
    TokenDelta,
)
from lyanna.engine import StepLoop
from lyanna.scheduler import Emitted
from lyanna.sequence import Sequence

logger = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.05  # a worker with waiting requests it cannot admit yet looks again


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


class EngineBackend:
    """``GenerationBackend`` over a ``StepLoop`` (see the module docstring). A backend builds
    its engine (``_build``, in a thread) and says how a request becomes a ``Sequence``."""

    supports_logprobs = True
    admit_limit: int | None = None  # sequences one ``engine.admit`` prefills; None = all
    default_method: str
    methods: tuple[str, ...]

    def __init__(self, max_waiting: int, queue_timeout: float, drain_seconds: float) -> None:
        self.max_waiting, self.queue_timeout = max_waiting, queue_timeout
        self.drain_seconds = drain_seconds
        self.engine: StepLoop | None = None  # built by start()
        self._handles: dict[int, _Handle] = {}  # worker thread only
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._num_waiting = 0  # event loop only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._crashed = False

    # -- per backend ---------------------------------------------------------------------

    def _build(self) -> None:
        """Build ``self.engine`` (in a thread; it may block)."""
        raise NotImplementedError

    def _close(self) -> None:
        """Free what ``_build`` took, once the worker stopped."""

    def _sequence(self, request: GenerationRequest, method: str) -> Sequence:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def _serves(self, method: str) -> bool:
        """Whether ``method`` can serve now (worker thread)."""
        return self.engine.serves(method)

    def _step_failed(self, err: Exception) -> None:
        """An engine call raised: every running request fails (503) and is aborted."""
        logger.error("engine step failed", exc_info=err)
        failure = BackendUnavailable("engine error (logged)")
        for seq_id in list(self.engine.running):
            self.engine.abort(seq_id)
            handle = self._handles.pop(seq_id, None)
            if handle is not None:
                self._deliver(handle, failure)

    def _stepped(self, loops: set[asyncio.AbstractEventLoop]) -> None:
        """A step's deltas went to these loops."""

    def _before_step(self) -> None:
        pass

    # -- GenerationBackend ------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self._build)
        self._thread = threading.Thread(target=self._work, name="lyanna-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(_Stop(time.monotonic() + self.drain_seconds))
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        await asyncio.to_thread(self._close)

    def _alive(self) -> str:
        if self._thread is not None and self._thread.is_alive() and not self._stopping:
            return "ok"
        return "crashed (see the server log)" if self._crashed else "not running"

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if self._alive() != "ok":
            raise BackendUnavailable("the engine is not running")
        method = request.method or self.default_method
        # the HTTP intake validated the request (method, prompt ids); a Python caller that
        # skips it still meets the engine's own refusals (unknown method, context) below
        if self._num_waiting >= self.max_waiting:
            raise BackendBusy(f"{self._num_waiting} requests are already waiting")
        sequence = self._sequence(request, method)
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
        timeout = self.queue_timeout
        try:
            return await asyncio.wait_for(handle.queue.get(), timeout)
        except TimeoutError:
            return BackendBusy(f"no sequence slot became free within {timeout:g} s; retry later")

    # -- worker thread ----------------------------------------------------------------------

    def _work(self) -> None:
        deadline: float | None = None
        try:
            while True:
                idle = not self.engine.has_work and deadline is None
                # waiting requests it could not admit (no free slot on a remote verifier)
                stalled = not idle and not self.engine.running
                for command in self._drain_commands(0.5 if idle else stalled * IDLE_POLL_SECONDS):
                    deadline = self._apply(command, deadline)
                if deadline is not None and (not self._handles or time.monotonic() > deadline):
                    break
                self._admit()
                if self.engine.running:
                    self._before_step()
                    self._run(self.engine.step)
        except Exception:  # the thread must report its death, not vanish silently
            logger.exception("engine thread crashed")
            self._crashed = True
        self._stopping = True
        reason = BackendUnavailable("the engine stopped")
        late = [c.handle for c in self._drain_commands(0) if isinstance(c, _Submit)]
        for seq_id, handle in list(self._handles.items()):
            self._abort_quietly(seq_id)
            self._deliver(handle, reason)
        for handle in late:
            self._deliver(handle, reason)
        self._handles.clear()

    def _abort_quietly(self, seq_id: int) -> None:
        try:
            self.engine.abort(seq_id)
        except Exception:  # leaving anyway: its slot goes with the services' leases
            logger.exception("abort of %d failed", seq_id)

    def _drain_commands(self, wait: float) -> list:
        commands = []
        try:
            if wait > 0:
                commands.append(self._commands.get(timeout=wait))
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
        """Prefill waiting requests (``admit_limit`` at a time) while the engine admits any,
        streaming each first token at once (rather than after a verification)."""
        while self.engine.waiting:
            if not self._run(lambda: self.engine.admit(self.admit_limit)):
                return

    def _run(self, action: Callable[[], list[Emitted]]) -> list[Emitted]:
        """``engine.admit`` or ``engine.step``, then hand every emitted delta to its request."""
        try:
            emitted = action()
        except Exception as err:  # fail the requests in flight, keep serving new ones
            self._step_failed(err)
            return []
        loops = set()
        for item in emitted:
            handle = self._handles.get(item.sequence.seq_id)
            if handle is None:
                continue
            loops.add(handle.loop)
            if item.error is not None:
                del self._handles[item.sequence.seq_id]
                self._deliver(handle, self._failure(item.error))
                continue
            step = None if item.verdict is None else StepFacts.of(item)
            self._deliver(
                handle,
                TokenDelta(
                    token_ids=item.tokens,
                    finish_reason=item.finish_reason,
                    step=step,
                    prompt_tokens=len(item.sequence.prompt_ids) if step is None else 0,
                    logprobs=item.logprobs,
                ),
            )
            if item.finish_reason is not None:
                del self._handles[item.sequence.seq_id]
        self._stepped(loops)
        return emitted

    @staticmethod
    def _failure(error: Exception) -> Exception:
        """What the request raises: its own fault (ValueError: 400) or unavailable (503)."""
        return error if isinstance(error, ValueError) else BackendUnavailable(str(error))

    @staticmethod
    def _deliver(handle: _Handle, item: TokenDelta | Exception) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)
        except RuntimeError:
            logger.debug("event loop closed; dropping a delta for %d", handle.sequence.seq_id)
