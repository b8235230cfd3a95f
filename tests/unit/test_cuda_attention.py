"""``cuda_attention`` (the GPU path: grouped heads expanded, cuDNN left out) computes attention
over grouped key/value heads with a boolean mask or a causal one, checked against a
per-head loop written out here. It runs on the CPU too, which is what CI checks; the H100
run that motivated it is in docs/benchmarks.md."""

from __future__ import annotations

import math

import pytest
import torch

from lyanna.model.transformer import cuda_attention


def reference(q, k, v, mask):
    """Per batch row and query head: softmax(q k^T / sqrt(d) over allowed keys) v, where
    query head h reads key/value head h // (heads / kv_heads)."""
    B, heads, nq, hd = q.shape
    group = heads // k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(heads):
            scores = q[b, h] @ k[b, h // group].T / math.sqrt(hd)
            if mask is not None:
                scores = scores.masked_fill(~mask[b, 0], float("-inf"))
            out[b, h] = torch.softmax(scores, dim=-1) @ v[b, h // group]
    return out


@pytest.mark.parametrize("kv_heads", [1, 3, 9])
def test_grouped_heads_with_a_tree_mask(kv_heads) -> None:
    gen = torch.Generator().manual_seed(kv_heads)
    B, heads, nq, kv, hd = 2, 9, 5, 12, 16
    q = torch.randn(B, heads, nq, hd, generator=gen)
    k = torch.randn(B, kv_heads, kv, hd, generator=gen)
    v = torch.randn(B, kv_heads, kv, hd, generator=gen)
    mask = torch.rand(B, 1, nq, kv, generator=gen) < 0.6
    mask[..., 0] = True  # every query sees at least the first committed row
    got = cuda_attention(q, k, v, mask, is_causal=False)
    torch.testing.assert_close(got, reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_causal_prefill() -> None:
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 9, 6, 16, generator=gen)
    k, v = torch.randn(2, 1, 3, 6, 16, generator=gen)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    got = cuda_attention(q, k, v, None, is_causal=True)
    torch.testing.assert_close(got, reference(q, k, v, causal), rtol=1e-5, atol=1e-5)
