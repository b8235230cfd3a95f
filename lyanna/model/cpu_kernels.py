"""oneDNN weight prepacking for CPU inference.

On this class of CPU, MKL's sgemm for the small-M products of decoding (M = 1..64 rows) runs
at half the memory bandwidth; oneDNN with weights reordered once into its blocked layout runs
a 16-row product for barely more than a 1-row one (see docs/benchmarks.md). That is exactly
the property speculative verification needs, so every Linear of a CPU fp32/bf16 model is
swapped for ``PackedLinear`` at load time. GPU models keep plain ``nn.Linear``.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

PACK_BATCH_HINT = 16  # oneDNN picks its kernel for this many rows; 1..64 all run well


def prepacking_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@cache
def bf16_prepacking_supported() -> bool:
    """Whether oneDNN can prepack bf16 weights here: it needs AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT, so AVX2-only CPUs (e.g. AMD Zen 3) refuse, and those keep fp32."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """A bias-free Linear whose weight lives in oneDNN's blocked layout (inference only).
    With ``dtype`` (bf16: half the bytes of fp32, e.g. the LM head of 4-bit models) the weight
    is stored and multiplied in it; inputs are cast to it and outputs back to theirs. A CPU
    without oneDNN's bf16 path keeps the bf16-rounded weights in fp32 (twice the bytes)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        super().__init__()  # weight [out, in]
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype or weight.dtype
        weight = weight.detach().to(self.dtype)
        if self.dtype == torch.bfloat16 and not bf16_prepacking_supported():
            self.dtype = torch.float32
            weight = weight.float()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # .to() is free when dtypes agree
        out = torch.ops.mkldnn._linear_pointwise(
            x.to(self.dtype), self.packed, None, "none", [], ""
        )
        return out.to(x.dtype)


def prepack_linears(module: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace every bias-free ``nn.Linear`` under ``module`` by a ``PackedLinear`` (its
    weight in ``dtype``, default its own); returns how many were replaced (0 when oneDNN is
    unavailable or the weights are not on CPU)."""
    replaced = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.bias is None:
            if prepacking_available(child.weight):
                setattr(module, name, PackedLinear(child.weight, dtype))
                replaced += 1
        else:
            replaced += prepack_linears(child, dtype)
    return replaced
