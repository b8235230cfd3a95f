"""An asyncio front over the engine interface (``lyanna.engine.StepLoop``: submit, admit,
step, abort), what a server streams from: the gateway's embedded backend drives ``SpecEngine``
through it, its remote one ``remote_engine.RemoteEngine``.

One worker thread owns the engine (not thread-safe; torch and gRPC release the GIL, so the
event loop stays responsive) and hears from the loop only through a command queue. A request
that waits for its first token past ``queue_timeout``, or finds ``max_waiting`` waiting, gets
``BackendBusy`` (a server answers 429). Closing a request's iterator early aborts its sequence
(KV slot and drafter state freed). A stop drains for at most ``drain_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from lyanna.engine import StepLoop
from lyanna.scheduler import Emitted
from lyanna.sequence import Sequence
from lyanna.step_facts import StepFacts

logger = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.05  # a worker with waiting requests it cannot admit yet looks again
SETTLE_HOPS = 4  # event-loop turns ``settle`` waits for, at most SETTLE_SECONDS
SETTLE_SECONDS = 0.01


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Newly committed output tokens of one request (empty when only a finish arrives)."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    step: StepFacts | None = None  # None for the first token (it comes from prefill)
    prompt_tokens: int = 0  # set on the first delta
    logprobs: list | None = None  # one lyanna.sampling.TokenLogprob per token (when asked)


class BackendUnavailable(RuntimeError):
    """The engine (or the verifier behind it) cannot serve: a server answers 503."""


class BackendBusy(RuntimeError):
    """The waiting queue is full: a server answers 429."""


@dataclass(slots=True, eq=False)
class _Handle:
    sequence: Sequence  # its method names the drafter that serves it
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(frozen=True, slots=True)
class _Abort:
    seq_id: int


@dataclass(frozen=True, slots=True)
class _Stop:
    deadline: float


def settle(loop: asyncio.AbstractEventLoop) -> None:
    """Wait briefly until ``loop`` ran what was just handed to it, so requests send their
    tokens now, not while the next step's OpenMP team holds every core: a team waits at each
    barrier for its slowest thread (2 cores, embedded, concurrency 1: 96 tokens/s on 2
    threads without this, 190 on 1)."""
    done = threading.Event()

    def hop(left: int) -> None:  # each turn runs the tasks the previous one woke
        loop.call_soon(hop, left - 1) if left else done.set()

    try:
        loop.call_soon_threadsafe(hop, SETTLE_HOPS)
    except RuntimeError:  # the loop is closed
        return
    done.wait(SETTLE_SECONDS)


class AsyncEngine:
    """Streams over a ``StepLoop`` (the gateway's ``GenerationBackend``). A subclass builds
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
        self._stopping = self._crashed = False

    def _build(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        """Free what ``_build`` took, once the worker stopped."""

    def _sequence(self, request: Any) -> Sequence:
        """``request`` as a sequence; its ``method`` None stands for ``default_method``."""
        raise NotImplementedError

    def _serves(self, method: str) -> bool:  # worker thread
        return self.engine.serves(method)

    def _step_failed(self, err: Exception) -> None:
        """An engine call raised: every request but the waiting ones fails (503), aborted."""
        logger.error("engine step failed", exc_info=err)
        for seq_id in list(self.engine.running):
            self.engine.abort(seq_id)
        waiting = {s.seq_id for s in self.engine.waiting}
        for seq_id, handle in list(self._handles.items()):
            if seq_id not in waiting:  # running, or waiting on a method the engine dropped
                del self._handles[seq_id]
                self._deliver(handle, BackendUnavailable("engine error (logged)"))

    def _stepped(self, loops: set[asyncio.AbstractEventLoop]) -> None:
        """A step's deltas went to these loops."""

    def _before_step(self) -> None:
        pass

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

    async def generate(self, request: Any) -> AsyncIterator[TokenDelta]:
        if self._alive() != "ok":
            raise BackendUnavailable("the engine is not running")
        # a caller that skipped the HTTP intake still meets the engine's own refusals
        if self._num_waiting >= self.max_waiting:
            raise BackendBusy(f"{self._num_waiting} requests are already waiting")
        sequence = self._sequence(request)
        sequence.method = sequence.method or self.default_method
        handle = _Handle(sequence, asyncio.get_running_loop(), asyncio.Queue())
        self._num_waiting += 1
        waiting, finished = True, False
        self._commands.put(handle)
        try:
            while not finished:
                if waiting:  # the first delta: at most queue_timeout (then 429, aborted)
                    try:
                        item = await asyncio.wait_for(handle.queue.get(), self.queue_timeout)
                    except TimeoutError:
                        raise BackendBusy(
                            f"no sequence slot became free within {self.queue_timeout:g} s; "
                            "retry later"
                        ) from None
                    self._num_waiting -= 1
                    waiting = False
                else:
                    item = await handle.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if waiting:
                self._num_waiting -= 1
            if not finished:
                self._commands.put(_Abort(sequence.seq_id))

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
                # prefill admit_limit at a time, streaming each first token at once
                while self.engine.waiting and self._run(
                    lambda: self.engine.admit(self.admit_limit)
                ):
                    pass
                if self.engine.running:
                    self._before_step()
                    self._run(self.engine.step)
        except Exception:  # the thread must report its death, not vanish silently
            logger.exception("engine thread crashed")
            self._crashed = True
        self._stopping = True
        reason = BackendUnavailable("the engine stopped")
        late = [c for c in self._drain_commands(0) if isinstance(c, _Handle)]
        for seq_id, handle in list(self._handles.items()):
            try:
                self.engine.abort(seq_id)
            except Exception:  # leaving anyway: its slot goes with the services' leases
                logger.exception("abort of %d failed", seq_id)
            self._deliver(handle, reason)
        for handle in late:
            self._deliver(handle, reason)
        self._handles.clear()

    def _drain_commands(self, wait: float) -> list:
        commands = []
        try:
            if wait > 0:
                commands.append(self._commands.get(timeout=wait))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _apply(self, command: _Handle | _Abort | _Stop, deadline: float | None) -> float | None:
        if isinstance(command, _Stop):
            return command.deadline
        if isinstance(command, _Abort):
            if self._handles.pop(command.seq_id, None) is not None:
                self.engine.abort(command.seq_id)
            return deadline
        method = command.sequence.method
        if not self._serves(method):
            self._deliver(command, BackendUnavailable(f"method {method!r} is unavailable"))
            return deadline
        try:
            self.engine.submit(command.sequence)
        except Exception as err:  # past the edges the core asserts: fail this request only
            if not isinstance(err, ValueError):
                logger.error("submit failed", exc_info=err)
                err = BackendUnavailable("the engine refused the request (logged)")
            self._deliver(command, err)
            return deadline
        self._handles[command.sequence.seq_id] = command
        return deadline

    def _run(self, action: Callable[[], list[Emitted]]) -> list[Emitted]:
        """``engine.admit`` or ``engine.step``, then hand every emitted delta to its request."""
        try:
            emitted = action()
        except Exception as err:  # fail the requests in flight, keep serving new ones
            self._step_failed(err)
            return []
        loops = set()
        for item in emitted:
            seq_id = item.sequence.seq_id
            handle = self._handles.get(seq_id)
            if handle is None:
                continue
            loops.add(handle.loop)
            if item.error is not None or item.finish_reason is not None:
                del self._handles[seq_id]
            if item.error is not None:  # its own fault (ValueError: 400) or unavailable (503)
                error = item.error
                if not isinstance(error, ValueError):
                    error = BackendUnavailable(str(error))
                self._deliver(handle, error)
                continue
            step = None if item.verdict is None else StepFacts.of(item)
            prompt_tokens = len(item.sequence.prompt_ids) if step is None else 0
            delta = TokenDelta(item.tokens, item.finish_reason, step, prompt_tokens, item.logprobs)
            self._deliver(handle, delta)
        self._stepped(loops)
        return emitted

    @staticmethod
    def _deliver(handle: _Handle, item: TokenDelta | Exception) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)
        except RuntimeError:
            logger.debug("event loop closed; dropping a delta for %d", handle.sequence.seq_id)
