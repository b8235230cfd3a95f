"""Training the EAGLE head (``lyanna.drafters.eagle_head``) with a training-time test: the
head is unrolled ``unroll_steps`` times over every position at once, step k feeding on the
features step k-1 predicted, with the attention pattern it will see when drafting.

Position i of step 1 reads ``fc(h_i, embed(t_{i+1}))`` (the target's own hidden state) and
predicts h_{i+1}; that is how every committed token enters the draft KV at inference. Step k
reads the step k-1 prediction made at position i-1 in place of h_i, which is what a depth-(k-1)
draft node does. Such a node attends to committed rows (step-1 keys at positions
<= i-k+1) and to its draft ancestors, one per earlier step (the step-m key at position
i-k+m), so each step's attention runs over the step-1 keys with a shifted causal mask plus
one diagonal band per later step. Every step has the same targets (h_{i+1} and the target's
distribution from it) and the loss is the mean over steps. ``unroll_steps = 1`` is plain
teacher forcing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lyanna.drafters.eagle_head import EagleConfig, EagleHead
from lyanna.model.config import ModelConfig
from training.block_forward import attend, attention_inputs, block_output
from training.config import TrainConfig
from training.losses import FrozenTarget, TrainBatch, composite_loss, target_rows


def shift_right(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [B, ..., T, d] -> y with y[..., i, :] = x[..., i - by, :] (zeros for i < by)."""
    if by == 0:
        return x
    pad = torch.zeros_like(x[..., :by, :])
    return torch.cat([pad, x[..., :-by, :]], dim=-2)


def unrolled_mask(length: int, step: int) -> torch.Tensor:  # [T, step * T] bool
    """Keys of step ``step`` (1-based): step-1 keys at j <= i - step + 1, then one diagonal
    (the shifted ancestor key) per later step."""
    idx = torch.arange(length)
    blocks = [idx[None, :] <= idx[:, None] - (step - 1)]
    blocks += [torch.eye(length, dtype=torch.bool)] * (step - 1)
    return torch.cat(blocks, dim=1)


class EagleTrainModel(nn.Module):
    def __init__(self, head: EagleHead, target: FrozenTarget, config: TrainConfig) -> None:
        super().__init__()
        self.head = head
        self.target = target  # frozen, not a parameter
        self.train_config = config

    @classmethod
    def build(
        cls, target: FrozenTarget, target_config: ModelConfig, config: TrainConfig
    ) -> EagleTrainModel:
        head = EagleHead(EagleConfig.for_target(target_config, target.hot_vocab.numel()))
        head.hot_vocab.copy_(target.hot_vocab)
        return cls(head, target, config)

    def unroll(
        self,
        tokens: torch.Tensor,  # [B, T + 1] int64
        hidden: torch.Tensor,  # [B, T + 1, d] target final hidden states
        num_steps: int,
    ) -> list[torch.Tensor]:  # num_steps x [B, T, d]: step k's prediction of h_{i+1}
        """Predictions of every unrolled step (see the module docstring)."""
        layer = self.head.layer
        embeds = F.embedding(tokens[:, 1:], self.target.embedding)  # [B, T, d]
        T = embeds.shape[1]
        cos = self.head.rope_cos[:T][None, None]  # [1, 1, T, hd]
        sin = self.head.rope_sin[:T][None, None]
        feature = hidden[:, :-1]  # [B, T, d] step 1 reads the target's states
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        predictions = []
        for step in range(1, num_steps + 1):
            x = self.head.fuse(feature, embeds)
            q, k, v = attention_inputs(layer, x, cos, sin)
            keys.append(k)
            values.append(v)
            shifts = [0] + [step - 1 - m for m in range(1, step)]
            key_all = torch.cat([shift_right(t, s) for t, s in zip(keys, shifts, strict=True)], 2)
            val_all = torch.cat([shift_right(t, s) for t, s in zip(values, shifts, strict=True)], 2)
            attended = attend(layer, q, key_all, val_all, unrolled_mask(T, step))
            predictions.append(block_output(layer, x, attended))
            feature = shift_right(predictions[-1], 1)
        return predictions

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        config = self.train_config
        hot_head = self.target.hot_head
        targets = target_rows(batch, hot_head)
        B, T = targets.weight.shape
        positions = torch.arange(T)
        total = torch.zeros(())
        metrics: dict[str, float] = {}
        predictions = self.unroll(batch.tokens, batch.hidden, config.unroll_steps)
        step_weights = config.step_weight_list()
        for step, predicted in enumerate(predictions, start=1):
            valid = (positions >= step - 1)[None, :].expand(B, T)
            step_loss, step_metrics = composite_loss(
                predicted,
                targets,
                valid,
                hot_head,
                config,
                f"step{step}_",
                None if self.training else self.target,  # full-vocabulary top-1: evaluation
            )
            total = total + step_weights[step - 1] * step_loss
            metrics.update(step_metrics)
        loss = total / config.unroll_steps
        metrics["loss"] = float(loss.detach())
        return loss, metrics

    def export(self) -> dict[str, torch.Tensor]:
        """fp16 inference weights of fc + the layer, and the int64 hot vocabulary."""
        return {
            name: (t.detach().half() if t.is_floating_point() else t.detach()).contiguous()
            for name, t in self.head.state_dict().items()
        }

    def load_export(self, state: dict[str, torch.Tensor]) -> None:
        """Start from an exported checkpoint (the inverse of ``export``)."""
        self.head.load_state_dict({k: v.float() if v.is_floating_point() else v
                                   for k, v in state.items()})  # fmt: skip

    def config_dict(self) -> dict:
        return {"kind": "eagle", **self.head.config.as_dict()}
