"""Assembling and running a gateway: the embedded backend on a model directory, uvicorn in the
foreground (``lyanna serve``) or in a background thread on a free port (tests, benchmarks).

The first SIGTERM (or SIGINT) drains instead of closing the listener: ``/readyz`` answers 503
(the load balancer stops sending), new API requests get 503 with ``Retry-After`` (clients
retry elsewhere), and streams in flight run on for at most ``drain_seconds``; then uvicorn
shuts down and the backend stops. A second signal stops at once. Kubernetes' ``preStop``
sleep runs before the SIGTERM (deploy/k8s/base/gateway.yaml)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.embedded import EmbeddedBackend, EmbeddedConfig
from lyanna.serving_model import LoadedModel
from services.launch import free_port

__all__ = ["ThreadedServer", "embedded_app", "free_port"]
log = logging.getLogger(__name__)

DRAIN_SECONDS = 60.0  # default bound on a drain: streams longer than this are cut


def embedded_app(
    loaded: LoadedModel,
    config: GatewayConfig,
    embedded: EmbeddedConfig | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    backend = EmbeddedBackend(loaded.model, loaded.eos_token_ids, embedded)
    return create_app(backend, loaded.tokenizer, config, on_ready)


class DrainingServer(uvicorn.Server):
    """uvicorn whose first exit signal drains; a second one shuts down at once."""

    def __init__(self, app: FastAPI, host: str, port: int, log_level: str, drain: float) -> None:
        self.drain, self.drain_seconds = app.state.drain, drain  # gateway.app.Guard drains
        self.drain_deadline: float | None = None
        # the drain already let the streams finish: what is left after it is cut quickly
        config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5
        )
        super().__init__(config)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain.draining or self.drain_seconds <= 0:
            super().handle_exit(sig, frame)
        else:
            self.begin_drain()

    def begin_drain(self) -> None:
        if self.drain.draining:
            return
        self.drain.draining = True
        self.drain_deadline = time.monotonic() + self.drain_seconds
        in_flight = self.drain.in_flight
        log.info("draining: %d request(s) in flight, at most %.0f s", in_flight, self.drain_seconds)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.drain_deadline is None:
            return False
        if self.drain.in_flight == 0:
            log.info("drained")
            return True
        if time.monotonic() >= self.drain_deadline:
            log.warning("drain bound reached; cutting %d request(s)", self.drain.in_flight)
            return True
        return False


def serve(
    app: FastAPI,
    config: GatewayConfig,
    log_level: str = "info",
    drain_seconds: float = DRAIN_SECONDS,
) -> None:
    """Run until SIGINT/SIGTERM, drain (see the module docstring), then stop the backend."""
    DrainingServer(app, config.host, config.port, log_level, drain_seconds).run()


class ThreadedServer:
    """uvicorn in a daemon thread (its own event loop); ``drain`` does what SIGTERM does."""

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int | None = None,
        drain_seconds: float = DRAIN_SECONDS,
    ) -> None:
        self.app, self.host, self.port = app, host, port or free_port(host)
        self._server = DrainingServer(app, self.host, self.port, "warning", drain_seconds)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def in_flight(self) -> int:
        return self._server.drain.in_flight

    def start(self, timeout: float = 120.0) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.05)
        return self

    def drain(self) -> None:  # the server stops by itself once the drain is over
        self._server.begin_drain()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the server to stop; True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
