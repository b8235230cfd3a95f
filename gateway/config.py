"""Gateway settings from flags and ``LYANNA_*`` variables (flags win), validated once; every
size the HTTP surface accepts is bounded here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from lyanna.sampling import MAX_STOP_STRINGS
from services.tls import ClientTls

MODES = ("embedded", "services")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str = "embedded"  # "embedded" | "services"; also the ``service`` metrics label
    model_name: str = "SmolLM2-135M-Instruct"  # the one model /v1/models lists
    api_keys: tuple[str, ...] = ()  # empty (and no key file) = no authentication
    api_keys_file: str = ""  # one key per line, reloaded when it changes (gateway.auth)
    metrics_need_key: bool = False  # also require a key on GET /metrics
    openapi: bool = False  # serve /docs, /redoc and /openapi.json (off: the API is not mapped)
    metrics_port: int = -1  # >= 0: /metrics on this port of its own, none on the API port
    max_streams_per_key: int = 0  # requests in flight per key (then 429); 0 = unbounded
    max_tokens_per_minute_per_key: int = 0  # prompt + output tokens per key per minute
    max_body_bytes: int = 1 << 20
    max_messages: int = 128
    max_prompt_tokens: int = 4096  # also bounded by the backend's context
    max_output_tokens: int = 2048  # largest max_tokens a request may ask for
    default_max_tokens: int = 512  # when a request names none (clipped to the context)
    max_stop_strings: int = 4
    max_stop_chars: int = 64
    # services mode: TLS to the verifier and drafter (services.tls); a CA turns it on, a
    # client certificate and key answer services that require mutual TLS
    services_tls_ca: str = ""
    services_tls_cert: str = ""
    services_tls_key: str = ""
    services_tls_server_name: str = ""  # the name in the services' certificates, if not the host

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ValueError("API keys must be non-empty and carry no surrounding spaces")
        positive = (
            "max_body_bytes",
            "max_messages",
            "max_prompt_tokens",
            "max_output_tokens",
            "default_max_tokens",
            "max_stop_chars",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_streams_per_key < 0 or self.max_tokens_per_minute_per_key < 0:
            raise ValueError("per-key limits must be >= 0")
        if self.metrics_need_key and not (self.api_keys or self.api_keys_file):
            raise ValueError("metrics_need_key needs API keys")
        if (self.services_tls_cert or self.services_tls_key) and not self.services_tls_ca:
            raise ValueError("a client certificate for the services needs services_tls_ca")
        self.services_tls()  # validates the certificate / key pairing
        if not 0 <= self.max_stop_strings <= MAX_STOP_STRINGS:
            raise ValueError(f"max_stop_strings must be in [0, {MAX_STOP_STRINGS}]")

    def services_tls(self) -> ClientTls | None:
        """How the gateway reaches the services: None = plaintext."""
        if not self.services_tls_ca:
            return None
        names = (self.services_tls_cert, self.services_tls_key, self.services_tls_server_name)
        return ClientTls(self.services_tls_ca, *(name or None for name in names))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> GatewayConfig:
        """``LYANNA_<FIELD>`` variables (``LYANNA_API_KEYS`` is comma-separated), then the
        non-None ``overrides`` (command-line flags)."""
        environ = os.environ if environ is None else environ
        values: dict = {}
        for f in fields(cls):
            raw = environ.get(f"LYANNA_{f.name.upper()}")
            if raw is None:
                continue
            if f.name == "api_keys":
                values[f.name] = tuple(k.strip() for k in raw.split(",") if k.strip())
            elif isinstance(f.default, bool):
                values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif isinstance(f.default, int):
                values[f.name] = int(raw)
            else:
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
