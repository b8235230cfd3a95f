"""Where a model-based drafter (EAGLE-2, Lyanna) runs: next to its target, on its device.

On the CPU a drafter keeps its fast paths (prepacked oneDNN linears, Q8_0 block heads, 4-bit
layers, the native decoder: ``lyanna.drafters.heads``). Anywhere else (a GPU) it runs the
*generic* path: plain torch modules in the target's dtype, the draft KV cache on that device,
the target's hidden states used where they arrive. Tree building stays CPU bookkeeping on
both paths (``TokenTree``, ``DraftNodes``): each depth's few top-k results come to the CPU in
one copy (``to_host``), and the small index tensors a depth's forward needs go back, as the
target does with its tokens and positions (``lyanna.model.transformer``). The generic path
can be forced on the CPU (``generic=True``), so tests cover it on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class DraftPlacement:
    """A drafter's device and how it computes there."""

    device: torch.device  # the target's device: draft weights, KV and activations live here
    generic: bool  # plain torch modules (any device) instead of the CPU fast paths
    dtype: torch.dtype  # activations and draft KV (float32 on the CPU fast path)

    @classmethod
    def of(
        cls,
        target: nn.Module,
        weight_dtype: torch.dtype | str | None = "auto",
        generic: bool = False,
    ) -> DraftPlacement:
        """Next to ``target``. The generic path computes in ``weight_dtype``: "auto" = the
        target's dtype (bf16 on a bf16 GPU target: its hidden rows enter as they are), None
        = float32. The fast path keeps float32 activations whatever its weights are stored
        in (``heads.draft_weight_dtype``)."""
        device = target.embed_tokens.weight.device
        generic = generic or device.type != "cpu"
        if not generic:
            return cls(device, False, torch.float32)
        if weight_dtype == "auto":
            dtype = target.embed_tokens.weight.dtype
        else:
            dtype = weight_dtype or torch.float32
        return cls(device, True, dtype)

    def move(self, module: nn.Module, *compute: nn.Module) -> None:
        """Generic path: ``module`` onto the device (in place) and its ``compute`` parts into
        the compute dtype. Buffers elsewhere (rotary tables, hot-vocabulary maps) keep their
        dtype, and a frozen embedding shared with the target is not copied."""
        module.to(self.device)
        for part in compute:
            part.to(self.dtype)

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows as the drafter computes them: on its device, in its dtype (a no-op for
        the target's own rows in the usual case; never through the CPU)."""
        return hidden.to(self.device, self.dtype)

    def ids(self, values: list[int] | list[list[int]] | torch.Tensor) -> torch.Tensor:
        """Token ids or positions (built on the CPU) on the device: one small copy."""
        if isinstance(values, torch.Tensor):
            return values.to(self.device)
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def to_host(*tensors: torch.Tensor, force: bool = False) -> tuple[torch.Tensor, ...]:
    """The tensors on the CPU in ONE device-to-host copy, each with its shape and dtype: packed
    as float64, exact for any float32/bf16/fp16 value and any integer below 2**53 (hot-vocab
    columns, node indices). CPU tensors come back as they are unless ``force`` (tests run the
    packing on the CPU)."""
    if not force and all(t.device.type == "cpu" for t in tensors):
        return tensors
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu()
    parts = flat.split([t.numel() for t in tensors])
    return tuple(p.view(t.shape).to(t.dtype) for p, t in zip(parts, tensors, strict=True))
