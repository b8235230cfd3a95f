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
from lyanna.model.kv_cache import KVCache
from lyanna.model.native import load_decoder
from lyanna.model.native_layers import run_native
from lyanna.model.quant import Int4Linear, Q4Blocks
from lyanna.model.transformer import rope_tables
from lyanna.tree import pack_trees
from tests.conftest import make_tiny_model, prompt_logits
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


def q4_model(head_dim: int, seed: int = 0, int8_rows: bool = False) -> Transformer:
    """A random model whose four projections per layer are 4-bit blocks (eager path; the
    native products take int8 inputs with ``int8_rows``)."""
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
        inter = config.intermediate_size
        block.attention.wqkv = Int4Linear(random_blocks(qkv_out, d, gen), int8_rows)
        block.attention.wo = Int4Linear(random_blocks(d, inner, gen), int8_rows)
        block.feed_forward.w13 = Int4Linear(random_blocks(2 * inter, d, gen), int8_rows)
        block.feed_forward.w2 = Int4Linear(random_blocks(d, inter, gen), int8_rows)
    model.attention_dtype = torch.float64
    return model


def native_twin(model: Transformer, extension) -> Transformer:
    twin = copy.deepcopy(model)
    assert twin.use_native(extension)
    return twin


def test_layers_the_extension_cannot_run_stay_eager(extension) -> None:
    plain = make_tiny_model(0)  # nn.Linear projections: neither prepacked nor 4-bit
    assert not plain.use_native(extension) and plain.native is None
    assert not plain.layers[0].use_native(extension) and plain.layers[0].native is None
    assert not q4_model(32).use_native(None)  # no extension: nothing changes


def decode_after_prefill(model: Transformer, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), hidden]: the prefix prefilled as a prompt, then ``tokens`` decoded one
    at a time (what plain decoding computes for them)."""
    cache = model.new_cache(1, len(prefix) + len(tokens) + 1)
    slot = cache.allocate()
    prefill(model, cache, slot, prefix)
    rows = []
    for pos, tok in enumerate(tokens, start=len(prefix)):
        hidden = model(torch.tensor([[tok]]), torch.tensor([[pos]]), cache, torch.tensor([slot]))
        rows.append(hidden[0, -1])
        cache.commit(slot, [0])
    return torch.stack(rows)


@pytest.mark.parametrize("head_dim", [32, 40])  # whole 16-lane chunks, and a tail
def test_native_computes_the_eager_q4_model(head_dim: int, extension) -> None:
    eager = q4_model(head_dim)
    native = native_twin(eager, extension)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    logits = [prompt_logits(model, ids) for model in (eager, native)]
    rel = (logits[0] - logits[1]).norm() / logits[0].norm()
    assert rel < 2e-2, rel  # both round each product's input to bf16, at different places
    assert native.attention_dtype is None and native.new_cache(1, 4).keys.dtype == torch.float16


@pytest.mark.parametrize("seed", range(3))
def test_native_tree_rows_equal_decoding_bitwise(seed: int, extension) -> None:
    assert_tree_rows_equal_decoding(native_twin(q4_model(32, seed), extension), random.Random(seed))


def assert_tree_rows_equal_decoding(model: Transformer, rng: random.Random) -> None:
    """A random tree after a random prefix: each node's hidden state is bitwise what decoding
    its path one token at a time gives."""
    prefix = [rng.randrange(96) for _ in range(rng.randint(1, 40))]
    tree = random_tree(rng, 96)
    cache = model.new_cache(1, 128)
    slot = cache.allocate()
    prefill(model, cache, slot, prefix)
    packed = pack_trees([tree], [len(prefix)])
    hidden = model(packed.tokens, packed.positions, cache, torch.tensor([slot]), packed.mask)[0]
    for node in range(tree.num_nodes):
        path = [int(tree.tokens[i]) for i in tree.path_to(node)]
        expected = decode_after_prefill(model, prefix, path)[-1]
        assert torch.equal(hidden[node], expected), node


def test_a_prompt_prefills_close_to_decoding_it_token_by_token(extension) -> None:
    """A fresh prompt's attention runs as torch's blocked causal kernel (fast for long
    prompts; not bitwise the per-row attention): it computes the same hidden states as
    decoding the prompt one token at a time, within float32 rounding."""
    model = native_twin(q4_model(32, 6), extension)
    prompt = [random.Random(6).randrange(96) for _ in range(48)]
    cache = model.new_cache(1, 64)
    slot = torch.tensor([cache.allocate()])
    prefilled = model(torch.tensor([prompt]), torch.arange(48)[None], cache, slot)[0]
    one_by_one = decode_after_prefill(model, prompt[:1], prompt[1:])
    rel = (prefilled[1:] - one_by_one).norm() / one_by_one.norm()
    assert rel < 1e-5, rel


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
    with pytest.raises(RuntimeError, match="mask must be"):
        model(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), cache, slot, torch.ones(1, 2, 2))
    cos = model.rope_cos[:1]
    with pytest.raises(RuntimeError, match="write row out of the cache"):
        run_native(
            extension, torch.zeros(1, 128), model._native_layers, cache, range(0, 2), slot,
            torch.tensor([0]), torch.ones(1, 1, 1, dtype=torch.bool), torch.tensor([[8]]),
            cos, cos, model.config,
        )  # fmt: skip


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_native_drafter_layer_matches_eager(weight_dtype, extension) -> None:
    """A drafter's layer (oneDNN-prepacked weights) in the native decoder, under both kinds of
    context it meets: the engine's ``ForwardContext`` and a tree step's explicit rows and mask."""
    from lyanna.model.cpu_kernels import prepack_linears
    from lyanna.model.transformer import ForwardContext, eager_context

    eager, native = (make_tiny_model(3).layers[0] for _ in range(2))  # the same weights
    config = make_tiny_model(3).config
    for block in (eager, native):
        prepack_linears(block, weight_dtype)
    assert native.use_native(extension)
    gen = torch.Generator().manual_seed(0)
    cos, sin = rope_tables(config)
    results = []
    for block in (eager, native):
        cache = KVCache(config, 2, 32)
        slots = torch.tensor([cache.allocate(), cache.allocate()])
        prefix = torch.randn(2, 6, config.hidden_size, generator=torch.Generator().manual_seed(1))
        ctx = eager_context(cache, slots, torch.arange(6).expand(2, 6), None, cos, sin)
        first = block(prefix, ctx, 0)
        for s in slots.tolist():
            cache.commit(s, torch.arange(6))
        # a tree step: 3 nodes per sequence at rows 6..8, each seeing the prefix and itself
        rows = torch.tensor([[6, 7, 8], [6, 7, 8]])
        mask = torch.zeros(2, 1, 3, 9, dtype=torch.bool)
        mask[..., :6] = True
        mask[:, 0, [0, 1, 2], [6, 7, 8]] = True
        mask[1, 0, 2, 6] = True  # node 2 of sequence 1 is node 0's child
        positions = torch.tensor([[6, 6, 6], [6, 6, 7]])
        tree = ForwardContext(
            cache, slots, rows, 9, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1), mask
        )
        x = torch.randn(2, 3, config.hidden_size, generator=gen)
        before = x.clone()
        results.append((first, block(x, tree, 0)))
        assert torch.equal(x, before)  # the caller's input is left alone
        gen = torch.Generator().manual_seed(0)
    tolerance = 1e-4 if weight_dtype == torch.float32 else 3e-2
    for e, n in zip(results[0], results[1], strict=True):
        assert ((e - n).norm() / e.norm()).item() < tolerance


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


def test_a_resumed_sequence_gets_back_the_kv_decoding_gave_it(extension) -> None:
    """After a verifier restart a sequence is prefilled again from every committed token.
    Split where the original prompt ended (``prompt_len``), the decoded tokens re-run as a
    causal chain, and the KV cache is bitwise what prefill + decoding left; all of it
    prefilled as one prompt, it is not (a prompt's attention rounds differently)."""
    from lyanna.sampling import SamplingParams
    from lyanna.target import TargetConfig, TargetRunner
    from lyanna.tree import TokenTree

    model = native_twin(q4_model(32, 7), extension)
    runner = TargetRunner(model, TargetConfig(max_running=3, max_len=96))
    rng = random.Random(7)
    prompt = [rng.randrange(96) for _ in range(24)]
    params = SamplingParams(max_tokens=16)
    runner.prefill(1, prompt, params)
    history = list(prompt)
    for _ in range(6):
        (verified,) = runner.verify([1], [TokenTree.root_only(runner.next_token(1))])
        history += verified.committed
    runner.prefill(2, history, params, next_token=runner.next_token(1), prompt_len=len(prompt))
    runner.prefill(3, history, params, next_token=runner.next_token(1))

    def kv(seq_id: int) -> torch.Tensor:
        rows = slice(0, len(history))
        slot = runner.slot(seq_id)
        return torch.stack(
            [runner.cache.keys[:, slot, :, rows], runner.cache.values[:, slot, :, rows]]
        )

    assert runner.num_committed(2) == runner.num_committed(1) == len(history)
    assert torch.equal(kv(2), kv(1))
    assert not torch.equal(kv(3), kv(1))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_fast_attention_keeps_the_generic_bits(head_dim: int, kv_dtype, extension) -> None:
    """Attention's loops run on 8-lane registers where the CPU has AVX2 (scores eight keys at a
    time) and, with AVX-512, over blocks of queries that share a KV head (sixteen keys reduced
    at once); the build with the generic 16-lane loops, one query at a time
    (``LYANNA_GENERIC_ATTENTION``), must give the same hidden states, bit for bit, over
    contexts that are and are not multiples of eight and sixteen keys, with the target's
    float16 cache and the drafters' float32 one."""
    from lyanna.model.native import load_decoder_variant

    generic_ext = load_decoder_variant("LYANNA_GENERIC_ATTENTION")
    assert generic_ext is not None
    model = q4_model(head_dim, seed=11)
    fast, generic = native_twin(model, extension), native_twin(model, generic_ext)
    fast.kv_dtype = generic.kv_dtype = kv_dtype
    rng = random.Random(11)
    for length in (5, 16, 37):
        prefix = [rng.randrange(96) for _ in range(length)]
        tree = random_tree(rng, 96)
        outputs = []
        for twin in (fast, generic):
            cache = twin.new_cache(1, 128)
            assert cache.keys.dtype == kv_dtype
            slot = cache.allocate()
            prefill(twin, cache, slot, prefix)
            packed = pack_trees([tree], [length])
            outputs.append(
                twin(packed.tokens, packed.positions, cache, torch.tensor([slot]), packed.mask)
            )
        assert torch.equal(outputs[0], outputs[1]), length


def test_int8_rows_run_the_whole_decoder_batch_invariantly(extension) -> None:
    """q4a8 (int8 activations): tree rows still equal decoding bitwise, and the model stays
    close to the int16-row one (7 bits per input instead of 15)."""
    a8 = native_twin(q4_model(32, seed=12, int8_rows=True), extension)
    assert a8._native_int8_rows
    assert_tree_rows_equal_decoding(a8, random.Random(12))
    a16 = native_twin(q4_model(32, seed=12), extension)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    exact, coarse = prompt_logits(a16, ids), prompt_logits(a8, ids)
    rel = (exact - coarse).norm() / exact.norm()
    assert 0 < rel < 0.1, rel
