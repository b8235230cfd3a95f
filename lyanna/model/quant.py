"""Native 4-bit weights: GGUF Q4_0 / Q4_1 blocks run as they are, through torch's int4 kernel.

A Q4_1 block holds 32 weights as 4-bit codes q with an fp16 scale d and minimum m
(w = d*q + m); Q4_0 has no minimum (w = d*(q - 8)). torch's CPU kernel
``_weight_int4pack_mm_for_cpu`` computes with groups of 32 along the input dimension and a
per-group (scale, zero) pair as w = (q - 8)*scale + zero, so a block maps onto it with the
file's own codes: scale = d, zero = m + 8d (Q4_1) or 0 (Q4_0). Nothing is requantized; the one
rounding is the kernel's: it wants scales and activations in bf16 for its fast path (measured:
the fp32 path is 25x slower), so d and m + 8d are rounded to bf16 (relative error <= 2^-9) and
each product's input is rounded to bf16 (llama.cpp rounds it further, to 8 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

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
    low, high = blocks.amin(-1), blocks.amax(-1)
    step = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((blocks - low[..., None]) / step[..., None]).round().clamp(0, 15)
    return Q4Blocks(codes.to(torch.uint8).reshape(out_features, in_features), step, low)


def int4_kernel_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu"
    )


class Int4Linear(nn.Module):
    """A bias-free Linear over Q4 blocks packed for torch's CPU int4 kernel (inference only).
    Takes and returns the caller's dtype; the product itself runs in bf16."""

    def __init__(self, blocks: Q4Blocks) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            blocks.codes.to(torch.int32).contiguous(), 1
        )
        zero = blocks.minimum + 8.0 * blocks.scale  # w = (q - 8)*d + (m + 8d)
        self.scales_and_zeros = (
            torch.stack([blocks.scale, zero], dim=-1).transpose(0, 1).to(KERNEL_DTYPE).contiguous()
        )  # [in/32, out, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, GROUP, self.scales_and_zeros
        )
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def runs_q4(model: nn.Module) -> bool:
    """Whether ``model`` runs 4-bit weights (any ``Int4Linear`` in it)."""
    return any(isinstance(m, Int4Linear) for m in model.modules())
