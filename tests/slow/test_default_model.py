"""The lean model on the real default checkpoint against transformers loaded from the same
GGUF: logits within 1e-3, greedy decoding identical for 64 tokens on several prompts."""

from __future__ import annotations

import pytest
import torch

from lyanna.decode import generate
from lyanna.model.default import gguf_path
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.tokenizer import chat_prompt_ids

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain in detail how a hash table works.",
    "Describe the water cycle step by step.",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "Give me five tips for learning a new language, with an explanation for each.",
    "Summarize the history of the Roman Empire.",
]


@pytest.fixture(scope="module")
def reference_model(default_model_dir):
    from transformers import LlamaForCausalLM

    gguf = gguf_path()
    model = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(default_tokenizer) -> list[list[int]]:
    return [chat_prompt_ids(default_tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]


def test_logits_match_transformers_from_gguf(default_model, reference_model, prompt_ids) -> None:
    for ids in prompt_ids[:4]:
        cache = default_model.new_cache(1, len(ids) + 1)
        slot = torch.tensor([cache.allocate()])
        x = torch.tensor([ids])
        logits = default_model.logits(default_model(x, torch.arange(len(ids))[None], cache, slot))
        with torch.no_grad():
            expected = reference_model(x).logits
        assert (logits - expected).abs().max().item() < 1e-3


def test_greedy_equals_transformers_generate(default_model, reference_model, prompt_ids) -> None:
    eos = frozenset({reference_model.config.eos_token_id})
    seqs = [
        Sequence(i, ids, SamplingParams(max_tokens=64), eos) for i, ids in enumerate(prompt_ids)
    ]
    generate(default_model, seqs)
    assert sum(len(s.output_ids) == 64 for s in seqs) >= 5  # long answers, not early stops
    for seq in seqs:
        x = torch.tensor([seq.prompt_ids])
        with torch.no_grad():
            out = reference_model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False
            )
        expected = out[0, x.shape[1] :].tolist()
        ours = seq.output_ids + ([*eos] if seq.finish_reason == "stop" else [])
        assert ours == expected


def test_cli_generate_answers(default_model_dir) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "generate",
            "--prompt",
            "What is 2+2?",
            "--max-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "4" in result.stdout
    assert "tokens/s" in result.stderr
