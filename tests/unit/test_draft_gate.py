"""The per-sequence draft gate: drafts while drafting pays, probes with doubling waits while it
does not, and stays lossless around any drafter."""

from __future__ import annotations

import pytest

from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.gate import DraftGate, GateConfig, GatedDrafter, step_source
from lyanna.drafters.ngram import NgramDrafter
from lyanna.tree_cost import VerifyCost
from tests.conftest import make_tiny_model
from tests.unit.test_eagle import (
    PROMPTS,
    plain_outputs,
    random_head,
    run_checking_draft_kv,
    run_engine,
)

# a second row costs half a step: a drafted step pays from 0.5 accepted tokens on
HALF_STEP_ROW = VerifyCost((1, 2), (1.0, 1.5))


def drafted_steps(gate: DraftGate, accepted_if_drafted, steps: int) -> list[int]:
    gate.start(0)
    drafted = []
    for step in range(steps):
        (chosen,) = gate.choose([0])
        if chosen:
            drafted.append(step)
        gate.verified(0, accepted_if_drafted(step) if chosen else 0)
    return drafted


def test_a_sequence_whose_drafts_pay_always_drafts() -> None:
    gate = DraftGate(HALF_STEP_ROW)
    assert drafted_steps(gate, lambda step: 1, 50) == list(range(50))


def test_a_sequence_whose_drafts_fail_probes_after_doubling_waits() -> None:
    # average 1 -> 0.7 (still pays) -> 0.49: off; probes after 4, 8, 16 plain steps, then 32
    gate = DraftGate(HALF_STEP_ROW, GateConfig(alpha=0.3, prior=1.0, probe_after=4, probe_max=32))
    assert drafted_steps(gate, lambda step: 0, 100) == [0, 1, 6, 15, 32, 65, 98]


def test_a_probe_that_pays_turns_drafting_back_on() -> None:
    gate = DraftGate(HALF_STEP_ROW)
    # rejected until step 10, accepted from then on: the probe at step 15 finds it
    drafted = drafted_steps(gate, lambda step: int(step >= 10), 40)
    assert drafted == [0, 1, 6, *range(15, 40)]


def test_quiet_steps_foretell_the_plain_steps_before_each_probe() -> None:
    """A caller that skips the drafter for ``quiet_steps`` steps misses no drafted step: each
    promised quiet step is one ``choose`` would have made plain, and the step after them drafts
    (a probe) or is announced quiet again."""
    gate = DraftGate(HALF_STEP_ROW, GateConfig(alpha=0.3, prior=1.0, probe_after=4, probe_max=32))
    gate.start(0)
    promised, checked, drafted = 0, 0, []
    for step in range(120):
        (chosen,) = gate.choose([0])
        drafted += [step] * chosen
        if promised:
            assert not chosen, f"step {step} was promised quiet"
            promised -= 1
            checked += 1
        else:
            promised = gate.quiet_steps(0)
            assert promised == 0 or not chosen
        gate.verified(0, 0)
    assert drafted == [0, 1, 6, 15, 32, 65, 98]  # as without quiet steps (test above)
    # every plain step was announced but the first of each run of them (6 runs)
    assert checked == 120 - len(drafted) - 6


def test_a_new_sequence_starts_from_what_earlier_ones_of_its_kind_accepted() -> None:
    """Sampled sequences whose drafts never pay teach the gate: the next sampled sequence
    starts gated off (drafting only its probes), while a greedy one, whose kind has shown
    nothing yet, still starts from the prior and drafts."""
    gate = DraftGate(HALF_STEP_ROW, GateConfig(population_alpha=0.2))
    for seq_id in range(10):
        gate.start(seq_id, sampled=True)
        for _ in range(40):
            (chosen,) = gate.choose([seq_id])
            gate.verified(seq_id, 0)
        gate.release(seq_id)
    assert gate.population[True] < 0.2 and gate.population[False] == GateConfig().prior
    gate.start(10, sampled=True)
    gate.start(11, sampled=False)
    assert gate.choose([10]) == [False] and gate.choose([11]) == [True]


def test_a_new_sequence_starts_at_the_probe_interval_its_kind_last_ended_with() -> None:
    """Where probes keep failing, each sampled request doubles its wait between probes; the
    next one starts at the longest wait, not at 4 again. A probe that pays resets the wait,
    for its own sequence and the next ones; greedy sequences keep their own interval."""
    config = GateConfig(alpha=0.3, prior=0.0, probe_after=4, probe_max=32)
    gate = DraftGate(HALF_STEP_ROW, config)

    def run(seq_id: int, accepted: int, steps: int) -> list[int]:
        gate.start(seq_id, sampled=True)
        drafted = []
        for step in range(steps):
            (chosen,) = gate.choose([seq_id])
            drafted += [step] * chosen
            gate.verified(seq_id, accepted if chosen else 0)
        gate.release(seq_id)
        return drafted

    assert run(0, 0, 100) == [4, 13, 30, 63, 96]  # waits of 4, 8, 16, 32, 32
    assert run(1, 0, 100) == [32, 65, 98]  # starts where sequence 0 ended
    gate.start(2, sampled=False)
    assert gate.choose([2]) == [False] and gate.quiet_steps(2) == config.probe_after - 1
    assert run(3, 2, 40)[:2] == [32, 33]  # its probe pays: it drafts on ...
    # ... the next sequence starts drafting (its kind's drafts paid), then probes early again
    assert run(4, 0, 10) == [0, 5]


def test_draft_time_raises_the_bar() -> None:
    gate = DraftGate(HALF_STEP_ROW, GateConfig(alpha=1.0))
    gate.start(0)
    gate._seqs[0].accepted = 0.6
    assert gate.pays(0, batch=1)  # 0.6 * 1.0 >= 0 + 0.5
    gate.drafted(0.2, {0: 1})  # 0.2 s of drafting per sequence now
    assert not gate.pays(0, batch=1)  # 0.6 < 0.2 + 0.5


def test_in_a_batch_the_bar_is_the_rows_cost_against_a_share_of_the_step() -> None:
    # 4 roots cost 2.0 (0.5 per token); a 5th row costs 0.1: 0.3 tokens pay there
    gate = DraftGate(VerifyCost((1, 4, 5), (1.0, 2.0, 2.1)))
    gate.start(0)
    gate._seqs[0].accepted = 0.3
    assert gate.pays(0, batch=4)
    assert not gate.pays(0, batch=1)  # alone, the second row costs 0.5 of a 1.0 step


def test_bad_gate_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        GateConfig(alpha=0.0)
    with pytest.raises(ValueError):
        GateConfig(probe_after=8, probe_max=4)


# a second row dearer than two whole steps: no drafted token can pay
NEVER_PAYS = VerifyCost((1, 2), (1.0, 3.0))


@pytest.mark.parametrize("max_running", [1, 3])
def test_a_gated_eagle_drafter_stays_lossless_and_in_sync(max_running: int) -> None:
    model = make_tiny_model(2, vocab_size=16)
    budget = DraftBudget(2, 2, 3, cost=NEVER_PAYS)
    inner = EagleDrafter(model, random_head(model), budget, max_running=max_running, max_len=256)
    drafter = GatedDrafter(inner, DraftGate(NEVER_PAYS, GateConfig(probe_after=2)))
    engine, seqs = run_engine(model, drafter, PROMPTS, max_running)
    run_checking_draft_kv(engine, inner)
    assert [s.output_ids for s in seqs] == plain_outputs(model, PROMPTS)
    assert drafter.num_gated_steps > engine.stats.num_steps // 2  # mostly plain steps
    assert inner.cache.num_free_slots == max_running and not inner._seqs


def test_a_gated_ngram_drafter_keeps_drafting_a_repetitive_sequence() -> None:
    model = make_tiny_model(3, vocab_size=16)
    free_rows = VerifyCost((1, 2, 16), (1.0, 1.0, 1.0))  # rows cost nothing: drafting pays
    drafter = GatedDrafter(NgramDrafter(DraftBudget(3, 1, 3)), DraftGate(free_rows))
    engine, seqs = run_engine(model, drafter, [[4, 4, 4, 4, 4, 4]], max_running=1, max_tokens=32)
    engine.run()
    assert [s.output_ids for s in seqs] == plain_outputs(model, [[4, 4, 4, 4, 4, 4]], 32)
    assert drafter.num_gated_steps == 0 and engine.stats.num_drafted > 0
    assert drafter.budget is drafter.inner.budget  # other attributes are the inner drafter's


def test_gated_off_steps_draft_from_a_free_fallback_and_stay_lossless() -> None:
    """A learned drafter that never pays (a random head) gated off; its sequences draft from
    the n-gram fallback instead, trees cut by the same cost curve: greedy output unchanged,
    tokens accepted, no quiet steps announced, the inner drafter kept in sync."""
    model = make_tiny_model(2, vocab_size=16)
    budget = DraftBudget(2, 2, 3, cost=HALF_STEP_ROW)
    inner = EagleDrafter(model, random_head(model), budget, max_running=2, max_len=256)
    fallback = NgramDrafter(DraftBudget(3, 1, 3, cost=HALF_STEP_ROW))
    drafter = GatedDrafter(inner, DraftGate(HALF_STEP_ROW, GateConfig(prior=0.0)), fallback)
    proposed_by_fallback: list[int] = []
    propose = fallback.propose
    fallback.propose = lambda ids: (proposed_by_fallback.extend(ids), propose(ids))[1]
    engine, seqs = run_engine(model, drafter, PROMPTS, max_running=2)
    quiet = []
    while engine.has_work:
        engine.step()
        quiet += [drafter.quiet_steps(s) for s in engine.slots]
    assert [s.output_ids for s in seqs] == plain_outputs(model, PROMPTS)
    assert proposed_by_fallback and engine.stats.num_accepted > 0
    assert drafter.num_gated_steps > engine.stats.num_steps // 2 and set(quiet) == {0}
    assert inner.cache.num_free_slots == 2 and not inner._seqs and not fallback._seqs


def test_without_a_fallback_gated_off_steps_are_plain_and_announced_quiet() -> None:
    model = make_tiny_model(2, vocab_size=16)
    inner = NgramDrafter(DraftBudget(3, 1, 3))
    drafter = GatedDrafter(inner, DraftGate(NEVER_PAYS, GateConfig(prior=0.0, probe_after=8)))
    engine, seqs = run_engine(model, drafter, [[4, 4, 4, 4, 4, 4]], max_running=1)
    engine.step()
    engine.step()  # gated off after the first step: plain, with the wait announced
    assert drafter.quiet_steps(0) > 0 and engine.stats.num_drafted == 0


def test_a_configured_rule_must_suit_the_fallbacks_trees_too() -> None:
    """A rule for sampled trees cannot verify the n-gram fallback's top-k trees: refused
    when the method is added, not at the first such tree."""
    from lyanna.drafters.base import NoDrafter
    from lyanna.engine import EngineConfig, SpecEngine
    from lyanna.tree import DraftScheme
    from lyanna.verify import LossyRuleError

    class SampledInner(NoDrafter):
        scheme = DraftScheme.WITHOUT_REPLACEMENT

    model = make_tiny_model(2, vocab_size=16)
    config = EngineConfig(max_running=1, max_len=64, rule="traversal")
    gate = DraftGate(HALF_STEP_ROW)
    SpecEngine(model, GatedDrafter(SampledInner(), gate), config)  # one scheme: accepted
    with pytest.raises(LossyRuleError, match="TOPK"):
        SpecEngine(model, GatedDrafter(SampledInner(), gate, NgramDrafter()), config)


def test_make_drafter_gives_gated_learned_drafters_the_ngram_fallback(monkeypatch) -> None:
    import lyanna.drafters as drafters

    model = make_tiny_model(2, vocab_size=16)
    registry = dict(drafters.DRAFTERS)
    registry["learned"] = lambda model, budget, capacity: NgramDrafter(budget)  # a stand-in
    monkeypatch.setattr(drafters, "DRAFTERS", registry)
    budget = DraftBudget(2, 2, 4, cost=HALF_STEP_ROW)
    gated = drafters.make_drafter("learned", model, budget)
    assert isinstance(gated, GatedDrafter) and isinstance(gated.plain, NgramDrafter)
    assert gated.plain.budget.cost is HALF_STEP_ROW  # the fallback's trees pay their rows
    plain = drafters.make_drafter("learned", model, budget, free_fallback=False)
    assert not plain.drafts_when_gated
    assert not isinstance(drafters.make_drafter("ngram", model, budget), GatedDrafter)


def test_with_a_fallback_the_learned_drafter_must_beat_it_not_plain_steps() -> None:
    """Learned drafts accepting 0.6 tokens pay against plain steps at half a step per row, but
    not against a free fallback whose drafts accept 0.5 tokens per step."""
    gate = DraftGate(HALF_STEP_ROW, GateConfig(prior=0.6, alpha=1.0))
    gate.start(0)
    assert gate.pays(0, batch=1)  # 0.6 >= 0.5
    gate.fallback_verified(0, 1)  # the fallback drafted a token that was accepted
    assert not gate.pays(0, batch=1)  # (0.6 - 1.0) < 0.5
    gate.fallback_verified(0, 0)
    assert gate.pays(0, batch=1)
    gate.start(1)  # a new sequence starts from the fallback's population average
    assert 0 < gate._seqs[1].fallback < 1


def test_step_source_names_what_drafted_each_step() -> None:
    """The per-step fact the drafter service counts (``lyanna_drafter_steps_total``): the
    wrapped method on its probes, the free fallback or a plain root-only tree on gated-off
    steps; a drafter without a gate drafts every step itself."""
    model = make_tiny_model(2, vocab_size=16)
    # drafting pays only when every drafted token is accepted: the gate stays off, yet its
    # probes are worth making (under NEVER_PAYS they are put off)
    barely = VerifyCost((1, 2, 4), (1.0, 1.95, 3.9))
    for fallback, gated_off in ((None, "plain"), (NgramDrafter(DraftBudget(3, 1, 3)), "fallback")):
        gate = DraftGate(barely, GateConfig(prior=0.0, probe_after=2))
        drafter = GatedDrafter(NgramDrafter(DraftBudget(3, 1, 3)), gate, fallback)
        engine, _ = run_engine(model, drafter, [[4, 4, 4, 4, 4, 4]], max_running=1)
        sources = []
        while engine.has_work:
            engine.step()
            sources += [step_source(drafter, seq_id) for seq_id in engine.slots]
        assert sources.count(gated_off) > sources.count("method") > 0  # probes only
        assert set(sources) == {"method", gated_off}
        assert sources.count(gated_off) <= drafter.num_gated_steps
    assert step_source(NgramDrafter(), 0) == "method"


def test_a_probe_that_could_not_pay_even_fully_accepted_is_put_off() -> None:
    """In a batch of 4 a token's share of the step is 0.5 and one more row costs 1.0, so even
    a draft whose every node is accepted loses: each due probe is put off instead, its wait
    doubled and announced quiet. Alone the same gate probes when due (4 plain steps)."""
    cost = VerifyCost((1, 2, 4, 5), (1.0, 1.5, 2.0, 3.0))
    config = GateConfig(alpha=1.0, prior=0.0, probe_after=4, probe_max=32)
    gate = DraftGate(cost, config)
    batch = [0, 1, 2, 3]
    for seq_id in batch:
        gate.start(seq_id)
    quiet = []
    for _ in range(40):
        assert gate.choose(batch) == [False] * 4  # never a probe in this batch
        quiet.append(gate.quiet_steps(0))
        for seq_id in batch:
            gate.verified(seq_id, 0)
    # put off at steps 4, 12, 28 (waits 4 -> 8 -> 16 -> 32): each announces the whole new wait
    assert [quiet[i] for i in (4, 12, 28)] == [7, 15, 31]
    assert not gate.could_pay(0, 4) and gate.could_pay(0, 1)
    assert drafted_steps(DraftGate(cost, config), lambda step: 0, 12) == [4]


def test_route_time_raises_the_bar_like_draft_time() -> None:
    """Across processes a drafted step's extra hops count against it, shared by the sequences
    the step drafted; a step that drafted none teaches nothing."""
    gate = DraftGate(HALF_STEP_ROW, GateConfig(alpha=1.0))
    gate.start(0)
    gate._seqs[0].accepted = 0.6
    gate.routed(0.4, 0)
    assert gate.route_seconds == 0 and gate.pays(0, batch=1)  # 0.6 >= 0 + 0.5
    gate.routed(0.4, 2)  # 0.2 s per drafted sequence
    assert gate.route_seconds == pytest.approx(0.2)
    assert not gate.pays(0, batch=1)  # 0.6 < 0.2 + 0.5
    gate.routed(-1.0, 1)  # a clock that went backwards costs nothing, never a gain
    assert gate.route_seconds == 0


def test_gated_off_steps_drafted_elsewhere_count_as_the_fallback() -> None:
    """Without a fallback of its own (across processes the verifier drafts gated-off steps
    for free), what a gated-off step accepted is still what drafting must beat."""
    gate = DraftGate(HALF_STEP_ROW, GateConfig(alpha=1.0, prior=0.0))
    drafter = GatedDrafter(NgramDrafter(DraftBudget(3, 1, 3)), gate)
    drafter.start(0, [1, 2, 3], None, 4)
    assert drafter.propose([0])[0].num_drafted == 0  # gated off (prior 0)
    free_drafted = VerifiedStep(
        seq_id=0, committed=[4, 5], hidden=None, next_token=6, num_accepted=1, num_committed=5
    )
    drafter.on_verified([free_drafted])
    assert gate._seqs[0].fallback == 1.0
    gate._seqs[0].accepted = 1.2  # would pay against plain steps (1.2 >= 0.5), not against 1.0
    assert not gate.pays(0, batch=1)
