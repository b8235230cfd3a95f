"""The native decoder (``lyanna.model.native``) computes the eager q4 model, and computes it
batch invariantly: a token's hidden state is bitwise the same decoded alone, inside a token
tree, or beside other sequences of other lengths (what keeps q4 speculation lossless)."""

from __future__ import annotations

import copy
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lyanna.model import ModelConfig, Transformer, load_model
from lyanna.model.native import load_decoder
from lyanna.model.quant import Int4Linear, Q4Blocks
from lyanna.tree import pack_trees
from tests.unit.test_model_tree_attention import prefill, random_tree


@pytest.fixture(scope="module")
def extension():
    ext = load_decoder()
    assert ext is not None, "the native decoder failed to build (see the logged warning)"
    return ext


def random_blocks(out_features: int, in_features: int, gen: torch.Generator) -> Q4Blocks:
    groups = in_features // 32
    return Q4Blocks(
        torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8),
        torch.rand(out_features, groups, generator=gen) * 0.05 + 0.01,
        -torch.rand(out_features, groups, generator=gen) * 0.3,
    )


def q4_model(head_dim: int, seed: int = 0) -> Transformer:
    """A random model whose four projections per layer are 4-bit blocks (eager path)."""
    config = replace(
        ModelConfig.tiny(vocab_size=96),
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
    )
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    gen = torch.Generator().manual_seed(seed)
    d, inner = config.hidden_size, config.num_heads * head_dim
    for block in model.layers:
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * head_dim
        block.attention.wqkv = Int4Linear(random_blocks(qkv_out, d, gen))
        block.attention.wo = Int4Linear(random_blocks(d, inner, gen))
        block.feed_forward.w13 = Int4Linear(random_blocks(2 * config.intermediate_size, d, gen))
        block.feed_forward.w2 = Int4Linear(random_blocks(d, config.intermediate_size, gen))
    model.attention_dtype = torch.float64
    return model


def native_twin(model: Transformer, extension) -> Transformer:
    twin = copy.deepcopy(model)
    twin.use_native(extension)
    return twin


def decode_one_by_one(model: Transformer, tokens: list[int]) -> torch.Tensor:  # [len, hidden]
    cache = model.new_cache(1, len(tokens) + 1)
    slot = torch.tensor([cache.allocate()])
    rows = []
    for pos, tok in enumerate(tokens):
        rows.append(model(torch.tensor([[tok]]), torch.tensor([[pos]]), cache, slot)[0, -1])
        cache.commit(0, [0])
    return torch.stack(rows)


@pytest.mark.parametrize("head_dim", [32, 40])  # whole 16-lane chunks, and a tail
def test_native_computes_the_eager_q4_model(head_dim: int, extension) -> None:
    eager = q4_model(head_dim)
    native = native_twin(eager, extension)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    logits = []
    for model in (eager, native):
        cache = model.new_cache(1, 32)
        slot = torch.tensor([cache.allocate()])
        logits.append(model.logits(model(ids, torch.arange(20)[None], cache, slot))[0])
    rel = (logits[0] - logits[1]).norm() / logits[0].norm()
    assert rel < 2e-2, rel  # both round each product's input to bf16, at different places
    assert native.attention_dtype is None and native.new_cache(1, 4).keys.dtype == torch.float32


@pytest.mark.parametrize("seed", range(3))
def test_native_tree_rows_equal_decoding_bitwise(seed: int, extension) -> None:
    model = native_twin(q4_model(32, seed), extension)
    rng = random.Random(seed)
    prefix = [rng.randrange(96) for _ in range(rng.randint(1, 40))]
    tree = random_tree(rng, 96)
    cache = model.new_cache(1, 128)
    slot = cache.allocate()
    prefill(model, cache, slot, prefix)
    packed = pack_trees([tree], [len(prefix)])
    hidden = model(packed.tokens, packed.positions, cache, torch.tensor([slot]), packed.mask)[0]
    for node in range(tree.num_nodes):
        path = [int(tree.tokens[i]) for i in tree.path_to(node)]
        expected = decode_one_by_one(model, prefix + path)[-1]
        assert torch.equal(hidden[node], expected), node


def test_native_batch_equals_single_bitwise(extension) -> None:
    model = native_twin(q4_model(32, 5), extension)
    rng = random.Random(7)
    prefixes = [[rng.randrange(96) for _ in range(n)] for n in (3, 29, 11)]
    trees = [random_tree(rng, 96, max_depth=3, max_width=3) for _ in prefixes]
    cache = model.new_cache(4, 128)
    all_slots = [cache.allocate() for _ in range(4)]
    cache.release(all_slots[1])
    slots = [all_slots[0], all_slots[2], all_slots[3]]
    for slot, prefix in zip(slots, prefixes, strict=True):
        prefill(model, cache, slot, prefix)
    packed = pack_trees(trees, [len(p) for p in prefixes])
    batched = model(packed.tokens, packed.positions, cache, torch.tensor(slots), packed.mask)
    for b, (prefix, tree) in enumerate(zip(prefixes, trees, strict=True)):
        single = model.new_cache(1, 128)
        prefill(model, single, single.allocate(), prefix)
        one = pack_trees([tree], [len(prefix)])
        h = model(one.tokens, one.positions, single, torch.tensor([0]), one.mask)[0]
        assert torch.equal(batched[b, : tree.num_nodes], h[: tree.num_nodes]), b


def test_native_rejects_malformed_input(extension) -> None:
    model = native_twin(q4_model(32), extension)
    cache = model.new_cache(1, 8)
    slot = torch.tensor([cache.allocate()])
    with pytest.raises(RuntimeError, match="tree_mask"):
        model(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), cache, slot, torch.ones(1, 2, 2))
    with pytest.raises(RuntimeError, match="rotary"):
        model.native.decoder_layers(
            torch.zeros(1, 128), model._native_layers, cache.keys, cache.values, slot,
            torch.tensor([0]), torch.tensor([[10**6]]), torch.ones(1, 1, 1, dtype=torch.bool),
            model.rope_cos, model.rope_sin, 4, 2, 256, 1e-5,
        )  # fmt: skip


def test_q4_gguf_loads_native_unless_disabled(tmp_path: Path, monkeypatch, extension) -> None:
    from tests.unit.test_quant import _write_q4_gguf

    gguf_file = tmp_path / "tiny-q4.gguf"
    _write_q4_gguf(gguf_file)
    assert load_model(gguf_file, weights="q4").native is extension
    monkeypatch.setenv("LYANNA_NATIVE", "0")
    load_decoder.cache_clear()
    try:
        eager = load_model(gguf_file, weights="q4")
    finally:
        load_decoder.cache_clear()
    assert eager.native is None and eager.attention_dtype == torch.float64
