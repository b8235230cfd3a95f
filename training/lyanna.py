"""Training the Lyanna draft model (``lyanna.drafters.lyanna_model``) with the shared loop:
every anchor of a sequence at once, the chain unrolled ``unroll_steps`` times on its own
outputs (no token enters the chain), loss ``alpha * MSE(h, H) + beta * CE(softmax(l'),
softmax(L))`` per step with teacher-forced parent tokens for the token-info bias.
The draft layer starts from the target's last decoder layer.
"""

from __future__ import annotations

import torch
from torch import nn

from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel, draft_loss
from lyanna.model.config import ModelConfig
from training.config import TrainConfig
from training.losses import FrozenTarget, TrainBatch, default_target_state


class LyannaTrainModel(nn.Module):
    def __init__(self, draft: LyannaDraftModel, config: TrainConfig) -> None:
        super().__init__()
        self.draft = draft
        self.train_config = config

    @classmethod
    def build(
        cls, target: FrozenTarget, target_config: ModelConfig, config: TrainConfig
    ) -> LyannaTrainModel:
        draft_config = LyannaDraftConfig(
            target_config,
            num_hot=target.hot_vocab.numel(),
            chain_steps=config.unroll_steps,
            use_token_info=config.token_info,
            fuse_first_token=config.fuse_first_token,
        )
        model = cls(LyannaDraftModel(draft_config, target.embedding, target.hot_vocab), config)
        state = default_target_state(target_config)
        if state is not None:
            model.init_from_target(state)
        return model

    def init_from_target(self, target_state: dict[str, torch.Tensor]) -> None:
        """Copy the target's last decoder layer into the draft layer (a warm start)."""
        from lyanna.model.loader import build_model

        config = self.draft.config.target
        last = config.num_layers - 1
        prefix = f"model.layers.{last}."
        layer_state = {k: v for k, v in target_state.items() if k.startswith(prefix)}
        one_layer = ModelConfig(**{**config.as_dict(), "num_layers": 1})
        renamed = {k.replace(prefix, "model.layers.0."): v for k, v in layer_state.items()}
        shared = {k: target_state[k] for k in ("model.embed_tokens.weight", "model.norm.weight")}
        donor = build_model(one_layer, {**renamed, **shared}, prepack=False)
        self.draft.layer.load_state_dict(donor.layers[0].state_dict())
        self.draft.out_norm.weight.data.copy_(target_state["model.norm.weight"])

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return draft_loss(
            self.draft,
            batch.hidden,
            batch.tokens,
            batch.weight,
            alpha=self.train_config.regression_weight,
            beta=self.train_config.ce_weight,
            steps=self.train_config.unroll_steps,
        )

    def export(self) -> dict[str, torch.Tensor]:
        state = self.draft.state_dict()
        return {
            k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in state.items()
        }

    def load_export(self, state: dict[str, torch.Tensor]) -> None:
        """Start from an exported checkpoint (the inverse of ``export``)."""
        self.draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                                    for k, v in state.items()})  # fmt: skip

    def config_dict(self) -> dict:
        return self.draft.config.to_dict()
