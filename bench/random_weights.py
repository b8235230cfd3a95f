"""Random-weight Llama models of a given shape, as a Hugging Face state dict: for checks and
speed comparisons whose results do not depend on the weights' values (graph capture, step
timings against transformers), so no checkpoint needs to travel."""

from __future__ import annotations

import torch

from lyanna.model.config import ModelConfig
from lyanna.model.loader import HF_LAYER, build_model
from lyanna.model.transformer import Transformer

SHAPES = {
    # a small Llama: two layers, grouped heads, a vocabulary of 512
    "tiny": dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2),
    # SmolLM2-135M's shape
    "default": dict(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3),
}


def shape_config(shape: str, max_positions: int = 8192) -> ModelConfig:
    s = SHAPES[shape]
    return ModelConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_layers=s["layers"],
        num_heads=s["heads"],
        num_kv_heads=s["kv_heads"],
        head_dim=s["hidden"] // s["heads"],
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )


def random_hf_state(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face names, float32; projections scaled so activations stay O(1) over depth
    (the logits then have a spread like a trained model's, and near ties are rare)."""
    gen = torch.Generator().manual_seed(seed)
    d, hd = config.hidden_size, config.head_dim

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen) * (0.8 / inp**0.5)

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(d, generator=gen)

    state = {
        "model.embed_tokens.weight": torch.randn(config.vocab_size, d, generator=gen),
        "model.norm.weight": norm(),
    }
    for i in range(config.num_layers):
        pre = HF_LAYER.format(i)
        state |= {
            pre + "input_layernorm.weight": norm(),
            pre + "post_attention_layernorm.weight": norm(),
            pre + "self_attn.q_proj.weight": linear(config.num_heads * hd, d),
            pre + "self_attn.k_proj.weight": linear(config.num_kv_heads * hd, d),
            pre + "self_attn.v_proj.weight": linear(config.num_kv_heads * hd, d),
            pre + "self_attn.o_proj.weight": linear(d, config.num_heads * hd),
            pre + "mlp.gate_proj.weight": linear(config.intermediate_size, d),
            pre + "mlp.up_proj.weight": linear(config.intermediate_size, d),
            pre + "mlp.down_proj.weight": linear(d, config.intermediate_size),
        }
    return state


def random_model(
    shape: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    max_positions: int = 8192,
) -> Transformer:
    """This engine's model of ``shape`` with random weights (generic forward: no native
    decoder, no prepacking)."""
    config = shape_config(shape, max_positions)
    return build_model(config, random_hf_state(config, seed), dtype, device, prepack=False)
