"""What both gRPC service processes share: the server with explicit message-size limits,
health checking and reflection, SIGTERM/SIGINT handling that drains in-flight calls, and the
mapping from core exceptions to gRPC status codes (``rpc_errors``).

Status codes: an unknown sequence is NOT_FOUND, a sequence whose committed length or next
token disagrees is FAILED_PRECONDITION, a malformed message is INVALID_ARGUMENT, no free
slot or room is RESOURCE_EXHAUSTED; anything else is INTERNAL with the error text.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lyanna.kv_cache import CacheFullError
from lyanna.target import OutOfStepError, UnknownSequenceError
from services.config import PARENT_PID_ENV, ServerConfig
from services.tls import server_credentials

log = logging.getLogger("lyanna.services")


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


def serve(
    config: ServerConfig,
    add_servicers: Callable[[grpc.Server], None],
    service_names: tuple[str, ...],
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Run a server until SIGTERM or SIGINT, then report NOT_SERVING, stop taking calls and
    let in-flight ones finish for ``grace_seconds``."""
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
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.port_file:
        scratch = Path(config.port_file + ".tmp")
        scratch.write_text(str(port))
        scratch.replace(config.port_file)
    mode = "plaintext" if credentials is None else "mutual TLS" if config.tls_client_ca else "TLS"
    log.info("serving %s on %s:%d (%s)", ", ".join(service_names), config.host, port, mode)
    # The handler only records the signal: setting a threading.Event from a signal handler
    # deadlocks when the signal lands while the main thread holds that Event's lock inside
    # Event.wait (seen: a service that ignored every later SIGTERM).
    signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: signals.append(signum))
    while not signals:
        time.sleep(0.2)
    log.info("draining (grace %.1fs)", config.grace_seconds)
    health_servicer.enter_graceful_shutdown()
    server.stop(config.grace_seconds).wait()
    if on_stop is not None:
        on_stop()
    log.info("stopped")
