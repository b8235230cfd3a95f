"""Draft counters with vLLM's meaning: a draft is a verification with at least one draft token;
root-only steps (target-only, gated-off, quiet, drafter fallbacks) are counted apart and never
lower the acceptance length. A scripted run of steps, its expected counts written out by hand."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from lyanna.stats import SpecStats
from lyanna.step_facts import StepFacts
from lyanna.verify import Verdict

# (drafted per depth, accepted, resampled, drafter fallback)
SCRIPT = [
    ([1, 1, 1], 2, 0, False),  # a chain of 3, 2 accepted
    ([], 0, 0, False),  # gated off: root-only
    ([], 0, 0, True),  # the drafter service missed the step: root-only fallback
    ([1], 0, 0, False),  # one draft token, rejected
    ([2, 1, 1], 3, 1, False),  # a tree of 4, 3 accepted (one from a re-sampled subtree)
    ([], 0, 0, False),  # root-only again
]


def verdict(drafted: list[int], accepted: int) -> Verdict:
    return Verdict(
        path=list(range(accepted + 1)),
        tokens=[7] * (accepted + 1),
        num_accepted=accepted,
        accepted_per_depth=[d < accepted for d in range(len(drafted))],
        num_drafted_per_depth=drafted,
    )


def test_spec_stats_count_drafts_apart_from_root_only_steps() -> None:
    stats = SpecStats()
    for drafted, accepted, _, _ in SCRIPT:
        stats.record(verdict(drafted, accepted))
    assert (stats.num_steps, stats.num_drafted_steps, stats.num_root_only_steps) == (6, 3, 3)
    assert (stats.num_drafted, stats.num_accepted) == (8, 5)
    assert stats.acceptance_length == 1 + 5 / 6  # per verification (the paper's tau)
    assert stats.draft_acceptance_length == 1 + 5 / 3  # per draft (vLLM's)
    other = SpecStats()
    other.record(verdict([1], 1))
    other.record(verdict([], 0))
    stats.merge(other)
    assert (stats.num_steps, stats.num_drafted_steps, stats.num_root_only_steps) == (8, 4, 4)


def samples(metrics: GatewayMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "position" in sample.labels:
                key += f"[{sample.labels['position']}]"
            out[key] = out.get(key, 0.0) + sample.value
    return out


def test_gateway_counts_drafts_root_only_steps_and_fallbacks_apart() -> None:
    metrics = GatewayMetrics("m", "services")
    metrics.prime("lyanna")
    for drafted, accepted, resampled, fallback in SCRIPT:
        metrics.record_step(
            StepFacts("lyanna", sum(drafted), accepted, resampled, drafter_fallback=fallback)
        )
    got = samples(metrics)
    assert got["lyanna_spec_draft_steps_total"] == 3
    assert got["lyanna_spec_root_only_steps_total"] == 3
    assert got["lyanna_spec_drafter_fallback_total"] == 1
    assert got["lyanna_spec_draft_tokens_total"] == 8
    assert got["lyanna_spec_accepted_tokens_total"] == 5
    assert got["lyanna_spec_resampled_accepted_tokens_total"] == 1
    # accepted at depth 1: steps 1 and 5; depth 2: 1 and 5; depth 3: 5
    assert {k: v for k, v in got.items() if "per_position_total" in k} == {
        "lyanna_spec_accepted_tokens_per_position_total[0]": 2,
        "lyanna_spec_accepted_tokens_per_position_total[1]": 2,
        "lyanna_spec_accepted_tokens_per_position_total[2]": 1,
    }
    # the histogram sees drafts only: tokens emitted 3, 1, 4
    assert got["lyanna_spec_acceptance_length_count"] == 3
    assert got["lyanna_spec_acceptance_length_sum"] == 8
    # every verification has its latencies
    assert got["lyanna_spec_verify_latency_seconds_count"] == len(SCRIPT)
    tau = 1 + got["lyanna_spec_accepted_tokens_total"] / got["lyanna_spec_draft_steps_total"]
    assert tau == 1 + 5 / 3


def test_a_run_without_drafts_counts_no_draft() -> None:
    """Drafting off (c = 16 on a CPU, or method ar): every step root-only, so the acceptance
    length has no denominator rather than reading 1.0 and looking like a collapse."""
    metrics = GatewayMetrics("m", "services")
    metrics.prime("lyanna")
    for _ in range(5):
        metrics.record_step(StepFacts("lyanna", 0, 0))
    got = samples(metrics)
    assert got["lyanna_spec_draft_steps_total"] == 0
    assert got["lyanna_spec_root_only_steps_total"] == 5
    assert got.get("lyanna_spec_acceptance_length_count", 0) == 0


def test_fallback_drafts_are_counted_apart_and_stay_drafts() -> None:
    """A draft the n-gram fallback of a gated learned drafter made is a draft (vLLM counts
    it) and is also counted in lyanna_spec_fallback_draft_steps_total."""
    metrics = GatewayMetrics("m", "embedded")
    metrics.prime("lyanna")
    metrics.record_step(StepFacts("lyanna", 2, 1, fallback_drafted=True))
    metrics.record_step(StepFacts("lyanna", 3, 0))
    metrics.record_step(StepFacts("lyanna", 0, 0))
    got = samples(metrics)
    assert got["lyanna_spec_draft_steps_total"] == 2
    assert got["lyanna_spec_fallback_draft_steps_total"] == 1
    assert got["lyanna_spec_root_only_steps_total"] == 1


def test_the_engine_says_which_drafter_drafted_each_step() -> None:
    """In one process the engine hands each step's drafter (the method, its n-gram fallback,
    or none) to the gateway: checked against which drafter was asked for the sequence."""
    from lyanna.drafters.base import DraftBudget
    from lyanna.drafters.eagle import EagleDrafter
    from lyanna.drafters.gate import DraftGate, GateConfig, GatedDrafter
    from lyanna.drafters.ngram import NgramDrafter
    from tests.conftest import make_tiny_model
    from tests.unit.test_draft_gate import HALF_STEP_ROW
    from tests.unit.test_eagle import PROMPTS, random_head, run_engine

    model = make_tiny_model(2, vocab_size=16)
    budget = DraftBudget(2, 2, 3, cost=HALF_STEP_ROW)
    inner = EagleDrafter(model, random_head(model), budget, max_running=2, max_len=256)
    fallback = NgramDrafter(DraftBudget(3, 1, 3, cost=HALF_STEP_ROW))
    gate = DraftGate(HALF_STEP_ROW, GateConfig(prior=0.0, probe_after=2))
    drafter = GatedDrafter(inner, gate, fallback)
    asked: dict[str, set[int]] = {"method": set(), "fallback": set()}

    def spy(name: str, propose):
        return lambda ids: (asked[name].update(ids), propose(ids))[1]

    inner.propose = spy("method", inner.propose)
    fallback.propose = spy("fallback", fallback.propose)
    engine, _ = run_engine(model, drafter, PROMPTS, max_running=2)
    seen = []
    while engine.has_work:
        for names in asked.values():
            names.clear()
        for item in engine.step():
            if item.verdict is None:  # the prefill
                continue
            seq_id = item.sequence.seq_id
            expected = next((n for n, ids in asked.items() if seq_id in ids), "plain")
            assert item.source == expected
            facts = StepFacts.of(item)
            assert facts.fallback_drafted == (expected == "fallback" and facts.num_drafted > 0)
            seen.append((item.source, facts.num_drafted > 0))
    assert ("fallback", True) in seen  # the fallback drafted some steps
