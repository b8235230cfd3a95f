"""TLS and mutual TLS for the gRPC services and their clients (the gateway, the drafter's
link to the verifier, the launcher's health checks).

A service with ``--tls-cert`` / ``--tls-key`` serves TLS only; with ``--tls-client-ca`` too it
requires every client to present a certificate that CA signed (mutual TLS), so only holders of
a client certificate (the gateway, and the drafter with the same client settings:
``--verifier-ca`` / ``--verifier-cert`` / ``--verifier-key``) can call Prefill, Verify, Step
or Release. A client names the CA that signed the services' certificates (``ClientTls.ca``)
and, for mutual TLS, its own certificate and key. Certificates are PEM files read once at
start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

MAX_PEM_BYTES = 1 << 20


def read_pem(path: str) -> bytes:
    data = Path(path).read_bytes()
    if len(data) > MAX_PEM_BYTES or b"-----BEGIN" not in data:
        raise ValueError(f"{path} is not a PEM file of at most {MAX_PEM_BYTES} bytes")
    return data


def check_server_files(cert: str | None, key: str | None, client_ca: str | None) -> None:
    """Raise unless the service's TLS settings make sense together."""
    if bool(cert) != bool(key):
        raise ValueError("tls_cert and tls_key go together")
    if client_ca and not cert:
        raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None
) -> grpc.ServerCredentials | None:
    """TLS credentials for a service, or None for a plaintext port."""
    check_server_files(cert, key, client_ca)
    if not cert or not key:
        return None
    ca = read_pem(client_ca) if client_ca else None
    return grpc.ssl_server_credentials(
        [(read_pem(key), read_pem(cert))], root_certificates=ca, require_client_auth=ca is not None
    )


@dataclass(frozen=True, slots=True)
class ClientTls:
    ca: str  # PEM: the CA that signed the services' certificates
    cert: str | None = None  # PEM: this client's certificate (mutual TLS)
    key: str | None = None  # PEM: its private key
    server_name: str | None = None  # the name to expect in the services' certificates

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate and its key go together")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca),
            private_key=read_pem(self.key) if self.key else None,
            certificate_chain=read_pem(self.cert) if self.cert else None,
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    """A client channel's options: explicit message sizes, and a short reconnect backoff so
    a returning service is found quickly."""
    size = max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def aio_channel(
    addr: str, tls: ClientTls | None, options: Sequence[tuple[str, object]] = ()
) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(addr, options=list(options))
    return grpc.aio.secure_channel(addr, tls.credentials(), options=[*options, *tls.options()])


def sync_channel(
    addr: str, tls: ClientTls | None, options: Sequence[tuple[str, object]] = ()
) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(addr, options=list(options))
    return grpc.secure_channel(addr, tls.credentials(), options=[*options, *tls.options()])
