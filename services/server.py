"""What both gRPC service processes share: the server with explicit message-size limits,
health checking and reflection, SIGTERM/SIGINT handling that drains in-flight calls, and the
mapping from core exceptions to gRPC status codes (``rpc_errors``).

Health: the standard gRPC health service answers three kinds of names. ``liveness`` says the
process makes progress: a ``ComputeWatch`` on the compute thread turns it NOT_SERVING when
work is pending and nothing started or finished for ``hang_seconds`` (a hung forward or GPU),
and SERVING again once it moves. ``readiness`` (and ``""`` and every service name) says it
takes calls: NOT_SERVING while hung and from the first SIGTERM on, while in-flight calls
drain. Kubernetes probes name them (``grpc: {port: ..., service: liveness}``).

Status codes: an unknown sequence is NOT_FOUND, a sequence whose committed length or next
token disagrees is FAILED_PRECONDITION, a malformed message is INVALID_ARGUMENT, no free
slot or room is RESOURCE_EXHAUSTED; anything else is INTERNAL with the error text.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from lyanna.model.kv_cache import CacheFullError
from lyanna.target import OutOfStepError, UnknownSequenceError
from services.config import PARENT_PID_ENV, ServerConfig, parse_configs
from services.metrics import serve_metrics
from services.tls import server_credentials

log = logging.getLogger("lyanna.services")
T = TypeVar("T")

LIVENESS = "liveness"  # health service name: the process makes progress
READINESS = "readiness"  # health service name: it takes calls (not hung, not draining)


class ServiceError(Exception):
    """An RPC failure with an explicit status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def not_found(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, message)


def out_of_step(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def caller_gone(what: str) -> ServiceError:
    """The caller's deadline passed or it cancelled while its call waited: ``what`` was done."""
    return ServiceError(grpc.StatusCode.CANCELLED, f"the caller is gone; {what}")


def _status_of(error: Exception) -> grpc.StatusCode:
    if isinstance(error, ServiceError):
        return error.code
    if isinstance(error, UnknownSequenceError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, OutOfStepError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, CacheFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def rpc_errors(handler: Callable) -> Callable:
    """Turn exceptions raised by a servicer method into a gRPC status with a message."""

    def abort(error: Exception, context: grpc.ServicerContext) -> None:
        code = _status_of(error)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("%s failed", handler.__name__)
        message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        context.abort(code, f"{handler.__name__}: {message}")

    if inspect.isgeneratorfunction(handler):  # a streaming reply: errors arise while iterating

        @functools.wraps(handler)
        def streamed(self, request, context: grpc.ServicerContext):
            try:
                yield from handler(self, request, context)
            except Exception as error:
                abort(error, context)

        return streamed

    @functools.wraps(handler)
    def wrapped(self, request, context: grpc.ServicerContext):
        try:
            return handler(self, request, context)
        except Exception as error:
            abort(error, context)

    return wrapped


def exit_with_parent(poll_seconds: float = 0.5) -> None:
    """Get SIGTERM (and drain) when the launcher process named in ``LYANNA_PARENT_PID`` dies;
    exit at once if it is already gone. A no-op when the variable is unset. A watchdog polls
    the parent pid rather than using Linux's PR_SET_PDEATHSIG, which fires when the *thread*
    that spawned us exits: a service restarted from a worker thread (``asyncio.to_thread``)
    would die with that thread."""
    parent = os.environ.get(PARENT_PID_ENV)
    if parent is None:
        return
    if os.getppid() != int(parent):
        raise SystemExit(f"launcher {parent} is gone")

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(poll_seconds)
        log.warning("launcher %s is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class ComputeWatch:
    """Progress of a service's compute thread: ``submitted`` when a job is queued, ``started``
    and ``finished`` around it. ``stalled_for`` is how long work has been pending with no job
    starting or finishing (0 when idle): a hung forward shows as a growing stall, an idle
    service as none. Thread safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._pending = 0
        self._progress = clock()

    def submitted(self) -> None:
        with self._lock:
            if self._pending == 0:  # an idle thread's stall starts now, not at its last job
                self._progress = self._clock()
            self._pending += 1

    def started(self) -> None:
        with self._lock:
            self._progress = self._clock()

    def finished(self) -> None:
        with self._lock:
            self._pending = max(0, self._pending - 1)
            self._progress = self._clock()

    @property
    def pending(self) -> int:
        return self._pending

    def stalled_for(self) -> float:
        with self._lock:
            return 0.0 if self._pending == 0 else max(0.0, self._clock() - self._progress)


class WatchedLock:
    """A lock a ``ComputeWatch`` follows: waiting for it counts as pending work and holding it
    as a job, so a forward that hangs while holding it shows as a growing stall (the drafter:
    its RPCs run on gRPC's threads, one at a time under this lock)."""

    def __init__(self, watch: ComputeWatch) -> None:
        self.watch = watch
        self._lock = threading.Lock()

    def __enter__(self) -> WatchedLock:
        self.watch.submitted()
        self._lock.acquire()
        self.watch.started()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        self.watch.finished()


class ComputeThread:
    """Every model call of a service on one thread (``executor``: the one that loaded the
    model), one at a time under a lock, its progress followed by ``watch`` for liveness.
    torch's OpenMP team belongs to the thread that runs a parallel op, so forwards spread over
    gRPC's workers each made a team of their own, and with more team threads than CPUs libgomp
    stops spinning at barriers and sleeps (a 2-thread forward took 8.9 ms against 4.4 on one
    thread)."""

    def __init__(
        self,
        executor: futures.ThreadPoolExecutor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.executor = executor or futures.ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.watch = ComputeWatch(clock)
        self._lock = threading.Lock()

    def run(self, work: Callable[[], T]) -> T:
        """``work`` under the lock on the compute thread (its exceptions raised here)."""

        def locked() -> T:
            self.watch.started()
            try:
                with self._lock:
                    return work()
            finally:
                self.watch.finished()

        self.watch.submitted()
        return self.executor.submit(locked).result()


class Health:
    """The health statuses of one server: liveness from a ``ComputeWatch`` (polled by a
    daemon thread), readiness from liveness and draining."""

    def __init__(
        self,
        servicer: health.HealthServicer,
        service_names: tuple[str, ...],
        watch: ComputeWatch | None = None,
        hang_seconds: float = 0.0,
    ) -> None:
        self.servicer = servicer
        self.ready_names = ("", READINESS, *service_names)
        self.watch, self.hang_seconds = watch, hang_seconds
        self.draining = False
        self.hung = False
        self._lock = threading.Lock()

    def publish(self) -> None:
        """Set every name's status from the current state."""
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        with self._lock:
            self.servicer.set(LIVENESS, not_serving if self.hung else serving)
            ready = not (self.hung or self.draining)
            for name in self.ready_names:
                self.servicer.set(name, serving if ready else not_serving)

    def drain(self) -> None:
        self.draining = True
        self.publish()

    def check(self) -> bool:
        """Compare the watch's stall with ``hang_seconds`` and publish a change; True when
        hung."""
        if self.watch is None or self.hang_seconds <= 0:
            return False
        stall = self.watch.stalled_for()
        hung = stall >= self.hang_seconds
        if hung != self.hung:
            self.hung = hung
            if hung:
                log.error("compute thread made no progress for %.1f s: liveness NOT_SERVING", stall)
            else:
                log.warning("compute thread moves again: liveness SERVING")
            self.publish()
        return hung

    def start_watchdog(self, period: float) -> None:
        if self.watch is None or self.hang_seconds <= 0:
            return

        def run() -> None:
            while True:
                time.sleep(period)
                self.check()

        threading.Thread(target=run, name="liveness-watchdog", daemon=True).start()


@dataclass(slots=True, eq=False)
class RunningServer:
    """A started gRPC server, its bound port and its health."""

    server: grpc.Server
    port: int
    health: Health


def start_server(
    config: ServerConfig,
    add_servicers: Callable[[grpc.Server], None],
    service_names: tuple[str, ...],
    watch: ComputeWatch | None = None,
) -> RunningServer:
    """Build, bind and start a server with health (and reflection when asked); the liveness
    watchdog runs when ``watch`` is given and ``config.hang_seconds`` > 0."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers),
        options=config.grpc_options(),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,  # load shedding, not a queue
    )
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    address = f"{config.host}:{config.port}"
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot bind {config.host}:{config.port}")
    server.start()
    status = Health(health_servicer, service_names, watch, config.hang_seconds)
    status.publish()
    status.start_watchdog(min(1.0, max(0.05, config.hang_seconds / 4)))
    mode = "plaintext" if credentials is None else "mutual TLS" if config.tls_client_ca else "TLS"
    log.info("serving %s on %s:%d (%s)", ", ".join(service_names), config.host, port, mode)
    return RunningServer(server, port, status)


def serve(
    config: ServerConfig,
    add_servicers: Callable[[grpc.Server], None],
    service_names: tuple[str, ...],
    on_stop: Callable[[], None] | None = None,
    watch: ComputeWatch | None = None,
) -> None:
    """Run a server until SIGTERM or SIGINT, then report NOT_SERVING on readiness at once,
    stop taking calls and let in-flight ones finish for ``grace_seconds``."""
    running = start_server(config, add_servicers, service_names, watch)
    if config.port_file:
        scratch = Path(config.port_file + ".tmp")
        scratch.write_text(str(running.port))
        scratch.replace(config.port_file)
    # The handler only records the signal: setting a threading.Event from a signal handler
    # deadlocks when the signal lands while the main thread holds that Event's lock inside
    # Event.wait (seen: a service that ignored every later SIGTERM).
    signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: signals.append(signum))
    while not signals:
        time.sleep(0.2)
    log.info("draining (grace %.1fs)", config.grace_seconds)
    running.health.drain()
    running.server.stop(config.grace_seconds).wait()
    running.health.servicer.enter_graceful_shutdown()
    if on_stop is not None:
        on_stop()
    log.info("stopped")


@dataclass(frozen=True, slots=True, eq=False)
class Service:
    """A built service, as ``run_service`` starts it."""

    name: str  # the full gRPC service name (health, reflection)
    add: Callable[[grpc.Server], None]  # adds the servicer to a server
    registry: CollectorRegistry  # its metrics
    plane: Any = None  # its data plane (``services.data_plane.DataPlane``), if any
    on_stop: Callable[[], None] | None = None  # after the drain
    watch: ComputeWatch | None = None  # liveness: its compute thread


def run_service(
    role: str,  # "verifier" | "drafter": the log lines' tag and the LYANNA_<ROLE>_ settings
    config_class: type,  # the service's own settings, beside ``ServerConfig``
    argv: list[str] | None,
    description: str | None,
    build: Callable[[Any, ServerConfig], Service],  # (its settings, the server's) -> Service
) -> int:
    """Both service processes' ``main``: the flags and environment, logging, exiting with the
    parent, the service (``build``), its metrics endpoint, the data plane's handshake, then
    ``serve`` until SIGTERM / SIGINT."""
    server_config, config = parse_configs(
        (ServerConfig, config_class), argv, f"LYANNA_{role.upper()}_", description=description
    )
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(message)s")
    exit_with_parent()
    service = build(config, server_config)
    serve_metrics(service.registry, server_config)
    plane = service.plane
    if plane is not None and not plane.wait_ready(server_config.plane_timeout):
        logging.warning("data plane not ready; hidden states travel inline")
    serve(server_config, service.add, (service.name,), on_stop=service.on_stop, watch=service.watch)
    return 0


@dataclass(slots=True, eq=False)
class Lease:
    """A held sequence's record at a service: when its lease runs out (``Leases``' clock; inf
    without leases). A servicer extends it with its own state of the sequence, which is then
    held and dropped with the lease, never one without the other."""

    until: float = math.inf


L = TypeVar("L", bound=Lease)


class Leases(Generic[L]):
    """The held sequences' records (``Lease``) and their leases (``seconds`` <= 0: no leases,
    a record is held until dropped). Not thread safe: its servicer calls it under its own
    lock, except ``renew`` and ``due`` that may run beside it: they never change the map (a
    renew that a drop overtook renews a record no longer held: the sequence stays gone)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self._clock = seconds, clock
        self._held: dict[int, L] = {}  # seq id -> its record
        self.num_reclaimed = 0  # sequences whose lease ran out
        self._reaper: threading.Thread | None = None

    def hold(self, seq_id: int, lease: L | None = None) -> None:
        """Hold ``seq_id`` with its record (default: a bare ``Lease``), leased from now."""
        self._held[seq_id] = held = lease if lease is not None else Lease()
        self._renew(held)

    def get(self, seq_id: int) -> L | None:
        return self._held.get(seq_id)

    def renew(self, seq_ids) -> None:
        """Renew the held ones among ``seq_ids`` (an unknown or reclaimed one stays unknown:
        its call answers NOT_FOUND)."""
        for seq_id in seq_ids:
            held = self._held.get(seq_id)
            if held is not None:
                self._renew(held)

    def _renew(self, lease: Lease) -> None:
        if self.seconds > 0:
            lease.until = self._clock() + self.seconds

    def drop(self, seq_id: int) -> L | None:
        """Stop holding ``seq_id``; its record (None: it was not held)."""
        return self._held.pop(seq_id, None)

    def due(self) -> bool:
        """Whether some lease ran out (cheap: no lock needed for a look)."""
        now = self._clock()
        return any(held.until <= now for held in list(self._held.values()))

    def reclaim(self, forget: Callable[[int], object]) -> list[int]:
        """``forget`` every sequence whose lease ran out (its gateway is gone); their ids."""
        now = self._clock()
        expired = [seq_id for seq_id, held in list(self._held.items()) if held.until <= now]
        for seq_id in expired:
            forget(seq_id)
            self.drop(seq_id)
        self.num_reclaimed += len(expired)
        if expired:
            log.warning(
                "reclaimed %d sequence(s) unrenewed for %.0f s (a gateway gone without a "
                "Release?): %s",
                *(len(expired), self.seconds, expired),
            )
        return expired

    def start_reaper(self, sweep: Callable[[], object], period: float | None = None) -> None:
        """Run ``sweep`` (the servicer's ``reclaim_expired``) from a daemon thread every
        ``period`` seconds (default: a quarter lease, at most 1 s); a no-op without leases
        or when already started."""
        if self._reaper is None:
            self._reaper = start_lease_reaper(sweep, self.seconds, period)


def start_lease_reaper(
    reclaim: Callable[[], object], lease_seconds: float, period: float | None = None
) -> threading.Thread | None:
    """Call ``reclaim`` (a servicer's expired-lease sweep) from a daemon thread every
    ``period`` seconds (default: a quarter of the lease, at most 1 s); None without leases.
    A failed sweep is logged and the next one runs: the reaper never dies."""
    if lease_seconds <= 0:
        return None
    every = period if period is not None else min(1.0, lease_seconds / 4)

    def reap() -> None:
        while True:
            time.sleep(every)
            try:
                reclaim()
            except Exception:
                log.exception("lease reclaim failed")

    thread = threading.Thread(target=reap, name="lease-reaper", daemon=True)
    thread.start()
    return thread
