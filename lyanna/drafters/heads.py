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

from lyanna.model.cpu_kernels import (
    PackedLinear,
    bf16_prepacking_supported,
    prepack_linears,
    prepacking_available,
)
from lyanna.model.huge_pages import on_huge_pages
from lyanna.model.native import load_decoder
from lyanna.model.quant import (
    GROUP,
    TILE,
    BlockLinear,
    Int4Linear,
    int4_kernel_available,
    quantize_q4_1,
    runs_q4,
)
from lyanna.model.transformer import Block, use_native_layers


class Linear(nn.Module):
    """A bias-free linear over fixed rows: the fallback where oneDNN prepacking is unavailable,
    and the head of the device-generic path (a GPU). Inputs are cast to the rows' dtype."""

    def __init__(self, weight: torch.Tensor) -> None:  # weight [out, in]
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


def hot_lm_head(
    embedding: torch.Tensor,
    hot_vocab: torch.Tensor,
    dtype: torch.dtype | None = None,
    blocks: BlockLinear | None = None,
    generic: bool = False,
) -> nn.Module:
    """The tied LM head restricted to the hot rows: [..., d] -> [..., num_hot] logits. From
    ``blocks`` (the target's Q8_0 embedding, ``embedding_blocks``) where given: the file's
    own weights at about half the bytes of bf16; else fp32, or ``dtype`` when prepacked.
    ``generic`` (``lyanna.drafters.placement``): plain rows in ``dtype`` (default fp32) on the
    embedding's device, gathered once."""
    if generic:
        index = hot_vocab.to(embedding.device)
        return Linear(embedding.detach()[index].to(dtype or torch.float32).contiguous())
    if blocks is not None and hot_vocab.numel() % TILE == 0:
        return on_huge_pages(blocks.rows(hot_vocab))
    rows = embedding.detach()[hot_vocab].float().contiguous()  # [num_hot, d]
    return on_huge_pages(PackedLinear(rows, dtype) if prepacking_available(rows) else Linear(rows))


def embedding_blocks(target: nn.Module) -> BlockLinear | None:
    """The target's embedding as Q8_0 blocks, when its LM head is tied to it and runs on them
    (``lyanna.model.loader``); drafters gather their hot heads from it."""
    head = getattr(target, "lm_head", None)
    tied = getattr(getattr(target, "config", None), "tie_word_embeddings", False)
    return head if tied and isinstance(head, BlockLinear) else None


def draft_weight_dtype(target: nn.Module) -> torch.dtype | None:
    """The dtype a drafter's layers and head compute in next to ``target``: bf16 when the
    target runs 4-bit weights and oneDNN has a bf16 path on this CPU (AVX-512 or
    AVX-NE-CONVERT; an AVX2-only CPU keeps fp32), else the weights' own. A draft step is bound
    by reading its weights (one layer and an 8k-row head: about 33 MB in fp32 per depth), so
    half the bytes is nearly half the time; drafting stays lossless whatever it computes in."""
    return torch.bfloat16 if runs_q4(target) and bf16_prepacking_supported() else None


def prepare_draft_layers(module: nn.Module, dtype: torch.dtype | None, q4_layers: bool) -> None:
    """Ready a drafter's weights for serving, once and in place (inference only): with
    ``q4_layers`` (next to a 4-bit target) and the native decoder at hand, its decoder
    layers' projections become 4-bit too (``quantize_q4_1``; measured in docs/benchmarks.md:
    the same acceptance as bf16 layers, faster steps); every other linear is prepacked in
    ``dtype``; the layers then run in the native decoder when it builds. The input projection
    ``fc`` goes 4-bit with the layers: a bf16 product of its 1.3 MB cost a draft step more
    than the whole 4-bit layer (measured in docs/benchmarks.md)."""
    if q4_layers and int4_kernel_available() and load_decoder() is not None:
        parents: list[nn.Module] = [module]  # its input projection (``fc``), then the layers
        for block in (m for m in module.modules() if isinstance(m, Block)):
            parents += [block.attention, block.feed_forward]
        for parent in parents:
            for name, child in list(parent.named_children()):
                if parent is module and name != "fc":
                    continue
                if _fits_blocks(child):
                    setattr(parent, name, Int4Linear(quantize_q4_1(child.weight)))
    prepack_linears(module, dtype)
    use_native_layers(module)
    on_huge_pages(module)  # after the native layers took their tensors: those move too


def _fits_blocks(child: nn.Module) -> bool:
    return (
        isinstance(child, nn.Linear)
        and child.bias is None
        and child.in_features % GROUP == 0
        and child.out_features % TILE == 0
    )


FULL_VOCAB_CHUNK = 512  # rows per full-vocabulary product (bounded memory in evaluation)


def full_vocab_hits(
    draft_top1: torch.Tensor,  # [R] int64 token id the drafter ranks first
    target_hidden: torch.Tensor,  # [R, d] the target's hidden state that decides the token
    embedding: torch.Tensor,  # [vocab, d] the (tied) LM head
) -> torch.Tensor:  # [R] float 1.0 where the drafter's first token is the target's argmax
    """Top-1 agreement over the *full* vocabulary: a hot-set drafter whose set lacks the
    target's token scores a miss there (the hot-vocabulary metric would not see it)."""
    hits = [target_hidden.new_zeros(0)]
    for start in range(0, draft_top1.shape[0], FULL_VOCAB_CHUNK):
        best = (target_hidden[start : start + FULL_VOCAB_CHUNK] @ embedding.T).argmax(-1)
        hits.append((draft_top1[start : start + FULL_VOCAB_CHUNK] == best).float())
    return torch.cat(hits)
