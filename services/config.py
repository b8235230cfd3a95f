"""Service configuration: frozen dataclasses filled from command-line flags and environment
variables (flag > environment > default), validated in ``__post_init__``.

``parse_configs((ServerConfig, VerifierConfig), argv, "LYANNA_VERIFIER_")`` turns every field
into a flag (``max_running`` -> ``--max-running``) whose default comes from
``LYANNA_VERIFIER_MAX_RUNNING`` when set; each component then receives only its own dataclass.
Fields are ``int``, ``float``, ``str``, ``bool`` or ``str | None``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.tls import check_server_files

PLANE_BACKENDS = ("grpc", "gloo", "nccl")
PARENT_PID_ENV = "LYANNA_PARENT_PID"  # set by services.launch for the services it starts


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """What every gRPC service process shares."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port (written to port_file)
    port_file: str | None = None  # write the bound port here once serving
    max_message_mb: int = 64  # max send and receive message size
    grace_seconds: float = 10.0  # SIGTERM: in-flight calls get this long to finish
    # liveness: NOT_SERVING once the compute thread has had work pending with no progress
    # for this long (a hung forward or GPU; longer than the slowest legitimate call); 0 = off
    hang_seconds: float = 30.0
    workers: int = 8  # gRPC handler threads (model work is serialized by a lock)
    max_concurrent_rpcs: int = 64  # beyond this, calls are shed with RESOURCE_EXHAUSTED
    # 0 = the service's default: every CPU for the verifier (its forwards are the step), the
    # CPUs less one for the drafter (services.launch gives a local drafter one)
    torch_threads: int = 0
    # torch.distributed data plane for hidden states: "grpc" (inline, no data plane), "gloo"
    # (CPU) or "nccl" (GPU); the verifier is rank 0, the drafter rank 1.
    plane: str = "grpc"
    plane_addr: str = "127.0.0.1:29511"  # rendezvous (host:port) of the data plane
    plane_timeout: float = 120.0  # seconds to wait for the peer before serving without it
    reflection: bool = False  # gRPC server reflection (lists the services to anyone who asks)
    metrics_port: int = -1  # Prometheus /metrics: -1 = off, 0 = any free port
    metrics_port_file: str | None = None  # write the bound metrics port here
    # TLS (services.tls): certificate and key of this service; with a client CA, mutual TLS
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(
                f"metrics_port must be -1 (off) or in [0, 65536), got {self.metrics_port}"
            )
        if min(self.max_message_mb, self.workers, self.max_concurrent_rpcs) < 1:
            raise ValueError("max_message_mb, workers and max_concurrent_rpcs must be >= 1")
        if self.torch_threads < 0:
            raise ValueError("torch_threads must be >= 0")
        if self.grace_seconds < 0 or self.hang_seconds < 0:
            raise ValueError("grace_seconds and hang_seconds must be >= 0")
        if self.plane not in PLANE_BACKENDS:
            raise ValueError(f"plane must be one of {PLANE_BACKENDS}, got {self.plane!r}")
        check_server_files(self.tls_cert, self.tls_key, self.tls_client_ca)

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024

    def grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]


def _field_type(cls: type, field: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _convert(kind: type, text: str) -> Any:
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {text!r}")
    return kind(text)


def parse_configs(
    classes: tuple[type, ...],
    argv: list[str] | None,
    env_prefix: str,
    env: Mapping[str, str] | None = None,
    description: str | None = None,
) -> list[Any]:
    """Build one instance of each class (field names must not collide) from ``argv`` flags
    over ``env_prefix``-ed environment variables."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(description=description)
    owners: dict[str, int] = {}
    for index, cls in enumerate(classes):
        for field in dataclasses.fields(cls):
            if field.name in owners:
                raise ValueError(f"config field {field.name!r} is defined twice")
            owners[field.name] = index
            kind = _field_type(cls, field)
            name = env_prefix + field.name.upper()
            default = _convert(kind, env[name]) if name in env else field.default
            parser.add_argument(
                "--" + field.name.replace("_", "-"),
                dest=field.name,
                type=lambda text, kind=kind: _convert(kind, text),
                default=default,
                help=f"(env {name}; default {default!r})",
            )
    args = vars(parser.parse_args(argv))
    values: list[dict[str, Any]] = [{} for _ in classes]
    for name, value in args.items():
        values[owners[name]][name] = value
    try:
        return [cls(**kwargs) for cls, kwargs in zip(classes, values, strict=True)]
    except ValueError as error:
        parser.error(str(error))
        raise
