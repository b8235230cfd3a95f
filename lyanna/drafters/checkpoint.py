"""Reading a committed drafter checkpoint directory: ``config.json``, ``model.safetensors``
(fp16 weights, int64 index tensors) and ``manifest.json`` whose sha256 of the weights is
checked before anything is loaded. safetensors only: nothing is ever unpickled.

The committed checkpoints live in the repository's ``checkpoints/``; an installed package
(a container image, a wheel) finds them where ``LYANNA_CHECKPOINTS`` points instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from lyanna.model.default import sha256_of

WEIGHTS = "model.safetensors"
CHECKPOINTS_ENV = "LYANNA_CHECKPOINTS"
REPO_CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def checkpoint_dir(name: str) -> Path:
    """The committed checkpoint ``name``: under ``$LYANNA_CHECKPOINTS`` when set, else the
    repository's ``checkpoints/``."""
    return Path(os.environ.get(CHECKPOINTS_ENV) or REPO_CHECKPOINTS) / name


def read_checkpoint(
    path: str | Path, what: str, weights_file: str = WEIGHTS
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, state dict) of the checkpoint at ``path``; ``what`` names it in errors,
    ``weights_file`` is its safetensors file (sha256 checked against the manifest's)."""
    path = Path(path)
    weights = path / weights_file
    if not weights.is_file() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"no {what} checkpoint at {path} (see training/README.md)")
    manifest_file = path / "manifest.json"
    if manifest_file.is_file():
        expected = json.loads(manifest_file.read_text()).get("sha256", {}).get(weights_file)
        if expected is not None and sha256_of(weights) != expected:
            raise ValueError(f"sha256 mismatch for {weights}")
    return json.loads((path / "config.json").read_text()), load_file(weights)
