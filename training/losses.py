"""What every trainable draft model shares: the frozen target pieces (embedding, hot-vocabulary
LM head), the padded ``TrainBatch`` and the composite EAGLE loss of one unrolled step:
``regression_weight`` x smooth-L1 between the predicted and the target's next hidden state +
``ce_weight`` x cross-entropy of the draft's hot-vocabulary distribution against the target's
(softmax of the target's logits from the dumped hidden state through the frozen LM head,
restricted to the hot vocabulary), with top-1/top-3 agreement metrics on answer positions.
The cross-entropy is chunked and fused (``training.hot_ce``): no ``[positions, num_hot]``
logits are kept for backward at any unrolled step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lyanna.drafters.heads import full_vocab_hits
from lyanna.model import default_model_dir, read_hf_dir
from lyanna.model.config import ModelConfig
from training.config import TrainConfig
from training.hot_ce import fused_hot_ce


@dataclass(frozen=True, slots=True, eq=False)
class FrozenTarget:
    """The target pieces a drafter shares and never trains."""

    embedding: torch.Tensor  # [vocab, d] float32 (tied: also the LM head)
    hot_vocab: torch.Tensor  # [num_hot] int64 token id of each hot LM-head row
    hot_head: torch.Tensor  # [num_hot, d] float32 LM-head rows of the hot tokens

    @classmethod
    def from_embedding(cls, embedding: torch.Tensor, hot_vocab: torch.Tensor) -> FrozenTarget:
        embedding = embedding.detach().float()
        return cls(embedding, hot_vocab, embedding[hot_vocab].contiguous())

    def to(self, device: torch.device) -> FrozenTarget:
        return FrozenTarget(self.embedding.to(device), self.hot_vocab.to(device),
                            self.hot_head.to(device))  # fmt: skip


def default_target_state(target_config: ModelConfig) -> dict[str, torch.Tensor] | None:
    """The default model's HF state dict when it is the target being trained against (drafters
    warm-start from its layers), else None (e.g. tiny test targets)."""
    default_dir = default_model_dir()
    if not (default_dir / "config.json").is_file():
        return None
    default_config, state = read_hf_dir(default_dir)
    return state if default_config == target_config else None


@dataclass(frozen=True, slots=True, eq=False)
class TrainBatch:
    """Right-padded sequences of one shard format (``training.data``)."""

    tokens: torch.Tensor  # [B, T] int64
    hidden: torch.Tensor  # [B, T, d] float32 target final hidden state at each token
    weight: torch.Tensor  # [B, T] float32 loss weight of each position (0 = padding)
    answer: torch.Tensor  # [B, T] bool answer positions (accuracy metrics)

    def to(self, device: torch.device) -> TrainBatch:
        if self.tokens.device == device:
            return self
        return TrainBatch(*(t.to(device, non_blocking=True) for t in
                            (self.tokens, self.hidden, self.weight, self.answer)))  # fmt: skip


@dataclass(frozen=True, slots=True, eq=False)
class TargetRows:
    """Per-position targets shared by every unrolled step (the target's hot-vocabulary
    distribution is computed from ``hidden`` chunk by chunk, inside the loss)."""

    hidden: torch.Tensor  # [B, T-1, d] next hidden state h_{i+1}
    weight: torch.Tensor  # [B, T-1] loss weight
    answer: torch.Tensor  # [B, T-1] bool


def target_rows(batch: TrainBatch, hot_head: torch.Tensor | None = None) -> TargetRows:
    """Targets of position i: the state h_{i+1} (whose distribution through ``hot_head`` the
    loss computes)."""
    return TargetRows(
        hidden=batch.hidden[:, 1:], weight=batch.weight[:, 1:], answer=batch.answer[:, 1:]
    )


def composite_loss(
    predicted: torch.Tensor,  # [B, T-1, d] predicted next hidden states
    targets: TargetRows,
    valid: torch.Tensor,  # [B, T-1] bool positions this step trains on
    hot_head: torch.Tensor,  # [num_hot, d]
    config: TrainConfig,
    prefix: str,
    target: FrozenTarget | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's regression + distribution loss of one unrolled step, with accuracy metrics
    (the full-vocabulary top-1 too when ``target`` is given: evaluation only, it costs a
    full LM-head product per row)."""
    weight = targets.weight * valid
    denom = weight.sum().clamp(min=1e-6)
    regression = F.smooth_l1_loss(predicted, targets.hidden, reduction="none").mean(-1)
    rows = weight > 0  # the cross-entropy of zero-weight rows (padding) is never computed
    out = fused_hot_ce(predicted[rows], hot_head, targets.hidden[rows], weight[rows])
    ce_sum = out.loss
    loss = config.regression_weight * (regression * weight).sum() + config.ce_weight * ce_sum
    loss = loss / denom
    with torch.no_grad():
        answer = (targets.answer & valid)[rows].float()
        n = answer.sum().clamp(min=1.0)
        hit1 = (out.top3[:, 0] == out.target_argmax).float()
        hit3 = (out.top3 == out.target_argmax[:, None]).any(-1).float()
        metrics = {
            f"{prefix}reg": float((regression * weight).sum() / denom),
            f"{prefix}ce": float(ce_sum.detach() / denom),
            f"{prefix}top1": float((hit1 * answer).sum() / n),
            f"{prefix}top3": float((hit3 * answer).sum() / n),
        }
        if target is not None:
            keep = answer.bool()
            full = full_vocab_hits(
                target.hot_vocab[out.top3[:, 0][keep]], targets.hidden[rows][keep],
                target.embedding,
            )  # fmt: skip
            metrics[f"{prefix}top1_full"] = float(full.mean()) if full.numel() else 0.0
    return loss, metrics
