"""Reading a committed drafter checkpoint directory: ``config.json``, ``model.safetensors``
(fp16 weights, int64 index tensors) and ``manifest.json`` whose sha256 of the weights is
checked before anything is loaded. safetensors only: nothing is ever unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from lyanna.model.default import sha256_of

WEIGHTS = "model.safetensors"


def read_checkpoint(path: str | Path, what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, state dict) of the checkpoint at ``path``; ``what`` names it in errors."""
    path = Path(path)
    weights = path / WEIGHTS
    if not weights.is_file() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"no {what} checkpoint at {path} (see training/README.md)")
    manifest_file = path / "manifest.json"
    if manifest_file.is_file():
        expected = json.loads(manifest_file.read_text()).get("sha256", {}).get(WEIGHTS)
        if expected is not None and sha256_of(weights) != expected:
            raise ValueError(f"sha256 mismatch for {weights}")
    return json.loads((path / "config.json").read_text()), load_file(weights)
