"""The speculative engine: at temperature 0 every drafter reproduces plain greedy decoding,
continuous batching admits and retires sequences, statistics add up."""

from __future__ import annotations

import pytest

from lyanna.decode import generate
from lyanna.drafters.base import DraftBudget
from lyanna.drafters.ngram import NgramDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.tree_cost import VerifyCost
from tests.conftest import make_tiny_model

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [9], [4, 4, 4, 4, 4, 4]]


def plain_greedy(model, prompts, max_tokens=24):
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    generate(model, seqs)
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("max_running", [1, 3])
@pytest.mark.parametrize("drafter_name", ["ar", "ngram", "ngram-cost-aware"])
def test_greedy_equals_plain_decoding(drafter_name: str, max_running: int) -> None:
    model = make_tiny_model(2, vocab_size=16)  # small vocab: repetitive output, n-gram hits
    cost = VerifyCost((1, 4, 8), (1.0, 1.2, 1.6)) if drafter_name.endswith("cost-aware") else None
    drafter = (
        NgramDrafter(DraftBudget(depth=4, top_k=2, max_tokens=6, cost=cost))
        if drafter_name.startswith("ngram")
        else None
    )
    engine = SpecEngine(model, drafter, EngineConfig(max_running=max_running, max_len=128))
    seqs = [Sequence(i, p, SamplingParams(max_tokens=24)) for i, p in enumerate(PROMPTS)]
    for s in seqs:
        engine.submit(s)
    stats = engine.run()
    assert [s.output_ids for s in seqs] == plain_greedy(model, PROMPTS)
    assert not engine.running and engine.cache.num_free_slots == max_running
    # the first token of each sequence comes from prefill, the rest from verifications
    assert stats.num_emitted + len(seqs) >= sum(len(s.output_ids) for s in seqs)
    if drafter_name.startswith("ngram"):
        assert stats.num_accepted > 0  # repetitive tiny-vocab output: the n-gram trie must hit
        assert stats.acceptance_length > 1.0
    else:
        assert stats.num_drafted == 0 and stats.acceptance_length == 1.0


def test_sampled_outputs_are_seeded_and_complete() -> None:
    model = make_tiny_model(3, vocab_size=16)

    def run(seed: int) -> list[int]:
        engine = SpecEngine(model, NgramDrafter(), EngineConfig(max_running=2, max_len=128))
        seq = Sequence(0, PROMPTS[0], SamplingParams(temperature=0.9, max_tokens=20, seed=seed))
        engine.submit(seq)
        engine.run()
        return seq.output_ids

    assert run(1) == run(1)
    assert len(run(2)) == 20


def test_submit_rejects_sequences_that_cannot_fit() -> None:
    engine = SpecEngine(make_tiny_model(), None, EngineConfig(max_running=1, max_len=64))
    with pytest.raises(ValueError, match="KV rows"):
        engine.submit(Sequence(0, [1] * 10, SamplingParams(max_tokens=60)))


def test_methods_mixed_in_a_batch_share_each_target_forward() -> None:
    """AR and n-gram sequences in one engine: every step verifies all of them in one
    forward, each drafter sees only its own sequences, and all outputs stay greedy."""
    model = make_tiny_model(2, vocab_size=16)
    engine = SpecEngine(model, None, EngineConfig(max_running=4, max_len=128), method="ar")
    ngram = NgramDrafter(DraftBudget(depth=4, top_k=2, max_tokens=6))
    engine.add_method("ngram", ngram)
    proposed_for: list[list[int]] = []
    propose = ngram.propose
    ngram.propose = lambda ids: (proposed_for.append(list(ids)), propose(ids))[1]
    batches: list[list[int]] = []
    verify = engine.target.verify
    engine.target.verify = lambda ids, *rest: (batches.append(list(ids)), verify(ids, *rest))[1]
    methods = ["ar", "ngram", "ar", "ngram"]
    seqs = [
        Sequence(i, p, SamplingParams(max_tokens=24), method=m)
        for i, (p, m) in enumerate(zip(PROMPTS, methods, strict=True))
    ]
    for s in seqs:
        engine.submit(s)
    engine.run()
    assert [s.output_ids for s in seqs] == plain_greedy(model, PROMPTS)
    assert any({0, 1, 2, 3} <= set(batch) for batch in batches)  # a mixed batch, one forward
    assert proposed_for and all(set(ids) <= {1, 3} for ids in proposed_for)
    by_method = engine.scheduler.stats_by_method
    assert by_method["ar"].num_drafted == 0 and by_method["ngram"].num_accepted > 0
    assert by_method["ar"].num_steps + by_method["ngram"].num_steps == engine.stats.num_steps
    with pytest.raises(ValueError, match="no drafter for method 'eagle'"):
        engine.submit(Sequence(9, [1], SamplingParams(), method="eagle"))


def test_removing_a_method_aborts_its_sequences_only() -> None:
    model = make_tiny_model(2, vocab_size=16)
    engine = SpecEngine(model, None, EngineConfig(max_running=2, max_len=128), method="ar")
    ngram = NgramDrafter()
    engine.add_method("ngram", ngram)
    kept, dropped = (Sequence(i, PROMPTS[i], SamplingParams(max_tokens=8)) for i in (0, 1))
    dropped.method = "ngram"
    engine.submit(kept)
    engine.submit(dropped)
    engine.admit()  # both running: each holds a KV slot, the n-gram one drafter state
    assert engine.cache.num_free_slots == 0 and 1 in ngram._seqs
    assert engine.remove_method("ngram") == [dropped] and "ngram" not in engine.drafters
    assert engine.cache.num_free_slots == 1 and 1 not in ngram._seqs
    engine.run()
    assert kept.output_ids == plain_greedy(model, PROMPTS[:1], 8)[0]
    assert len(dropped.output_ids) == 1  # its prefill token, nothing after the removal
