"""Hidden-state transport between verifier and drafter: inline in the gRPC messages, or on the
torch.distributed data plane (``services.data_plane``) with only a ``PlaneRef`` in the message.

``HiddenSender`` (verifier side) turns the accepted-path rows of a whole micro-batch into one
``HiddenStates`` message per sequence; with a data plane they are concatenated into a single
send. ``HiddenReceiver`` (drafter side) turns such messages back into tensors, receiving each
data-plane transfer once and checking every shape against the model's hidden size.
"""

from __future__ import annotations

import logging

import torch

from services import codec
from services.data_plane import DataPlane
from services.pb import common_pb2

log = logging.getLogger("lyanna.services.hidden")

# Transfer ids grow by one per send. A reference may run this far ahead of the newest transfer
# received (two pipeline lanes keep a few in flight); one further ahead, or one already
# received, would block the drafter in a receive no send will ever match: refused up front.
PLANE_WINDOW = 64


class HiddenSender:
    def __init__(self, plane: DataPlane | None = None) -> None:
        self.plane = plane

    def encode(
        self,
        rows: list[torch.Tensor | None],  # each [n_i, hidden] or None (not asked for)
        use_plane: bool = False,
    ) -> list[common_pb2.HiddenStates | None]:
        if not (use_plane and self.plane is not None and self.plane.ready):
            return [
                None if r is None else common_pb2.HiddenStates(tensor=codec.encode_tensor(r))
                for r in rows
            ]
        present = [r for r in rows if r is not None]
        if not present:
            return [None] * len(rows)
        batch = torch.cat(present)  # [sum n_i, hidden]
        try:
            transfer_id = self.plane.send(batch)
        except RuntimeError as error:  # the peer is gone: inline from now on
            log.warning("data plane send failed (%s); hidden states travel inline", error)
            self.plane.mark_broken()
            return self.encode(rows)
        messages: list[common_pb2.HiddenStates | None] = []
        offset = 0
        for r in rows:
            if r is None:
                messages.append(None)
                continue
            ref = common_pb2.PlaneRef(
                transfer_id=transfer_id,
                row_offset=offset,
                num_rows=r.shape[0],
                total_rows=batch.shape[0],
                mac=self.plane.sign(transfer_id, batch.shape[0]),
            )
            messages.append(common_pb2.HiddenStates(plane=ref))
            offset += r.shape[0]
        return messages


class HiddenReceiver:
    def __init__(
        self,
        hidden_size: int,
        dtype: torch.dtype,
        plane: DataPlane | None = None,
        limits: codec.TensorLimits = codec.DEFAULT_LIMITS,
        device: torch.device | str = "cpu",  # the drafter model's: rows are handed over there
    ) -> None:
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.plane = plane
        self.limits = limits
        self._received: dict[int, torch.Tensor] = {}  # transfer id -> [total_rows, hidden]
        self._newest = 0  # the highest transfer id received so far
        self._done: set[int] = set()  # ids received, within the window below the newest

    def decode(self, message: common_pb2.HiddenStates, num_rows: int) -> torch.Tensor:
        """The [num_rows, hidden] rows the message carries or refers to."""
        kind = message.WhichOneof("payload")
        if kind == "tensor":
            rows = codec.decode_tensor(message.tensor, self.limits)
            if not rows.is_floating_point():
                raise codec.WireError(f"hidden states must be floating point, got {rows.dtype}")
            rows = rows.to(self.dtype)
        elif kind == "plane":
            rows = self._from_plane(message.plane)
        else:
            raise codec.WireError("hidden states are missing")
        if rows.shape != (num_rows, self.hidden_size):
            raise codec.WireError(
                f"hidden states must have shape [{num_rows}, {self.hidden_size}], "
                f"got {list(rows.shape)}"
            )
        return rows.to(self.device)  # a no-op on the CPU

    def take(self, result, num_rows: int, needed: bool, keep: bool) -> torch.Tensor | None:
        """The rows of a verifier's ``result`` (``result.hidden``) when ``needed``, None
        otherwise; data-plane rows are received always (every transfer must be). The result
        keeps them for its caller, inline, only when ``keep``."""
        rows, kind = None, result.hidden.WhichOneof("payload")
        if kind == "plane" or (kind and needed):
            rows = self.decode(result.hidden, num_rows)
        if not keep or kind is None:
            result.ClearField("hidden")
        elif kind == "plane":
            result.hidden.tensor.CopyFrom(codec.encode_tensor(rows))
        return rows if needed else None

    def end_batch(self) -> None:
        """Forget the transfers of the finished call (each is used by one micro-batch)."""
        self._received.clear()

    def _from_plane(self, ref: common_pb2.PlaneRef) -> torch.Tensor:
        if self.plane is None:
            raise codec.WireError("hidden states refer to a data plane this drafter lacks")
        if ref.total_rows > self.limits.max_elements // self.hidden_size:
            raise codec.WireError(f"data-plane transfer of {ref.total_rows} rows is too large")
        if ref.row_offset + ref.num_rows > ref.total_rows:
            raise codec.WireError("data-plane rows lie outside the transfer")
        if not self.plane.verify(ref.transfer_id, ref.total_rows, ref.mac):
            raise codec.WireError("the data-plane reference is not signed by the verifier")
        batch = self._received.get(ref.transfer_id)
        if batch is None:
            self._check_fresh(ref.transfer_id)
            shape = (ref.total_rows, self.hidden_size)
            # the verifier's dtype (its model's), converted as inline rows are
            batch = self.plane.recv(ref.transfer_id, shape, None).to(self.dtype)
            self._received[ref.transfer_id] = batch
            self._done.add(ref.transfer_id)
            self._newest = max(self._newest, ref.transfer_id)
            self._done = {i for i in self._done if i > self._newest - PLANE_WINDOW}
        return batch[ref.row_offset : ref.row_offset + ref.num_rows]

    def _check_fresh(self, transfer_id: int) -> None:
        """Refuse, before any allocation or blocking receive, a transfer already received or
        not plausibly sent yet (a stale or forged reference)."""
        if transfer_id in self._done or transfer_id <= self._newest - PLANE_WINDOW:
            raise codec.WireError(f"data-plane transfer {transfer_id} was already received")
        if transfer_id > self._newest + PLANE_WINDOW:
            raise codec.WireError(f"data-plane transfer {transfer_id} is not expected")
