"""A target ready to serve: the model, its tokenizer and the EOS ids that end a request, one
way for the gateway, the CLI, benchmarks and load tests (the EOS set must agree)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lyanna.model import fetch_default_model, load_model
from lyanna.model.transformer import Transformer
from lyanna.tokenizer import load_tokenizer


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Transformer
    tokenizer: Any
    eos_token_ids: frozenset[int]


def model_path(model: str | Path | None = None) -> Path:
    """An HF directory or a .gguf; None: the default model (fetched once)."""
    return Path(model) if model else fetch_default_model()


def eos_ids(tokenizer: Any, config_eos: int | None) -> frozenset[int]:
    """The tokenizer's EOS and the model config's (``config_eos``) end a request alike."""
    return frozenset({tokenizer.eos_token_id, config_eos} - {None})


def config_eos(model: str | Path) -> int | None:
    """config.json's EOS id (its first, when a list) without loading the weights, for a
    gateway whose services load them; a .gguf's EOS is its tokenizer's."""
    config = Path(model) / "config.json"
    eos = json.loads(config.read_text()).get("eos_token_id") if config.is_file() else None
    return eos[0] if isinstance(eos, list) else eos


def load(
    model: str | Path | None = None,
    weights: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    path = model_path(model)
    tokenizer = load_tokenizer(path)
    model_ = load_model(path, dtype, device, weights=weights)
    return LoadedModel(model_, tokenizer, eos_ids(tokenizer, model_.config.eos_token_id))
