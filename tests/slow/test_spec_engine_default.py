"""On the real default model, every speculative method in the engine (greedy acceptance rule on
real tree logits) reproduces plain greedy decoding token for token, Lyanna with fusion on and
off included."""

from __future__ import annotations

import pytest

from lyanna.decode import generate
from lyanna.drafters import DraftBudget, DraftCapacity, make_drafter
from lyanna.engine import DrafterError, EngineConfig, SpecEngine
from lyanna.model.kv_cache import CacheFullError
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.tokenizer import chat_prompt_ids

pytestmark = pytest.mark.slow

PROMPTS = [
    "Rewrite in a formal tone: 'hey, the meeting moved to 3pm, dont be late'.",
    "Explain why the sky is blue in three sentences.",
    "Write a Python function that reverses a string.",
]


@pytest.fixture(scope="module")
def plain_outputs(default_model, default_tokenizer):
    eos = frozenset({default_tokenizer.eos_token_id})
    prompts = [
        chat_prompt_ids(default_tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS
    ]
    seqs = [Sequence(i, p, SamplingParams(max_tokens=48), eos) for i, p in enumerate(prompts)]
    generate(default_model, seqs)
    return prompts, eos, [s.output_ids for s in seqs]


@pytest.mark.parametrize("method", ["ngram", "sps", "lyanna", "lyanna-unfused"])
def test_speculative_greedy_equals_plain(method, default_model, plain_outputs) -> None:
    prompts, eos, expected = plain_outputs
    drafter = make_drafter(method, default_model, DraftBudget(depth=4, top_k=4, max_tokens=12))
    engine = SpecEngine(default_model, drafter, EngineConfig(max_running=2, max_len=1024))
    seqs = [Sequence(i, p, SamplingParams(max_tokens=48), eos) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.submit(seq)
    stats = engine.run()
    assert [s.output_ids for s in seqs] == expected
    assert stats.num_drafted > 0


@pytest.mark.parametrize("method", ["eagle", "sps", "lyanna"])
def test_drafters_hold_as_many_sequences_as_the_engine_admits(method, default_model) -> None:
    """Defect: the learned drafters kept 16 KV slots whatever the engine admitted, so an
    embedded server with --max-running above 16 failed every request once the 17th arrived."""
    capacity = DraftCapacity(max_running=20, max_len=256)
    drafter = make_drafter(method, default_model, DraftBudget(2, 2, 4), capacity)
    engine = SpecEngine(default_model, drafter, EngineConfig(max_running=20, max_len=256))
    seqs = [Sequence(i, [1, 2, 3 + i], SamplingParams(max_tokens=2)) for i in range(20)]
    for seq in seqs:
        engine.submit(seq)
    engine.run()
    assert all(len(s.output_ids) == 2 for s in seqs)
    with pytest.raises(DrafterError) as failed:  # the default capacity is too small for it
        small = SpecEngine(
            default_model,
            make_drafter(method, default_model, DraftBudget(2, 2, 4)),
            EngineConfig(max_running=20, max_len=256),
        )
        for i in range(20):
            small.submit(Sequence(i, [1, 2, 3 + i], SamplingParams(max_tokens=2)))
        small.run()
    assert isinstance(failed.value.__cause__, CacheFullError)
