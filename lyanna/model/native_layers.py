"""The Python side of the native decoder (``lyanna/model/native``): which tensors a decoder
layer hands it, and one call over a range of layers of a KV cache. Kept apart from the model
code so that the model reads as a model."""

from __future__ import annotations

import functools

import torch
from torch import nn

from lyanna.model.config import ModelConfig
from lyanna.model.cpu_kernels import PackedLinear
from lyanna.model.kv_cache import KVCache
from lyanna.model.quant import Int4Linear


@functools.lru_cache(maxsize=64)
def causal_mask(B: int, q: int) -> torch.Tensor:  # [B, q, q] bool: each row sees its past
    """Contiguous and shared (never written): a decode step asks for the same few shapes."""
    return torch.ones(q, q, dtype=torch.bool).tril_().expand(B, q, q).contiguous()


NATIVE_MAX_HEAD_DIM = 256  # decoder.cpp's kMaxHeadDim


def native_layer_tensors(block: nn.Module) -> list[torch.Tensor] | None:
    """The native decoder's view of one layer: norm weights, and per projection its int4 pack
    and scales-and-zeros (``Int4Linear``) or its oneDNN-packed weight and an empty tensor
    (``PackedLinear``); None when the layer cannot run there (a plain or trainable projection,
    heads wider than the extension's limit)."""
    if block.config.head_dim > NATIVE_MAX_HEAD_DIM:
        return None
    empty = torch.empty(0)
    tensors: list[torch.Tensor] = []
    a, f = block.attention, block.feed_forward
    for norm, linears in ((block.attention_norm, (a.wqkv, a.wo)), (block.ffn_norm, (f.w13, f.w2))):
        tensors.append(norm.weight.detach().float().contiguous())
        for linear in linears:
            if isinstance(linear, Int4Linear):
                tensors += [linear.packed, linear.scales]
            elif isinstance(linear, PackedLinear):
                tensors += [linear.packed, empty]
            else:
                return None
    return tensors


def int8_rows(module: nn.Module) -> bool:
    """Whether the 4-bit projections under ``module`` take int8 inputs (one native call runs
    them all alike, so they must agree)."""
    found = {m.int8_rows for m in module.modules() if isinstance(m, Int4Linear)}
    if len(found) > 1:
        raise ValueError("4-bit projections disagree on int8 rows")
    return found == {True}


def run_native(
    extension,
    x: torch.Tensor,  # [B*q, d] float32 contiguous
    tensors: list[torch.Tensor],
    cache: KVCache,
    layers: range,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    mask: torch.Tensor,
    write_rows: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    config: ModelConfig,
    prompt: bool = False,
    int8_rows: bool = False,
) -> torch.Tensor:
    """One native call over ``layers`` of ``cache`` (see ``decoder.cpp`` for the arguments;
    ``prompt``: the rows are a fresh prompt's prefill, and the causal mask is implied;
    ``int8_rows``: the 4-bit products take int8 inputs)."""
    return extension.decoder_layers(
        x,
        tensors,
        cache.keys[layers.start : layers.stop],
        cache.values[layers.start : layers.stop],
        slots.contiguous(),
        lengths.contiguous(),
        mask.contiguous(),
        write_rows.contiguous(),
        cos.float().contiguous(),
        sin.float().contiguous(),
        config.num_heads,
        config.num_kv_heads,
        config.rms_norm_eps,
        prompt,
        int8_rows,
    )
