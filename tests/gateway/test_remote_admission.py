"""Admission of the remote engine against a fake verifier stub (no services): a sequence the
verifier lost waits to be re-prefilled only until its deadline, even when no slot ever comes
back, and its own old slot is released first (a verifier that merely timed out still holds
it, and a full verifier would otherwise never have room)."""

from __future__ import annotations

import time

import grpc
import pytest

from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from remote_engine import RemoteConfig, RemoteEngine, Unavailable
from remote_engine.seq import RemoteSeq
from services.pb import common_pb2, verifier_pb2


def engine_with(verifier, **config) -> RemoteEngine:
    """A remote engine whose calls go to ``verifier`` (its event loop running, no channel)."""
    engine = RemoteEngine(RemoteConfig("unused:1", **config))
    engine._io.start()
    engine.verifier = verifier
    return engine


def queue(engine: RemoteEngine, seq: RemoteSeq) -> None:
    """A request waiting in the engine's scheduler, as ``submit`` leaves it."""
    engine.scheduler.add(seq.sequence)
    engine._seqs[seq.seq_id] = seq


def running(engine: RemoteEngine, seq: RemoteSeq) -> None:
    """A sequence the engine runs (admitted and prefilled)."""
    queue(engine, seq)
    assert engine.scheduler.schedule_prefill() == [seq.sequence]


def admit_until(engine: RemoteEngine, condition, timeout: float = 10.0) -> list:
    """What ``engine.admit`` emitted, called as the gateway's worker does, until ``condition``."""
    deadline, emitted = time.monotonic() + timeout, []
    while not condition(emitted):
        assert time.monotonic() < deadline
        emitted += engine.admit()
        time.sleep(0.02)
    return emitted


class FullVerifier:
    """Capacity: no free slot, ever; records what it is asked to release; never prefills."""

    def __init__(self) -> None:
        self.released: list[int] = []

    async def Capacity(self, request, timeout=None):
        return verifier_pb2.CapacityResponse(free_slots=0, total_slots=4)

    async def Release(self, request: common_pb2.ReleaseRequest, timeout=None):
        self.released += list(request.seq_ids)
        return common_pb2.ReleaseResponse()

    async def Prefill(self, request, timeout=None):
        raise AssertionError("no slot is free: nothing may be prefilled")


def test_a_lost_sequence_stops_waiting_at_its_deadline_when_no_slot_comes_back() -> None:
    verifier = FullVerifier()
    engine = engine_with(verifier, queue_timeout=0.3)
    try:
        seq = RemoteSeq(Sequence(7, [1, 2, 3], SamplingParams(max_tokens=8)), use_drafter=False)
        seq.sequence.append([4])  # prefilled: 4 is its next token
        running(engine, seq)
        seq.resume_by = time.monotonic() + 0.3  # what a failed Verify sets
        start = time.monotonic()
        engine._requeue([seq])
        emitted = admit_until(engine, bool)
        waited = time.monotonic() - start
    finally:
        engine.close()
    [outcome] = emitted
    assert isinstance(outcome.error, Unavailable) and "not resumed in 0.3 s" in str(outcome.error)
    assert outcome.sequence is seq.sequence and not outcome.tokens
    assert 0.25 < waited < 5.0 and not engine.scheduler.has_work
    assert verifier.released[:1] == [7]  # its old slot was freed before free slots were counted


def test_seeds_outside_the_wires_uint64_are_refused() -> None:
    """Refused where a request is built, not inside a batched prefill call."""
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-1)


class HiddenHungryDrafter:
    """What admission asks of the drafter link: it reads hidden states, inline."""

    needs_hidden, plane_ok = True, False

    def wants_hidden(self, seq: RemoteSeq, proposed: bool) -> bool:
        return seq.use_drafter


def test_prefill_batches_keep_inline_prompt_hidden_states_within_one_message() -> None:
    """Prompt hidden states travel inline in the Prefill response: a batch takes sequences
    while theirs fit ``max_hidden_bytes`` together (the rest wait for the next Prefill), and
    one whose own rows exceed it is prefilled without them and decodes target-only, rather
    than failing the whole call at the message limit."""
    engine = RemoteEngine(RemoteConfig("unused:1", max_hidden_mb=1.0))
    engine.drafter = HiddenHungryDrafter()
    budget = engine.config.max_hidden_bytes
    engine.hidden_row_bytes = budget // 15  # 10 prompt rows: two thirds of one message

    def waiting(seq_id: int, rows: int) -> RemoteSeq:
        sequence = Sequence(seq_id, [1] * rows, SamplingParams(max_tokens=4), method="lyanna")
        return RemoteSeq(sequence, use_drafter=True)

    small, other, huge, last = waiting(1, 10), waiting(2, 10), waiting(3, 20), waiting(4, 1)
    for seq in (small, other, huge, last):
        queue(engine, seq)
    assert engine._take_batch(room=8) == [small]  # the second would overflow the message
    assert engine._take_batch(room=8) == [other, huge, last]
    assert not huge.use_drafter and small.use_drafter and other.use_drafter and last.use_drafter
    queue(engine, waiting(5, 1))
    queue(engine, waiting(6, 1))
    assert len(engine._take_batch(room=1)) == 1 and len(engine.scheduler.waiting) == 1


class StalledVerifier(FullVerifier):
    """Free slots, but its first two Release calls time out (still stalled); records the
    order of Release successes and Prefill calls."""

    def __init__(self) -> None:
        super().__init__()
        self.failures, self.calls = 2, []

    async def Capacity(self, request, timeout=None):
        return verifier_pb2.CapacityResponse(free_slots=4, total_slots=4)

    async def Release(self, request, timeout=None):
        if self.failures:
            self.failures -= 1
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata()
            )
        self.calls.append("release")
        return await super().Release(request, timeout)

    async def Prefill(self, request, timeout=None):
        self.calls.append("prefill")
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()
        )


def test_a_lost_sequence_is_prefilled_again_only_after_its_old_copy_is_released() -> None:
    """While the verifier cannot confirm the release (it stalled past the deadlines), the
    sequence is not prefilled again: a copy the verifier still holds would refuse it."""
    verifier = StalledVerifier()
    engine = engine_with(verifier, queue_timeout=5)
    try:
        seq = RemoteSeq(Sequence(9, [1, 2], SamplingParams()), use_drafter=False)
        seq.sequence.append([3])  # prefilled: 3 is its next token
        seq.resume_by = time.monotonic() + 5
        running(engine, seq)
        engine._requeue([seq])
        admit_until(engine, lambda _: "prefill" in verifier.calls)
    finally:
        engine.close()
    assert verifier.calls[:2] == ["release", "prefill"]
    assert list(engine.scheduler.waiting) == [seq.sequence]  # still first in line (UNAVAILABLE)
