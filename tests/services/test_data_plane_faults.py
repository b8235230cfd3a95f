"""The gloo data plane when things go wrong, each with its own verifier-side process: a receive
waiting when the peer dies raises promptly (and every later one at once) instead of hanging; a
header out of bounds breaks the plane instead of allocating; ``close`` stops the receiver."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from services.data_plane import HEADER_MAGIC, PlaneError
from tests.services.plane_peer import plane_peer, rows_of

PLANE_TIMEOUT = 30.0  # the plane's own timeout: "promptly" is well below it


def send_and_claim(peer, rows: int, columns: int, fill: int) -> int:
    """One transfer sent and claimed intact (the plane works before the fault); its id."""
    transfer_id = peer.send(rows, columns, fill=fill)
    got = peer.plane.recv(transfer_id, (rows, columns), torch.float32, timeout=PLANE_TIMEOUT)
    assert torch.equal(got, rows_of(rows, columns, torch.float32, fill))
    return transfer_id


def test_a_waiting_receive_raises_promptly_when_the_peer_dies() -> None:
    with plane_peer() as peer:
        plane = peer.plane
        first = send_and_claim(peer, 2, 4, fill=1)
        outcome: list[BaseException | torch.Tensor] = []

        def wait() -> None:
            try:
                outcome.append(plane.recv(first + 1, (2, 4), torch.float32, timeout=PLANE_TIMEOUT))
            except BaseException as error:  # handed to the test thread
                outcome.append(error)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(0.3)  # the waiter is waiting, the receiver posted its receive
        start = time.monotonic()
        peer.conn.send(("die",))
        waiter.join(PLANE_TIMEOUT)
        assert not waiter.is_alive()
        assert time.monotonic() - start < PLANE_TIMEOUT / 3
        assert len(outcome) == 1 and isinstance(outcome[0], PlaneError)
        assert "broken" in str(outcome[0])
        assert not plane.ready
        start = time.monotonic()
        with pytest.raises(PlaneError, match="broken"):  # at once, not after a timeout
            plane.recv(first + 2, (2, 4), torch.float32, timeout=PLANE_TIMEOUT)
        assert time.monotonic() - start < 1.0
        assert not plane._receiver.is_alive()


@pytest.mark.parametrize(
    "header",
    [
        [HEADER_MAGIC, 1, 1 << 40, 8, 1],  # rows no transfer has
        [HEADER_MAGIC, 1, 4, 1 << 40, 1],  # nor columns
        [HEADER_MAGIC, 1, 4, 8, 99],  # an unknown dtype
        [12345, 1, 4, 8, 1],  # not a header (out of step)
    ],
    ids=["rows", "columns", "dtype", "magic"],
)
def test_a_corrupt_header_breaks_the_plane_without_allocating(header) -> None:
    with plane_peer() as peer:
        plane = peer.plane
        assert peer.call("raw", header) == "sent"
        start = time.monotonic()
        with pytest.raises(PlaneError, match="broken"):
            plane.recv(1, (4, 8), torch.float32, timeout=PLANE_TIMEOUT)
        assert time.monotonic() - start < PLANE_TIMEOUT / 3
        assert not plane.ready
        assert plane._arrived == {}


def test_close_stops_the_receiver_and_fails_later_receives() -> None:
    with plane_peer() as peer:
        plane = peer.plane
        transfer_id = send_and_claim(peer, 1, 3, fill=2)
        receiver = plane._receiver
        assert receiver.is_alive()
        start = time.monotonic()
        plane.close()
        assert time.monotonic() - start < 2.0
        assert not receiver.is_alive()
        assert not dist.is_initialized()
        with pytest.raises(PlaneError, match="closed"):
            plane.recv(transfer_id + 1, (1, 3), torch.float32, timeout=PLANE_TIMEOUT)
