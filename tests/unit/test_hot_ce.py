"""The fused, chunked hot-vocabulary cross-entropy (``training.hot_ce``) against a plain full
cross-entropy written out here: loss, every gradient, the metrics' indices, and the drafters'
losses that use it against the unchunked formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import make_tiny_model
from training.hot_ce import TokenInfo, fused_hot_ce


def _case(seed: int = 0, R: int = 37, d: int = 16, H: int = 50, rank: int = 8):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(R, d, generator=gen, requires_grad=True)
    head = torch.randn(H, d, generator=gen)
    target = torch.randn(R, d, generator=gen)
    weight = torch.rand(R, generator=gen) + 0.25
    a = torch.randn(R, rank, generator=gen, requires_grad=True)
    w2 = torch.randn(rank, H, generator=gen, requires_grad=True)
    g = (torch.rand(H, generator=gen) + 0.5).requires_grad_()
    keep = torch.rand(R, generator=gen) > 0.3
    return rows, head, target, weight, a, w2, g, keep


def _plain(rows, head, target, weight, a=None, w2=None, g=None, keep=None, eps=1e-5):
    """The full cross-entropy, every logit materialised (the reference)."""
    z = rows @ head.T
    if a is not None:
        z = z + F.rms_norm(a @ w2, (w2.shape[1],), g, eps) * keep[:, None].float()
    p = (target @ head.T).softmax(-1)
    return (weight * -(p * z.log_softmax(-1)).sum(-1)).sum(), z, target @ head.T


@pytest.mark.parametrize("chunk", [1, 8, 1000])
@pytest.mark.parametrize("with_info", [False, True])
def test_fused_ce_equals_the_plain_full_cross_entropy(chunk: int, with_info: bool) -> None:
    rows, head, target, weight, a, w2, g, keep = _case()
    info = TokenInfo(a, w2, g, keep, 1e-5) if with_info else None
    out = fused_hot_ce(rows, head, target, weight, info, chunk=chunk)
    (3.0 * out.loss).backward()  # an upstream gradient other than 1 scales every gradient
    got = [rows.grad] + ([a.grad, w2.grad, g.grad] if with_info else [])
    for t in (rows, a, w2, g):
        t.grad = None
    ref, z, t_logits = _plain(rows, head, target, weight, *((a, w2, g, keep) if with_info else ()))
    (3.0 * ref).backward()
    expected = [rows.grad] + ([a.grad, w2.grad, g.grad] if with_info else [])
    torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    assert out.top3.tolist() == z.detach().topk(3, dim=-1).indices.tolist()
    assert out.target_argmax.tolist() == t_logits.argmax(-1).tolist()
    p = t_logits.softmax(-1)
    torch.testing.assert_close(out.ce, -(p * z.detach().log_softmax(-1)).sum(-1))


def test_token_info_changes_the_loss_only_where_kept() -> None:
    rows, head, target, weight, a, w2, g, keep = _case(1)
    none_kept = TokenInfo(a, w2, g, torch.zeros_like(keep), 1e-5)
    with torch.no_grad():
        plain = fused_hot_ce(rows, head, target, weight).ce
        off = fused_hot_ce(rows, head, target, weight, none_kept).ce
        on = fused_hot_ce(rows, head, target, weight, TokenInfo(a, w2, g, keep, 1e-5)).ce
    torch.testing.assert_close(off, plain)
    assert bool((on[keep] != plain[keep]).all())
    torch.testing.assert_close(on[~keep], plain[~keep])


def test_without_a_gradient_nothing_is_kept_and_backward_refuses() -> None:
    rows, head, target, weight, *_ = _case(2)
    with torch.no_grad():
        out = fused_hot_ce(rows, head, target, weight)
    assert not out.loss.requires_grad
    ref, _, _ = _plain(rows.detach(), head, target, weight)
    torch.testing.assert_close(out.loss, ref)


@pytest.mark.parametrize(
    ("info_gate", "info_space", "step_weights"),
    [(False, "logits", None), (True, "logits", [0.5, 1.0, 1.5]), (True, "state", None)],
    ids=["table-bias", "state-gated-bias-step-weights", "gated-state-correction"],
)
def test_lyanna_draft_loss_matches_the_unchunked_formula(
    info_gate: bool, info_space: str, step_weights: list[float] | None
) -> None:
    """``training.lyanna.draft_loss`` (fused) against the loss written out with the model's own
    ``token_info`` rows and a plain softmax cross-entropy: same value, same gradients (with
    ``info_gate``, the gate's gradient too: it reaches the fused product through ``a``). With
    ``info_space="state"`` the correction ``D = ((W_E[t] W1) * (1 + G h)) U`` is written out
    here by hand and both the MSE and the cross-entropy read ``h + D``. ``step_weights``
    multiply each step's loss."""
    from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
    from training.lyanna import draft_loss

    target = make_tiny_model(3, vocab_size=40)
    torch.manual_seed(0)
    hot = torch.randperm(40)[:24]
    draft = LyannaDraftModel(LyannaDraftConfig(target.config, num_hot=24, info_rank=8,
                                               chain_steps=3, info_gate=info_gate,
                                               info_space=info_space),
                             target.embed_tokens.weight, hot)  # fmt: skip
    state = info_space == "state"
    with torch.no_grad():
        (draft.info_up if state else draft.w2).normal_()
        if info_gate:
            draft.info_gate.weight.normal_(std=0.3)
    hidden = torch.randn(2, 11, target.config.hidden_size)
    tokens = torch.randint(0, 40, (2, 11))
    mask = torch.rand(2, 11) > 0.3
    loss, metrics = draft_loss(draft, hidden, tokens, mask, alpha=0.5, beta=0.7, steps=3,
                               step_weights=step_weights)  # fmt: skip
    loss.backward()
    fused_grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()

    total = torch.zeros(())
    head = draft.embedding[draft.hot_ids]
    weight = mask.float()
    for i, y in enumerate(draft.unrolled(hidden, tokens, 3), start=1):
        valid = 11 - 1 - i
        pred, target_h = y[:, :valid], hidden[:, i : i + valid]
        w = weight[:, i + 1 : i + 1 + valid]
        if state:
            step_parents = tokens[:, i : i + valid]
            a = target.embed_tokens.weight[step_parents] @ draft.w1
            a = a * (1 + pred @ draft.info_gate.weight.T)
            hot_parent = torch.isin(step_parents, hot).unsqueeze(-1)
            pred = pred + torch.where(hot_parent, a @ draft.info_up, 0.0)
        mse = ((pred - target_h).pow(2).mean(-1) * w).sum() / w.sum().clamp_min(1.0)
        answer = w >= 1.0
        parents = tokens[:, i : i + valid][answer]
        logits = pred[answer] @ head.T
        if not state:
            logits = logits + draft.token_info(parents, pred[answer])
        p = (target_h[answer] @ head.T).softmax(-1)
        ce = -(p * logits.log_softmax(-1)).sum(-1).mean()
        total = total + (step_weights[i - 1] if step_weights else 1.0) * (0.5 * mse + 0.7 * ce)
        assert metrics[f"ce{i}"] == pytest.approx(float(ce.detach()), rel=1e-5)
        top1 = (logits.argmax(-1) == p.argmax(-1)).float().mean()
        assert metrics[f"top1_{i}"] == pytest.approx(float(top1))
    (total / 3).backward()
    torch.testing.assert_close(loss.detach(), (total / 3).detach())
    assert ("info_gate.weight" in fused_grads) == info_gate
    for name, param in draft.named_parameters():
        torch.testing.assert_close(fused_grads[name], param.grad, rtol=1e-4, atol=1e-6)


def test_eagle_composite_loss_matches_the_unchunked_formula() -> None:
    from training.config import TrainConfig
    from training.losses import FrozenTarget, TrainBatch, composite_loss, target_rows

    torch.manual_seed(1)
    d, H = 12, 20
    embedding = torch.randn(30, d)
    target = FrozenTarget.from_embedding(embedding, torch.randperm(30)[:H])
    hidden = torch.randn(2, 9, d)
    weight = torch.tensor([[1.0] * 9, [0.25] * 3 + [1.0] * 4 + [0.0] * 2])
    batch = TrainBatch(torch.zeros(2, 9, dtype=torch.int64), hidden, weight, weight >= 1.0)
    predicted = torch.randn(2, 8, d, requires_grad=True)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[:, 0] = False
    config = TrainConfig(regression_weight=0.3, ce_weight=0.2)
    targets = target_rows(batch, target.hot_head)
    loss, metrics = composite_loss(predicted, targets, valid, target.hot_head, config, "s_")
    (grad,) = torch.autograd.grad(loss, predicted)

    w = weight[:, 1:] * valid
    reg = F.smooth_l1_loss(predicted, hidden[:, 1:], reduction="none").mean(-1)
    p = (hidden[:, 1:] @ target.hot_head.T).softmax(-1)
    ce = -(p * (predicted @ target.hot_head.T).log_softmax(-1)).sum(-1)
    ref = ((0.3 * reg + 0.2 * ce) * w).sum() / w.sum()
    (ref_grad,) = torch.autograd.grad(ref, predicted)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert metrics["s_ce"] == pytest.approx(float((ce * w).sum() / w.sum()), rel=1e-5)


def test_bf16_autocast_stays_close_to_the_fp32_reference() -> None:
    """The folded token-info product under bf16 autocast (the training default on a CPU):
    loss and gradients within bf16 rounding of the fp32 reference."""
    rows, head, target, weight, a, w2, g, keep = _case(3, R=64, d=32, H=96, rank=16)
    with torch.autocast("cpu", torch.bfloat16):
        out = fused_hot_ce(rows, head, target, weight, TokenInfo(a, w2, g, keep, 1e-5), chunk=16)
    out.loss.backward()
    got = [t.grad.clone() for t in (rows, a, w2, g)]
    for t in (rows, a, w2, g):
        t.grad = None
    ref, _, _ = _plain(rows, head, target, weight, a, w2, g, keep)
    ref.backward()
    torch.testing.assert_close(out.loss, ref.detach(), rtol=2e-2, atol=1e-2)
    for mine, t in zip(got, (rows, a, w2, g), strict=True):
        scale = t.grad.abs().max()
        assert float((mine - t.grad).abs().max()) <= 0.05 * float(scale)


def test_lyanna_regression_loss_options() -> None:
    """``regression="smooth_l1"`` swaps only the regression term; ``feature_noise`` 0 is a
    no-op (both are issue-41 ablations of ``training.lyanna.draft_loss``)."""
    from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
    from training.lyanna import draft_loss

    target = make_tiny_model(3, vocab_size=40)
    torch.manual_seed(0)
    draft = LyannaDraftModel(LyannaDraftConfig(target.config, num_hot=24, info_rank=8,
                                               chain_steps=2),
                             target.embed_tokens.weight, torch.randperm(40)[:24])  # fmt: skip
    hidden = 3.0 * torch.randn(2, 9, target.config.hidden_size)
    tokens = torch.randint(0, 40, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    with torch.no_grad():
        mse, _ = draft_loss(draft, hidden, tokens, mask, alpha=1.0, beta=0.0, steps=2)
        sl1, _ = draft_loss(draft, hidden, tokens, mask, alpha=1.0, beta=0.0, steps=2,
                            regression="smooth_l1")  # fmt: skip
        same, _ = draft_loss(draft, hidden, tokens, mask, alpha=1.0, beta=0.0, steps=2,
                             feature_noise=0.0)  # fmt: skip
        outputs = draft.unrolled(hidden, tokens, 2)
    expected = (
        sum(
            F.smooth_l1_loss(y[:, : 9 - 1 - i], hidden[:, i : 9 - 1], reduction="mean")
            for i, y in enumerate(outputs, start=1)
        )
        / 2
    )
    torch.testing.assert_close(sl1, expected)
    assert float(sl1) < float(mse)
    torch.testing.assert_close(same, mse)
