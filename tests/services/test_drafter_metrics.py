"""The drafter service's own counters, called in-process (no sockets): a sequence started
again after the drafter dropped it counts as a resync, not a start, and every learned step is
counted by what drafted it (the configured method, the gate's free n-gram fallback, or a
plain root-only step, quiet steps included)."""

from __future__ import annotations

import pytest

from lyanna.drafters.gate import DraftGate, GateConfig, GatedDrafter
from lyanna.drafters.ngram import NgramDrafter
from lyanna.tree_cost import VerifyCost
from services.pb import drafter_pb2, verifier_pb2
from tests.services.test_servicers import Aborted, FakeContext, verify_item
from tests.services.test_step import NGRAM, gated_with_quiet_steps, run_step, setup, step_item

# each row costs 0.9 of a step: only a draft accepted whole would pay, so the gate stays off
# and probes (a probe that could not pay even then is put off)
HARDLY_PAYS = VerifyCost((1, 2, 32), (1.0, 1.9, 28.9))


def value(servicer, name: str, **labels: str) -> float:
    return servicer.metrics.registry.get_sample_value(name, labels) or 0.0


def starts_and_resyncs(servicer) -> tuple[float, float]:
    return (
        value(servicer, "lyanna_drafter_starts_total"),
        value(servicer, "lyanna_drafter_resyncs_total"),
    )


def steps_by_source(servicer) -> dict[str, float]:
    return {
        source: value(servicer, "lyanna_drafter_steps_total", source=source)
        for source in ("method", "fallback", "plain")
    }


def test_a_sequence_started_again_counts_as_a_resync_not_a_start() -> None:
    """The verifier call of a Step fails after the verifier committed: the drafter drops the
    sequence, the caller runs the step directly and starts it again from its history with
    ``resync`` set."""
    prompt = [1, 2, 1, 2, 1]
    servicer, target, link, root = setup(NgramDrafter(NGRAM.shape()), 1, prompt, False)
    assert starts_and_resyncs(servicer) == (1, 0)
    link.fail_after = True
    with pytest.raises(Aborted):
        run_step(servicer, step_item(1, 5, root))
    assert 1 not in servicer.session
    retry = verifier_pb2.VerifyRequest(items=[verify_item(1, 5, root)])
    (result,) = target.Verify(retry, FakeContext()).results
    again = drafter_pb2.StartItem(
        ref=result.ref,
        prompt_ids=[*prompt, *result.committed],
        first_token=result.tokens[-1],
        resync=True,
    )
    servicer.Start(drafter_pb2.StartRequest(items=[again]), FakeContext())
    assert starts_and_resyncs(servicer) == (1, 1)
    assert value(servicer, "lyanna_drafter_sequences") == 1


def test_an_ungated_drafter_counts_every_step_as_its_methods() -> None:
    servicer, _, _, root = setup(NgramDrafter(NGRAM.shape()), 1, [1, 2, 1, 2, 1], False)
    run_step(servicer, step_item(1, 5, root))
    assert steps_by_source(servicer) == {"method": 1, "fallback": 0, "plain": 0}


def test_a_gated_off_step_with_a_fallback_counts_as_fallback() -> None:
    """A learned drafter the gate finds never pays: its first step is gated off and the free
    n-gram fallback drafts it (not a quiet step: nothing is announced)."""
    inner = NgramDrafter(NGRAM.shape())  # a stand-in for the learned drafter
    gate = DraftGate(HARDLY_PAYS, GateConfig(prior=0.0))
    drafter = GatedDrafter(inner, gate, fallback=NgramDrafter(NGRAM.shape()))
    servicer, _, _, root = setup(drafter, 1, [1, 2, 1, 2, 1], False)
    (result,) = run_step(servicer, step_item(1, 5, root)).results
    assert result.quiet_steps == 0
    assert steps_by_source(servicer) == {"method": 0, "fallback": 1, "plain": 0}


def test_gated_off_steps_without_a_fallback_count_as_plain_quiet_ones_included() -> None:
    """The first Step is gated off (plain); the quiet steps the caller then verified directly
    reach the drafter with the probe, which the method drafts."""
    servicer, drafter, first, plain = gated_with_quiet_steps()
    assert steps_by_source(servicer) == {"method": 0, "fallback": 0, "plain": 1}
    item = step_item(5, plain.ref.num_committed, plain.tokens[-1])
    item.unseen.extend(
        drafter_pb2.VerifiedStep(committed=[token], next_token=nxt)
        for token, nxt in zip(plain.committed, plain.tokens, strict=True)
    )
    run_step(servicer, item)
    quiet = first.quiet_steps
    assert steps_by_source(servicer) == {"method": 1, "fallback": 0, "plain": 1 + quiet}
    assert drafter.num_gated_steps == 1 + quiet
