"""The torch.distributed data plane on gloo, with a real verifier-side process: transfers are
matched by order, not tags (NCCL ignores tags), so they can be claimed in any order and each id
gets exactly its rows; every message uses tag 0; a transfer not of the expected shape or dtype
is refused; unclaimed transfers are bounded (the oldest evicted); a missing one times out with a
clear error; the sender refuses tensors the plane does not carry before sending anything."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from services import data_plane
from services.data_plane import DataPlane, PlaneError, PlaneTimeoutError
from tests.services.plane_peer import plane_peer, record_tags, rows_of

CLAIM_SECONDS = 20.0  # every recv below: a failure must not hang the suite


@pytest.fixture(scope="module")
def peer():
    with plane_peer() as peer:
        yield peer


def claim(plane: DataPlane, transfer_id: int, rows: int, columns: int, dtype=torch.float32):
    return plane.recv(transfer_id, (rows, columns), dtype, timeout=CLAIM_SECONDS)


def test_transfers_claimed_out_of_order_get_their_own_rows(peer) -> None:
    """Two lanes' micro-batches of different shapes and dtypes, claimed in another order than
    sent (the later lane first): each id gets exactly the rows sent under it."""
    shapes = [(3, 8, "float32"), (1, 8, "float32"), (5, 4, "bfloat16"), (2, 8, "float16")]
    ids = [peer.send(r, c, d, fill=n) for n, (r, c, d) in enumerate(shapes)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for n in (2, 0, 3, 1):
        rows, columns, dtype = shapes[n]
        got = claim(peer.plane, ids[n], rows, columns, getattr(torch, dtype))
        assert torch.equal(got, rows_of(rows, columns, getattr(torch, dtype), n))
        assert got.device.type == "cpu"
    with pytest.raises(PlaneError, match="already claimed"):  # each transfer once
        claim(peer.plane, ids[2], 5, 4, torch.bfloat16)
    assert peer.plane._arrived == {}


def test_every_message_uses_tag_zero(peer, monkeypatch) -> None:
    """Sender and receiver never tell transfers apart by tag (NCCL would ignore it)."""
    received_tags = record_tags(monkeypatch.setattr)
    ids = [peer.send(2, 4, fill=n) for n in range(3)]
    for n in (1, 2, 0):
        assert torch.equal(claim(peer.plane, ids[n], 2, 4), rows_of(2, 4, torch.float32, n))
    sent_tags = peer.call("tags")
    assert len(sent_tags) >= 2 * len(ids)  # a header and a payload each (and earlier tests')
    assert {call for call, _ in sent_tags} == {"isend"}
    assert {tag for _, tag in sent_tags} == {0}
    assert received_tags == [("recv", 0)] * (2 * len(ids))


@pytest.mark.parametrize("shape, dtype", [((3, 5), torch.float32), ((3, 4), torch.float16)])
def test_a_transfer_not_of_the_expected_shape_or_dtype_is_refused(peer, shape, dtype) -> None:
    transfer_id = peer.send(3, 4, "float32")
    with pytest.raises(PlaneError, match=r"is \[3, 4\] torch.float32, expected"):
        peer.plane.recv(transfer_id, shape, dtype, timeout=CLAIM_SECONDS)
    with pytest.raises(PlaneError, match="already claimed"):  # dropped, not kept for later
        claim(peer.plane, transfer_id, 3, 4)


def test_a_claim_without_a_dtype_takes_the_senders(peer) -> None:
    """A bf16 verifier next to a float32 drafter: the drafter claims whatever was sent and
    converts it itself (``HiddenReceiver``), as it does with inline rows."""
    transfer_id = peer.send(2, 3, "bfloat16", fill=7)
    got = peer.plane.recv(transfer_id, (2, 3), None, timeout=CLAIM_SECONDS)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, rows_of(2, 3, torch.bfloat16, 7))


def test_unclaimed_transfers_are_bounded_in_number_oldest_evicted(
    peer, monkeypatch, caplog
) -> None:
    """Claiming the sixth of six transfers receives all six; with room for three unclaimed,
    the three oldest are evicted with a warning, the others are still claimable."""
    monkeypatch.setattr(data_plane, "MAX_UNCLAIMED_TRANSFERS", 3)
    ids = [peer.send(2, 4, fill=n) for n in range(6)]
    with caplog.at_level(logging.WARNING, logger="lyanna.services.data_plane"):
        assert torch.equal(claim(peer.plane, ids[5], 2, 4), rows_of(2, 4, torch.float32, 5))
    evicted = [r.getMessage() for r in caplog.records if "never claimed" in r.getMessage()]
    assert [message.split()[2] for message in evicted] == [str(i) for i in ids[:3]]
    assert list(peer.plane._arrived) == ids[3:5]
    for n in (0, 1, 2):
        start = time.monotonic()
        with pytest.raises(PlaneError, match="claimed or evicted"):
            claim(peer.plane, ids[n], 2, 4)
        assert time.monotonic() - start < 1.0  # known gone: no wait
    for n in (4, 3):
        assert torch.equal(claim(peer.plane, ids[n], 2, 4), rows_of(2, 4, torch.float32, n))


def test_unclaimed_transfers_are_bounded_in_bytes(peer, monkeypatch) -> None:
    one = 4 * 8 * 4  # bytes of a [4, 8] float32 transfer
    monkeypatch.setattr(data_plane, "MAX_UNCLAIMED_BYTES", 2 * one + one // 2)
    ids = [peer.send(4, 8, fill=n) for n in range(4)]
    assert torch.equal(claim(peer.plane, ids[3], 4, 8), rows_of(4, 8, torch.float32, 3))
    assert list(peer.plane._arrived) == [ids[2]]
    assert peer.plane._arrived_bytes == one
    for n in (0, 1):
        with pytest.raises(PlaneError, match="claimed or evicted"):
            claim(peer.plane, ids[n], 4, 8)
    assert torch.equal(claim(peer.plane, ids[2], 4, 8), rows_of(4, 8, torch.float32, 2))
    assert peer.plane._arrived_bytes == 0


def test_a_transfer_not_sent_times_out_then_arrives_when_sent(peer) -> None:
    next_id = peer.plane._newest + 1
    start = time.monotonic()
    with pytest.raises(PlaneTimeoutError, match=f"transfer {next_id} did not arrive"):
        peer.plane.recv(next_id, (1, 2), torch.float32, timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 5.0
    assert isinstance(PlaneTimeoutError("x"), RuntimeError)  # callers treat it as a dead peer
    assert peer.send(1, 2, fill=7) == next_id  # the receive already posted gets it
    assert torch.equal(claim(peer.plane, next_id, 1, 2), rows_of(1, 2, torch.float32, 7))
    assert peer.plane.ready


def test_the_sender_refuses_what_the_plane_does_not_carry(monkeypatch) -> None:
    """Checked before anything is sent (no process group here: a send would fail)."""
    plane = DataPlane("gloo", "127.0.0.1:1", 0)
    with pytest.raises(ValueError, match="3-D"):
        plane.send(torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="does not carry torch.int64"):
        plane.send(torch.zeros(2, 3, dtype=torch.int64))
    monkeypatch.setattr(data_plane, "MAX_ROWS", 2)
    with pytest.raises(PlaneError, match="out of bounds"):  # a RuntimeError: sent inline
        plane.send(torch.zeros(3, 4))
    monkeypatch.setattr(data_plane, "MAX_TRANSFER_BYTES", 16)
    with pytest.raises(PlaneError, match="exceeds"):
        plane.send(torch.zeros(2, 4))
    with pytest.raises(PlaneError, match="not connected"):  # a receiver that never connected
        DataPlane("gloo", "127.0.0.1:1", 1).recv(1, (1, 1), torch.float32, timeout=1)
