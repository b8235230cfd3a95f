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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CHUNK = 1024  # rows per chunk: 1024 x 8192 float32 = 32 MB of transient logits


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
        R = rows.shape[0]
        device = rows.device
        head_mm = head.to(matmul_dtype)
        has_info = a is not None
        w2_mm = w2.to(matmul_dtype) if has_info else None
        g = norm_weight.float() if has_info else None
        total = torch.zeros((), device=device, dtype=torch.float32)
        ce_all = torch.empty(R, device=device, dtype=torch.float32)
        top3 = torch.empty(R, min(3, head.shape[0]), device=device, dtype=torch.int64)
        target_argmax = torch.empty(R, device=device, dtype=torch.int64)
        d_rows = torch.zeros_like(rows, dtype=torch.float32) if want_grad else None
        d_a = torch.zeros_like(a, dtype=torch.float32) if want_grad and has_info else None
        d_w2 = torch.zeros_like(w2, dtype=torch.float32) if want_grad and has_info else None
        d_g = torch.zeros_like(norm_weight, dtype=torch.float32) if want_grad and has_info else None
        for s in _chunks(R, chunk):
            z = (rows[s].to(matmul_dtype) @ head_mm.T).float()
            if has_info:
                u = (a[s].to(matmul_dtype) @ w2_mm).float()
                inv = torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
                normed = u * inv
                k = keep[s].to(torch.float32)[:, None]
                z = z + normed * g * k
            log_q = z.log_softmax(-1)
            t_logits = (target_hidden[s].to(matmul_dtype) @ head_mm.T).float()
            p = t_logits.softmax(-1)
            ce = -(p * log_q).sum(-1)
            ce_all[s] = ce
            total += (weight[s].float() * ce).sum()
            top3[s] = z.topk(top3.shape[1], dim=-1).indices
            target_argmax[s] = t_logits.argmax(-1)
            if want_grad:
                dz = (log_q.exp() - p) * weight[s].float()[:, None]  # [c, num_hot]
                d_rows[s] = (dz.to(matmul_dtype) @ head_mm).float()
                if has_info:
                    d_bias = dz * k
                    d_g += (d_bias * normed).sum(0)
                    d_normed = d_bias * g
                    du = inv * (d_normed - normed * (d_normed * normed).mean(-1, keepdim=True))
                    du_mm = du.to(matmul_dtype)
                    d_w2 += (a[s].to(matmul_dtype).T @ du_mm).float()
                    d_a[s] = (du_mm @ w2_mm.T).float()
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
