"""Distilling the SPS student (``lyanna.drafters.sps``): the target's first ``student_layers``
decoder layers and final norm, fine-tuned with teacher forcing so that the student's output at
token t_{i+1} matches the target's state h_{i+1} (regression) and the target's next-token
distribution over the hot vocabulary (cross-entropy). The embedding stays the target's, frozen.
"""

from __future__ import annotations

import torch
from torch import nn

from lyanna.drafters.sps import SpsConfig
from lyanna.model.config import ModelConfig
from lyanna.model.loader import build_model
from lyanna.model.transformer import Block, RMSNorm, rope_tables
from training.block_forward import causal_block
from training.config import TrainConfig
from training.losses import (
    FrozenTarget,
    TrainBatch,
    composite_loss,
    default_target_state,
    target_rows,
)


class SpsTrainModel(nn.Module):
    def __init__(
        self, target_config: ModelConfig, target: FrozenTarget, config: TrainConfig
    ) -> None:
        super().__init__()
        num_layers = config.student_layers
        self.student_config = ModelConfig(**{**target_config.as_dict(), "num_layers": num_layers})
        self.layers = nn.ModuleList(Block(self.student_config) for _ in range(num_layers))
        self.norm = RMSNorm(target_config.hidden_size, target_config.rms_norm_eps)
        self.target = target  # frozen, not a parameter
        self.train_config = config
        cos, sin = rope_tables(self.student_config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def build(
        cls, target: FrozenTarget, target_config: ModelConfig, config: TrainConfig
    ) -> SpsTrainModel:
        model = cls(target_config, target, config)
        state = default_target_state(target_config)
        if state is not None:
            model.init_from_target(state)
        return model

    def init_from_target(self, target_state: dict[str, torch.Tensor]) -> None:
        """Start from the target's first layers and its final norm."""
        donor = build_model(self.student_config, target_state, prepack=False)
        self.layers.load_state_dict(donor.layers.state_dict())
        self.norm.load_state_dict(donor.norm.state_dict())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [B, T] -> [B, T, d]
        """Student outputs (post-norm) at every token (positions from 0, as at inference)."""
        T = tokens.shape[1]
        cos = self.rope_cos[:T][None, None]
        sin = self.rope_sin[:T][None, None]
        x = nn.functional.embedding(tokens, self.target.embedding)
        for block in self.layers:
            x = causal_block(block, x, cos, sin)
        return self.norm(x)

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        targets = target_rows(batch, self.target.hot_head)
        predicted = self(batch.tokens)[:, 1:]  # output at t_{i+1} ~ h_{i+1}
        valid = torch.ones_like(targets.answer)
        loss, metrics = composite_loss(
            predicted,
            targets,
            valid,
            self.target.hot_head,
            self.train_config,
            prefix="step1_",
            target=None if self.training else self.target,  # full vocabulary: evaluation
        )
        metrics["loss"] = float(loss.detach())
        return loss, metrics

    def export(self) -> dict[str, torch.Tensor]:
        """fp16 layers + norm under the lean model's names, and the int64 hot vocabulary."""
        state = {f"layers.{k}": v for k, v in self.layers.state_dict().items()}
        state["norm.weight"] = self.norm.weight
        state = {k: v.detach().half().contiguous() for k, v in state.items()}
        state["hot_vocab"] = self.target.hot_vocab.clone()
        return state

    def load_export(self, state: dict[str, torch.Tensor]) -> None:
        """Start from an exported checkpoint (the inverse of ``export``)."""
        layers = {
            k[len("layers.") :]: v.float() for k, v in state.items() if k.startswith("layers.")
        }
        self.layers.load_state_dict(layers)
        self.norm.weight.data.copy_(state["norm.weight"].float())

    def config_dict(self) -> dict:
        return SpsConfig(len(self.layers), self.target.hot_vocab.numel()).as_dict()
