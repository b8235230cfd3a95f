"""The gateway's drafter link with a scripted stub (no processes): a sequence is started from
its history before its first Step, an unreachable drafter opens the breaker (direct
target-only steps) until the retry interval passes, a failed or aborted step restarts the
sequence from its full history, results that do not match the batch are never trusted, and a
gated drafter's quiet steps cost no call and reach it in order with the next Step."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from grpc.aio import AioRpcError, Metadata

from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from remote_engine import drafter as remote_drafter
from remote_engine.config import RemoteConfig
from remote_engine.drafter import DrafterLink
from remote_engine.seq import RemoteSeq
from services.pb import common_pb2, drafter_pb2, verifier_pb2


def rpc_error(code: grpc.StatusCode, details: str | None = None) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details=details or f"scripted {code.name}")


class ScriptedStub:
    """Answers Step as drafter and verifier together (each item commits its root, drafted
    ones one accepted draft too), or raises queued errors."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.requests: list = []
        self.errors: dict[str, list[AioRpcError]] = {}
        self.quiet = 0  # announce this many quiet steps with each result
        self.wrong_seq = False  # answer for another sequence (a misbehaving drafter)
        self.events = "normal"  # normal | silent (a stuck drafter) | unordered
        self.delay = 0.0  # seconds each Step takes
        self.handled = 0.0  # ... of which the drafter says it spent this long itself

    async def _call(self, name: str, request):
        self.calls.append(name)
        self.requests.append(request)
        if self.errors.get(name):
            raise self.errors[name].pop(0)
        if name == "Step":
            await asyncio.sleep(self.delay)
            results = []
            for item in request.items:
                committed = [item.next_token, 3] if item.draft else [item.next_token]
                ref = common_pb2.SeqRef(
                    seq_id=item.ref.seq_id + self.wrong_seq,
                    num_committed=item.ref.num_committed + len(committed),
                )
                verified = verifier_pb2.VerifyResult(
                    ref=ref, committed=committed, tokens=[*committed[1:], 9]
                )
                quiet = self.quiet if item.draft else 0
                results.append(drafter_pb2.StepResult(verified=verified, quiet_steps=quiet))
            return drafter_pb2.StepResponse(results=results, handled_seconds=self.handled)
        return common_pb2.ReleaseResponse()

    def Step(self, request, timeout):
        return ScriptedCall(self._call("Step", request), self.events)

    async def Start(self, request, timeout):
        return await self._call("Start", request)

    async def Release(self, request, timeout):
        return await self._call("Release", request)


class ScriptedCall:
    """A Step call's events as grpc.aio streams them: ``drafted``, then ``response``."""

    def __init__(self, reply, events: str) -> None:
        self.reply, self.events, self.sent, self.cancelled = reply, events, 0, False

    async def read(self):
        self.sent += 1
        if self.events == "silent":
            await asyncio.sleep(3600)  # drafting never ends
        response = await self.reply if self.sent == 1 else self.response
        if self.sent == 1:
            self.response = response
            if self.events == "unordered":
                return drafter_pb2.StepEvent(response=response)
            return drafter_pb2.StepEvent(drafted=drafter_pb2.StepDrafted(draft_seconds=0.01))
        if self.sent == 2:
            return drafter_pb2.StepEvent(response=response)
        return grpc.aio.EOF

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def make_seq(seq_id: int = 1, method: str = "lyanna") -> RemoteSeq:
    sequence = Sequence(seq_id, [1, 2], SamplingParams(), method=method)
    sequence.append([7])  # prefilled: [1, 2] committed, 7 the next token
    seq = RemoteSeq(sequence, method != "ar")
    seq.keep_hidden = method != "ar"
    seq.hidden_history = [torch.zeros(2, 4)]
    return seq


def step(link: DrafterLink, batch: list[RemoteSeq]) -> drafter_pb2.StepResponse | None:
    """What the lane does: prepare, Step, and learn the results (None: no Step ran or it
    failed)."""
    ready = asyncio.run(link.prepare(batch))
    if not ready:
        return None
    response = asyncio.run(link.step(batch, ready))
    if response is not None:
        for seq, result in zip(batch, response.results, strict=True):
            seq.hidden_history.append(torch.zeros(len(result.verified.committed), 4))
            seq.sequence.append(list(result.verified.tokens))  # the scheduler's commit
    return response


def direct(seq: RemoteSeq, link: DrafterLink, token: int) -> None:
    """A root-only step verified directly against the verifier, hidden row inline."""
    result = verifier_pb2.VerifyResult(committed=[seq.sequence.next_token], tokens=[token])
    result.hidden.tensor.dtype = "float32"
    seq.hidden_history.append(torch.zeros(1, 4))
    link.learn(seq, result)  # (the engine tells the link, then the scheduler commits)
    seq.sequence.append([token])


@pytest.fixture()
def link_and_stub():
    stub = ScriptedStub()
    config = RemoteConfig("unused:1", "unused:2", draft_deadline=1.0, drafter_retry_seconds=0.05)
    return DrafterLink(stub, config), stub


def test_start_then_one_step_per_step(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    response = step(link, [seq])
    assert stub.calls == ["Start", "Step"] and seq.drafter_synced
    assert not stub.requests[0].items[0].resync  # a first start
    (item,) = stub.requests[1].items
    assert item.draft and item.next_token == 7 and item.ref.num_committed == 2
    assert item.return_hidden  # the gateway keeps the history for a resync
    assert list(response.results[0].verified.committed) == [7, 3]
    step(link, [seq])
    assert stub.calls == ["Start", "Step", "Step"]  # nothing else per step
    assert stub.requests[2].items[0].ref.num_committed == 4 and seq.sequence.num_committed == 6


def test_target_only_sequences_ride_along_root_only(link_and_stub) -> None:
    link, stub = link_and_stub
    drafted, plain = make_seq(1), make_seq(2, method="ar")
    step(link, [drafted, plain])
    assert [item.draft for item in stub.requests[-1].items] == [True, False]
    assert not stub.requests[-1].items[1].return_hidden
    assert [s.seq_id for s in (drafted, plain) if s.drafter_started] == [1]
    assert asyncio.run(link.prepare([plain])) == []  # alone: the lane verifies directly


def test_unreachable_drafter_opens_the_breaker_then_recovers(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    stub.errors["Step"] = [rpc_error(grpc.StatusCode.UNAVAILABLE)]
    assert step(link, [seq]) is None and not link.available
    assert not seq.drafter_synced  # state in doubt: start it again
    assert asyncio.run(link.prepare([seq])) == []  # breaker open: no call at all
    assert stub.calls == ["Start", "Step"]
    direct(seq, link, 9)  # a target-only step the drafter never saw
    asyncio.run(asyncio.sleep(0.06))
    assert step(link, [seq]) is not None
    assert stub.calls[2:] == ["Release", "Start", "Step"]  # resync from the full history
    assert stub.requests[3].items[0].ref.num_committed == 3
    assert stub.requests[3].items[0].resync  # the drafter counts it apart from first starts


def test_an_aborted_step_restarts_the_sequence_and_keeps_the_drafter(link_and_stub) -> None:
    """ABORTED: the drafter's verifier call failed (the verifier may have committed): the
    lane runs the step directly, the sequence starts again, the breaker stays closed."""
    link, stub = link_and_stub
    seq = make_seq()
    stub.errors["Step"] = [rpc_error(grpc.StatusCode.ABORTED)]
    assert step(link, [seq]) is None and link.available and not seq.drafter_synced
    assert step(link, [seq]) is not None
    assert stub.calls == ["Start", "Step", "Release", "Start", "Step"]


def test_results_that_do_not_match_the_batch_are_never_trusted(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    stub.wrong_seq = True
    assert step(link, [seq]) is None and not seq.drafter_synced and seq.sequence.num_committed == 2
    stub.wrong_seq = False
    assert step(link, [seq]) is not None


def test_fallback_status_names_the_code_not_the_peer(link_and_stub) -> None:
    """/health shows the link's status: the error code, never gRPC's details (peer
    addresses) that anyone reaching /health could read."""
    link, stub = link_and_stub
    details = "failed to connect to all addresses; last error: ipv4:10.1.2.3:50051: refused"
    stub.errors["Step"] = [rpc_error(grpc.StatusCode.UNAVAILABLE, details)]
    step(link, [make_seq()])
    assert link.status() == "fallback: UNAVAILABLE"


def test_refused_sequences_stay_target_only(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    stub.errors["Start"] = [rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED)]
    assert step(link, [seq]) is None and not seq.use_drafter
    assert step(link, [seq]) is None and stub.calls == ["Start"]


def test_quiet_steps_skip_the_drafter_and_reach_it_in_order(link_and_stub) -> None:
    """A result announcing quiet steps: those steps cost no call, and the next Step carries
    every verification the drafter has not seen, oldest first, hidden rows included."""
    link, stub = link_and_stub
    seq = make_seq()
    stub.quiet = 2
    step(link, [seq])  # the (gated) step the result was for: the drafter learned it
    stub.calls.clear(), stub.requests.clear()
    for token in (8, 6):  # two quiet steps: no call, root-only, directly
        assert asyncio.run(link.prepare([seq])) == [] and seq.quiet_step
        assert link.wants_hidden(seq, False)
        direct(seq, link, token)
    assert stub.calls == [] and seq.drafter_synced
    stub.quiet = 0
    assert step(link, [seq]) is not None and not seq.quiet_step
    (item,) = stub.requests[0].items
    assert [list(s.committed) for s in item.unseen] == [[9], [8]]
    assert [s.next_token for s in item.unseen] == [8, 6] and item.next_token == 6
    assert all(s.hidden.HasField("tensor") for s in item.unseen)
    assert not seq.unseen_steps and seq.quiet_left == 0


def test_a_quiet_sequence_rides_along_when_another_drafts(link_and_stub) -> None:
    link, stub = link_and_stub
    quiet, busy = make_seq(1), make_seq(2)
    stub.quiet = 3
    step(link, [quiet, busy])
    busy.quiet_left = 0  # it drafts next step: one Step for both, the quiet one learned there
    stub.quiet = 0
    assert step(link, [quiet, busy]) is not None
    assert [item.draft for item in stub.requests[-1].items] == [True, True]
    assert quiet.quiet_left == 0 and not quiet.unseen_steps


def test_a_missed_step_or_a_desync_forgets_quiet_steps(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    stub.quiet = 3
    step(link, [seq])
    asyncio.run(link.prepare([seq]))
    direct(seq, link, 8)
    seq.desync()  # e.g. the drafter lost it: started again from the full history
    stub.calls.clear()
    stub.quiet = 0
    assert step(link, [seq]) is not None
    assert stub.calls == ["Release", "Start", "Step"]
    assert not stub.requests[-1].items[0].unseen
    seq.quiet_step = False  # a fallback step (not quiet) the drafter never saw
    direct(seq, link, 5)
    assert not seq.drafter_synced


def test_a_silent_drafter_is_given_up_after_its_draft_deadline(link_and_stub) -> None:
    """A drafter that never says `drafted` (hung, frozen) costs one draft deadline plus the
    grace, not a whole step's deadline: the breaker opens and the sequence restarts later."""
    link, stub = link_and_stub  # draft_deadline 1 s: given up after 2 s
    seq = make_seq()
    stub.events = "silent"
    started = time.monotonic()
    assert step(link, [seq]) is None
    waited = time.monotonic() - started
    assert link.hang_seconds <= waited < link.hang_seconds + 1.0 < link.step_deadline
    assert not link.available and "DEADLINE_EXCEEDED" in link.status()
    assert not seq.drafter_synced and seq.use_drafter  # restarted once the drafter is back


def test_a_stuck_drafter_is_asked_less_and_less_often(monkeypatch) -> None:
    """Each try of a stuck drafter stalls the lane for its hang time, so the waits between
    tries double (from twice the hang time, capped) until a Step is answered again; other
    failures keep the plain retry interval."""
    monkeypatch.setattr(remote_drafter, "HANG_GRACE_SECONDS", 0.02)
    stub = ScriptedStub()
    config = RemoteConfig("unused:1", "unused:2", draft_deadline=0.03, drafter_retry_seconds=0.01)
    link, seq = DrafterLink(stub, config), make_seq()
    stub.events = "silent"
    waits = []
    for _ in range(3):
        assert step(link, [seq]) is None
        waits.append(link.retry_in)
        time.sleep(link.retry_in + 0.01)
    assert waits[0] == pytest.approx(0.1, abs=0.02)  # 2 x (0.03 + 0.02)
    assert waits[1] == pytest.approx(0.2, abs=0.02) and waits[2] == pytest.approx(0.4, abs=0.02)
    stub.events = "normal"
    assert step(link, [seq]) is not None and link.available
    stub.errors["Step"] = [rpc_error(grpc.StatusCode.UNAVAILABLE)]
    assert step(link, [seq]) is None
    assert link.retry_in <= 0.01  # answered since: back to the plain interval


def test_step_events_out_of_order_are_never_trusted(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    stub.events = "unordered"
    assert step(link, [seq]) is None
    assert not seq.drafter_synced and not link.available


def test_each_step_sends_the_hop_the_last_one_took(link_and_stub) -> None:
    """The drafter's gate prices the route of a drafted step: the gateway's part is each
    Step's wall time less the time the drafter says it spent, sent with the next Step;
    a drafter that claims more than the wall time gives a hop of 0, never less."""
    link, stub = link_and_stub
    seq = make_seq()
    stub.delay, stub.handled = 0.06, 0.02
    step(link, [seq])
    assert stub.requests[-1].caller_hop_seconds == 0  # nothing measured before the first
    first = link.hop_seconds
    assert 0.04 <= first < 0.06 + 0.5
    step(link, [seq])
    assert stub.requests[-1].caller_hop_seconds == first  # the last Step's, as measured
    stub.delay, stub.handled = 0.0, 5.0
    step(link, [seq])
    assert link.hop_seconds == 0
