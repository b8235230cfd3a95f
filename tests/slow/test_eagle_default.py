"""The committed EAGLE-2 checkpoint on the default model: greedy speculative output equals
plain greedy decoding and the mean acceptance length clears a floor (sglang-style)."""

from __future__ import annotations

import pytest

from lyanna.decode import generate
from lyanna.drafters.base import DraftBudget
from lyanna.drafters.eagle import EagleDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.tokenizer import chat_prompt_ids

pytestmark = pytest.mark.slow

PROMPTS = [
    "Explain in detail how a hash table works.",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "Give me five tips for learning a new language, with an explanation for each.",
]
ACCEPTANCE_FLOOR = 1.5


def test_checkpoint_accepts_and_matches_greedy(default_model, default_tokenizer) -> None:
    eos = frozenset([default_tokenizer.convert_tokens_to_ids("<|im_end|>")])
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    prompts = [chat_prompt_ids(default_tokenizer, chat) for chat in chats]
    params = SamplingParams(max_tokens=96)
    drafter = EagleDrafter(default_model, budget=DraftBudget(depth=5, top_k=4, max_tokens=16))
    engine = SpecEngine(default_model, drafter, EngineConfig(max_running=1, max_len=1024))
    seqs = [Sequence(i, p, params, eos_token_ids=eos) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.submit(s)
    stats = engine.run()
    expected = [Sequence(i, p, params, eos_token_ids=eos) for i, p in enumerate(prompts)]
    generate(default_model, expected)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in expected]
    assert stats.acceptance_length > ACCEPTANCE_FLOOR
