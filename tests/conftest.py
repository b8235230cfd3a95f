"""Shared fixtures: a tiny random-weight model for fast tests, the real default model for
tests marked ``slow`` (run in CI; skip locally with ``-m 'not slow'``)."""

from __future__ import annotations

import pytest
import torch

from lyanna.model import ModelConfig, Transformer
from lyanna.model.cpu_kernels import prepack_linears


def make_tiny_model(seed: int = 0, vocab_size: int = 64, prepack: bool = False) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.tiny(vocab_size)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    if prepack:
        prepack_linears(model)
    return model


def prompt_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:  # [len, vocab]
    """Logits of every position of one prompt ``ids`` [1, len], run on a fresh cache."""
    cache = model.new_cache(1, ids.shape[1] + 1)
    slot = torch.tensor([cache.allocate()])
    return model.logits(model(ids, torch.arange(ids.shape[1])[None], cache, slot))[0]


@pytest.fixture(scope="session")
def tiny_model() -> Transformer:
    return make_tiny_model()


@pytest.fixture(scope="session")
def default_model_dir():
    from lyanna.model import fetch_default_model

    return fetch_default_model()


@pytest.fixture(scope="session")
def default_model(default_model_dir) -> Transformer:
    from lyanna.model import load_model

    return load_model(default_model_dir)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from lyanna.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)
