"""Validation at the gRPC edge: ``services.codec`` decodes and checks every request before a
servicer does any work (no lock taken, no compute job, no drafter or model call), and answers
INVALID_ARGUMENT; past it the servicers only check state (NOT_FOUND, FAILED_PRECONDITION).
Also the drafter's one record per sequence (``lyanna.draft_session``)."""

from __future__ import annotations

import grpc
import pytest
import torch

from lyanna.draft_session import DraftSession, Unseen
from lyanna.drafters.base import NoDrafter, VerifiedStep
from lyanna.drafters.ngram import NgramDrafter
from lyanna.target import OutOfStepError, UnknownSequenceError
from lyanna.tree import TokenTree
from services import codec
from services.codec import WireError
from services.pb import common_pb2, drafter_pb2, verifier_pb2
from tests.services.test_servicers import Aborted, FakeContext, prefill, verifier, verify_item
from tests.services.test_step import NGRAM, setup, step_item

VOCAB = 16


def ref(seq_id: int, committed: int) -> common_pb2.SeqRef:
    return common_pb2.SeqRef(seq_id=seq_id, num_committed=committed)


def prefill_request(**fields) -> verifier_pb2.PrefillRequest:
    params = fields.pop("params", common_pb2.SamplingParams(max_tokens=4))
    item = verifier_pb2.PrefillItem(**({"seq_id": 1, "prompt_ids": [1, 2, 3]} | fields))
    item.params.CopyFrom(params)
    return verifier_pb2.PrefillRequest(items=[item])


@pytest.mark.parametrize(
    ("request_", "why"),
    [
        (prefill_request(prompt_ids=[]), "at least one token"),
        (prefill_request(prompt_ids=[1, VOCAB]), "prompt ids"),
        (prefill_request(prompt_ids=[1, -1]), "prompt ids"),
        (prefill_request(next_token=VOCAB), "next_token"),
        (prefill_request(prompt_len=4), "prompt_len"),
        (prefill_request(params=common_pb2.SamplingParams(logit_bias={VOCAB: 1.0})), "logit_bias"),
        (prefill_request(params=common_pb2.SamplingParams(max_tokens=200)), "KV rows"),
        (verifier_pb2.PrefillRequest(items=prefill_request().items[:] * 2), "once per Prefill"),
    ],
)
def test_the_codec_refuses_bad_prefills(request_, why: str) -> None:
    with pytest.raises(WireError, match=why):
        codec.decode_prefill(request_, VOCAB, max_rows=96)


def test_the_codec_refuses_bad_verifies_and_steps() -> None:
    root = codec.encode_tree(TokenTree.root_only(3))
    chain = codec.encode_tree(TokenTree.chain(3, [4]))
    item = verifier_pb2.VerifyItem(ref=ref(1, 3), tree=root)
    for items, why in (
        ([item, item], "once per Verify"),
        ([verifier_pb2.VerifyItem(ref=ref(1, 3), tree=root, steps=65)], "more than 64 steps"),
        ([verifier_pb2.VerifyItem(ref=ref(1, 3), tree=chain, steps=2)], "root-only"),
        ([verifier_pb2.VerifyItem(ref=ref(1, 3), tree=codec.root_only_tree(VOCAB))], "tree token"),
    ):
        with pytest.raises(WireError, match=why):
            codec.decode_verify(verifier_pb2.VerifyRequest(items=items), VOCAB, max_nodes=8)
    (job,) = codec.decode_verify(verifier_pb2.VerifyRequest(items=[item]), VOCAB, 8)
    assert job.steps == 1 and job.tree.token_list == (3,)  # 0 steps: one verification
    good = drafter_pb2.VerifiedStep(committed=[1, 2], next_token=3, num_accepted=1)
    for fields, why in (
        ({"next_token": VOCAB}, "next_token"),
        ({"unseen": [drafter_pb2.VerifiedStep(committed=[], next_token=1)]}, "root"),
        ({"unseen": [drafter_pb2.VerifiedStep(committed=[1, VOCAB], num_accepted=1)]}, "unseen"),
        ({"unseen": [good] * 65}, "more than 64 unseen"),
    ):
        item = drafter_pb2.StepItem(ref=ref(1, 3), **({"next_token": 1} | fields))
        with pytest.raises(WireError, match=why):
            codec.decode_step(drafter_pb2.StepRequest(items=[item]), VOCAB)
    start = drafter_pb2.StartItem(ref=ref(1, 2), prompt_ids=[1, 2], first_token=VOCAB)
    with pytest.raises(WireError, match="first_token"):
        codec.decode_start(drafter_pb2.StartRequest(items=[start]), VOCAB)
    start = drafter_pb2.StartItem(ref=ref(1, 0), prompt_ids=[], first_token=1)
    with pytest.raises(WireError, match="prompt length"):
        codec.decode_start(drafter_pb2.StartRequest(items=[start]), VOCAB)
    # a drafter that reads hidden states needs them with every start and unseen step
    start = drafter_pb2.StartItem(ref=ref(1, 2), prompt_ids=[1, 2], first_token=3)
    assert codec.decode_start(drafter_pb2.StartRequest(items=[start]), VOCAB)[0].first_token == 3
    with pytest.raises(WireError, match="needs prompt_hidden"):
        codec.decode_start(drafter_pb2.StartRequest(items=[start]), VOCAB, needs_hidden=True)
    item = drafter_pb2.StepItem(ref=ref(1, 5), next_token=3, draft=True, unseen=[good])
    assert codec.decode_step(drafter_pb2.StepRequest(items=[item]), VOCAB)[0].unseen == [good]
    with pytest.raises(WireError, match="needs unseen steps' hidden"):
        codec.decode_step(drafter_pb2.StepRequest(items=[item]), VOCAB, needs_hidden=True)
    item.unseen[0].hidden.tensor.CopyFrom(codec.encode_tensor(torch.zeros(2, 4)))
    codec.decode_step(drafter_pb2.StepRequest(items=[item]), VOCAB, needs_hidden=True)


def test_the_verifier_does_no_work_for_a_request_the_codec_refuses() -> None:
    servicer = verifier()
    root = prefill(servicer, 1, [1, 2, 3])
    calls: list[str] = []
    for name in ("prefill", "verify"):
        original = getattr(servicer.runner, name)
        setattr(servicer.runner, name, lambda *a, _o=original, _n=name, **k: calls.append(_n))
    submitted = []
    servicer.compute.run = lambda work: submitted.append(work)  # type: ignore[method-assign]
    bad_tree = verify_item(1, 3, root)
    bad_tree.tree.tokens[0] = VOCAB
    for call, request in (
        (servicer.Prefill, prefill_request(prompt_ids=[1, VOCAB])),
        (servicer.Prefill, prefill_request(prompt_ids=[])),
        (servicer.Verify, verifier_pb2.VerifyRequest(items=[bad_tree])),
    ):
        with pytest.raises(Aborted) as error:
            call(request, FakeContext())
        assert error.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert calls == [] and submitted == []  # no compute job, no model call
    assert servicer.runner.num_committed(1) == 3 and servicer.runner.num_free_slots == 1


class CountingNgram(NgramDrafter):
    def __init__(self, budget) -> None:
        super().__init__(budget)
        self.calls: list[str] = []

    def start(self, *args, **kwargs) -> None:
        self.calls.append("start")
        super().start(*args, **kwargs)

    def propose(self, seq_ids):
        self.calls.append("propose")
        return super().propose(seq_ids)

    def on_verified(self, steps):
        self.calls.append("on_verified")
        return super().on_verified(steps)


def test_the_drafter_does_no_work_for_a_request_the_codec_refuses() -> None:
    """An out-of-vocabulary id, a hop out of bounds or a malformed unseen step answers
    INVALID_ARGUMENT before the lock: nothing drafted, verified or dropped."""
    drafter = CountingNgram(NGRAM.shape())
    servicer, _, link, root = setup(drafter, 1, [1, 2, 1, 2], False)
    drafter.calls.clear()
    bad_unseen = step_item(1, 5, root)
    bad_unseen.unseen.append(drafter_pb2.VerifiedStep(committed=[root], next_token=VOCAB))
    for request in (
        drafter_pb2.StepRequest(items=[step_item(1, 4, VOCAB)]),
        drafter_pb2.StepRequest(items=[step_item(1, 4, root)], caller_hop_seconds=-1.0),
        drafter_pb2.StepRequest(items=[bad_unseen]),
        drafter_pb2.StepRequest(items=[step_item(1, 4, root), step_item(1, 4, root)]),
    ):
        with pytest.raises(Aborted) as error:
            list(servicer.Step(request, FakeContext()))
        assert error.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    empty = drafter_pb2.StartItem(ref=ref(2, 0), prompt_ids=[], first_token=1)
    with pytest.raises(Aborted) as error:
        servicer.Start(drafter_pb2.StartRequest(items=[empty]), FakeContext())
    assert error.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert drafter.calls == [] and link.calls == 0 and servicer.watch.pending == 0
    assert servicer.session.seqs[1].committed == 4 and 2 not in servicer.session
    drafted, last = servicer.Step(  # the sequence is intact: the next good step drafts
        drafter_pb2.StepRequest(items=[step_item(1, 4, root)]), FakeContext()
    )
    assert last.response.results[0].verified.ref.num_committed > 4


def test_the_draft_session_keeps_one_record_per_sequence() -> None:
    """Committed length and next token move with every verification, learned or unseen; a
    caller that disagrees is out of step; a verification of a sequence started again since it
    was drafted is not learned."""
    session = DraftSession(NoDrafter())
    session.start(7, [1, 2, 3], None, 4, None)
    with pytest.raises(OutOfStepError):
        session.start(7, [1], None, 1, None)
    with pytest.raises(UnknownSequenceError):
        session.check(8, 3, 0)
    with pytest.raises(OutOfStepError):
        session.check(7, 5, 1)  # 3 + 1 unseen != 5
    session.check(7, 5, 2)
    session.catch_up(7, [Unseen([4, 5], None, 6)])
    assert (session.seqs[7].committed, session.seqs[7].next_token) == (5, 6)
    with pytest.raises(OutOfStepError, match="another root"):
        session.propose([7], [9])
    (tree,) = session.propose([7], [6])
    assert tree.token_list == (6,)
    marks = session.marks([7])
    step = VerifiedStep(7, [6], None, next_token=2, num_accepted=0, num_committed=6)
    learned, _ = session.learn([step], marks)
    assert learned == [step] and (session.seqs[7].committed, session.seqs[7].next_token) == (6, 2)
    marks = session.marks([7])
    assert session.release(7) and not session.release(7)
    session.start(7, [1, 2, 3, 4, 5, 6], None, 2, None)  # started again from the history
    later = VerifiedStep(7, [2], None, next_token=3, num_accepted=0, num_committed=7)
    assert session.learn([later], marks) == ([], {}) and session.seqs[7].committed == 6
    assert torch.equal(torch.tensor(session.propose([7], [2])[0].token_list), torch.tensor([2]))
