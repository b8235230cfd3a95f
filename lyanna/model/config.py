"""Shape and numerics of a Llama-family decoder, read from GGUF metadata or an HF config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "LlamaForCausalLM")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture this decoder does not implement."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers")
        for name in (*positive, "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                "num_heads must be a multiple of num_kv_heads (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @classmethod
    def tiny(cls, vocab_size: int = 64) -> ModelConfig:
        """A random-weight model of the same architecture for fast unit tests."""
        return cls(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            rope_theta=10000.0,
            max_position_embeddings=512,
            eos_token_id=vocab_size - 1,
        )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face ``config.json`` dictionary."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        if cfg.get("model_type") != "llama" and not set(archs) & set(SUPPORTED_ARCHITECTURES):
            raise UnsupportedModelError(
                f"unsupported architecture {archs}: only Llama-family checkpoints are supported"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise UnsupportedModelError(f"unsupported rope scaling {rope}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` that transformers' LlamaForCausalLM reads back."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
