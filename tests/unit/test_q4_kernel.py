"""The native block products (``lyanna/model/native/block_matmul.h``, 4-bit layers and the
Q8_0 LM head): packed layouts, bits against an operation-by-operation torch reference, batch
invariance, and the distance from the file's exact (dequantized) weights."""

from __future__ import annotations

import pytest
import torch

from lyanna.model.native import load_decoder
from lyanna.model.quant import (
    GROUP,
    TILE,
    BlockLinear,
    Int4Linear,
    Q4Blocks,
    Q8Blocks,
    block_matmul_reference,
    pack_q4,
    pack_q8,
    parse_q8_blocks,
)

pytestmark = pytest.mark.skipif(load_decoder() is None, reason="native decoder not built")


def random_blocks(out_f: int, in_f: int, seed: int = 0) -> Q4Blocks:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(out_f, in_f // GROUP, generator=gen) * 0.02 + 1e-3).half().float()
    minimum = (-8 * scale + torch.randn(out_f, in_f // GROUP, generator=gen) * 0.01).half().float()
    return Q4Blocks(codes, scale, minimum)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] read back from the packed lanes, one nibble at a time."""
    tiles, G = packed.shape[:2]
    lanes = packed.to(torch.int64) & 0xFFFFFFFF  # [t, g, c, j]
    codes = torch.zeros(tiles * TILE, G * GROUP, dtype=torch.int64)
    for c in range(4):
        for i in range(4):
            for e, shift in enumerate((4 * i, 16 + 4 * i)):
                k = torch.arange(G) * GROUP + 2 * (4 * c + i) + e  # [g]
                values = (lanes[:, :, c, :] >> shift) & 0xF  # [t, g, j]
                codes[:, k] = values.permute(0, 2, 1).reshape(tiles * TILE, G)
    return codes


def test_packed_layout_holds_every_code_once() -> None:
    blocks = random_blocks(48, 4 * GROUP)
    packed, scales = pack_q4(blocks)
    assert packed.dtype == torch.int32 and packed.shape == (3, 4, 4, TILE)
    assert torch.equal(unpack(packed), blocks.codes.to(torch.int64))
    assert scales.dtype == torch.float16 and scales.shape == (3, 4, 2, TILE)
    assert torch.equal(scales[1, 2, 0].float(), blocks.scale[TILE : 2 * TILE, 2])
    assert torch.equal(scales[1, 2, 1].float(), blocks.minimum[TILE : 2 * TILE, 2])
    with pytest.raises(ValueError, match="tile"):
        pack_q4(random_blocks(40, 2 * GROUP))


@pytest.mark.parametrize("shape", [(16, 32), (96, 256), (48, 1536)])
def test_kernel_computes_the_reference_bit_for_bit(shape: tuple[int, int]) -> None:
    blocks = random_blocks(*shape, seed=shape[1])
    packed, scales = pack_q4(blocks)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8, 9, 20):
        x = torch.randn(rows, shape[1], generator=gen) * torch.rand(rows, 1, generator=gen) * 4
        x[0, :GROUP] = 0.0  # an all-zero block (scale 0)
        got = load_decoder().block_linear(x, packed, scales)
        assert torch.equal(got, block_matmul_reference(x, blocks))


def test_a_row_is_the_same_alone_and_in_a_batch() -> None:
    blocks = random_blocks(64, 4 * GROUP)
    packed, scales = pack_q4(blocks)
    x = torch.randn(13, 4 * GROUP, generator=torch.Generator().manual_seed(2))
    batch = load_decoder().block_linear(x, packed, scales)
    for r in range(13):
        alone = load_decoder().block_linear(x[r : r + 1], packed, scales)
        assert torch.equal(alone, batch[r : r + 1])


def test_kernel_is_far_closer_to_the_file_than_bf16_products() -> None:
    blocks = random_blocks(96, 8 * GROUP)
    layer = Int4Linear(blocks)
    assert layer.native  # the native kernel, not torch's
    x = torch.randn(2, 5, 8 * GROUP, generator=torch.Generator().manual_seed(3))
    exact = x @ blocks.dequantize().T
    rel = (layer(x) - exact).norm() / exact.norm()
    assert rel < 2e-4, rel  # int16 activations; torch's bf16 path is about 3e-3
    wrong = x @ Q4Blocks(blocks.codes.flip(1), blocks.scale, blocks.minimum).dequantize().T
    assert (layer(x) - wrong).norm() / exact.norm() > 0.1


def test_without_the_extension_torchs_kernel_runs(monkeypatch) -> None:
    import lyanna.model.native

    monkeypatch.setattr(lyanna.model.native, "load_decoder", lambda: None)
    blocks = random_blocks(48, 2 * GROUP)
    layer = Int4Linear(blocks)
    assert not layer.native and layer.packed.dtype == torch.uint8
    x = torch.randn(3, 2 * GROUP, generator=torch.Generator().manual_seed(5))
    exact = x @ blocks.dequantize().T
    assert (layer(x) - exact).norm() / exact.norm() < 1e-2  # bf16 activations and scales


def test_malformed_operands_are_refused() -> None:
    blocks = random_blocks(32, 2 * GROUP)
    packed, scales = pack_q4(blocks)
    ext = load_decoder()
    with pytest.raises(RuntimeError, match="inputs"):
        ext.block_linear(torch.randn(2, 3 * GROUP), packed, scales)
    with pytest.raises(RuntimeError, match="float16"):
        ext.block_linear(torch.randn(2, 2 * GROUP), packed, scales.float())
    with pytest.raises(RuntimeError, match="float32"):
        ext.block_linear(torch.randn(2, 2 * GROUP).double(), packed, scales)


def random_q8(out_f: int, in_f: int, seed: int = 0) -> Q8Blocks:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (out_f, in_f), generator=gen).to(torch.int8)
    scale = (torch.rand(out_f, in_f // GROUP, generator=gen) * 0.01 + 1e-4).half().float()
    return Q8Blocks(codes, scale)


def test_q8_blocks_reproduce_gguf_dequantization_exactly() -> None:
    import gguf
    import numpy as np

    weight = np.random.default_rng(0).normal(size=(32, 4 * GROUP)).astype(np.float32)
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    blocks = parse_q8_blocks(raw, weight.shape)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(np.asarray(expected)))


def test_q8_layout_and_bits() -> None:
    blocks = random_q8(48, 3 * GROUP)
    packed, scales = pack_q8(blocks)
    assert packed.dtype == torch.int8 and packed.shape == (3, 3, GROUP // 2, TILE, 2)
    # pair p of lane j of tile t, block g: inputs 32g + 2p and 32g + 2p + 1 of output 16t + j
    assert packed[2, 1, 5, 7, 1] == blocks.codes[2 * TILE + 7, GROUP + 2 * 5 + 1]
    assert torch.equal(scales[..., 1, :], torch.zeros_like(scales[..., 1, :]))  # no minimum
    gen = torch.Generator().manual_seed(6)
    for rows in (1, 5, 17):
        x = torch.randn(rows, 3 * GROUP, generator=gen)
        got = load_decoder().block_linear(x, packed, scales)
        assert torch.equal(got, block_matmul_reference(x, blocks))
        assert torch.equal(load_decoder().block_linear(x[-1:], packed, scales), got[-1:])
    exact = x @ blocks.dequantize().T
    assert (BlockLinear(blocks)(x) - exact).norm() / exact.norm() < 2e-4


def test_the_avx2_path_computes_the_same_bits() -> None:
    """A Zen 3 (AVX2, no VNNI) runs another loop body; it must give the same numbers."""
    from lyanna.model.native import load_decoder_variant

    avx2 = load_decoder_variant("LYANNA_BLOCKS_AVX2")
    assert avx2 is not None
    gen = torch.Generator().manual_seed(7)
    for blocks, pack in (
        (random_blocks(48, 3 * GROUP, seed=8), pack_q4),
        (random_q8(32, 64), pack_q8),
    ):
        packed, scales = pack(blocks)
        for rows in (1, 6, 11):
            x = torch.randn(rows, blocks.shape[1], generator=gen)
            expected = block_matmul_reference(x, blocks)
            assert torch.equal(avx2.block_linear(x, packed, scales), expected)
            assert torch.equal(load_decoder().block_linear(x, packed, scales), expected)


@pytest.mark.parametrize("define", [None, "LYANNA_BLOCKS_AVX2", "LYANNA_BLOCKS_PORTABLE"])
@pytest.mark.parametrize("int8_rows", [False, True])
def test_rows_quantize_halves_to_even_in_every_path(define, int8_rows: bool) -> None:
    """Block maxima of exactly qmax make the scale 1, so inputs of k + 0.5 are ties: every path
    must round them to even as the reference does (x.5 -> nearest even code), not away."""
    from lyanna.model.native import load_decoder_variant

    ext = load_decoder() if define is None else load_decoder_variant(define)
    assert ext is not None
    qmax = 127.0 if int8_rows else 32767.0
    blocks = random_blocks(16, 2 * GROUP, seed=21)
    packed, scales = pack_q4(blocks)
    halves = torch.arange(GROUP, dtype=torch.float32) - 15.5  # -15.5 ... 15.5: all ties
    x = torch.stack([torch.cat([halves, halves.flip(0)]), -torch.cat([halves, halves])])
    x[:, 7] = qmax  # the block maximum: scale max/qmax = 1
    x[:, GROUP + 3] = -qmax
    got = ext.block_linear(x, packed, scales, int8_rows)
    assert torch.equal(got, block_matmul_reference(x, blocks, int8_rows=int8_rows))
    away = x.clone()
    away[x.abs() < qmax] += torch.sign(x[x.abs() < qmax]) * 0.25  # what rounding away gives
    assert not torch.equal(got, block_matmul_reference(away, blocks, int8_rows=int8_rows))


def test_a_head_restricted_to_rows_keeps_their_blocks() -> None:
    blocks = random_q8(64, 2 * GROUP, seed=9)
    head = BlockLinear(blocks)
    back = head.blocks()
    assert torch.equal(back.codes, blocks.codes) and torch.equal(back.scale, blocks.scale)
    hot = torch.tensor([3, 60, 17, 5, 40, 41, 0, 9, 12, 33, 34, 35, 50, 51, 52, 63])
    x = torch.randn(3, 2 * GROUP, generator=torch.Generator().manual_seed(10))
    assert torch.equal(head.rows(hot)(x), head(x)[:, hot])  # rows are independent


@pytest.mark.parametrize("define", [None, "LYANNA_BLOCKS_AVX2", "LYANNA_BLOCKS_PORTABLE"])
def test_int8_rows_compute_their_reference_bit_for_bit(define) -> None:
    """int8 rows (llama.cpp's activations, weights='q4a8'): every path gives the reference's
    bits, a row alone equals the row in a batch, and the product stays near the file's."""
    from lyanna.model.native import load_decoder_variant

    ext = load_decoder() if define is None else load_decoder_variant(define)
    assert ext is not None
    gen = torch.Generator().manual_seed(13)
    for shape in ((16, 32), (48, 256), (32, 1536)):
        blocks = random_blocks(*shape, seed=shape[1] + 1)
        packed, scales = pack_q4(blocks)
        for rows in (1, 2, 7, 17):
            x = torch.randn(rows, shape[1], generator=gen) * torch.rand(rows, 1, generator=gen) * 4
            x[0, :GROUP] = 0.0  # an all-zero block (scale 0)
            got = ext.block_linear(x, packed, scales, True)
            assert torch.equal(got, block_matmul_reference(x, blocks, int8_rows=True))
            assert torch.equal(ext.block_linear(x[-1:], packed, scales, True), got[-1:])
    exact = x @ blocks.dequantize().T
    coarse = (got - exact).norm() / exact.norm()
    fine = (ext.block_linear(x, packed, scales) - exact).norm() / exact.norm()
    assert fine < coarse < 2e-2, (fine, coarse)  # 7 bits per input against 15
    with pytest.raises(RuntimeError, match="4-bit"):
        q8_packed, q8_scales = pack_q8(random_q8(16, GROUP))
        ext.block_linear(torch.randn(1, GROUP), q8_packed, q8_scales, True)
