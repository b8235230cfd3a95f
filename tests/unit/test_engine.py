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


@pytest.mark.parametrize("max_batch", [1, 3])
@pytest.mark.parametrize("drafter_name", ["ar", "ngram", "ngram-cost-aware"])
def test_greedy_equals_plain_decoding(drafter_name: str, max_batch: int) -> None:
    model = make_tiny_model(2, vocab_size=16)  # small vocab: repetitive output, n-gram hits
    cost = VerifyCost((1, 4, 8), (1.0, 1.2, 1.6)) if drafter_name.endswith("cost-aware") else None
    drafter = (
        NgramDrafter(DraftBudget(depth=4, top_k=2, max_tokens=6, cost=cost))
        if drafter_name.startswith("ngram")
        else None
    )
    engine = SpecEngine(model, drafter, EngineConfig(max_batch=max_batch, max_len=128))
    seqs = [Sequence(i, p, SamplingParams(max_tokens=24)) for i, p in enumerate(PROMPTS)]
    for s in seqs:
        engine.submit(s)
    stats = engine.run()
    assert [s.output_ids for s in seqs] == plain_greedy(model, PROMPTS)
    assert not engine.running and engine.cache.num_free_slots == max_batch
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
        engine = SpecEngine(model, NgramDrafter(), EngineConfig(max_batch=2, max_len=128))
        seq = Sequence(0, PROMPTS[0], SamplingParams(temperature=0.9, max_tokens=20, seed=seed))
        engine.submit(seq)
        engine.run()
        return seq.output_ids

    assert run(1) == run(1)
    assert len(run(2)) == 20


def test_submit_rejects_sequences_that_cannot_fit() -> None:
    engine = SpecEngine(make_tiny_model(), None, EngineConfig(max_batch=1, max_len=64))
    with pytest.raises(ValueError, match="KV rows"):
        engine.submit(Sequence(0, [1] * 10, SamplingParams(max_tokens=60)))
