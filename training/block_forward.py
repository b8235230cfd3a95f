"""Cache-free forwards of one ``lyanna.model.transformer.Block`` for training: the inference
block reads and writes a KV cache, training runs whole sequences with an explicit mask. The
arithmetic is the block's own (same modules, same rotary layout), split at the attention so
callers can assemble unusual key sets (EAGLE's unrolled training-time test).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lyanna.model.transformer import Block, apply_rope


def attention_inputs(
    block: Block,
    x: torch.Tensor,  # [B, T, d] the block's input
    cos: torch.Tensor,  # [1, 1, T, hd]
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, heads, T, hd], k and v [B, kv_heads, T, hd] (rotary applied to q and k)."""
    attn = block.attention
    B, T, _ = x.shape
    hd, n_q, n_kv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    qkv = attn.wqkv(block.attention_norm(x))
    q = qkv[..., : n_q * hd].view(B, T, n_q, hd).transpose(1, 2)
    k = qkv[..., n_q * hd : (n_q + n_kv) * hd].view(B, T, n_kv, hd).transpose(1, 2)
    v = qkv[..., (n_q + n_kv) * hd :].view(B, T, n_kv, hd).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attend(
    block: Block,
    q: torch.Tensor,  # [B, heads, T, hd]
    keys: torch.Tensor,  # [B, kv_heads, S, hd]
    values: torch.Tensor,  # [B, kv_heads, S, hd]
    mask: torch.Tensor | None,  # [T, S] bool; None = causal (S == T)
) -> torch.Tensor:  # [B, heads, T, hd]
    group = block.attention.num_heads // block.attention.num_kv_heads
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None)


def block_output(
    block: Block,
    x: torch.Tensor,  # [B, T, d] the block's input
    attended: torch.Tensor,  # [B, heads, T, hd]
) -> torch.Tensor:  # [B, T, d]
    """Residual + output projection + MLP."""
    B, T, _ = x.shape
    x = x + block.attention.wo(attended.transpose(1, 2).reshape(B, T, -1))
    return x + block.feed_forward(block.ffn_norm(x))


def causal_block(
    block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:  # [B, T, d]
    """Plain causal self-attention block over whole sequences (teacher forcing)."""
    q, k, v = attention_inputs(block, x, cos, sin)
    return block_output(block, x, attend(block, q, k, v, None))
