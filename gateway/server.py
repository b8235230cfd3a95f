"""Assembling and running a gateway: the embedded backend on a model directory, uvicorn in the
foreground (``lyanna serve``) or in a background thread on a free port (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.embedded import EmbeddedBackend, EmbeddedConfig
from lyanna.model.transformer import Transformer


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Transformer
    tokenizer: Any
    eos_token_ids: frozenset[int]


def load(
    model_dir: str | Path | None = None,
    weights: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """The target model and its tokenizer (default: SmolLM2-135M-Instruct, fetched once);
    ``weights``, ``device`` and ``dtype`` as in ``lyanna.model.load_model``."""
    from lyanna.model import fetch_default_model, load_model
    from lyanna.tokenizer import load_tokenizer

    path = Path(model_dir) if model_dir else fetch_default_model()
    model = load_model(path, dtype, device, weights=weights)
    tokenizer = load_tokenizer(path)
    return LoadedModel(model, tokenizer, eos_ids(tokenizer, model))


def eos_ids(tokenizer: Any, model: Transformer) -> frozenset[int]:
    return frozenset({tokenizer.eos_token_id, model.config.eos_token_id} - {None})


def embedded_app(
    loaded: LoadedModel,
    config: GatewayConfig,
    embedded: EmbeddedConfig | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    backend = EmbeddedBackend(loaded.model, loaded.eos_token_ids, embedded)
    return create_app(backend, loaded.tokenizer, config, on_ready)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve(app: FastAPI, config: GatewayConfig, log_level: str = "info") -> None:
    """Run until SIGINT/SIGTERM; in-flight requests drain before the backend stops."""
    uvicorn.run(
        app, host=config.host, port=config.port, log_level=log_level, timeout_graceful_shutdown=30
    )


class ThreadedServer:
    """uvicorn in a daemon thread (its own event loop); ``url`` once ``start`` returns."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.app, self.host, self.port = app, host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
