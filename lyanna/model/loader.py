"""Checkpoint loaders: GGUF (through the ``gguf`` package, dequantized) and Hugging Face
Llama-family directories (config.json + safetensors). Both produce a state dict with Hugging
Face names, which ``build_model`` maps onto the lean ``Transformer`` (fusing q/k/v and
gate/up). ``export_hf_dir`` writes a converted GGUF as an HF directory, so later loads are a
fast safetensors mmap instead of a dequantization.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lyanna.model.calibrate import choose_weights
from lyanna.model.config import ModelConfig, UnsupportedModelError
from lyanna.model.cpu_kernels import PackedLinear, prepack_linears
from lyanna.model.device import check_placement
from lyanna.model.huge_pages import on_huge_pages
from lyanna.model.native import load_decoder
from lyanna.model.paths import MARKER, cache_root
from lyanna.model.quant import (
    Q4_TYPES,
    TILE,
    BlockLinear,
    Int4Linear,
    Q4Blocks,
    Q8Blocks,
    int4_kernel_available,
    parse_q4_blocks,
    parse_q8_blocks,
)
from lyanna.model.transformer import Transformer, rope_tables

# q4a8: the q4 blocks with int8 activations (llama.cpp's numerics): cheaper products when a
# forward carries many rows (verification, batches, prefill), at 7 bits per input
WEIGHT_FORMATS = ("auto", "fp32", "q4", "q4a8")

HF_LAYER = "model.layers.{}."
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class CheckpointError(FileNotFoundError):
    """A checkpoint file is missing or incomplete."""


def _gguf_config(reader) -> ModelConfig:
    def field(name: str, default=None):
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}: only 'llama' is supported"
        )
    heads = int(field("llama.attention.head_count"))
    hidden = int(field("llama.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = field("llama.vocab_size") or len(tokens.data)
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(field("llama.attention.head_count_kv", heads)),
        head_dim=int(field("llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(field("llama.context_length", 8192)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
    )


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows so the rotate-half RoPE layout applies."""
    rows, cols = weight.shape
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, cols)
        .transpose(1, 2)
        .reshape(rows, cols)
    )


def _unpermute_rope_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order ``_unpermute_rope`` produces, as an index (for weights kept in blocks)."""
    return _unpermute_rope(torch.arange(num_rows)[:, None], num_heads)[:, 0]


def _hf_name(name: str) -> str | None:
    """Hugging Face name of a GGUF tensor (None for tensors the decoder does not use)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name.startswith("blk."):
        _, idx, kind, _ = name.split(".")
        if kind in _GGUF_LAYER_NAMES:
            return HF_LAYER.format(idx) + _GGUF_LAYER_NAMES[kind] + ".weight"
    return None


def _open_gguf(path: str | Path):
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    reader = GGUFReader(path)
    return reader, _gguf_config(reader)


HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")  # the LM head, or its tied twin


def read_gguf_q4(path: str | Path) -> dict[str, Q4Blocks | Q8Blocks]:
    """The GGUF's 4-bit linear weights (Q4_0 / Q4_1) as blocks, by Hugging Face name, with
    llama.cpp's q/k row interleaving undone (rows move whole, so every block is kept), and
    an LM head (or the embedding it is tied to) stored as Q8_0."""
    reader, config = _open_gguf(path)
    blocks: dict[str, Q4Blocks | Q8Blocks] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if name in HEAD_NAMES and tensor.tensor_type.name == "Q8_0":
            blocks[name] = parse_q8_blocks(tensor.data, shape)
        if name is None or tensor.tensor_type.name not in Q4_TYPES or ".layers." not in name:
            continue
        weight = parse_q4_blocks(tensor.data, tensor.tensor_type.name, shape)
        if name.endswith("q_proj.weight"):
            weight = weight.rows(_unpermute_rope_rows(shape[0], config.num_heads))
        elif name.endswith("k_proj.weight"):
            weight = weight.rows(_unpermute_rope_rows(shape[0], config.num_kv_heads))
        blocks[name] = weight
    return blocks


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize a llama GGUF file to an fp32 state dict with Hugging Face names."""
    from gguf.quants import dequantize

    reader, config = _open_gguf(path)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        array = dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weight = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))
        if name.endswith("q_proj.weight"):
            weight = _unpermute_rope(weight, config.num_heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute_rope(weight, config.num_kv_heads)
        state[name] = weight
    return config, state


def read_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config.json and every *.safetensors shard of a Hugging Face checkpoint."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"no config.json in {path}")
    config = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard))
    return config, state


def build_model(
    config: ModelConfig,
    hf_state: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    prepack: bool = True,
    q4: dict[str, Q4Blocks | Q8Blocks] | None = None,
    int8_rows: bool = False,
) -> Transformer:
    """Map a Hugging Face Llama state dict onto the lean model; on CPU, ``prepack`` swaps the
    linear layers for oneDNN-packed ones (see ``cpu_kernels``). With ``q4`` (4-bit blocks by
    Hugging Face name, ``read_gguf_q4``) every projection whose parts are all 4-bit runs on
    the int4 kernel and the LM head on its Q8_0 blocks, or in bf16 (see ``quant``)."""

    def take(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise CheckpointError(f"checkpoint lacks tensor {name}")
        return hf_state[name]

    ours: dict[str, torch.Tensor] = {
        "embed_tokens.weight": take("model.embed_tokens.weight"),
        "norm.weight": take("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        ours["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        pre, new = HF_LAYER.format(i), f"layers.{i}."
        ours[new + "attention_norm.weight"] = take(pre + "input_layernorm.weight")
        ours[new + "ffn_norm.weight"] = take(pre + "post_attention_layernorm.weight")
        ours[new + "attention.wqkv.weight"] = torch.cat(
            [take(pre + f"self_attn.{p}_proj.weight") for p in "qkv"]
        )
        ours[new + "attention.wo.weight"] = take(pre + "self_attn.o_proj.weight")
        ours[new + "feed_forward.w13.weight"] = torch.cat(
            [take(pre + "mlp.gate_proj.weight"), take(pre + "mlp.up_proj.weight")]
        )
        ours[new + "feed_forward.w2.weight"] = take(pre + "mlp.down_proj.weight")
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(ours, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # rotary tables were created on meta; rebuild them in fp32 whatever the weight dtype
    model.rope_cos, model.rope_sin = rope_tables(config)
    model = model.to(device=device, dtype=dtype).eval()
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_tables(config))
    if q4:
        _use_q4(model, q4, int8_rows)
    if prepack:
        prepack_linears(model)
    if torch.device(device).type == "cpu":
        on_huge_pages(model)  # a step streams every weight: fewer TLB misses (huge_pages)
    return model


def _use_q4(
    model: Transformer, q4: dict[str, Q4Blocks | Q8Blocks], int8_rows: bool = False
) -> None:
    """Swap the fused projections for ``Int4Linear`` wherever all their parts are 4-bit
    (taking int8 inputs with ``int8_rows``), and the LM head for its Q8_0 blocks where the
    file has them."""
    fused = {
        "attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "attention.wo": ("self_attn.o_proj",),
        "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
        "feed_forward.w2": ("mlp.down_proj",),
    }
    for i, block in enumerate(model.layers):
        for ours, parts in fused.items():
            names = [HF_LAYER.format(i) + p + ".weight" for p in parts]
            if all(n in q4 for n in names):
                parent_name, attr = ours.split(".")
                parent = getattr(block, parent_name)
                blocks = Q4Blocks.cat([q4[n] for n in names])
                setattr(parent, attr, Int4Linear(blocks, int8_rows))
    tied = model.lm_head.weight is model.embed_tokens.weight
    head = q4.get(HEAD_NAMES[1] if tied else HEAD_NAMES[0])
    if isinstance(head, Q8Blocks) and head.shape[0] % TILE == 0 and load_decoder() is not None:
        model.lm_head = BlockLinear(head)  # the file's Q8_0 blocks, half the bytes of bf16
    else:
        model.lm_head = PackedLinear(model.lm_head.weight, torch.bfloat16)  # see quant
    model.attention_dtype = torch.float64  # see Transformer.attention_dtype
    # every projection 4-bit (the rest are still plain Linears here): the native decoder
    model.use_native(load_decoder())


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    prepack: bool = True,
    weights: str = "fp32",
) -> Transformer:
    """Load a ``.gguf`` file or a Hugging Face directory.

    ``weights``: ``fp32`` dequantizes everything (the exact reference); ``q4`` runs the 4-bit
    blocks of the source GGUF (the file itself, or the one a converted default-model directory
    came from) on the int4 kernel; ``q4a8`` the same blocks with int8 activations in the
    native kernel (llama.cpp's numerics: faster products over many rows, less exact);
    ``auto`` picks whichever measured faster on this machine
    (``calibrate.choose_weights``, cached per machine). The 4-bit formats run on the CPU in
    float32 only (``ValueError`` elsewhere); ``auto`` loads the dense weights in ``dtype`` on
    ``device`` anywhere else."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    check_placement(weights, dtype, device)  # 4-bit: CPU float32 only
    path = Path(path)
    if path.suffix == ".gguf":
        config, state = read_gguf(path)
        gguf = path
    elif path.is_dir():
        config, state = read_hf_dir(path)
        gguf = source_gguf(path)
    else:
        raise CheckpointError(f"not a .gguf file or a checkpoint directory: {path}")
    q4 = None
    if weights != "fp32" and torch.device(device).type == "cpu" and dtype == torch.float32:
        q4 = read_gguf_q4(gguf) if gguf is not None and int4_kernel_available() else {}
        if not any(isinstance(b, Q4Blocks) for b in q4.values()):
            q4 = {}  # a Q8_0 head alone is not a 4-bit model
        if weights in ("q4", "q4a8") and not q4:
            raise CheckpointError(
                f"weights={weights!r} needs a GGUF with Q4_0/Q4_1 layers and torch's int4 CPU "
                f"kernel; {path} has none"
            )
        if weights == "auto" and q4:
            q4 = q4 if choose_weights(config) == "q4" else None
    if weights == "q4a8" and load_decoder() is None:
        raise CheckpointError("weights='q4a8' needs the native decoder (a C++ compiler)")
    return build_model(
        config, state, dtype, device, prepack, q4=q4 or None, int8_rows=weights == "q4a8"
    )


def source_gguf(model_dir: Path) -> Path | None:
    """The GGUF a converted directory was made from, when it is still in the cache."""
    marker = model_dir / MARKER
    if not marker.is_file():
        return None
    name = Path(json.loads(marker.read_text()).get("file", "")).name
    gguf = cache_root() / "gguf" / name
    return gguf if name and gguf.is_file() else None


def export_hf_dir(config: ModelConfig, hf_state: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Write config.json + model.safetensors that both this loader and transformers read."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in hf_state.items()}
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
