"""The registry of trainable draft models and the ``DraftTrainModel`` protocol the training
loop drives. Adding a drafter is one entry in ``MODELS`` plus a class with ``build``,
``loss``, ``export`` and ``config_dict`` (shared pieces live in ``training.losses``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

import torch
from torch import nn

from lyanna.model.config import ModelConfig
from training.config import TrainConfig
from training.eagle import EagleTrainModel
from training.losses import FrozenTarget, TrainBatch
from training.lyanna import LyannaTrainModel
from training.sps import SpsTrainModel


class DraftTrainModel(Protocol):
    """An ``nn.Module`` the loop trains: ``loss`` returns the scalar to minimise and float
    metrics; ``export`` the inference weights (frozen target parts excluded) that
    ``config_dict`` describes."""

    @classmethod
    def build(
        cls, target: FrozenTarget, target_config: ModelConfig, config: TrainConfig
    ) -> nn.Module: ...

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]: ...

    def export(self) -> dict[str, torch.Tensor]: ...

    def load_export(self, state: dict[str, torch.Tensor]) -> None: ...

    def config_dict(self) -> dict: ...


MODELS: Mapping[str, type] = MappingProxyType(
    {
        "eagle": EagleTrainModel,
        "lyanna": LyannaTrainModel,
        "sps": SpsTrainModel,
    }
)


def get_model_class(name: str) -> type:
    if name not in MODELS:
        raise KeyError(f"unknown draft model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name]
