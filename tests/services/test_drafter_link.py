"""The gateway's drafter link with a scripted stub (no processes): a sequence is started from
its history before its first proposal, an unreachable drafter opens the breaker (target-only
steps) until the retry interval passes, a lost sequence is started again from its full
history, and a tree with the wrong root is never verified."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from grpc.aio import AioRpcError, Metadata

from gateway.remote_config import RemoteConfig
from gateway.remote_drafter import DrafterLink
from gateway.remote_seq import RemoteSeq
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from services.pb import common_pb2, drafter_pb2, verifier_pb2


def rpc_error(code: grpc.StatusCode, details: str | None = None) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details=details or f"scripted {code.name}")


class ScriptedStub:
    """Answers Propose with a one-draft tree at the next token it was told, or raises queued
    errors."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.requests: list = []
        self.errors: dict[str, list[AioRpcError]] = {}
        self.root: int | None = None  # force this root (a misbehaving drafter)
        self.roots: dict[int, int] = {}  # seq id -> next token as the drafter knows it
        self.quiet = 0  # announce this many quiet steps with each proposal

    async def _call(self, name: str, request):
        self.calls.append(name)
        self.requests.append(request)
        if self.errors.get(name):
            raise self.errors[name].pop(0)
        if name == "Start":
            self.roots.update({item.ref.seq_id: item.first_token for item in request.items})
        if name == "Propose":
            proposals = []
            for item in request.items:
                if item.HasField("verified"):
                    self.roots[item.ref.seq_id] = item.verified.next_token
                root = self.root if self.root is not None else self.roots[item.ref.seq_id]
                tree = common_pb2.TokenTree(tokens=[root, 3], parents=[-1, 0], scheme=4)
                proposal = drafter_pb2.Proposal(ref=item.ref, tree=tree, quiet_steps=self.quiet)
                proposals.append(proposal)
            return drafter_pb2.ProposeResponse(proposals=proposals)
        return common_pb2.ReleaseResponse()

    async def Propose(self, request, timeout):
        return await self._call("Propose", request)

    async def Start(self, request, timeout):
        return await self._call("Start", request)

    async def Release(self, request, timeout):
        return await self._call("Release", request)


def make_seq(needs_hidden: bool = True) -> RemoteSeq:
    seq = RemoteSeq(Sequence(1, [1, 2], SamplingParams()), "lyanna", asyncio.Queue(), True)
    seq.history, seq.next_token, seq.keep_hidden = [1, 2], 7, needs_hidden
    seq.hidden_history = [torch.zeros(2, 4)]
    return seq


def verified(
    seq: RemoteSeq, link: DrafterLink, tokens: list[int], transfer: int | None = None
) -> None:
    """The verifier's result; ``transfer``: its hidden row went over the data plane."""
    result = verifier_pb2.VerifyResult(committed=[seq.next_token], tokens=tokens, num_accepted=0)
    if transfer is None:
        result.hidden.tensor.dtype = "float32"
    else:
        result.hidden.plane.CopyFrom(
            common_pb2.PlaneRef(transfer_id=transfer, row_offset=0, num_rows=1, total_rows=2)
        )
    seq.history += list(result.committed)
    seq.hidden_history.append(torch.zeros(1, 4))
    seq.next_token = tokens[-1]
    link.learn(seq, result)


@pytest.fixture()
def link_and_stub():
    stub = ScriptedStub()
    config = RemoteConfig("unused:1", "unused:2", draft_deadline=1.0, drafter_retry_seconds=0.05)
    link = DrafterLink(stub, config)
    return link, stub


def test_start_then_propose_then_learn(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    proposals = asyncio.run(link.propose([seq]))
    assert stub.calls == ["Start", "Propose"] and seq.drafter_synced
    assert list(proposals[1].tree.tokens) == [7, 3]
    verified(seq, link, [9])
    assert seq.pending_step.next_token == 9 and list(seq.pending_step.committed) == [7]


def test_unreachable_drafter_opens_the_breaker_then_recovers(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    stub.errors["Propose"] = [rpc_error(grpc.StatusCode.UNAVAILABLE)]
    assert asyncio.run(link.propose([seq])) == {} and not link.available
    assert not seq.drafter_synced  # state in doubt: start it again
    assert asyncio.run(link.propose([seq])) == {}  # breaker open: no call at all
    assert stub.calls == ["Start", "Propose"]
    verified(seq, link, [9])  # a target-only step the drafter never saw
    asyncio.run(asyncio.sleep(0.06))
    assert 1 in asyncio.run(link.propose([seq]))
    assert stub.calls[2:] == ["Release", "Start", "Propose"]  # resync from the full history


def test_fallback_status_names_the_code_not_the_peer(link_and_stub) -> None:
    """/health shows the link's status: the error code, never gRPC's details (peer
    addresses) that anyone reaching /health could read."""
    link, stub = link_and_stub
    details = "failed to connect to all addresses; last error: ipv4:10.1.2.3:50051: refused"
    stub.errors["Propose"] = [rpc_error(grpc.StatusCode.UNAVAILABLE, details)]
    asyncio.run(link.propose([make_seq()]))
    assert link.status() == "fallback: UNAVAILABLE"


def test_lost_sequence_is_restarted_and_wrong_roots_are_dropped(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    asyncio.run(link.propose([seq]))
    verified(seq, link, [9])
    stub.errors["Propose"] = [rpc_error(grpc.StatusCode.NOT_FOUND)]
    assert asyncio.run(link.propose([seq])) == {} and link.available
    stub.root = 5  # not the next token (9)
    assert asyncio.run(link.propose([seq])) == {} and not seq.drafter_synced
    stub.root = None
    assert 1 in asyncio.run(link.propose([seq]))


def test_refused_sequences_stay_target_only(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    stub.errors["Start"] = [rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED)]
    assert asyncio.run(link.propose([seq])) == {} and not seq.use_drafter
    assert asyncio.run(link.propose([seq])) == {} and stub.calls == ["Start"]


def test_a_desynced_sequence_s_unread_transfer_is_drained() -> None:
    """Defect: a sequence that missed a step (fallback) was desynced with its step's hidden
    rows still waiting on the data plane, and the verifier's send was never received. Now
    the next call drains such transfers, unless a sequence still in step will read them."""
    stub = ScriptedStub()
    config = RemoteConfig("unused:1", "unused:2", draft_deadline=1.0, use_data_plane=True)
    link = DrafterLink(stub, config)
    a, b = make_seq(), make_seq()
    b.sequence = Sequence(2, [1, 2], SamplingParams())
    asyncio.run(link.propose([a, b]))
    verified(a, link, [9], transfer=5)
    verified(b, link, [9], transfer=5)  # one send for the micro-batch
    # a target-only step (no Propose read transfer 5), then the next verification
    verified(a, link, [8], transfer=6)
    verified(b, link, [8], transfer=6)
    assert not a.drafter_synced and not b.drafter_synced
    stub.calls.clear(), stub.requests.clear()
    assert 1 in asyncio.run(link.propose([a, b]))
    assert stub.calls[:1] == ["Release"]
    assert sorted(r.transfer_id for r in stub.requests[0].discard) == [5, 6]  # once each
    assert not a.dropped_refs and not b.dropped_refs

    # a transfer a sequence still in step will read is left to it
    verified(a, link, [7], transfer=7)
    verified(b, link, [7], transfer=7)
    b.desync()
    stub.calls.clear(), stub.requests.clear()
    asyncio.run(link.propose([a, b]))
    assert all(not r.discard for r in stub.requests if hasattr(r, "discard"))
    # and a finished sequence's dropped transfer goes out with its release
    verified(a, link, [6], transfer=8)
    a.desync()
    request = link.release_request([a], [b])
    assert [r.transfer_id for r in request.discard] == [8]


def test_quiet_steps_skip_the_drafter_and_reach_it_in_order(link_and_stub) -> None:
    """A proposal announcing quiet steps: those steps cost no Propose, and the next Propose
    carries every verification the drafter has not seen, oldest first, hidden rows included."""
    link, stub = link_and_stub
    seq = make_seq()
    stub.quiet = 2
    asyncio.run(link.propose([seq]))
    verified(seq, link, [9])  # the (gated) step the proposal was for
    stub.calls.clear(), stub.requests.clear()
    for token in (8, 6):  # two quiet steps: no call, root-only
        assert asyncio.run(link.propose([seq])) == {} and seq.quiet_step
        assert link.wants_hidden(seq, proposed=False)
        verified(seq, link, [token])
    assert stub.calls == []
    stub.quiet = 0
    assert 1 in asyncio.run(link.propose([seq])) and not seq.quiet_step
    (item,) = stub.requests[0].items
    assert [list(step.committed) for step in item.quiet] == [[7], [9]]
    assert list(item.verified.committed) == [8] and item.verified.next_token == 6
    assert all(step.hidden.HasField("tensor") for step in [*item.quiet, item.verified])
    assert not seq.unseen_steps and seq.quiet_left == 0


def test_a_desync_forgets_quiet_steps(link_and_stub) -> None:
    link, stub = link_and_stub
    seq = make_seq()
    stub.quiet = 3
    asyncio.run(link.propose([seq]))
    verified(seq, link, [9])
    asyncio.run(link.propose([seq]))
    verified(seq, link, [8])
    seq.desync()  # e.g. the drafter lost it: started again from the full history
    stub.calls.clear()
    assert 1 in asyncio.run(link.propose([seq]))
    assert stub.calls == ["Release", "Start", "Propose"]
    assert not stub.requests[-1].items[0].quiet
