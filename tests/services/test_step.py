"""The drafter's Step called in-process (no sockets) against an in-process verifier: one call
drafts, verifies through the verifier and learns the step (plain greedy output, the drafter's
length moving with the verifier's); a retried step gets the result the verifier committed
instead of running twice; a drafter whose verifier call fails after the verifier committed
answers ABORTED and drops the sequence, and the caller's direct retry recovers every token;
the drafter checks hidden shapes, refs and roots, drafts nothing for a caller that is gone,
and applies a gated drafter's unseen quiet steps in order."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from lyanna.drafters import DraftBudget
from lyanna.drafters.gate import DraftGate, GateConfig, GatedDrafter, step_source
from lyanna.drafters.ngram import NgramDrafter
from lyanna.tree import TokenTree
from lyanna.tree_cost import VerifyCost
from services import codec
from services.drafter.server import DrafterConfig, DrafterServicer
from services.hidden import HiddenReceiver
from services.pb import common_pb2, drafter_pb2, verifier_pb2
from tests.services.remote_client import plain_greedy
from tests.services.test_servicers import Aborted, FakeContext, prefill, verifier, verify_item
from tests.services.tiny_drafters import tiny_lyanna

NGRAM = DrafterConfig(method="ngram", depth=4, top_k=2, max_draft_tokens=6)


class DiedAfterVerify(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the connection broke after the verifier answered"


class InProcessVerifier:
    """The drafter's verifier link, calling a ``VerifierServicer`` directly; ``fail_after``:
    the verifier runs the call, then the link breaks (the caller never hears)."""

    def __init__(self, servicer) -> None:
        self.servicer = servicer
        self.calls = 0
        self.fail_after = False

    def verify(self, request, remaining):
        self.calls += 1
        response = self.servicer.Verify(request, FakeContext())
        if self.fail_after:
            raise DiedAfterVerify()
        return response


def setup(drafter, seq_id: int, prompt: list[int], needs_hidden: bool):
    target = verifier()
    item = verifier_pb2.PrefillItem(seq_id=seq_id, prompt_ids=prompt, return_hidden=needs_hidden)
    item.params.max_tokens = 64
    (result,) = target.Prefill(verifier_pb2.PrefillRequest(items=[item]), FakeContext()).results
    link = InProcessVerifier(target)
    receiver = HiddenReceiver(32, torch.float32)
    config = DrafterConfig() if needs_hidden else NGRAM
    servicer = DrafterServicer(drafter, config, receiver, 16, verifier=link)
    start = drafter_pb2.StartItem(ref=result.ref, prompt_ids=prompt, first_token=result.first_token)
    if needs_hidden:
        start.prompt_hidden.CopyFrom(result.prompt_hidden)
    servicer.Start(drafter_pb2.StartRequest(items=[start]), FakeContext())
    return servicer, target, link, result.first_token


def step_item(seq_id: int, committed: int, root: int, **fields) -> drafter_pb2.StepItem:
    ref = common_pb2.SeqRef(seq_id=seq_id, num_committed=committed)
    return drafter_pb2.StepItem(ref=ref, next_token=root, draft=True, **fields)


def run_step(servicer, *items, context=None) -> drafter_pb2.StepResponse:
    request = drafter_pb2.StepRequest(items=list(items))
    drafted, last = servicer.Step(request, context or FakeContext())  # exactly two events
    assert drafted.WhichOneof("event") == "drafted" and last.WhichOneof("event") == "response"
    assert drafted.drafted.draft_seconds == last.response.draft_seconds
    return last.response


def test_one_step_call_drafts_verifies_and_learns(tiny_loaded) -> None:
    """Step after Step, with nothing in between: the drafter learned each verification in
    the call that ran it; the tokens are plain greedy decoding's."""
    torch.set_num_threads(1)
    model = verifier().runner.model
    prompt, max_tokens = [1, 2, 3, 1, 2, 3, 1, 2], 24
    servicer, target, link, root = setup(tiny_lyanna(model, DraftBudget(4, 2, 6)), 1, prompt, True)
    tokens, committed, drafted = [root], len(prompt), 0
    while len(tokens) < max_tokens:
        response = run_step(servicer, step_item(1, committed, root))
        (result,) = response.results
        assert result.verified.ref.num_committed == committed + len(result.verified.committed)
        assert not result.verified.HasField("hidden")  # not asked for
        committed, root = result.verified.ref.num_committed, result.verified.tokens[-1]
        tokens += list(result.verified.tokens)
        drafted += result.verified.num_drafted
        assert servicer.session.seqs[1].committed == committed == target.runner.num_committed(1)
    assert link.calls < max_tokens and drafted > 0
    assert tokens[:max_tokens] == plain_greedy(model, [prompt], max_tokens)[0]


def test_a_retried_step_gets_the_result_the_verifier_committed() -> None:
    servicer = verifier()
    root = prefill(servicer, 1, [1, 2, 3])
    drafted = verify_item(1, 3, root, return_hidden=True)
    drafted.tree.CopyFrom(codec.encode_tree(TokenTree.chain(root, [4, 5])))
    (first,) = servicer.Verify(verifier_pb2.VerifyRequest(items=[drafted]), FakeContext()).results
    after = first.ref.num_committed
    retry = verify_item(1, 3, root, return_hidden=True)  # the same step, root-only this time
    for _ in range(2):
        (again,) = servicer.Verify(verifier_pb2.VerifyRequest(items=[retry]), FakeContext()).results
        assert again == first and servicer.runner.num_committed(1) == after
    with pytest.raises(Aborted) as stale:  # a length that is neither: still refused
        servicer.Verify(verifier_pb2.VerifyRequest(items=[verify_item(1, 2, root)]), FakeContext())
    assert stale.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
    onward = verify_item(1, after, first.tokens[-1])
    (next_step,) = servicer.Verify(
        verifier_pb2.VerifyRequest(items=[onward]), FakeContext()
    ).results
    assert next_step.ref.num_committed == after + 1
    with pytest.raises(Aborted):  # only the last step is kept
        servicer.Verify(verifier_pb2.VerifyRequest(items=[retry]), FakeContext())


def test_a_relay_that_dies_after_verify_loses_no_token() -> None:
    """The verifier commits the step, the drafter never hears back: Step answers ABORTED and
    forgets the sequence (its state is in doubt), and the caller's direct retry with its own
    committed length gets exactly the committed tokens."""
    servicer, target, link, root = setup(NgramDrafter(NGRAM.shape()), 1, [1, 2, 1, 2, 1], False)
    link.fail_after = True
    with pytest.raises(Aborted) as aborted:
        run_step(servicer, step_item(1, 5, root))
    assert aborted.value.args[0] == grpc.StatusCode.ABORTED
    committed = target.runner.num_committed(1)
    assert committed > 5 and 1 not in servicer.session
    retry = verifier_pb2.VerifyRequest(items=[verify_item(1, 5, root)])
    (result,) = target.Verify(retry, FakeContext()).results
    assert result.ref.num_committed == committed == 5 + len(result.committed)
    link.fail_after = False  # started again (from the gateway's history), it steps on
    start = drafter_pb2.StartItem(
        ref=result.ref, prompt_ids=[1, 2, 1, 2, 1, *result.committed], first_token=result.tokens[-1]
    )
    servicer.Start(drafter_pb2.StartRequest(items=[start]), FakeContext())
    (onward,) = run_step(servicer, step_item(1, committed, result.tokens[-1])).results
    assert onward.verified.ref.num_committed > committed


def test_step_checks_refs_roots_and_hidden_shapes() -> None:
    model = verifier().runner.model
    servicer, _, link, root = setup(tiny_lyanna(model, DraftBudget(4, 2, 6)), 5, [1, 2, 3], True)
    cases = [
        (step_item(5, 2, root), grpc.StatusCode.FAILED_PRECONDITION),  # not the drafter's
        (step_item(6, 3, root), grpc.StatusCode.NOT_FOUND),
        (step_item(5, 3, 99), grpc.StatusCode.INVALID_ARGUMENT),  # not a token
    ]
    for item, code in cases:
        with pytest.raises(Aborted) as error:
            run_step(servicer, item)
        assert error.value.args[0] == code
    with pytest.raises(Aborted) as error:  # a root that is not the caller's next token
        run_step(servicer, step_item(5, 3, (root + 1) % 16))
    assert error.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert 5 not in servicer.session and link.calls == 0  # dropped, nothing verified
    servicer, _, _, root = setup(tiny_lyanna(model, DraftBudget(4, 2, 6)), 5, [1, 2, 3], True)
    bad = step_item(5, 4, 7)
    bad.unseen.append(drafter_pb2.VerifiedStep(committed=[root], next_token=7))
    bad.unseen[0].hidden.tensor.CopyFrom(codec.encode_tensor(torch.zeros(2, 32)))
    with pytest.raises(Aborted) as error:
        run_step(servicer, bad)
    assert (
        error.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and "[1, 32]" in error.value.args[1]
    )


def test_step_drafts_nothing_for_a_caller_that_is_gone() -> None:
    """A Step that waited past its deadline drafts and verifies nothing and forgets the
    sequence (the gateway starts it again), instead of spending a step on no one."""
    servicer, _, link, root = setup(NgramDrafter(NGRAM.shape()), 5, [1, 2], False)
    with pytest.raises(Aborted) as aborted:
        run_step(servicer, step_item(5, 2, root), context=FakeContext(active=False))
    assert aborted.value.args[0] == grpc.StatusCode.CANCELLED and link.calls == 0
    with pytest.raises(Aborted) as missing:
        run_step(servicer, step_item(5, 2, root))
    assert missing.value.args[0] == grpc.StatusCode.NOT_FOUND


def test_undrafted_items_ride_along_root_only() -> None:
    """A sequence the drafter does not hold (target-only) is verified root-only in the same
    forward, at the caller's next token."""
    servicer, target, link, root = setup(NgramDrafter(NGRAM.shape()), 1, [1, 2, 1, 2], False)
    other = prefill(target, 2, [3, 4, 5])
    plain = step_item(2, 3, other)
    plain.draft = False
    response = run_step(servicer, step_item(1, 4, root), plain)
    assert link.calls == 1 and [r.verified.ref.seq_id for r in response.results] == [1, 2]
    assert response.results[1].verified.num_drafted == 0
    assert target.runner.num_committed(2) == 4 and 2 not in servicer.session


def gated_with_quiet_steps():
    """A gated-off sequence after its first Step and the quiet steps the caller then ran
    directly: (servicer, drafter, first result, the direct steps' result)."""
    # each row 0.9 of a step: only a draft accepted whole would pay (the probe is worth making)
    hardly_pays = VerifyCost((1, 2, 32), (1.0, 1.9, 28.9))
    gate = DraftGate(hardly_pays, GateConfig(prior=0.0))
    drafter = GatedDrafter(NgramDrafter(NGRAM.shape()), gate)
    servicer, target, _, root = setup(drafter, 5, [1, 2], False)
    (first,) = run_step(servicer, step_item(5, 2, root)).results
    committed, root = first.verified.ref.num_committed, first.verified.tokens[-1]
    direct = verify_item(5, committed, root, steps=first.quiet_steps)
    (plain,) = target.Verify(verifier_pb2.VerifyRequest(items=[direct]), FakeContext()).results
    return servicer, drafter, first, plain


def test_step_applies_unseen_quiet_steps_in_order_and_refuses_bad_ones() -> None:
    """A gated-off sequence's result says how many steps it will not draft; the caller's
    quiet verifications (run directly) are applied before drafting (the drafter's length
    moves by all of them), and malformed ones are refused."""
    servicer, drafter, first, plain = gated_with_quiet_steps()
    assert first.verified.num_drafted == 0  # gated off: a root-only tree
    assert first.quiet_steps == GateConfig().probe_after - 1
    unseen = [
        drafter_pb2.VerifiedStep(committed=[token], next_token=nxt)
        for token, nxt in zip(plain.committed, plain.tokens, strict=True)
    ]
    after, root = plain.ref.num_committed, plain.tokens[-1]
    bad_cases = [
        (unseen[:-1], grpc.StatusCode.FAILED_PRECONDITION),  # one missing
        (  # two tokens (the verifier's free drafts) must say one of them was accepted
            [*unseen[:-2], drafter_pb2.VerifiedStep(committed=[1, 2], num_accepted=0)],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (unseen * 22, grpc.StatusCode.INVALID_ARGUMENT),  # more than the bound
    ]
    for bad, code in bad_cases:
        item = step_item(5, after, root)
        item.unseen.extend(bad)
        with pytest.raises(Aborted) as error:
            run_step(servicer, item)
        assert error.value.args[0] == code
    item = step_item(5, after, root)
    item.unseen.extend(unseen)
    (probe,) = run_step(servicer, item).results
    assert probe.verified.ref.num_committed == after + 1
    assert drafter.num_gated_steps == first.quiet_steps + 1


class SlowLink(InProcessVerifier):
    """A verifier link whose every call spends ``delay`` seconds on the way (a slow hop)."""

    def __init__(self, servicer, delay: float) -> None:
        super().__init__(servicer)
        self.delay = delay

    def verify(self, request, remaining):
        time.sleep(self.delay)
        return super().verify(request, remaining)


@pytest.mark.parametrize(("delay", "caller_hop"), [(0.0, 0.0), (0.05, 0.0), (0.0, 0.1)])
def test_a_gated_drafter_learns_what_its_route_to_the_verifier_costs(
    delay: float, caller_hop: float
) -> None:
    """Each drafted Step teaches the gate its route: the hop to the verifier (the call less
    the verifier's forward) plus the caller's hop here (``caller_hop_seconds``; until the
    caller has measured one, taken as the same again). With rows nearly free and a 2 ms step,
    a 50 ms hop to the verifier or a 100 ms hop from the caller makes even a draft accepted
    whole a loss, so the gate stops; hops of nothing keep it drafting. (That case steps in
    20 ms: what it measures as hops and draft time is the host's noise, some milliseconds on
    a loaded 2-core machine, which must not decide it.)"""
    expected = 2 * delay + caller_hop  # (no caller hop measured: the verifier hop twice)
    step = 0.002 if expected else 0.02
    cheap_rows = VerifyCost((1, 2, 32), (step, step + 0.00001, step + 0.0006))
    gate = DraftGate(cheap_rows, GateConfig(prior=2.0))
    drafter = GatedDrafter(NgramDrafter(NGRAM.shape()), gate)
    servicer, target, _, root = setup(drafter, 7, [1, 2, 3, 1, 2, 3, 1, 2], False)
    servicer.verifier = SlowLink(target, delay)
    request = drafter_pb2.StepRequest(items=[step_item(7, 8, root)], caller_hop_seconds=caller_hop)
    drafted, last = servicer.Step(request, FakeContext())
    assert drafted.WhichOneof("event") == "drafted"
    assert last.response.handled_seconds >= delay  # the verifier's hop is the drafter's time
    assert step_source(drafter, 7) == "method"  # drafted (prior 2.0 pays), so it learned
    if expected:
        assert gate.route_seconds >= GateConfig().alpha * expected
        assert not gate.could_pay(7, batch=1)
    else:
        assert gate.route_seconds < GateConfig().alpha * 2 * 0.025  # far under the 50 ms case
        assert gate.could_pay(7, batch=1)


@pytest.mark.parametrize("hop", [-0.1, float("nan"), 61.0])
def test_a_caller_hop_out_of_bounds_is_refused(hop: float) -> None:
    servicer, _, _, root = setup(NgramDrafter(NGRAM.shape()), 8, [1, 2], False)
    request = drafter_pb2.StepRequest(items=[step_item(8, 2, root)], caller_hop_seconds=hop)
    with pytest.raises(Aborted) as error:
        list(servicer.Step(request, FakeContext()))
    assert error.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
