"""``bench.spec_bench``'s per-source figures: the share of drafted steps a gated method
proposed itself (``learned_step_share``) against a count of the inner drafter's own
proposals, and the conditional acceptance of each source."""

from __future__ import annotations

from bench.spec_bench import BenchSetup, run_batch, run_methods
from lyanna.drafters.base import DraftBudget
from lyanna.drafters.gate import DraftGate, GateConfig, GatedDrafter
from lyanna.drafters.ngram import NgramDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.tree_cost import VerifyCost
from tests.conftest import make_tiny_model

PROMPTS = [[4, 4, 4, 4, 4, 4], [3, 5, 3, 5, 3, 5, 3], [7, 1, 7, 1]]
# drafting pays only when every drafted token is accepted: the gate stays off but probes
BARELY = VerifyCost((1, 2, 4), (1.0, 1.95, 3.9))


class Counting:
    """An inner drafter that counts the sequence-steps it was asked to draft."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.proposed = 0

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def propose(self, seq_ids):
        self.proposed += len(seq_ids)
        return self.inner.propose(seq_ids)


def _tally(drafter, model):
    config = EngineConfig(max_running=1, max_len=256)
    params = SamplingParams(max_tokens=24)
    tallies = [
        run_batch(lambda: SpecEngine(model, drafter, config), [p], params, frozenset())[0]
        for p in PROMPTS
    ]
    total = tallies[0]
    for t in tallies[1:]:
        total.add(t)
    return total


def test_learned_step_share_counts_the_method_own_steps() -> None:
    model = make_tiny_model(2, vocab_size=16)
    inner = Counting(NgramDrafter(DraftBudget(3, 1, 3)))
    gate = DraftGate(BARELY, GateConfig(prior=0.0, probe_after=2))
    tally = _tally(GatedDrafter(inner, gate, NgramDrafter(DraftBudget(3, 1, 3))), model)
    summary = tally.summary(None)
    steps = tally.stats.num_steps
    assert 0 < inner.proposed < steps  # probes only: most steps drafted by the fallback
    assert summary["learned_step_share"] == inner.proposed / steps
    assert summary["steps_by_source"] == {
        "method": inner.proposed,
        "fallback": steps - inner.proposed,
        "plain": 0,
    }
    assert set(summary["cond_accept_by_source"]) == {"method", "fallback"}

    # without a fallback the gated-off steps are plain (no draft): every drafted step is the
    # method's
    inner = Counting(NgramDrafter(DraftBudget(3, 1, 3)))
    gate = DraftGate(BARELY, GateConfig(prior=0.0, probe_after=2))
    summary = _tally(GatedDrafter(inner, gate), model).summary(None)
    assert summary["learned_step_share"] == 1.0
    assert 0 < summary["steps_by_source"]["method"] == inner.proposed
    assert summary["steps_by_source"]["plain"] > 0


def test_an_ungated_method_drafts_every_step_with_the_engine_acceptance() -> None:
    model = make_tiny_model(2, vocab_size=16)
    tally = _tally(NgramDrafter(DraftBudget(3, 1, 3)), model)
    summary = tally.summary(None)
    assert summary["learned_step_share"] == 1.0
    assert summary["steps_by_source"]["method"] == tally.stats.num_steps
    assert summary["cond_accept_by_source"]["method"] == tally.stats.conditional_acceptance
    assert any(c > 0 for c in summary["cond_accept"])


def test_run_methods_reports_no_share_for_plain_decoding() -> None:
    model = make_tiny_model(2, vocab_size=16)
    setup = BenchSetup(model, frozenset(), {"tiny": PROMPTS})
    results = run_methods(setup, ["ngram"], 1, SamplingParams(max_tokens=16),
                          lambda method: DraftBudget(3, 1, 3), log=False)  # fmt: skip
    assert results["ar"]["learned_step_share"] is None
    assert results["ngram"]["learned_step_share"] == 1.0
    assert results["ngram"]["categories"]["tiny"]["cond_accept_by_source"]["method"]
