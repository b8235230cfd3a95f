"""The draft LM head every model-based drafter shares: the target's tied LM head restricted
to the drafter's hot vocabulary, gathered and prepacked once at load. Gathering the hot rows
on every step instead would read the full embedding rows, write a copy and read it again for
an unpacked product (about 57 MB per step for 8192 hot rows of SmolLM2-135M), three times the
bytes of the one read of a prepacked head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lyanna.model.cpu_kernels import PackedLinear, prepacking_available


class Linear(nn.Module):
    """A bias-free linear over fixed rows (fallback where oneDNN prepacking is unavailable)."""

    def __init__(self, weight: torch.Tensor) -> None:  # weight [out, in]
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def hot_lm_head(embedding: torch.Tensor, hot_vocab: torch.Tensor) -> nn.Module:
    """The tied LM head restricted to the hot rows (fp32), prepacked on CPU:
    [..., d] -> [..., num_hot] logits."""
    rows = embedding.detach()[hot_vocab].float().contiguous()  # [num_hot, d]
    return PackedLinear(rows) if prepacking_available(rows) else Linear(rows)
