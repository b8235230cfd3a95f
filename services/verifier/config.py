"""The verifier service's own settings (``VerifierConfig``, flags ``--max-running``,
``--weights``, ``--device``, ``--lease-seconds``, ...)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lyanna.model.device import parse_dtype, parse_placement
from lyanna.model.loader import WEIGHT_FORMATS
from lyanna.target import TargetConfig


@dataclass(frozen=True, slots=True)
class VerifierConfig:
    model: str = ""  # HF checkpoint directory or .gguf file; "" = the default model
    max_running: int = 8  # KV slots
    max_len: int = 2048  # KV rows per sequence
    rule: str | None = None  # acceptance rule at temperature > 0 (None = scheme default)
    max_tree_nodes: int = 128  # largest tree (after fusion) one sequence may send
    weights: str = "auto"  # q4 | fp32 | auto (see lyanna.model.load_model)
    device: str = "cpu"  # cpu | cuda | cuda:N: where the model and its KV cache live
    dtype: str = "float32"  # float32 | bfloat16 (bf16) | float16 (fp16); bf16 on a GPU
    # draft the root-only steps of items that allow it (VerifyItem.free_drafts) from an
    # n-gram drafter here: no forward, no round trip (see services.verifier.free_drafts)
    free_drafts: bool = True
    # a sequence's KV slot is leased: every Prefill and Verify naming it renews the lease,
    # and a slot nobody renewed for this long is reclaimed (its gateway died without a
    # Release: SIGKILL, OOM); 0 = slots are held until released
    lease_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.lease_seconds < 0:
            raise ValueError("lease_seconds must be >= 0 (0: no lease)")
        TargetConfig(self.max_running, self.max_len, self.rule)
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}")
        if self.max_tree_nodes < 1:
            raise ValueError("max_tree_nodes must be >= 1")
        parse_placement(self.device, self.dtype, self.weights)  # at start-up, not in a forward

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
