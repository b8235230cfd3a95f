"""Sampling parameters, the logits -> probs map, stop conditions, KV cache bookkeeping and
plain batched decoding on the tiny model."""

from __future__ import annotations

import pytest
import torch

from lyanna.decode import generate
from lyanna.model.kv_cache import CacheFullError
from lyanna.sampling import SamplingParams, logits_to_probs, sample
from lyanna.sequence import Sequence
from tests.conftest import make_tiny_model


def test_invalid_params_are_rejected() -> None:
    for bad in ({"temperature": -1}, {"top_p": 0.0}, {"max_tokens": 0}, {"stop": ("",)}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_logits_to_probs_greedy_top_p_and_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert logits_to_probs(logits, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]  # lowest index wins
    probs = logits_to_probs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), 1.0, top_p=0.7)
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_sample_matches_distribution() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3]).repeat(20000, 1)
    draws = sample(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[1] == 0
    assert (freq - probs[0]).abs().max() < 0.015


def test_sequence_stop_conditions() -> None:
    text = {1: "a", 2: "b", 3: "END", 4: "c"}
    detok = lambda ids: "".join(text[i] for i in ids)  # noqa: E731
    seq = Sequence(0, [9], SamplingParams(max_tokens=10, stop=("bE",)), frozenset({0}), detok)
    assert seq.append([1, 2, 3, 4]) == [1, 2, 3]
    assert seq.finish_reason == "stop" and seq.output_text() == "a"
    seq = Sequence(1, [9], SamplingParams(max_tokens=10), frozenset({0}))
    assert seq.append([1, 0, 2]) == [1] and seq.finish_reason == "stop"
    seq = Sequence(2, [9], SamplingParams(max_tokens=2), frozenset({0}))
    assert seq.append([1, 2, 3]) == [1, 2] and seq.finish_reason == "length"


def test_kv_cache_commit_and_slots() -> None:
    model = make_tiny_model()
    cache = model.new_cache(2, 16)
    a = cache.allocate()
    cache.keys[:, a, :, :6] = torch.arange(6.0)[None, None, :, None]
    cache.commit(a, [0, 2, 5])
    assert cache.lengths[a] == 3
    assert cache.keys[0, a, 0, :3, 0].tolist() == [0.0, 2.0, 5.0]
    cache.truncate(a, 1)
    assert cache.lengths[a] == 1
    cache.allocate()
    with pytest.raises(CacheFullError):
        cache.allocate()
    cache.release(a)
    with pytest.raises(ValueError):
        cache.release(a)
    assert cache.num_free_slots == 1


def test_commit_prefix_is_commit_of_the_first_rows() -> None:
    caches = [make_tiny_model().new_cache(1, 8) for _ in range(2)]
    for cache in caches:
        cache.allocate()
        cache.keys[:, 0, :, :8] = torch.arange(8.0)[None, None, :, None]
        cache.commit(0, [0, 1, 2])
    caches[0].commit(0, torch.arange(2))
    caches[1].commit_prefix(0, 2)
    assert int(caches[0].lengths[0]) == int(caches[1].lengths[0]) == 5
    assert torch.equal(caches[0].keys, caches[1].keys)
    with pytest.raises(CacheFullError):
        caches[1].commit_prefix(0, 4)  # 5 + 4 rows > 8
    with pytest.raises(CacheFullError):
        caches[1].commit_prefix(0, -1)


def test_batched_generate_equals_one_at_a_time() -> None:
    model = make_tiny_model(1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]

    def run(batch: list[list[int]], temperature: float) -> list[list[int]]:
        seqs = [
            Sequence(i, p, SamplingParams(temperature=temperature, max_tokens=12, seed=p[0]))
            for i, p in enumerate(batch)
        ]
        generate(model, seqs)
        return [s.output_ids for s in seqs]

    for temperature in (0.0, 0.8):
        together = run(prompts, temperature)
        alone = [run([p], temperature)[0] for p in prompts]
        # sampled runs draw from per-sequence seeded generators: batching changes nothing
        assert together == alone
        assert all(len(o) == 12 for o in together)
