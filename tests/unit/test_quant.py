"""Native 4-bit weights: GGUF Q4 blocks load to exactly the file's numbers, the int4 kernel
computes the same products within bf16 rounding, and a Q4_1 GGUF model runs in q4 mode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lyanna.model import CheckpointError, load_model
from lyanna.model.loader import export_hf_dir, read_gguf, read_gguf_q4
from lyanna.model.quant import GROUP, Int4Linear, Q4Blocks, parse_q4_blocks
from tests.conftest import make_tiny_model, prompt_logits
from tests.unit.test_loader import close_gguf, gguf_writer, hf_state_of

pytestmark = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="no int4 CPU kernel"
)


def _quantize(weight: np.ndarray, kind: str) -> np.ndarray:
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    return gguf.quants.quantize(weight.astype(np.float32), qtype)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_reproduce_gguf_dequantization_exactly(kind: str) -> None:
    import gguf

    rng = np.random.default_rng(0)
    weight = rng.normal(size=(48, 4 * GROUP)).astype(np.float32)
    raw = _quantize(weight, kind)
    blocks = parse_q4_blocks(raw, kind, weight.shape)
    expected = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(np.asarray(expected)))
    assert blocks.codes.max() <= 15 and blocks.codes.dtype == torch.uint8


def test_int4_linear_matches_dequantized_linear() -> None:
    gen = torch.Generator().manual_seed(0)
    out_f, in_f = 96, 8 * GROUP
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    scale = torch.rand(out_f, in_f // GROUP, generator=gen) * 0.02 + 0.001
    minimum = -8 * scale + torch.randn(out_f, in_f // GROUP, generator=gen) * 0.01
    blocks = Q4Blocks(codes, scale, minimum)
    layer = Int4Linear(blocks)
    for rows in (1, 3, 16):
        x = torch.randn(2, rows, in_f, generator=gen)
        got = layer(x)
        expected = x @ blocks.dequantize().T
        assert got.shape == expected.shape and got.dtype == torch.float32
        rel = (got - expected).norm() / expected.norm()
        assert rel < 1e-2, rel  # bf16 activations and scales: about 2^-9 per element
        # a wrong code order or scale layout gives an error of order 1
        wrong = x @ Q4Blocks(codes.flip(1), scale, minimum).dequantize().T
        assert (got - wrong).norm() / expected.norm() > 0.1


def _write_q4_gguf(path: Path, kind: str = "Q4_1") -> dict[str, torch.Tensor]:
    """A tiny llama GGUF whose projections are 4-bit blocks (q/k rows permuted as llama.cpp
    stores them); returns the Hugging Face state of the fp32 model it was quantized from."""
    import gguf

    model = make_tiny_model(7)
    cfg = model.config
    state = hf_state_of(model)
    qtype = getattr(gguf.GGMLQuantizationType, kind)

    def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
        rows, cols = w.shape
        return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)

    writer = gguf_writer(path, cfg, state)
    quantized = {
        "attn_q": ("self_attn.q_proj", cfg.num_heads),
        "attn_k": ("self_attn.k_proj", cfg.num_kv_heads),
        "attn_v": ("self_attn.v_proj", None),
        "attn_output": ("self_attn.o_proj", None),
        "ffn_gate": ("mlp.gate_proj", None),
        "ffn_up": ("mlp.up_proj", None),
        "ffn_down": ("mlp.down_proj", None),
    }
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        attn_norm = state[pre + "input_layernorm.weight"].numpy()
        writer.add_tensor(f"blk.{i}.attn_norm.weight", attn_norm)
        writer.add_tensor(
            f"blk.{i}.ffn_norm.weight", state[pre + "post_attention_layernorm.weight"].numpy()
        )
        for short, (long, heads) in quantized.items():
            w = state[pre + long + ".weight"]
            stored = permute(w, heads) if heads else w
            raw = _quantize(stored.numpy(), kind)
            writer.add_tensor(f"blk.{i}.{short}.weight", raw, raw_dtype=qtype)
    close_gguf(writer)
    return state


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_gguf_model_runs_on_its_blocks(tmp_path: Path, kind: str) -> None:
    gguf_file = tmp_path / "tiny-q4.gguf"
    _write_q4_gguf(gguf_file, kind)
    _, dequantized = read_gguf(gguf_file)
    blocks = read_gguf_q4(gguf_file)
    assert len(blocks) == 7 * 2
    for name, b in blocks.items():  # q/k un-permutation applied to whole rows of blocks
        assert torch.equal(b.dequantize(), dequantized[name]), name

    exact = load_model(gguf_file, weights="fp32")
    q4 = load_model(gguf_file, weights="q4")
    assert isinstance(q4.layers[0].attention.wqkv, Int4Linear)
    assert isinstance(q4.layers[1].feed_forward.w2, Int4Linear)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, exact.config.vocab_size, (1, 12), generator=gen)
    logits = [prompt_logits(model, ids) for model in (exact, q4)]
    rel = (logits[0] - logits[1]).norm() / logits[0].norm()
    assert rel < 2e-2, rel


def test_q4_without_a_4bit_source_is_a_clear_error(tmp_path: Path) -> None:
    model = make_tiny_model(3)
    export_hf_dir(model.config, hf_state_of(model), tmp_path / "hf")
    with pytest.raises(CheckpointError, match="Q4_0/Q4_1"):
        load_model(tmp_path / "hf", weights="q4")
    with pytest.raises(ValueError, match="weights must be one of"):
        load_model(tmp_path / "hf", weights="int3")
    # auto falls back to the exact fp32 model when there is nothing 4-bit to run
    auto = load_model(tmp_path / "hf", weights="auto")
    assert not isinstance(auto.layers[0].attention.wqkv, Int4Linear)


def test_auto_weights_follow_the_measurement_and_cache_it(tmp_path: Path, monkeypatch) -> None:
    from lyanna.model import calibrate
    from lyanna.model.config import ModelConfig

    monkeypatch.setenv("LYANNA_CACHE", str(tmp_path))
    calls = []

    def fake_measure(config):
        calls.append(config)
        return {"fp32": {1: 0.010, 4: 0.012}, "q4": {1: 0.004, 4: timing_q4_at_4}}

    monkeypatch.setattr(calibrate, "measure", fake_measure)
    config = ModelConfig.tiny()
    timing_q4_at_4 = 0.020  # q4 slower for a 4-row verification: not chosen
    assert calibrate.choose_weights(config) == "fp32"
    assert calibrate.choose_weights(config) == "fp32" and len(calls) == 1  # cached
    (tmp_path / "calibration.json").unlink()
    timing_q4_at_4 = 0.006
    assert calibrate.choose_weights(config) == "q4" and len(calls) == 2


def test_drafters_compute_in_bf16_next_to_a_q4_target(tmp_path: Path) -> None:
    from lyanna.drafters.heads import draft_weight_dtype, hot_lm_head
    from lyanna.model.cpu_kernels import PackedLinear, bf16_prepacking_supported

    bf16 = torch.bfloat16 if bf16_prepacking_supported() else None  # AVX2-only CPUs: fp32
    gguf_file = tmp_path / "tiny-q4.gguf"
    _write_q4_gguf(gguf_file, "Q4_1")
    assert draft_weight_dtype(load_model(gguf_file, weights="q4")) == bf16
    assert draft_weight_dtype(load_model(gguf_file, weights="fp32")) is None
    gen = torch.Generator().manual_seed(2)
    embedding = torch.randn(40, 64, generator=gen)
    hot = torch.tensor([3, 1, 30, 7])
    head = hot_lm_head(embedding, hot, torch.bfloat16)
    assert isinstance(head, PackedLinear) and head.dtype == (bf16 or torch.float32)
    x = torch.randn(2, 5, 64, generator=gen)
    got, expected = head(x), x @ embedding[hot].T
    assert got.dtype == torch.float32  # the caller's dtype: only the product runs in bf16
    assert (got - expected).norm() / expected.norm() < 1e-2


def test_bf16_prepacking_falls_back_to_the_rounded_weights_in_fp32(monkeypatch) -> None:
    """A CPU without oneDNN's bf16 path (AVX2 only) gets the bf16-rounded weights in fp32:
    (inputs stay fp32), not a crash at load."""
    from lyanna.model import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "bf16_prepacking_supported", lambda: False)
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(24, 32, generator=gen), torch.randn(3, 32, generator=gen)
    linear = cpu_kernels.PackedLinear(weight, torch.bfloat16)
    assert linear.dtype == torch.float32
    rounded = weight.to(torch.bfloat16).float()
    assert not torch.equal(rounded, weight)
    torch.testing.assert_close(linear(x), x @ rounded.T, rtol=1e-5, atol=1e-5)


def test_quantize_q4_1_moves_each_weight_by_at_most_half_a_step() -> None:
    from lyanna.model.quant import quantize_q4_1

    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(4))
    blocks = quantize_q4_1(weight)
    assert blocks.codes.max() <= 15 and blocks.codes.dtype == torch.uint8
    error = (blocks.dequantize() - weight).abs()
    half_step = blocks.scale.repeat_interleave(GROUP, dim=1) / 2
    assert bool((error <= half_step * (1 + 1e-5)).all())
    assert error.max() > 0  # a real rounding, not a copy
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4_1(torch.randn(4, 40))


def test_draft_layers_go_4bit_and_native_next_to_a_q4_target() -> None:
    from lyanna.drafters.heads import prepare_draft_layers
    from lyanna.model.cpu_kernels import PackedLinear
    from lyanna.model.native import load_decoder
    from lyanna.model.quant import quantize_q4_1

    assert load_decoder() is not None
    for q4_layers, kind in ((True, Int4Linear), (False, PackedLinear)):
        model = make_tiny_model(5)
        reference = make_tiny_model(5)  # fp32, eager; its projections hold what the 4-bit
        if q4_layers:  # codes mean, so only the kernels' bf16 rounding separates the two
            with torch.no_grad():
                for b in reference.layers:
                    a, f = b.attention, b.feed_forward
                    for lin in (a.wqkv, a.wo, f.w13, f.w2):
                        lin.weight.copy_(quantize_q4_1(lin.weight).dequantize())
        prepare_draft_layers(model, torch.bfloat16, q4_layers)
        block = model.layers[0]
        assert isinstance(block.attention.wqkv, kind) and isinstance(block.feed_forward.w2, kind)
        assert block.native is not None  # the layers run in the native decoder
        assert isinstance(model.lm_head, PackedLinear)  # not a decoder layer: prepacked
        ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
        logits = [prompt_logits(m, ids) for m in (reference, model)]
        rel = (logits[0] - logits[1]).norm() / logits[0].norm()
        assert rel < 0.02, rel
