"""``lyanna serve``: start what the deployment mode needs and serve until SIGINT / SIGTERM,
printing the URL and an example ``curl`` once the backend is ready.

- ``embedded``: drafter and verifier in the gateway process (``EmbeddedBackend``).
- ``services``: the verifier and drafter gRPC services as local subprocesses
  (``services.launch``) and ``RemoteBackend`` here; with ``--verifier-addr`` (and
  ``--drafter-addr``) it connects to running services and starts nothing. A local drafter
  that cannot start with the requested method (a missing checkpoint) is started with the
  next of ``FALLBACK_METHODS`` (logged).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.embedded import EmbeddedConfig
from gateway.server import embedded_app, serve
from lyanna.drafters import FALLBACK_METHODS
from lyanna.model.device import placement
from lyanna.serving_model import load
from lyanna.threads import serving_threads
from lyanna.tokenizer import make_detokenize

logger = logging.getLogger(__name__)


def banner(config: GatewayConfig, method: str) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    base = f"http://{host}:{config.port}"
    auth = " -H 'Authorization: Bearer $KEY'" if config.api_keys or config.api_keys_file else ""
    body = (
        f'{{"model": "{config.model_name}", "messages": [{{"role": "user", '
        f'"content": "Explain speculative decoding in two sentences."}}], "max_tokens": 128}}'
    )
    mode = f"{config.mode} mode, default method {method}"
    return f"""Lyanna serves {config.model_name} at {base}/v1 ({mode})
Try:
  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{body}'
  lyanna chat --url {base}/v1        # or: .venv/bin/python -m gateway.cli chat
Metrics: {base}/metrics   Health: {base}/health"""


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    names = ("host", "port", "mode", "api_keys_file", "max_streams_per_key")
    overrides = {name: getattr(args, name) for name in (*names, "max_tokens_per_minute_per_key")}
    if args.model:
        overrides["model_name"] = Path(args.model).stem
    config = GatewayConfig.from_env(**overrides)
    if config.mode == "embedded" or not args.verifier_addr:  # a model loads here or in the
        placement(args)  # services started here: CUDA, q4 only on CPU float32, checked first
    if args.data_plane != "grpc" and config.mode != "services":
        raise ValueError("--data-plane gloo/nccl needs --mode services")
    if args.data_plane == "nccl" and not args.verifier_addr and args.device == "cpu":
        raise ValueError("--data-plane nccl needs a CUDA --device (gloo on the CPU)")
    if config.mode == "services":
        _serve_services(args, config)
        return 0
    import torch  # the small batches' thread count while the model loads and measures its
    # cost curve; larger batches take every core

    torch.set_num_threads(serving_threads(args.threads))
    names = ("max_running", "max_len", "max_waiting", "queue_timeout", "tree", "threads")
    embedded = EmbeddedConfig(args.method, **{name: getattr(args, name) for name in names})
    device, dtype = placement(args)
    loaded = load(args.model, args.weights, device=device, dtype=dtype)

    def ready() -> None:
        print(banner(config, app.state.backend.default_method), flush=True)

    app = embedded_app(loaded, config, embedded, ready)
    serve(app, config, args.log_level, drain_seconds=args.drain_seconds)
    return 0


def _serve_services(args: argparse.Namespace, config: GatewayConfig) -> None:
    from lyanna.serving_model import config_eos, eos_ids, model_path
    from lyanna.tokenizer import load_tokenizer
    from services.launch import launch_first

    path = model_path(args.model)
    tokenizer = load_tokenizer(path)
    eos = eos_ids(tokenizer, config_eos(path))
    if args.verifier_addr:  # the services run elsewhere (deploy/k8s): connect, start nothing
        _serve_remote(args, config, tokenizer, eos, args.verifier_addr, args.drafter_addr)
        return
    # one capacity for both services (a drafter with fewer slots would refuse sequences);
    # both load the target alike (the drafter measures its cost curve and takes hidden rows)
    capacity = ("--max-running", str(args.max_running), "--max-len", str(args.max_len))
    target = ("--weights", args.weights, "--device", args.device, "--dtype", args.dtype)
    # the verifier gets --threads when set (else every CPU or LYANNA_VERIFIER_TORCH_THREADS)
    threads = ("--torch-threads", str(args.threads)) if args.threads else ()
    deployment, method = launch_first(
        path,
        (args.method, *FALLBACK_METHODS),
        verifier_args=(*capacity, *target, *threads),
        drafter_args=(*capacity, *target, "--tree", args.tree),
        plane=args.data_plane,
    )
    if method != args.method:
        logger.warning("serving %r instead of %r", method, args.method)
    with deployment:
        logger.info("service logs in %s", deployment.log_dir)
        addrs = (deployment.verifier_addr, deployment.drafter_addr)
        _serve_remote(args, config, tokenizer, eos, *addrs, method=method)


def _serve_remote(
    args: argparse.Namespace,
    config: GatewayConfig,
    tokenizer: Any,
    eos: frozenset[int],
    verifier_addr: str,
    drafter_addr: str | None,
    method: str | None = None,
) -> None:
    from gateway.remote import RemoteBackend, RemoteConfig
    from remote_engine.config import use_pipeline

    names = ("max_running", "max_waiting", "queue_timeout", "max_steps_per_call")
    names += ("draft_deadline", "verify_deadline", "control_deadline")
    remote = RemoteConfig(
        verifier_addr=verifier_addr,
        drafter_addr=drafter_addr,
        method=method or args.method,
        pipeline=use_pipeline(args.pipeline, remote=bool(args.verifier_addr), device=args.device),
        # the drafter takes hidden rows over the plane; the gateway's own calls stay inline
        use_data_plane=args.data_plane != "grpc" and drafter_addr is not None,
        tls=config.services_tls(),
        **{name: getattr(args, name) for name in names},
    )
    backend = RemoteBackend(remote, eos, make_detokenize(tokenizer))

    def ready() -> None:
        print(banner(config, backend.default_method), flush=True)
        print(f"verifier {verifier_addr}, drafter {drafter_addr or 'none'}", flush=True)

    serve(create_app(backend, tokenizer, config, ready), config, args.log_level, args.drain_seconds)
