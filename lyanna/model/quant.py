"""Native quantized weights: the GGUF's Q4_0 / Q4_1 layer blocks and its Q8_0 LM head run as
they are, nothing requantized.

A Q4_1 block holds 32 weights as 4-bit codes q with an fp16 scale d and minimum m
(w = d*q + m); Q4_0 has no minimum (w = d*(q - 8)); Q8_0 holds int8 codes and d (w = d*q).

The product is the native decoder's block kernel (``lyanna/model/native/block_matmul.h``): a
row is quantized to int16 per 32-block (15 bits, where bf16 keeps 8), its dot product with
each block's codes is an exact integer (AVX-512 VNNI ``vpdpwssd``), and the file's fp16 d and
m are applied in float32. Measured on the default model: logits 2.7e-4 from the fp32
dequantization (tests/slow/test_q4_default.py). Without the extension, torch's CPU kernel
``_weight_int4pack_mm_for_cpu`` runs the 4-bit layers (w = (q - 8)*scale + zero with
scale = d, zero = m + 8d; its fast path rounds scales and activations to bf16: logits about
3e-2 from fp32) and the LM head is a bf16 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lyanna.model import native  # looked up at each call: tests switch the extension off

GROUP = 32  # weights per GGUF block, and the kernel's group size
KERNEL_DTYPE = torch.bfloat16  # the dtype of the kernel's fast path (activations, scales)
Q4_TYPES = ("Q4_0", "Q4_1")


@dataclass(frozen=True, slots=True, eq=False)
class Q4Blocks:
    """A [out, in] weight as 4-bit codes with a (scale, minimum) per 32-weight block."""

    codes: torch.Tensor  # [out, in] uint8 in 0..15
    scale: torch.Tensor  # [out, in // 32] float32 (the block's d)
    minimum: torch.Tensor  # [out, in // 32] float32 (m; -8d for Q4_0)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:  # [out, in] float32, exactly what the file means
        scale = self.scale.repeat_interleave(GROUP, dim=1)
        minimum = self.minimum.repeat_interleave(GROUP, dim=1)
        return self.codes.float() * scale + minimum

    def rows(self, index: torch.Tensor) -> Q4Blocks:
        """The blocks of the selected output rows (a row permutation keeps every block)."""
        return Q4Blocks(self.codes[index], self.scale[index], self.minimum[index])

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        """Stack along the output dimension (fused q/k/v or gate/up projections)."""
        return Q4Blocks(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.minimum for p in parts]),
        )


def parse_q4_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Q4Blocks:
    """Split raw GGUF block bytes ([out, in/32 * block bytes] uint8) into codes and scales.

    Block layout (ggml): fp16 d, [fp16 m for Q4_1], 16 bytes whose low nibbles are weights
    0..15 of the block and high nibbles weights 16..31."""
    if kind not in Q4_TYPES:
        raise ValueError(f"not a 4-bit block type: {kind}")
    out_features, in_features = shape
    if in_features % GROUP:
        raise ValueError(f"input dimension {in_features} is not a multiple of {GROUP}")
    header = 4 if kind == "Q4_1" else 2
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(
        out_features, in_features // GROUP, header + GROUP // 2
    )
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        m = -8.0 * d
    packed = blocks[..., header:]  # [out, in/32, 16]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [out, in/32, 32]
    return Q4Blocks(
        torch.from_numpy(codes.reshape(out_features, in_features)),
        torch.from_numpy(d),
        torch.from_numpy(m),
    )


def quantize_q4_1(weight: torch.Tensor) -> Q4Blocks:
    """Round-to-nearest Q4_1 of a float [out, in] weight (in a multiple of 32), as llama.cpp
    quantizes: per 32-block the minimum m and step d = (max - m) / 15, codes round((w - m) / d).
    Each weight moves by at most d / 2. For weights the file did not quantize (a drafter's)."""
    out_features, in_features = weight.shape
    if in_features % GROUP:
        raise ValueError(f"input dimension {in_features} is not a multiple of {GROUP}")
    blocks = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
    low, high = blocks.amin(-1).half().float(), blocks.amax(-1)
    step = ((high - low) / 15).half().float()  # fp16 like the file's blocks
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = ((blocks - low[..., None]) / safe[..., None]).round().clamp(0, 15)
    return Q4Blocks(codes.to(torch.uint8).reshape(out_features, in_features), step, low)


def int4_kernel_available() -> bool:
    """Whether 4-bit products can run here: the native decoder's kernel, or torch's."""

    ops = torch.ops.aten
    return native.load_decoder() is not None or (
        hasattr(ops, "_weight_int4pack_mm_for_cpu")
        and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")
    )


TILE = 16  # outputs per tile of the native kernel's layouts (block_matmul.h)


def pack_q4(blocks: Q4Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The native kernel's 4-bit layout (``lyanna/model/native/block_matmul.h``): codes as int32
    [out/16, in/32, 4, 16], nibble i of chunk c of lane j holding q[j, 32g + 2p] and nibble
    4 + i q[j, 32g + 2p + 1] for pair p = 4c + i; scales [out/16, in/32, 2, 16]
    (d, then m, of each output) in fp16: the file's own values (``Q4Blocks`` holds them
    exactly; ``quantize_q4_1`` rounds to them)."""
    N, K = blocks.shape
    if N % TILE or K % GROUP:
        raise ValueError(f"a {N} x {K} weight does not tile into {TILE} x {GROUP} blocks")
    G = K // GROUP
    codes = blocks.codes.to(torch.int64).view(N // TILE, TILE, G, 4, 4, 2)  # t j g c i e
    shifts = (4 * torch.arange(4))[:, None] + torch.tensor([0, 16])  # [i, e]
    lanes = (codes << shifts).sum(dim=(-1, -2))  # [t, j, g, c]: disjoint bits, so a sum is an or
    packed = lanes.permute(0, 2, 3, 1).to(torch.int32).contiguous()
    return packed, _pack_scales(blocks)


def _pack_scales(blocks: Q4Blocks | Q8Blocks) -> torch.Tensor:  # [out/16, in/32, 2, 16] fp16
    N, K = blocks.shape
    scales = torch.stack([blocks.scale, blocks.minimum]).half().view(2, N // TILE, TILE, -1)
    return scales.permute(1, 3, 0, 2).contiguous()


@dataclass(frozen=True, slots=True, eq=False)
class Q8Blocks:
    """A [out, in] weight as GGUF Q8_0 blocks: int8 codes q with an fp16 scale d per 32
    inputs (w = d*q). The default model's embedding, tied to its LM head."""

    codes: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, in // 32] float32 (the block's d)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def minimum(self) -> torch.Tensor:  # Q8_0 blocks have none
        return torch.zeros_like(self.scale)

    def dequantize(self) -> torch.Tensor:  # [out, in] float32, exactly what the file means
        return self.codes.float() * self.scale.repeat_interleave(GROUP, dim=1)


def parse_q8_blocks(raw: np.ndarray, shape: tuple[int, int]) -> Q8Blocks:
    """Split raw GGUF Q8_0 bytes ([out, in/32 * 34] uint8: fp16 d, then 32 int8) into codes
    and scales."""
    out_features, in_features = shape
    if in_features % GROUP:
        raise ValueError(f"input dimension {in_features} is not a multiple of {GROUP}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(
        out_features, in_features // GROUP, 2 + GROUP
    )
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(out_features, in_features)
    return Q8Blocks(torch.from_numpy(codes), torch.from_numpy(d))


def pack_q8(blocks: Q8Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The native kernel's 8-bit layout: int8 [out/16, in/32, 16, 16, 2], pair p of lane j
    holding (q[j, 32g + 2p], q[j, 32g + 2p + 1]); scales as ``pack_q4``'s, m = 0."""
    N, K = blocks.shape
    if N % TILE or K % GROUP:
        raise ValueError(f"a {N} x {K} weight does not tile into {TILE} x {GROUP} blocks")
    codes = blocks.codes.view(N // TILE, TILE, K // GROUP, GROUP // 2, 2)  # t j g p e
    return codes.permute(0, 2, 3, 1, 4).contiguous(), _pack_scales(blocks)


class BlockLinear(nn.Module):
    """A bias-free Linear over Q8_0 blocks in the native kernel (int16 rows, exact integer
    block products, the file's scales): the default model's LM head, read at half the bytes
    of bf16 and without rounding the file's weights. Inference only."""

    def __init__(self, blocks: Q8Blocks) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.packed, self.scales = pack_q8(blocks)

    def blocks(self) -> Q8Blocks:
        """The Q8_0 blocks back from the packed layout (``pack_q8`` inverted)."""
        t, g, p, j, e = self.packed.shape
        codes = self.packed.permute(0, 3, 1, 2, 4).reshape(t * j, g * p * e)
        scale = self.scales[:, :, 0].permute(0, 2, 1).reshape(t * j, g).float()
        return Q8Blocks(codes, scale)

    def rows(self, index: torch.Tensor) -> BlockLinear:
        """A head over the selected output rows (a drafter's hot vocabulary)."""
        blocks = self.blocks()
        return BlockLinear(Q8Blocks(blocks.codes[index], blocks.scale[index]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:

        flat = x.reshape(-1, self.in_features).float().contiguous()
        out = native.load_decoder().block_linear(flat, self.packed, self.scales)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


QMAX = 32767.0  # activations are quantized to int16 per 32-input block
QMAX8 = 127.0  # ... or to int8 (``int8_rows``: llama.cpp's activations, half the integer work)


def block_matmul_reference(
    x: torch.Tensor, blocks: Q4Blocks | Q8Blocks, int8_rows: bool = False
) -> torch.Tensor:
    """What the native kernel computes, operation by operation in float32 (its bits): each
    row's 32-blocks rounded to int16 (int8 with ``int8_rows``) at scale max|x| / qmax, exact
    integer dot products with the codes, and the blocks' scales applied in ascending order."""
    qmax = QMAX8 if int8_rows else QMAX
    M, K = x.shape
    xb = x.float().reshape(M, K // GROUP, GROUP)
    top = xb.abs().amax(-1)  # [M, G]
    inv = torch.where(top > 0, torch.full_like(top, qmax) / top, 0.0)  # (scalar / t: 1/t * s)
    xq = (xb * inv[..., None]).round().clamp(-qmax, qmax)
    scale, total = top / qmax, xq.sum(-1)  # sums of integers below 2^24: exact
    codes = blocks.codes.to(torch.int64).reshape(-1, K // GROUP, GROUP)
    dots = torch.einsum("mgk,ngk->mng", xq.to(torch.int64), codes).float()  # [M, N, G] exact
    d, m = (t.half().float()[None] for t in (blocks.scale, blocks.minimum))
    terms = d * dots + m * total[:, None]
    y = torch.zeros(M, codes.shape[0])
    for g in range(K // GROUP):
        y = y + terms[..., g] * scale[:, None, g]
    return y


class Int4Linear(nn.Module):
    """A bias-free Linear over Q4 blocks (inference only). With the native decoder at hand
    the product is its kernel (``block_matmul.h``: int16 rows, or int8 rows with
    ``int8_rows``, exact integer block products, the file's scales in float32); otherwise
    torch's int4 kernel, which rounds the scales and the inputs to bf16."""

    def __init__(self, blocks: Q4Blocks, int8_rows: bool = False) -> None:
        super().__init__()

        self.out_features, self.in_features = blocks.shape
        self.native = native.load_decoder() is not None
        self.int8_rows = int8_rows and self.native
        if self.native:
            self.packed, self.scales = pack_q4(blocks)
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            blocks.codes.to(torch.int32).contiguous(), 1
        )
        zero = blocks.minimum + 8.0 * blocks.scale  # w = (q - 8)*d + (m + 8d)
        self.scales = (
            torch.stack([blocks.scale, zero], dim=-1).transpose(0, 1).to(KERNEL_DTYPE).contiguous()
        )  # [in/32, out, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.native:
            out = native.load_decoder().block_linear(
                flat.float().contiguous(), self.packed, self.scales, self.int8_rows
            )
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat.to(KERNEL_DTYPE), self.packed, GROUP, self.scales
            )
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def runs_q4(model: nn.Module) -> bool:
    """Whether ``model`` runs 4-bit weights (any ``Int4Linear`` in it)."""
    return any(isinstance(m, Int4Linear) for m in model.modules())
