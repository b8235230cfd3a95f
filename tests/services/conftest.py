"""Fixtures for the service tests: a tiny random model exported as an HF directory that the
service subprocesses load, the same weights loaded in this process for the oracles, and
verifier + drafter deployments on it (n-gram; the tiny Lyanna drafter), one per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from lyanna.model import load_model
from lyanna.model.loader import export_hf_dir
from services.launch import free_port, launch
from tests.conftest import make_tiny_model
from tests.services.remote_client import BUDGET_FLAGS, LYANNA_FLAGS, METRICS_PORTS
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


@pytest.fixture(scope="module")
def ngram_services(tiny_model_dir):
    ports = METRICS_PORTS
    ports.update(verifier=free_port(), drafter=free_port())
    with launch(
        tiny_model_dir,
        "ngram",
        verifier_args=["--reflection", "true", "--metrics-port", str(ports["verifier"])],
        drafter_args=[
            *BUDGET_FLAGS,
            "--reflection",
            "true",
            "--metrics-port",
            str(ports["drafter"]),
        ],
    ) as deployment:
        yield deployment
    # SIGTERM drained the services and they exited cleanly
    assert all(c.process.returncode == 0 for c in deployment.children.values())


@pytest.fixture(scope="module")
def lyanna_services(tiny_model_dir):
    with launch(tiny_model_dir, "lyanna", drafter_args=LYANNA_FLAGS) as deployment:
        yield deployment
