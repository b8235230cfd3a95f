"""Tree attention is exact: every node's logits equal sequential decoding of its path, commits
keep exactly the accepted rows, batching sequences of different lengths changes nothing."""

from __future__ import annotations

import random

import pytest
import torch

from lyanna.model import Transformer
from lyanna.tree import DraftScheme, TokenTree, pack_trees
from tests.conftest import make_tiny_model


def sequential_logits(model: Transformer, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    """Reference: feed the tokens one by one through a fresh cache."""
    cache = model.new_cache(1, len(tokens) + 1)
    slot = torch.tensor([cache.allocate()])
    rows = []
    for pos, tok in enumerate(tokens):
        hidden = model(torch.tensor([[tok]]), torch.tensor([[pos]]), cache, slot)
        cache.commit(0, [0])
        rows.append(model.logits(hidden[0, -1]))
    return torch.stack(rows)


def random_tree(rng: random.Random, vocab: int, max_depth: int = 6, max_width: int = 4):
    tokens, parents, depth = [rng.randrange(vocab)], [-1], [0]
    frontier = [0]
    while frontier:
        node = frontier.pop(0)
        if depth[node] >= max_depth:
            continue
        for _ in range(rng.randint(0, max_width)):
            if len(tokens) >= 40:
                break
            tokens.append(rng.randrange(vocab))
            parents.append(node)
            depth.append(depth[node] + 1)
            frontier.append(len(tokens) - 1)
    return TokenTree.from_parents(tokens, parents, scheme=DraftScheme.TOPK)


def prefill(model: Transformer, cache, slot: int, prefix: list[int]) -> None:
    ids = torch.tensor([prefix])
    model(ids, torch.arange(len(prefix))[None], cache, torch.tensor([slot]))
    cache.commit(slot, torch.arange(len(prefix)))


@pytest.mark.parametrize("prepack", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_tree_logits_equal_sequential_paths(seed: int, prepack: bool) -> None:
    model = make_tiny_model(seed, prepack=prepack)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
    tree = random_tree(rng, vocab)
    cache = model.new_cache(1, 128)
    slot = cache.allocate()
    prefill(model, cache, slot, prefix)
    packed = pack_trees([tree], [len(prefix)])
    hidden = model(packed.tokens, packed.positions, cache, torch.tensor([slot]), packed.mask)
    tree_logits = model.logits(hidden[0])
    for node in range(tree.num_nodes):
        path_tokens = [int(tree.tokens[i]) for i in tree.path_to(node)]
        expected = sequential_logits(model, prefix + path_tokens)[-1]
        assert (tree_logits[node] - expected).abs().max().item() < 1e-4, node


@pytest.mark.parametrize("seed", range(4))
def test_commit_accepted_path_continues_like_sequential(seed: int) -> None:
    model = make_tiny_model(seed)
    rng = random.Random(100 + seed)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(5)]
    tree = random_tree(rng, vocab)
    leaf = rng.randrange(tree.num_nodes)
    path = tree.path_to(leaf)
    cache = model.new_cache(1, 128)
    slot = cache.allocate()
    prefill(model, cache, slot, prefix)
    packed = pack_trees([tree], [len(prefix)])
    model(packed.tokens, packed.positions, cache, torch.tensor([slot]), packed.mask)
    cache.commit(slot, path)
    assert int(cache.lengths[slot]) == len(prefix) + len(path)
    # continue with a few more tokens on top of the committed path
    tail = [rng.randrange(vocab) for _ in range(3)]
    start = int(cache.lengths[slot])
    hidden = model(
        torch.tensor([tail]), torch.arange(start, start + 3)[None], cache, torch.tensor([slot])
    )
    committed = prefix + [int(tree.tokens[i]) for i in path]
    expected = sequential_logits(model, committed + tail)[-3:]
    assert (model.logits(hidden[0]) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("attention_dtype", [None, torch.float64])
def test_batched_forward_of_different_lengths_equals_single(attention_dtype) -> None:
    """float64 attention (the q4 setting) runs batches through ``grouped_attention`` and a
    single sequence through the flash kernel: the two must agree too."""
    tiny_model = make_tiny_model(0)
    tiny_model.attention_dtype = attention_dtype
    rng = random.Random(7)
    vocab = tiny_model.config.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 11, 7)]
    trees = [random_tree(rng, vocab, max_depth=3, max_width=3) for _ in prefixes]
    cache = tiny_model.new_cache(4, 128)
    all_slots = [cache.allocate() for _ in range(4)]
    cache.release(all_slots[1])  # non-contiguous slot ids exercise the gather path
    slots = [all_slots[0], all_slots[2], all_slots[3]]
    for slot, prefix in zip(slots, prefixes, strict=True):
        prefill(tiny_model, cache, slot, prefix)
    packed = pack_trees(trees, [len(p) for p in prefixes])
    hidden = tiny_model(packed.tokens, packed.positions, cache, torch.tensor(slots), packed.mask)
    batched = packed.unpack(tiny_model.logits(hidden))
    for b, (prefix, tree) in enumerate(zip(prefixes, trees, strict=True)):
        single_cache = tiny_model.new_cache(1, 128)
        single_slot = single_cache.allocate()
        prefill(tiny_model, single_cache, single_slot, prefix)
        one = pack_trees([tree], [len(prefix)])
        h = tiny_model(
            one.tokens, one.positions, single_cache, torch.tensor([single_slot]), one.mask
        )
        assert (batched[b] - tiny_model.logits(h[0])).abs().max().item() < 1e-5


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_attention_equals_the_flash_kernel(masked: bool) -> None:
    from lyanna.model.transformer import grouped_attention

    gen = torch.Generator().manual_seed(3)
    B, heads, kv_heads, q, kv, hd = 3, 6, 2, 5, 17, 8
    xq = torch.randn(B, heads, q, hd, generator=gen, dtype=torch.float64)
    keys = torch.randn(B, kv_heads, kv, hd, generator=gen, dtype=torch.float64)
    values = torch.randn(B, kv_heads, kv, hd, generator=gen, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.rand(B, 1, q, kv, generator=gen) < 0.6
        mask[..., 0] = True  # every query sees at least one key
    expected = torch.nn.functional.scaled_dot_product_attention(
        xq, keys, values, attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(grouped_attention(xq, keys, values, mask), expected,
                               rtol=1e-12, atol=1e-12)  # fmt: skip


def test_forward_past_capacity_is_refused(tiny_model: Transformer) -> None:
    from lyanna.model.kv_cache import CacheFullError

    cache = tiny_model.new_cache(1, 8)
    slot = torch.tensor([cache.allocate()])
    with pytest.raises(CacheFullError):
        tiny_model(torch.zeros(1, 9, dtype=torch.int64), torch.arange(9)[None], cache, slot)
