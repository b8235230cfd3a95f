"""The drafter's link to the verifier: ``Step`` verifies the trees it drafts itself, so a
speculative step costs the gateway one round trip (gateway -> drafter -> verifier -> drafter
-> gateway) instead of two through the gateway.

The link is a blocking stub on an ordinary channel (TLS as ``services.tls`` sets it up): the
servicer runs on gRPC's worker threads and releases the model lock while it waits for the
verifier, so another call (the other pipeline lane) drafts meanwhile, which is what an
asynchronous channel buys an event-loop server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from lyanna.tree import TokenTree
from services import codec
from services.pb import drafter_pb2, verifier_pb2, verifier_pb2_grpc
from services.tls import ClientTls, channel_options, sync_channel


class VerifierLink:
    def __init__(
        self,
        addr: str | Callable[[], str],  # host:port, or where to find it on first use
        tls: ClientTls | None = None,
        max_message_mb: int = 64,
        deadline: float = 60.0,  # seconds, when the caller of Step set none (or a longer one)
    ) -> None:
        self._options = channel_options(max_message_mb)
        self._addr, self._tls, self.deadline = addr, tls, deadline
        self._channel: grpc.Channel | None = None
        self._stub: verifier_pb2_grpc.VerifierStub | None = None
        self._lock = threading.Lock()

    def stub(self) -> verifier_pb2_grpc.VerifierStub:
        with self._lock:
            if self._stub is None:
                addr = self._addr() if callable(self._addr) else self._addr
                self._channel = sync_channel(addr, self._tls, self._options)
                self._stub = verifier_pb2_grpc.VerifierStub(self._channel)
            return self._stub

    def verify(
        self, request: verifier_pb2.VerifyRequest, remaining: float | None
    ) -> verifier_pb2.VerifyResponse:
        """Verify within the caller's remaining time (raises ``grpc.RpcError``)."""
        timeout = self.deadline if remaining is None else min(remaining, self.deadline)
        return self.stub().Verify(request, timeout=max(timeout, 0.001))

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()


def port_file_addr(path: str, host: str = "127.0.0.1") -> Callable[[], str]:
    """The address of a local verifier that writes its bound port to ``path`` (its
    ``--port-file``): read on first use, when the verifier serves (a launcher starts both
    services at once, before either port is known)."""

    def addr() -> str:
        try:
            return f"{host}:{int(Path(path).read_text())}"
        except (OSError, ValueError) as error:
            raise ValueError(f"the verifier's port file {path} is not there yet") from error

    return addr


def verify_request(
    items: Sequence[drafter_pb2.StepItem],
    trees: dict[int, TokenTree],  # seq id -> the drafted tree (drafted items only)
    needs_hidden: bool,
    use_plane: bool,
) -> verifier_pb2.VerifyRequest:
    """One Verify for the whole micro-batch: drafted trees, and root-only trees at the
    caller's next token for the items the drafter does not draft."""
    verify_items = []
    for item in items:
        tree = trees.get(item.ref.seq_id) if item.draft else None
        if tree is None:
            message = codec.root_only_tree(item.next_token)
        else:
            message = codec.encode_tree(tree, with_draft_probs=item.want_draft_probs)
        verify_items.append(
            verifier_pb2.VerifyItem(
                ref=item.ref,
                tree=message,
                return_hidden=item.return_hidden or (item.draft and needs_hidden),
                steps=1,
            )
        )
    return verifier_pb2.VerifyRequest(items=verify_items, use_data_plane=use_plane)


def client_tls(
    ca: str | None, cert: str | None, key: str | None, server_name: str | None
) -> ClientTls | None:
    """TLS to the verifier: on with a CA (a certificate and key answer mutual TLS)."""
    if not ca:
        if cert or key:
            raise ValueError("a client certificate for the verifier needs verifier_ca")
        return None
    return ClientTls(ca, cert or None, key or None, server_name or None)


def describe_failure(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return f"{code.name if code else 'UNKNOWN'}: {details}"
