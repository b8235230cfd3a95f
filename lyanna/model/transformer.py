"""A lean Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) built for
speculative decoding: one forward takes any number of new tokens per sequence with an arbitrary
mask over them (a token tree), reads and writes a preallocated ``KVCache``, and returns final
(post-norm) hidden states; the LM head is a separate call so callers project only the rows
they need.

Batching uses padding: a batch is ``[B, q]`` new tokens; sequence b attends to its own
``lengths[b]`` committed rows plus the new tokens its ``tree_mask`` row allows. Padding tokens
(``tree_mask`` with only the diagonal set) write harmless speculative rows that are never
committed. The fused projections (``wqkv``, ``w13``) follow gpt-fast: fewer, larger matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lyanna.model.config import ModelConfig
from lyanna.model.kv_cache import KVCache
from lyanna.model.native import load_decoder
from lyanna.model.native_layers import causal_mask, int8_rows, native_layer_tensors, run_native


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused op (eight eager ops before; the same float32 numbers, measured)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and *signed* sin tables [max_positions, hd] for the Hugging Face (rotate-half)
    layout: the sin table's first half is negated, so a rotation is one ``roll`` and two
    products (``apply_rope``) instead of two slices, a negation and a concatenation."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [..., hd]; tables from ``rope_tables`` broadcastable to it (x [B, heads, q, hd] with
    cos [B, 1, q, hd]). The same numbers as HF's ``x*cos + rotate_half(x)*sin``: the halves
    swap by ``roll`` and the sign comes from the table (negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def grouped_attention(
    q: torch.Tensor,  # [B, heads, q, hd]
    keys: torch.Tensor,  # [B, kv_heads, kv, hd]
    values: torch.Tensor,  # [B, kv_heads, kv, hd]
    mask: torch.Tensor | None,  # [B, 1, q, kv] bool, True = may attend; None = all
    dtype: torch.dtype | None = None,  # compute dtype; None = the inputs'
) -> torch.Tensor:  # [B, heads, q, hd]
    """Plain attention for a few new tokens per sequence: the query heads of one key/value
    head share one batched matmul (no repeated keys), the mask is applied as it is and the
    softmax runs in at least float32 (bf16 scores lose the last digits of a long context).
    Used for float64 batches (at batch 32 / 300-610 cached rows a q4 decode step took 335 ms
    with it and 973 ms with the CPU flash kernel, which splits work per (sequence, head, 32
    queries) and converts the mask per call) and by every captured step: a fixed sequence of
    kernels whose shapes depend only on the bucket, which no fused kernel gives with grouped
    heads and a mask (see ``cuda_attention``)."""
    if dtype is not None:
        q, keys, values = (t.to(dtype) for t in (q, keys, values))
    B, heads, nq, hd = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads  # heads h*group .. h*group + group - 1 read kv head h
    q = q.reshape(B, kv_heads, group * nq, hd)
    scores = torch.matmul(q, keys.transpose(-1, -2))  # [B, kvh, g*q, kv]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).mul_(hd**-0.5)
    if mask is not None:
        full = mask.expand(B, group, nq, mask.shape[-1]).reshape(B, 1, group * nq, -1)
        scores.masked_fill_(~full, float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(B, heads, nq, hd)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, qkv_out, bias=False)
        self.wo = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, q, d]
        ctx: ForwardContext,
        layer: int,
    ) -> torch.Tensor:  # [B, q, d]
        B, q, _ = x.shape
        hd, nh, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.wqkv(x).view(B, q, nh + 2 * nkv, hd)
        # queries and keys rotate together: one RoPE instead of two ([B, q, heads, hd] layout);
        # the float32 tables rotate bf16/fp16 activations in their own dtype, as HF's Llama does
        # (float32 activations: ``.to`` is a no-op, the same numbers as before)
        cos, sin = ctx.cos.to(qkv.dtype), ctx.sin.to(qkv.dtype)
        qk = apply_rope(qkv[:, :, : nh + nkv], cos.transpose(1, 2), sin.transpose(1, 2))
        xq = qk[:, :, :nh].transpose(1, 2)
        xk = qk[:, :, nh:].transpose(1, 2)
        xv = qkv[:, :, nh + nkv :].transpose(1, 2)
        ctx.cache.write(layer, ctx.slots, ctx.rows, xk, xv)
        keys, values = ctx.cache.read(layer, ctx.read_slots, ctx.kv_len)
        mask = ctx.attention_mask()
        # a captured step (one kernel sequence on every device, no host sync) or a float64
        # batch (see ``grouped_attention``)
        grouped = ctx.attention_dtype is not None and not ctx.is_causal and B > 1
        if ctx.static or grouped:
            out = grouped_attention(xq, keys, values, mask, ctx.attention_dtype).to(x.dtype)
        else:
            if ctx.attention_dtype is not None:
                xq, keys, values = (t.to(ctx.attention_dtype) for t in (xq, keys, values))
            if x.is_cuda:
                out = cuda_attention(xq, keys, values, mask, ctx.is_causal).to(x.dtype)
            else:
                out = F.scaled_dot_product_attention(
                    xq,
                    keys,
                    values,
                    attn_mask=mask,
                    is_causal=ctx.is_causal,
                    enable_gqa=nkv != nh,
                ).to(x.dtype)
        return self.wo(out.transpose(1, 2).reshape(B, q, self.num_heads * hd))


# cuDNN's attention builds a plan for every new KV length: 1.6 ms of host time per call on an
# H100 (torch 2.11), 58 ms per decoded token of this 30-layer model; no fused kernel takes
# grouped heads with a mask, so the heads are expanded and flash / memory-efficient run
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cuda_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
) -> torch.Tensor:
    """Attention on a GPU: ``[B, heads, q, hd]`` queries over ``[B, kv_heads, kv, hd]``."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with sdpa_kernel(CUDA_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.w13 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.intermediate, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)
        self.native = None  # the native decoder and this layer's tensors (``use_native``)
        self._native_tensors: list[torch.Tensor] = []
        self._native_int8_rows = False

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        if self.native is not None and isinstance(getattr(ctx, "cache", None), KVCache):
            return self._native_forward(x, ctx, layer)
        x = x + self.attention(self.attention_norm(x), ctx, layer)
        return x + self.feed_forward(self.ffn_norm(x))

    def use_native(self, extension) -> bool:
        """Run this layer in the native decoder when its projections are prepacked or 4-bit
        (a drafter's layer; see ``Transformer.use_native`` for a whole model)."""
        tensors = native_layer_tensors(self)
        if extension is None or tensors is None:
            return False
        self.native, self._native_tensors = extension, tensors
        self._native_int8_rows = int8_rows(self)
        return True

    def _native_forward(self, x: torch.Tensor, ctx, layer: int) -> torch.Tensor:
        """``ctx`` is a ``ForwardContext`` (committed lengths and a mask over the new rows) or
        a drafter's tree context (explicit rows and a mask over the whole cache)."""
        B, q, d = x.shape
        lengths = getattr(ctx, "lengths", None)
        if lengths is not None:
            mask = ctx.tree_mask if ctx.tree_mask is not None else causal_mask(B, q)
        else:
            lengths = torch.zeros(B, dtype=torch.int64)
            mask = ctx.mask[:, 0]
        out = run_native(
            self.native,
            x.reshape(B * q, d).to(torch.float32, copy=True),  # updated in place
            self._native_tensors,
            ctx.cache,
            range(layer, layer + 1),
            ctx.slots,
            lengths,
            mask,
            ctx.rows,
            ctx.cos.reshape(B * q, -1),
            ctx.sin.reshape(B * q, -1),
            self.config,
            int8_rows=self._native_int8_rows,
        )
        return out.view(B, q, d).to(x.dtype)


@dataclass(eq=False)
class ForwardContext:
    """Per-forward tensors shared by all layers: which slots and cache rows the new tokens
    write, which slots and how many rows attention reads, the mask over them and the rotary
    tables. One class for every forward: a target step built on the host (``eager_context``)
    or on the device (``lyanna.model.static_step``), a drafter's tree step."""

    cache: KVCache
    slots: torch.Tensor  # [B] int64: the slot each batch row writes
    rows: torch.Tensor  # [B, q] int64: the cache row each new token writes
    kv_len: int  # rows attention reads per slot
    cos: torch.Tensor  # [B, 1, q, hd]
    sin: torch.Tensor  # [B, 1, q, hd]
    mask: torch.Tensor | None  # [B, 1, q, kv_len] bool, True = may attend; None = all
    read_slots: torch.Tensor | slice | None = None  # what attention reads; None = ``slots``
    attention_dtype: torch.dtype | None = None
    is_causal: bool = False  # a fresh prompt alone: causal attention, no mask
    static: bool = False  # a captured step's context: device tensors of fixed shapes only
    lengths: torch.Tensor | None = None  # [B] committed rows, on the CPU (native decoder)
    tree_mask: torch.Tensor | None = None  # [B, q, q] (native decoder)
    mask_builder: Callable[[], torch.Tensor | None] | None = None  # ``mask`` on first use

    def __post_init__(self) -> None:
        if self.read_slots is None:
            self.read_slots = self.slots

    def attention_mask(self) -> torch.Tensor | None:
        """``mask``, built on first use when a builder was given: the eager attention reads
        it, the native decoder does not."""
        if self.mask_builder is not None:
            self.mask, self.mask_builder = self.mask_builder(), None
        return self.mask


def eager_context(
    cache: KVCache,
    slots: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, q] int64
    tree_mask: torch.Tensor | None,  # [B, q, q] bool, True = may attend; None = causal
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    attention_dtype: torch.dtype | None = None,
) -> ForwardContext:
    """A forward's context built from the cache's CPU lengths: reads exactly the rows in use
    (its shapes follow the context length), for prefills and the native decoder."""
    B, q = positions.shape
    lengths = cache.lengths[slots]  # [B] (the cache keeps its lengths on the CPU)
    kv_len = int(lengths.max()) + q
    cache.check_length(kv_len)
    # a fresh prompt alone: causal attention over exactly its own rows, no mask to build
    is_causal = tree_mask is None and q > 1 and B == 1 and int(lengths[0]) == 0
    # the KV's device (a GPU model's): rows index its cache and the mask meets its queries
    # there, moved once per forward rather than in every layer (CPU: no copy)
    device = cache.keys.device
    cpu_rows = lengths[:, None] + torch.arange(q)  # [B, q]

    def build_mask() -> torch.Tensor | None:
        mask = None if is_causal else _eager_mask(lengths, cpu_rows, kv_len, tree_mask)
        return None if mask is None else mask.to(device)

    return ForwardContext(
        cache=cache,
        slots=slots,
        rows=cpu_rows.to(device),
        kv_len=kv_len,
        cos=cos_table[positions].unsqueeze(1),
        sin=sin_table[positions].unsqueeze(1),
        mask=None,
        mask_builder=build_mask,
        attention_dtype=attention_dtype,
        is_causal=is_causal,
        lengths=lengths,
        tree_mask=tree_mask,
    )


def _eager_mask(
    lengths: torch.Tensor, rows: torch.Tensor, kv_len: int, tree_mask: torch.Tensor | None
) -> torch.Tensor | None:  # [B, 1, q, kv_len] bool
    B, q = rows.shape
    if tree_mask is None:
        tree_mask = causal_mask(B, q)
        if q == 1 and (B == 1 or bool((lengths == lengths[0]).all())):
            return None  # one new token per sequence, equal lengths: attend to all
    cols = torch.arange(kv_len)
    mask = (cols[None, None, :] < lengths[:, None, None]).expand(B, q, kv_len).clone()
    batch_idx = torch.arange(B)[:, None, None]
    query_idx = torch.arange(q)[None, :, None]
    mask[batch_idx, query_idx, rows[:, None, :]] = tree_mask.cpu()
    return mask.unsqueeze(1)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # None = the activations' dtype. The q4 weights set float64: they round every linear's
        # input to bf16, which turns attention's last-bit differences between a one-token and
        # a tree forward (kernel and summation order depend on the shape) into visible ones;
        # float64 attention rounds back to the same float32 whatever the order, so a token's
        # hidden state does not depend on how many tokens share its forward (measured bitwise)
        # and speculation reproduces greedy decoding exactly.
        self.attention_dtype: torch.dtype | None = None
        # the native decoder's extension and its per-layer tensors (``use_native``); None =
        # the eager layers below
        self.native = None
        self._native_layers: list[torch.Tensor] = []
        self._native_int8_rows = False
        # the native decoder's KV cache may be float16 (``use_native``); None = as above
        self.kv_dtype: torch.dtype | None = None
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, num_slots: int, max_len: int, spare_rows: int = 0) -> KVCache:
        """A cache of ``num_slots`` sequences of up to ``max_len`` rows (capped by the model's
        context), each with ``spare_rows`` rows that forwards may write but never keep."""
        max_len = min(max_len, self.config.max_position_embeddings)
        # float64 attention keeps its keys and values in float64: converting every cached row
        # on every layer of every step cost more than the attention itself (measured)
        dtype = self.kv_dtype or self.attention_dtype or self.dtype
        device = self.embed_tokens.weight.device
        return KVCache(self.config, num_slots, max_len, dtype, device, spare_rows)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, q] int64
        positions: torch.Tensor,  # [B, q] int64
        cache: KVCache,
        slots: torch.Tensor,  # [B] int64
        tree_mask: torch.Tensor | None = None,  # [B, q, q] bool; None = causal
    ) -> torch.Tensor:  # [B, q, hidden] final (post-norm) hidden states
        """Run the new tokens; their keys/values land in the speculative rows after each
        slot's committed prefix (call ``cache.commit`` to keep some of them)."""
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError("position exceeds the model's context length")
        # callers build tokens and positions on the CPU; a GPU model takes them to its device
        # (a no-op on the CPU). Slots and the cache's lengths stay CPU bookkeeping.
        device = self.embed_tokens.weight.device
        tokens, positions = tokens.to(device), positions.to(device)
        if self.native is not None:
            return self._native_forward(tokens, positions, cache, slots, tree_mask)
        ctx = eager_context(
            cache, slots, positions, tree_mask, self.rope_cos, self.rope_sin, self.attention_dtype
        )
        x = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, i)
        return self.norm(x)

    def use_native(self, extension) -> bool:
        """Run the decoder layers in one native call (``lyanna.model.native``) when every
        layer can (``native_layer_tensors``) and the extension is there; returns whether it
        does. Its attention is batch invariant in float32, so the float64 cache is not needed
        (see ``attention_dtype``), and it keeps keys and values in float16 (llama.cpp's
        default): each row rounded once when written, read back exactly, so tree rows still
        equal decoding bit for bit. Attention reads the whole cache every step: on a Zen 5 at
        1,000 cached rows a one-row forward took 4.30 ms with a float32 cache and 3.57 with
        float16 (300 rows: 2.9 -> 2.8; 8 new rows: +1.5 %), and the cache takes half the
        memory."""
        layers = [native_layer_tensors(block) for block in self.layers]
        if extension is None or any(layer is None for layer in layers):
            return False
        self.native = extension
        self._native_layers = [t for layer in layers for t in layer]  # type: ignore[union-attr]
        self._native_int8_rows = int8_rows(self)
        self.attention_dtype = None
        self.kv_dtype = torch.float16
        return True

    def _native_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        tree_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        B, q = tokens.shape
        cache.check_room(slots, q)
        lengths = cache.lengths[slots]
        # a fresh prompt alone (its prefill): the same in plain and speculative decoding, so
        # its attention may take a faster kernel that is not batch invariant (decoder.cpp)
        prompt = tree_mask is None and B == 1 and q > 1 and int(lengths[0]) == 0
        x = run_native(
            self.native,
            self.embed_tokens(tokens).reshape(B * q, -1).float().contiguous(),
            self._native_layers,
            cache,
            range(0, len(self.layers)),
            slots,
            lengths,
            tree_mask if tree_mask is not None else causal_mask(B, q),
            lengths[:, None] + torch.arange(q),
            self.rope_cos[positions].reshape(B * q, -1),
            self.rope_sin[positions].reshape(B * q, -1),
            self.config,
            prompt,
            self._native_int8_rows,
        )
        return self.norm(x.view(B, q, -1))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., vocab] float32
        """LM head on the given rows only."""
        return self.lm_head(hidden).float()


def use_native_layers(module: nn.Module) -> int:
    """Run every decoder layer (``Block``) under ``module`` whose projections are prepacked or
    4-bit in the native decoder (a drafter's layers, after ``prepack_linears``); returns how
    many. Nothing changes when the extension is unavailable."""
    extension = load_decoder()
    if extension is None:
        return 0
    return sum(b.use_native(extension) for b in module.modules() if isinstance(b, Block))
