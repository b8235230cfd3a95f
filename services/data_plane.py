"""Optional torch.distributed data plane for hidden states: the verifier (rank 0) sends the
accepted-path hidden rows of a micro-batch as one tensor, the drafter (rank 1) receives it;
gRPC carries only the transfer id and row ranges (``PlaneRef``), signed: when the process group
forms, the verifier draws a key and broadcasts it to the drafter over the group, so only the
two of them can sign a reference; the gateway relays references it cannot forge (a forged one
would make the drafter allocate and block in a receive no send matches).

``gloo`` runs on CPU, ``nccl`` on GPU (tensors on the current CUDA device). The process group
forms in the background when both ranks are up (``ready``); until then, and after the peer
dies, callers fall back to inline tensors in the gRPC messages. Transfers are matched by tag
(the transfer id), so micro-batches may be consumed in any order.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from datetime import timedelta
from itertools import count

import torch
import torch.distributed as dist

log = logging.getLogger("lyanna.services.data_plane")

TAG_MODULUS = 1 << 30
KEY_BYTES = 32


def sign_ref(key: bytes, transfer_id: int, total_rows: int) -> bytes:
    """The MAC a ``PlaneRef`` carries (16 bytes of HMAC-SHA256)."""
    message = f"{transfer_id}:{total_rows}".encode()
    return hmac.new(key, message, hashlib.sha256).digest()[:16]


class DataPlane:
    def __init__(self, backend: str, addr: str, rank: int, timeout_seconds: float = 120.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"data-plane backend must be gloo or nccl, got {backend!r}")
        if rank not in (0, 1):
            raise ValueError("the verifier is rank 0 and the drafter rank 1")
        self.backend, self.addr, self.rank = backend, addr, rank
        self.timeout = timedelta(seconds=timeout_seconds)
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        self._ready = threading.Event()
        self._ids = count(1)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # sends kept alive
        self.key = b""  # the references' signing key, shared when the group forms

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def connect_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self._connect, name="data-plane", daemon=True)
        thread.start()
        return thread

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def _connect(self) -> None:
        try:
            dist.init_process_group(
                self.backend,
                init_method=f"tcp://{self.addr}",
                rank=self.rank,
                world_size=2,
                timeout=self.timeout,
            )
            drawn = secrets.token_bytes(KEY_BYTES) if self.rank == 0 else bytes(KEY_BYTES)
            key = torch.tensor(list(drawn), dtype=torch.uint8, device=self.device)
            dist.broadcast(key, src=0)  # the verifier's key, to the drafter only
        except RuntimeError as error:
            log.warning("data plane %s at %s unavailable: %s", self.backend, self.addr, error)
            return
        self.key = bytes(key.cpu().tolist())
        log.info("data plane %s ready at %s (rank %d)", self.backend, self.addr, self.rank)
        self._ready.set()

    def send(
        self,
        tensor: torch.Tensor,  # [rows, hidden]
    ) -> int:
        """Start sending to the peer; returns the transfer id the receiver asks for."""
        transfer_id = next(self._ids)
        payload = tensor.detach().to(self.device).contiguous()
        work = dist.isend(payload, dst=1 - self.rank, tag=transfer_id % TAG_MODULUS)
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((work, payload))
        return transfer_id

    def sign(self, transfer_id: int, total_rows: int) -> bytes:
        return sign_ref(self.key, transfer_id, total_rows)

    def verify(self, transfer_id: int, total_rows: int, mac: bytes) -> bool:
        return bool(self.key) and hmac.compare_digest(self.sign(transfer_id, total_rows), mac)

    def recv(self, transfer_id: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buffer, src=1 - self.rank, tag=transfer_id % TAG_MODULUS)
        return buffer.to("cpu")

    def mark_broken(self) -> None:
        """Stop using the plane (the peer died); callers fall back to inline tensors."""
        self._ready.clear()

    def close(self) -> None:
        if self.ready:
            self._ready.clear()
            dist.destroy_process_group()
