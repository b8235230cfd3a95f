"""Fused, chunked soft cross-entropy over the hot vocabulary: what every drafter's loss
uses instead of materialising ``[rows, num_hot]`` logits for each unrolled step.

For each chunk of rows the forward computes the draft's logits ``z = r @ head.T (+ bias)``,
the target's distribution ``p = softmax(target_hidden @ head.T)`` over the same hot rows, the
weighted cross-entropy ``sum_i w_i * -sum_v p_iv log softmax(z_i)_v`` and, when a gradient is
wanted, the gradient at once (``dz = w * (softmax(z) - p)``, pushed back into the row and
token-info inputs). Only row-sized gradients (``[R, d]``, ``[R, rank]``) and the token-info
weights' gradients are kept for backward, which scales them by the loss's upstream gradient;
no ``[R, num_hot]`` tensor outlives its chunk (the Liger-kernel trick, in plain PyTorch).

The optional token-info bias is Lyanna's ``RMSNorm(W_E[parent] W1 W2)`` over the hot
columns (``lyanna.drafters.lyanna_model``): given ``a = W_E[parent] W1`` ``[R, rank]``, the
factor ``w2`` ``[rank, num_hot]``, the norm's weight ``g`` ``[num_hot]`` and ``keep`` (rows
whose parent has token info), ``bias = keep * g * u / sqrt(mean(u^2) + eps)`` with
``u = a @ w2``. Products run in ``matmul_dtype`` (bf16 under autocast), softmaxes in float32.
``tests/unit/test_hot_ce.py`` checks loss and gradients against a plain full cross-entropy.

CPU cost (issue 41, 2026-11-27): the products are the floor, so every ``[chunk, num_hot]``
pass that is not one costs. The bias is folded into the logit product: ``mean(u^2)`` is
``a G a^T`` with the ``[rank, rank]`` Gram matrix ``G = w2 w2^T / num_hot``, so with
``s = keep / sqrt(a G a^T + eps)`` per row, ``bias = (a * s) @ (w2 * g)`` and one product
``[r | a * s] @ [head | (w2 * g)^T]^T`` gives logits plus bias; its backward is closed form
in row-sized and ``[rank, *]`` terms (see ``forward``), the only ``[chunk, num_hot]`` work being
``dz`` and the products. The cross-entropy is ``-p . log_softmax(z)`` as a batched matmul,
``dz`` is made in place, and chunks are 256 rows: 1,024-row chunks are 32 MB tensors that
glibc serves with fresh ``mmap``s, page-faulted on every use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CHUNK = 256  # rows per chunk: 256 x 8192 float32 = 8 MB of transient logits (see below)


@dataclass(frozen=True, slots=True, eq=False)
class TokenInfo:
    """Lyanna's token-info bias pieces for the rows of one call (see the module docstring)."""

    a: torch.Tensor  # [R, rank] W_E[parent] @ W1 (differentiable)
    w2: torch.Tensor  # [rank, num_hot] (a parameter)
    norm_weight: torch.Tensor  # [num_hot] (a parameter)
    keep: torch.Tensor  # [R] bool: the parent has token info (hot parent, info enabled)
    eps: float


@dataclass(frozen=True, slots=True, eq=False)
class HotCE:
    loss: torch.Tensor  # scalar: sum_i w_i * ce_i (differentiable)
    ce: torch.Tensor  # [R] per-row cross-entropy (no gradient)
    top3: torch.Tensor  # [R, 3] int64 hot indices the draft ranks first
    target_argmax: torch.Tensor  # [R] int64 hot index of the target's most likely token


def _chunks(n: int, chunk: int):
    for start in range(0, n, chunk):
        yield slice(start, min(n, start + chunk))


class _FusedHotCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, a, w2, norm_weight, head, target_hidden, weight, keep, eps, chunk,
                matmul_dtype, want_grad):  # fmt: skip
        R, d = rows.shape
        device = rows.device
        has_info = a is not None
        f32 = torch.float32
        if has_info:
            # The token-info bias folded into the logit product (no [R, num_hot] pass of its
            # own): bias = keep * g * u * inv with u = a @ w2, inv = rsqrt(mean(u^2) + eps)
            # and mean(u^2) = a G a^T, G = w2 w2^T / num_hot; so bias = (a * s) @ (w2 * g)
            # with s = keep * inv per row, and [rows | a * s] @ [head | (w2 * g)^T]^T gives
            # logits and bias in one product.
            num_hot = w2.shape[1]
            w2f, g = w2.float(), norm_weight.float()
            gram = (w2f @ w2f.T) / num_hot  # [rank, rank]
            af = a.float()
            inv = torch.rsqrt(((af @ gram) * af).sum(-1) + eps)  # [R]
            s = inv * keep.to(f32)
            a_scaled = af * s[:, None]  # [R, rank]
            w2g = w2f * g  # [rank, num_hot]
            weights_mm = torch.cat([head.float(), w2g.T], dim=1).to(matmul_dtype)
            inputs = torch.cat([rows.float(), a_scaled], dim=1)
        else:
            weights_mm = head.to(matmul_dtype)
            inputs = rows
        head_mm = weights_mm[:, :d]
        total = torch.zeros((), device=device, dtype=f32)
        ce_all = torch.empty(R, device=device, dtype=f32)
        top3 = torch.empty(R, min(3, head.shape[0]), device=device, dtype=torch.int64)
        target_argmax = torch.empty(R, device=device, dtype=torch.int64)
        d_inputs = torch.empty(inputs.shape, device=device, dtype=f32) if want_grad else None
        m_acc = torch.zeros_like(w2f) if want_grad and has_info else None  # sum (a s)^T dz
        for sl in _chunks(R, chunk):
            w = weight[sl].float()
            z = (inputs[sl].to(matmul_dtype) @ weights_mm.T).float()  # [c, num_hot]
            t_logits = (target_hidden[sl].to(matmul_dtype) @ head_mm.T).float()
            top3[sl] = z.topk(top3.shape[1], dim=-1).indices
            log_q = z.log_softmax(-1)
            target_argmax[sl] = t_logits.argmax(-1)
            p = t_logits.softmax(-1)
            del t_logits
            del z
            # ce = -p . log_q, the row-wise dot product as a batched matmul (no [c, V] product)
            ce = -torch.bmm(p[:, None, :], log_q[:, :, None]).view(-1)
            ce_all[sl] = ce
            total += (w * ce).sum()
            if want_grad:
                dz = log_q.exp_().sub_(p)  # softmax(z) - p, in place; [c, V]
                del p
                dz_mm = dz.to(matmul_dtype)
                d_inputs[sl] = (dz_mm @ weights_mm).float() * w[:, None]
                if has_info:
                    m_acc += (a_scaled[sl] * w[:, None]).to(matmul_dtype).T.matmul(dz_mm).float()
        d_rows = d_a = d_w2 = d_g = None
        if want_grad:
            d_rows = d_inputs[:, :d]
            if has_info:
                # Back through the folding (see the module docstring): with D = d(a s) the
                # gradient reaching a * s, and c_r = s_r / V * (D_r . a_r):
                # d_a = s D - inv^2 c V (a G); d_w2 = g * M - (sum_r inv_r^2 c_r a_r a_r^T)
                # @ w2; d_g = sum_k w2 * M; M = sum_r (a s)_r^T dz_r.
                big_d = d_inputs[:, d:]  # [R, rank]
                c = s / num_hot * (big_d * af).sum(-1)
                coef = inv.pow(2) * c  # [R]
                d_a = s[:, None] * big_d - (coef * num_hot)[:, None] * (af @ gram)
                d_w2 = m_acc * g - ((af * coef[:, None]).T @ af) @ w2f
                d_g = (w2f * m_acc).sum(0)
        ctx.save_for_backward(d_rows, d_a, d_w2, d_g)
        ctx.dtypes = (rows.dtype, a.dtype if has_info else None, w2.dtype if has_info else None,
                      norm_weight.dtype if has_info else None)  # fmt: skip
        ctx.mark_non_differentiable(ce_all, top3, target_argmax)
        return total, ce_all, top3, target_argmax

    @staticmethod
    def backward(ctx, grad_total, *_):
        d_rows, d_a, d_w2, d_g = ctx.saved_tensors
        if d_rows is None:
            raise RuntimeError("fused_hot_ce was called without a gradient to keep")
        out = []
        for grad, dtype in zip((d_rows, d_a, d_w2, d_g), ctx.dtypes, strict=True):
            out.append(None if grad is None else (grad * grad_total).to(dtype))
        return (*out, None, None, None, None, None, None, None, None)


def fused_hot_ce(
    rows: torch.Tensor,  # [R, d] draft hidden states
    head: torch.Tensor,  # [num_hot, d] frozen hot LM-head rows
    target_hidden: torch.Tensor,  # [R, d] the target's states whose distribution is the label
    weight: torch.Tensor,  # [R] per-row loss weight
    info: TokenInfo | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> HotCE:
    """``sum_i weight_i * CE(softmax(target_i @ head.T), softmax(rows_i @ head.T + bias_i))``
    over the hot vocabulary, in chunks of ``chunk`` rows (see the module docstring)."""
    device_type = rows.device.type
    autocast = torch.is_autocast_enabled(device_type)
    matmul_dtype = torch.get_autocast_dtype(device_type) if autocast else torch.float32
    tensors = [rows] + ([info.a, info.w2, info.norm_weight] if info is not None else [])
    want_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    with torch.autocast(device_type, enabled=False):
        total, ce, top3, target_argmax = _FusedHotCE.apply(
            rows,
            info.a if info is not None else None,
            info.w2 if info is not None else None,
            info.norm_weight if info is not None else None,
            head.detach(),
            target_hidden.detach(),
            weight.detach(),
            info.keep if info is not None else None,
            info.eps if info is not None else 0.0,
            chunk,
            matmul_dtype,
            want_grad,
        )
    return HotCE(total, ce, top3, target_argmax)
