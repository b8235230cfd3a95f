"""Static-batch generation (the GPU path of ``training.distill generate``): greedy rows decode
exactly as the continuous-batching path does, every row keeps the hidden states a full forward
computes, sampled rows draw at their own temperature, and the distill driver writes the same
shards from it (on a CUDA device too, where one exists)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_tiny_model
from tests.unit.test_distill import _jobs
from training.distill import DistillConfig, Job, generate_answers
from training.static_batch import choose_tokens, generate_static

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def _full_hidden(model, tokens: list[int]) -> torch.Tensor:
    device = model.embed_tokens.weight.device
    return model(
        torch.tensor([tokens], device=device), torch.arange(len(tokens), device=device)[None],
        model.new_cache(1, 64), torch.tensor([0]),
    )[0].cpu()  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_size", [2, 5])
def test_static_answers_equal_continuous_ones_greedy(device: str, batch_size: int) -> None:
    model = make_tiny_model(3, vocab_size=24).to(device)
    config = DistillConfig(batch_size=batch_size, max_prompt_tokens=8, max_answer_tokens=12)
    jobs = [Job(j.index, 0, j.prompt_ids, 0.0) for j in _jobs()]
    # an end token that some greedy answers reach and others do not: rows finish apart
    free = [a.answer for a in generate_answers(model, iter(jobs), config, eos_id=-1)]
    eos = next(t for t in range(24) if 0 < sum(t in a for a in free) < len(free))
    expected = {a.job.index: a for a in generate_answers(model, iter(jobs), config, eos)}
    got = {a.job.index: a for a in generate_static(model, iter(jobs), config, eos)}
    assert sorted(got) == sorted(expected) == list(range(5))
    lengths = set()
    for index, answer in got.items():
        assert answer.answer == expected[index].answer, index
        tokens = answer.job.prompt_ids + answer.answer
        lengths.add(len(answer.answer))
        assert answer.hidden.shape == (len(tokens), model.config.hidden_size)
        torch.testing.assert_close(
            answer.hidden.float(), _full_hidden(model, tokens), atol=2e-3, rtol=1e-2
        )
    assert len(lengths) > 1  # rows finished at different steps (the batch kept going)


def test_sampled_rows_follow_their_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4, 1)
    temperature = torch.tensor([0.0, 1.0, 0.5, 2.0])
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([choose_tokens(logits, temperature, gen) for _ in range(6000)])
    assert bool((draws[:, 0] == 0).all())  # greedy row: always the argmax
    for row in (1, 2, 3):
        freq = torch.bincount(draws[:, row], minlength=4).float() / draws.shape[0]
        expected = (logits[0] / temperature[row]).softmax(-1)
        assert torch.allclose(freq, expected, atol=0.025), (row, freq, expected)


def test_sampled_jobs_end_with_their_turn_or_the_budget() -> None:
    model = make_tiny_model(3, vocab_size=24)
    eos = model.config.eos_token_id
    config = DistillConfig(batch_size=8, max_prompt_tokens=8, max_answer_tokens=6)
    answers = list(generate_static(model, iter(_jobs()), config, eos, seed=4))
    assert sorted(a.job.index for a in answers) == list(range(5))
    for answer in answers:
        n = len(answer.answer)
        assert 1 <= n <= 6 and (answer.answer[-1] == eos or n == 6)
        assert eos not in answer.answer[:-1]
        tokens = answer.job.prompt_ids + answer.answer
        torch.testing.assert_close(
            answer.hidden.float(), _full_hidden(model, tokens), atol=2e-3, rtol=1e-2
        )
