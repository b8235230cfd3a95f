"""Optional torch.distributed data plane for hidden states: the verifier (rank 0) sends the
accepted-path hidden rows of a micro-batch as one tensor, the drafter (rank 1) receives it;
gRPC carries only the transfer id and row ranges (``PlaneRef``), signed: when the process group
forms, the verifier draws a key and broadcasts it to the drafter over the group, so only the
two of them can sign a reference, and the drafter refuses any other (a forged one would make
it allocate and wait for a transfer that was never sent).

``gloo`` runs on CPU, ``nccl`` on GPU (tensors on the current CUDA device). The process group
forms in the background when both ranks are up (``ready``); until then, and after the peer
dies, callers fall back to inline tensors in the gRPC messages.

Transfers are matched by order, not by tag. NCCL ignores tags, so two pipeline lanes whose
micro-batches are consumed out of order could receive each other's rows if the receiver posted
a receive per transfer id. Instead every transfer is a fixed-size int64 header (magic, transfer
id, rows, columns, dtype code) followed by its payload, all with tag 0, issued under one lock so
pairs never interleave. Point-to-point messages between the same two ranks of one group arrive
in the order they were issued, under both backends: gloo pairs sends and receives of one
(peer, tag) first-in first-out, NCCL runs them in issue order on the pair's one communicator and
stream. One receiver thread reads header then payload, in that same order, into a dict keyed by
transfer id, from which ``recv`` claims the id it wants, whatever the order of the claims.

The thread receives on demand only: up to the highest id a caller asked for. Ids grow with each
send and a (signed) reference exists only once its send was issued, so everything up to that id
is already on its way. A receive posted with nothing coming would fail after the group timeout
under gloo, and under NCCL the watchdog would take the process down. Transfers received but
never claimed (a dropped micro-batch) are bounded in count and bytes, the oldest evicted; a
header out of bounds (corrupt or out of step) breaks the plane rather than allocating.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections import Counter
from datetime import timedelta
from itertools import count

import torch
import torch.distributed as dist

log = logging.getLogger("lyanna.services.data_plane")

KEY_BYTES = 32
TAG = 0  # every message: transfers are matched by order (NCCL ignores tags)
HEADER_MAGIC = 0x4C59414E4E41  # "LYANNA": a header read out of step is refused
HEADER_LEN = 5  # magic, transfer id, rows, columns, dtype code
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
# Bounds on one transfer, checked by the sender and on every header received.
MAX_ROWS = 1 << 20
MAX_COLUMNS = 1 << 17
MAX_TRANSFER_BYTES = 1 << 28
# Transfers received but not (yet) claimed; beyond either bound the oldest are evicted.
MAX_UNCLAIMED_TRANSFERS = 256
MAX_UNCLAIMED_BYTES = 1 << 30
CLOSE_JOIN_SECONDS = 5.0


class PlaneError(RuntimeError):
    """The data plane cannot deliver a transfer (peer gone, plane closed or broken, transfer
    evicted or not as expected): callers treat it like a dead peer."""


class PlaneTimeoutError(PlaneError, TimeoutError):
    """A transfer did not arrive in time."""


def sign_ref(key: bytes, transfer_id: int, total_rows: int) -> bytes:
    """The MAC a ``PlaneRef`` carries (16 bytes of HMAC-SHA256)."""
    message = f"{transfer_id}:{total_rows}".encode()
    return hmac.new(key, message, hashlib.sha256).digest()[:16]


def _check_bounds(rows: int, columns: int, dtype: torch.dtype) -> None:
    if not (0 <= rows <= MAX_ROWS and 1 <= columns <= MAX_COLUMNS):
        raise PlaneError(f"a transfer of [{rows}, {columns}] is out of bounds")
    size = rows * columns * dtype.itemsize
    if size > MAX_TRANSFER_BYTES:
        raise PlaneError(f"a transfer of {size} bytes exceeds {MAX_TRANSFER_BYTES}")


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
        self.key = b""  # the references' signing key, shared when the group forms
        # sender
        self._send_lock = threading.Lock()
        self._ids = count(1)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # sends kept alive
        # receiver: all below under _cond
        self._cond = threading.Condition()
        self._receiver: threading.Thread | None = None
        self._arrived: dict[int, torch.Tensor] = {}  # transfer id -> rows, in arrival order
        self._arrived_bytes = 0
        self._newest = 0  # the highest transfer id received
        self._wanted = 0  # the highest transfer id asked for
        self._waiting: Counter[int] = Counter()  # ids callers wait for (never evicted)
        self._failure: str | None = None  # why the receiver stopped
        self._closing = False

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
        if self.rank == 1:
            with self._cond:
                if self._closing:
                    return
                self._receiver = threading.Thread(
                    target=self._receive_loop, name="data-plane-recv", daemon=True
                )
                self._receiver.start()
        log.info("data plane %s ready at %s (rank %d)", self.backend, self.addr, self.rank)
        self._ready.set()

    # -- sender (verifier) -----------------------------------------------------------------

    def send(
        self,
        tensor: torch.Tensor,  # [rows, hidden]
    ) -> int:
        """Start sending to the peer; returns the transfer id the receiver asks for. Raises
        ``ValueError`` for a tensor the plane does not carry, a ``RuntimeError`` (``PlaneError``
        for one out of bounds) when it cannot send."""
        if tensor.dim() != 2:
            raise ValueError(f"the data plane carries 2-D tensors, got {tensor.dim()}-D")
        code = DTYPE_CODES.get(tensor.dtype)
        if code is None:
            raise ValueError(f"the data plane does not carry {tensor.dtype}")
        rows, columns = tensor.shape
        _check_bounds(rows, columns, tensor.dtype)
        payload = tensor.detach().to(self.device).contiguous()
        peer = 1 - self.rank
        with self._send_lock:  # ids in issue order, and header + payload pairs never interleave
            transfer_id = next(self._ids)
            fields = [HEADER_MAGIC, transfer_id, rows, columns, code]
            header = torch.tensor(fields, dtype=torch.int64).to(self.device)
            sent = [(dist.isend(header, dst=peer, tag=TAG), header)]
            if payload.numel():
                sent.append((dist.isend(payload, dst=peer, tag=TAG), payload))
            self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
            self._pending.extend(sent)
        return transfer_id

    def sign(self, transfer_id: int, total_rows: int) -> bytes:
        return sign_ref(self.key, transfer_id, total_rows)

    def verify(self, transfer_id: int, total_rows: int, mac: bytes) -> bool:
        return bool(self.key) and hmac.compare_digest(self.sign(transfer_id, total_rows), mac)

    # -- receiver (drafter) ----------------------------------------------------------------

    def recv(
        self,
        transfer_id: int,
        shape: tuple[int, ...],
        dtype: torch.dtype | None,  # None: whichever dtype the sender's rows have
        timeout: float | None = None,  # seconds; default: the plane's timeout
    ) -> torch.Tensor:
        """The transfer's tensor, on the CPU, once: in any order of transfer ids. Raises
        ``PlaneError`` if it cannot be had (plane broken or closed, already claimed or evicted,
        not of ``shape`` and ``dtype``), ``PlaneTimeoutError`` if it does not come in time."""
        wait = self.timeout.total_seconds() if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._cond:
            if self._receiver is None:
                raise PlaneError("the data plane is not connected")
            self._waiting[transfer_id] += 1
            if transfer_id > self._wanted:
                self._wanted = transfer_id
                self._cond.notify_all()
            try:
                while transfer_id not in self._arrived:
                    if self._failure is not None:
                        raise PlaneError(f"the data plane is broken: {self._failure}")
                    if self._closing:
                        raise PlaneError("the data plane is closed")
                    if transfer_id <= self._newest:
                        raise PlaneError(
                            f"data-plane transfer {transfer_id} was already claimed or evicted"
                        )
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise PlaneTimeoutError(
                            f"data-plane transfer {transfer_id} did not arrive in {wait:g} s"
                        )
                    self._cond.wait(remaining)
                tensor = self._arrived.pop(transfer_id)
                self._arrived_bytes -= tensor.nbytes
            finally:
                self._waiting[transfer_id] -= 1
                if not self._waiting[transfer_id]:
                    del self._waiting[transfer_id]
        if tuple(tensor.shape) != tuple(shape) or dtype not in (None, tensor.dtype):
            raise PlaneError(
                f"data-plane transfer {transfer_id} is {list(tensor.shape)} {tensor.dtype}, "
                f"expected {list(shape)} {dtype}"
            )
        return tensor

    def _receive_loop(self) -> None:
        """Receive transfers in order while callers want one not yet received; deposit each."""
        try:
            if self.device.type == "cuda" and self.device.index is not None:
                torch.cuda.set_device(self.device)
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._closing or self._wanted > self._newest)
                    if self._closing:
                        return
                transfer_id, tensor = self._receive_one()
                with self._cond:
                    self._deposit(transfer_id, tensor)
                    self._cond.notify_all()
        except Exception as error:  # the peer died, the group is gone, a header is corrupt
            log.warning("data-plane receive failed (%s); hidden states travel inline", error)
            with self._cond:
                self._failure = str(error) or type(error).__name__
                self._ready.clear()
                self._cond.notify_all()

    def _receive_one(self) -> tuple[int, torch.Tensor]:
        peer = 1 - self.rank
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.recv(header, src=peer, tag=TAG)
        magic, transfer_id, rows, columns, code = header.cpu().tolist()
        if magic != HEADER_MAGIC:
            raise PlaneError("a data-plane header is corrupt or out of step")
        if transfer_id <= self._newest:
            raise PlaneError(f"transfer {transfer_id} arrived after {self._newest}")
        dtype = DTYPES.get(code)
        if dtype is None:
            raise PlaneError(f"transfer {transfer_id} has an unknown dtype code {code}")
        _check_bounds(rows, columns, dtype)
        payload = torch.empty((rows, columns), dtype=dtype, device=self.device)
        if payload.numel():
            dist.recv(payload, src=peer, tag=TAG)
        return transfer_id, payload.cpu()

    def _deposit(self, transfer_id: int, tensor: torch.Tensor) -> None:
        self._arrived[transfer_id] = tensor
        self._arrived_bytes += tensor.nbytes
        self._newest = transfer_id
        while (
            len(self._arrived) > MAX_UNCLAIMED_TRANSFERS
            or self._arrived_bytes > MAX_UNCLAIMED_BYTES
        ):
            oldest = next((i for i in self._arrived if i not in self._waiting), None)
            if oldest is None:  # every one is waited for
                break
            evicted = self._arrived.pop(oldest)
            self._arrived_bytes -= evicted.nbytes
            log.warning(
                "data-plane transfer %d was never claimed; evicted (%d unclaimed, %d bytes)",
                oldest,
                len(self._arrived),
                self._arrived_bytes,
            )

    # -- both ------------------------------------------------------------------------------

    def mark_broken(self) -> None:
        """Stop using the plane (the peer died); callers fall back to inline tensors."""
        self._ready.clear()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            receiver = self._receiver
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(CLOSE_JOIN_SECONDS)
            if receiver.is_alive():  # stuck in a receive from a dead peer: leave the group be
                log.warning("data-plane receiver still busy; not destroying the group")
                self._ready.clear()
                return
        if self.ready:
            self._ready.clear()
            dist.destroy_process_group()


def start_plane(server_config, rank: int) -> DataPlane | None:
    """The data plane a service's settings ask for (``ServerConfig.plane``; rank 0: the
    verifier, 1: the drafter), connecting in the background; None when hidden rows travel
    in the gRPC messages."""
    if server_config.plane == "grpc":
        return None
    plane = DataPlane(
        server_config.plane, server_config.plane_addr, rank, server_config.plane_timeout
    )
    plane.connect_in_background()
    return plane
