"""Fixtures for the service tests: a tiny random model exported as an HF directory that the
service subprocesses load, and the same weights loaded in this process for the oracles."""

from __future__ import annotations

from pathlib import Path

import pytest

from lyanna.model import load_model
from lyanna.model.loader import export_hf_dir
from tests.conftest import make_tiny_model
from tests.unit.test_loader import hf_state_of

TINY_SEED, TINY_VOCAB = 2, 16  # small vocabulary: repetitive output, n-gram hits


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    model = make_tiny_model(TINY_SEED, vocab_size=TINY_VOCAB)
    out = tmp_path_factory.mktemp("tiny-hf") / "model"
    export_hf_dir(model.config, hf_state_of(model), out)
    return out


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """The exported model as the services load it."""
    return load_model(tiny_model_dir)
