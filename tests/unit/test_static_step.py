"""The static (capturable) step: fixed-shape buckets over a window of slots equal sequential
decoding, padding and idle slots leave every committed row alone, and the target verifies the
same through it as through the eager forward."""

from __future__ import annotations

import random

import pytest
import torch

from lyanna.decode import prefill
from lyanna.model.kv_cache import KVCache
from lyanna.model.static_step import (
    KV_MIN_BUCKET,
    ROW_BUCKETS,
    StaticStep,
    StepKey,
    bucket,
    kv_buckets,
    window_inputs,
)
from lyanna.sampling import SamplingParams
from lyanna.target import TargetConfig, TargetRunner
from lyanna.tree import DraftScheme, TokenTree
from tests.conftest import make_tiny_model
from tests.unit.test_model_tree_attention import random_tree, sequential_logits


def test_buckets_are_the_smallest_that_hold() -> None:
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="largest bucket"):
        bucket(9, (1, 2, 4, 8))
    assert kv_buckets(600) == (128, 256, 512, 600)
    assert kv_buckets(KV_MIN_BUCKET) == (KV_MIN_BUCKET,)


def test_the_lowest_free_slot_goes_first() -> None:
    cache = make_tiny_model().new_cache(6, 16)
    assert [cache.allocate() for _ in range(4)] == [0, 1, 2, 3]
    cache.release(1)
    cache.release(0)
    assert cache.allocate() == 0 and cache.allocate() == 1 and cache.allocate() == 4


def test_a_static_step_needs_spare_rows() -> None:
    model = make_tiny_model()
    with pytest.raises(ValueError, match="spare rows"):
        StaticStep(model, model.new_cache(2, 64))


def _filled(model, prompts: dict[int, list[int]], num_slots: int = 8) -> KVCache:
    cache = model.new_cache(num_slots, 256, ROW_BUCKETS[-1])
    taken = [cache.allocate() for _ in range(num_slots)]
    for slot in taken:
        if slot not in prompts:
            cache.release(slot)
    for slot, prompt in prompts.items():
        prefill(model, prompt, cache, slot)
    return cache


def _inputs(key: StepKey, cache: KVCache, model, trees: dict[int, TokenTree]):
    """The step's host inputs for ``trees`` by slot."""
    return window_inputs(
        key,
        cache.lengths,
        list(trees),
        [list(t.token_list) for t in trees.values()],
        [list(t.depth_list) for t in trees.values()],
        [t.attention_mask() for t in trees.values()],
        model.config.max_position_embeddings - 1,
    )


def test_every_node_of_every_slot_equals_sequential_decoding() -> None:
    model = make_tiny_model(seed=3)
    rng = random.Random(7)
    prompts = {1: [rng.randrange(64) for _ in range(5)], 4: [rng.randrange(64) for _ in range(19)]}
    cache = _filled(model, prompts)
    step = StaticStep(model, cache)
    trees = {slot: random_tree(rng, 64, max_depth=4, max_width=3) for slot in prompts}
    key = step.key_for(max(prompts), max(t.num_nodes for t in trees.values()))
    assert key.batch == 8 and key.rows >= max(t.num_nodes for t in trees.values())
    assert key.kv_len == KV_MIN_BUCKET
    out = step.run(key, _inputs(key, cache, model, trees))
    assert out.logits.shape == (key.batch, key.rows, 64)
    for slot, tree in trees.items():
        for node in range(tree.num_nodes):
            path = [tree.token_list[i] for i in tree.path_to(node)]
            expected = sequential_logits(model, prompts[slot] + path)[-1]
            torch.testing.assert_close(out.logits[slot, node], expected, atol=2e-5, rtol=1e-5)
            assert int(out.best[slot, node]) == int(expected.argmax())


def test_padding_and_idle_slots_leave_committed_rows_alone() -> None:
    model = make_tiny_model(seed=4)
    rng = random.Random(2)
    prompts = {0: [rng.randrange(64) for _ in range(9)], 2: [rng.randrange(64) for _ in range(4)]}
    cache = _filled(model, prompts, num_slots=4)
    before = {s: cache.keys[:, s, :, : len(p)].clone() for s, p in prompts.items()}
    step = StaticStep(model, cache)
    tree = random_tree(rng, 64, max_depth=2, max_width=2)
    key = step.key_for(0, tree.num_nodes)
    assert key.batch == 1  # slot 0 alone: the window stops there
    wide = StepKey(4, key.rows, key.kv_len)  # slot 2 rides along idle, slots 1 and 3 free
    for bucket_key in (key, wide):
        step.run(bucket_key, _inputs(bucket_key, cache, model, {0: tree}))
    assert step.keys_seen == [key, wide]
    for slot, rows in before.items():
        assert torch.equal(cache.keys[:, slot, :, : len(prompts[slot])], rows)
        assert int(cache.lengths[slot]) == len(prompts[slot])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize(
    "device, seed",
    [("cpu", 0), ("cpu", 1), pytest.param("cuda", 5, marks=CUDA, id="cuda-graphs")],
)
def test_the_target_verifies_the_same_through_the_static_step(device: str, seed: int) -> None:
    """Greedy verification of random trees over many steps: the static step (buckets, window,
    device mask and argmax; on a GPU one captured CUDA graph per bucket, replayed) and the
    eager forward give the same verdicts and KV lengths on the same device."""
    model = make_tiny_model(seed=seed).to(device)
    rng = random.Random(seed)
    runners = [
        TargetRunner(model, TargetConfig(max_running=6, max_len=300, static_step=flag))
        for flag in (True, False)
    ]
    assert runners[1].static_step is None
    assert runners[0].static_step.capture == (device == "cuda")
    prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 40))] for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    firsts = [[r.prefill(i, p, params).first_token for i, p in enumerate(prompts)] for r in runners]
    assert firsts[0] == firsts[1]
    for _ in range(20):
        batch = rng.sample(range(5), rng.randint(1, 5))
        trees = []
        for seq in batch:
            tree = random_tree(rng, 64, max_depth=3, max_width=2)
            tokens = [runners[0].next_token(seq), *tree.token_list[1:]]
            trees.append(TokenTree(torch.tensor(tokens), tree.parents, DraftScheme.TOPK))
        results = [r.verify(batch, trees) for r in runners]
        for static, eager in zip(*results, strict=True):
            assert static.verdict.tokens == eager.verdict.tokens
            assert static.num_committed == eager.num_committed
    assert len(runners[0].static_step.keys_seen) > 1
    assert bool(runners[0].static_step._graphs) == (device == "cuda")  # replayed, on a GPU
