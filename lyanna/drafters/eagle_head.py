"""The EAGLE draft head (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty"): one decoder layer of the target's shape that reads
``fc(concat(h_i, embed(t_{i+1})))`` - the target's final hidden state at token i and the
embedding of the token that followed - and predicts ``h_{i+1}``. The target's frozen embedding
and LM head are shared, so a checkpoint stores only ``fc``, the layer and the hot vocabulary:
the head scores only the ``hot_vocab`` tokens (the most frequent ones in the training data), a
cheap LM head on CPU. The same module trains (``training.eagle``) and serves
(``lyanna.drafters.eagle``).

A checkpoint directory holds ``model.safetensors`` (fp16 weights + int64 ``hot_vocab``),
``config.json`` (``EagleConfig``) and ``manifest.json`` (sha256 of the weights, training
recipe). Loading checks the sha256 and never unpickles anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lyanna.drafters.checkpoint import checkpoint_dir, read_checkpoint
from lyanna.model.config import ModelConfig
from lyanna.model.transformer import Block, rope_tables

DEFAULT_CHECKPOINT = checkpoint_dir("eagle2-smollm2-135m")


@dataclass(frozen=True, slots=True)
class EagleConfig:
    vocab_size: int  # the target's vocabulary
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hot_vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if not 0 < self.hot_vocab_size <= self.vocab_size:
            raise ValueError("hot_vocab_size must be in [1, vocab_size]")

    @classmethod
    def for_target(cls, target: ModelConfig, hot_vocab_size: int) -> EagleConfig:
        return cls(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            hot_vocab_size=min(hot_vocab_size, target.vocab_size),
            rope_theta=target.rope_theta,
            rms_norm_eps=target.rms_norm_eps,
            max_position_embeddings=target.max_position_embeddings,
        )

    def layer_config(self) -> ModelConfig:
        """The one-layer decoder shape (used for the layer and its KV cache)."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EagleConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


class EagleHead(nn.Module):
    """``fc`` + one decoder layer; ``hot_vocab[j]`` is the token id of hot LM-head row j."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layer = Block(config.layer_config())
        self.register_buffer("hot_vocab", torch.arange(config.hot_vocab_size, dtype=torch.int64))
        cos, sin = rope_tables(config.layer_config())
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def fuse(
        self,
        hidden: torch.Tensor,  # [..., d] target (or predicted) final hidden states
        embeds: torch.Tensor,  # [..., d] embeddings of the tokens that follow them
    ) -> torch.Tensor:  # [..., d] the layer's input
        return self.fc(torch.cat([hidden, embeds], dim=-1))


def load_eagle_head(
    path: str | Path = DEFAULT_CHECKPOINT, dtype: torch.dtype = torch.float32
) -> EagleHead:
    """Load a checkpoint directory (sha256-checked against its manifest)."""
    values, state = read_checkpoint(path, "EAGLE")
    config = EagleConfig.from_dict(values)
    head = EagleHead(config)
    head.load_state_dict(state)
    return head.to(dtype).eval()
