"""The Lyanna draft model: one decoder layer that auto-regresses on hidden states only, plus
the token-info embedding (paper: "Make Every Draft Count", Sections 4-6).

* Chain: ``h1 = Layer(fc(h0 ⊕ E(t1)))`` where ``h0`` is the target's hidden state before the
  root token ``t1``; then ``h(i+1) = Layer(h(i))``. No sampled token enters the chain, so the
  chain stays valid whatever tokens verification rejects. The layer attends over the fused
  inputs of the committed context (EAGLE-style) and over the chain's own earlier steps.
* One-pass logits: the frozen target LM head, restricted to the hot vocabulary, runs once over
  the whole chain.
* Token-info embedding: ``E'(t) = W_E[t] · W1 · W2`` (``W1: n x d``, ``W2: d x |V_hot|``),
  ``bias(t) = RMSNorm(E'(t))`` added to the logits whose parent token is ``t``; collapsed after
  training into a lookup table over the hot tokens (hot-token sparsity: tokens outside the
  hot set have no row and are never proposed).

Beyond the paper (issue 41, ``info_copy``): a copy read, the parent token's attention over
the committed context's tokens reading the target's states where it occurred (``CopyRead``),
added to the state the LM head reads; the chain itself still never sees a token.

Hidden states here are the target's *final, post-norm* states, so the LM head applies to
them directly; the draft layer's output goes through its own RMSNorm into that space.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lyanna.model.config import ModelConfig
from lyanna.model.transformer import Block, ForwardContext, RMSNorm, rope_tables


@dataclass(frozen=True, slots=True)
class LyannaDraftConfig:
    target: ModelConfig
    num_hot: int = 8192  # hot vocabulary (token-info rows/columns, proposable tokens)
    info_rank: int = 256  # d of the low-rank token-info factorisation
    chain_steps: int = 5  # N: hidden states per draft chain
    use_token_info: bool = True  # ablation: "w/o token info"
    fuse_first_token: bool = True  # ablation: "w/o first token" (h1 = Layer(h0))
    # ablation (issue 41, training and training.evaluate only; the serving drafter always
    # applies out_norm): False feeds the layer's raw residual output on, as EAGLE does
    out_norm: bool = True
    # True feeds chain step k + 1 the layer's raw residual output of step k (a weight-tied
    # deeper stack read out through out_norm); False (the paper's h_(i+1) = Layer(h_i)) feeds
    # the normed state. Training, evaluation and serving all follow it (issue 41)
    feed_residual: bool = False
    # issue 41: the parent's token info gated by the chain state, a = (W_E[t] W1) * (1 + G h)
    # with G [rank x n] starting at zero (= the paper's bias at the start): the bias can then
    # depend on the context the state carries, not on the parent alone. The state is
    # canonical still (no token enters the chain), but the bias is no longer one table row:
    # the serving drafter computes it per frontier row (``token_info_tree.GatedTokenInfo``)
    info_gate: bool = False
    # issue 41: where the parent's token info joins. "logits": the paper's bias
    # RMSNorm(a W2) on the logits. "state": a correction D = a U [rank x n] added to the chain
    # state before the LM head (the chain itself still reads the uncorrected state, so it
    # stays canonical); on the logits that is the bias D W_head, one-pass logits intact, and
    # training regresses h + D on the target's state: a dense signal for the token info
    info_space: str = "logits"
    # issue 41: a copy read for the parent. EAGLE's layer reads the drafted token with a query
    # over the context (it can look up what followed that token before); Lyanna's chain never
    # sees it. So the parent queries the committed context's tokens, q = E(t) Wq (+ h Wqs),
    # k_p = E(t_p) Wk (cosine scores, a learned temperature and a "no match" sink), and reads
    # their target states H_p (which predict t_(p+1)); the read, scaled per dimension and
    # gated by the chain state, joins the state the LM head reads only (the chain still feeds
    # h on: canonical). Trained, evaluated and served (``token_info_tree.ContextCopy`` over
    # ``copy_context.CopyContexts``, on the host loop and in the captured device step)
    info_copy: bool = False
    copy_dim: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.num_hot <= self.target.vocab_size:
            raise ValueError("num_hot must be in (0, vocab_size]")
        if self.info_space not in ("logits", "state"):
            raise ValueError("info_space must be 'logits' or 'state'")
        if self.chain_steps < 1 or self.info_rank < 1 or self.copy_dim < 1:
            raise ValueError("chain_steps, info_rank and copy_dim must be >= 1")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target"] = self.target.as_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> LyannaDraftConfig:
        return cls(**{**d, "target": ModelConfig(**d["target"])})


class LyannaDraftModel(nn.Module):
    """Trainable parts: ``fc``, ``layer``, ``out_norm``, ``w1``, then ``w2`` and ``info_norm``
    (``info_space="logits"``) or ``info_up`` (``"state"``), and ``info_gate`` with
    ``config.info_gate``.
    The target's embedding (= tied LM head) is shared and frozen, never saved."""

    def __init__(self, config: LyannaDraftConfig, embedding: torch.Tensor, hot_ids: torch.Tensor):
        super().__init__()
        t = config.target
        self.config = config
        self.register_buffer("embedding", embedding.detach(), persistent=False)  # [V, n] frozen
        self.register_buffer("hot_ids", hot_ids.to(torch.int64))  # [num_hot] full-vocab ids
        hot_index = torch.full((t.vocab_size,), -1, dtype=torch.int64)
        hot_index[hot_ids] = torch.arange(hot_ids.numel())
        self.register_buffer("hot_index", hot_index, persistent=False)  # [V] -> hot row or -1
        self.fc = nn.Linear(2 * t.hidden_size, t.hidden_size, bias=False)
        self.layer = Block(t)
        self.out_norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.w1 = nn.Parameter(torch.randn(t.hidden_size, config.info_rank) / t.hidden_size**0.5)
        self.w2 = self.info_norm = self.info_up = None
        if config.info_space == "state":
            self.info_up = nn.Parameter(torch.zeros(config.info_rank, t.hidden_size))
        else:
            self.w2 = nn.Parameter(torch.zeros(config.info_rank, config.num_hot))
            self.info_norm = RMSNorm(config.num_hot, t.rms_norm_eps)
        self.info_gate = None
        if config.info_gate:
            self.info_gate = nn.Linear(t.hidden_size, config.info_rank, bias=False)
            nn.init.zeros_(self.info_gate.weight)
        if config.info_copy:
            self.copy = CopyRead(t.hidden_size, config.copy_dim)
        else:
            self.copy = None
        cos, sin = rope_tables(t)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        with torch.no_grad():  # start as "h0 + E(t1)"
            eye = torch.eye(t.hidden_size)
            self.fc.weight.copy_(torch.cat([eye, eye], dim=1))
            if self.info_norm is not None:
                self.info_norm.weight.fill_(0.1)

    @property
    def hot_head(self) -> torch.Tensor:  # [num_hot, n] rows of the tied LM head
        """Gathered on every call, unpacked: for training and analysis only. The drafter
        serves with a copy gathered and prepacked once (``heads.hot_lm_head``)."""
        return self.embedding[self.hot_ids]

    def fuse(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """fc(h ⊕ E(t)): hidden [..., n], next_tokens [...] -> [..., n]."""
        emb = self.embedding[next_tokens].to(hidden.dtype)  # a bf16 target's rows: cast
        if not self.config.fuse_first_token:
            emb = torch.zeros_like(emb)
        return self.fc(torch.cat([hidden, emb], dim=-1))

    def info_factors(
        self, parent_tokens: torch.Tensor, states: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``a = W_E[t] W1`` per parent token [...] -> [..., rank], gated by the chain state
        [..., n] that the bias joins with ``config.info_gate``."""
        a = self.embedding[parent_tokens].to(self.w1.dtype) @ self.w1
        if self.info_gate is not None:
            if states is None:
                raise ValueError("an info_gate drafter's token info needs the chain states")
            a = a * (1.0 + self.info_gate(states.to(a.dtype)))
        return a

    def copy_read(
        self,
        parent_tokens: torch.Tensor,  # [B, A] parent of each anchor j = 0 .. A-1
        states: torch.Tensor,  # [B, A, n] the chain's state at each anchor
        tokens: torch.Tensor,  # [B, T] the context's tokens (T >= A)
        hidden: torch.Tensor,  # [B, T, n] the target's states at them
    ) -> torch.Tensor:
        """``info_copy``: what the parent's copy read adds to the state the LM head reads,
        [B, A, n]; anchor j reads the context positions p <= j (training's layout)."""
        if self.copy is None:
            raise ValueError("only an info_copy drafter has a copy read")
        A, T = parent_tokens.shape[1], tokens.shape[1]
        visible = torch.ones(A, T, dtype=torch.bool, device=tokens.device).tril()
        emb = self.embedding
        return self.copy(emb[parent_tokens], states, emb[tokens], hidden, visible)

    def info_keep(self, parent_tokens: torch.Tensor) -> torch.Tensor:
        """Which parents have token info: hot tokens, when token info is on ([...] bool)."""
        return (self.hot_index[parent_tokens] >= 0) & self.config.use_token_info

    def info_delta(
        self, parent_tokens: torch.Tensor, states: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``info_space="state"``: the correction ``D = a U`` the parent adds to the chain
        state before the LM head, [...] -> [..., n] (zero where ``info_keep`` is False)."""
        if self.info_up is None:
            raise ValueError("only an info_space='state' drafter corrects its states")
        delta = self.info_factors(parent_tokens, states) @ self.info_up
        return delta * self.info_keep(parent_tokens).unsqueeze(-1).to(delta.dtype)

    def info_out(self) -> torch.Tensor:
        """[rank, num_hot]: what the gated factors multiply into logits (``W2``, or with
        ``info_space="state"`` ``U W_head``, unnormalised)."""
        return self.w2 if self.info_up is None else self.info_up @ self.hot_head.T

    def token_info(
        self, parent_tokens: torch.Tensor, states: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logit bias per parent token, [...] -> [..., num_hot]: RMSNorm(W_E[t] W1 W2),
        or with ``info_space="state"`` ``D W_head``; zero for tokens outside the hot set or
        when token info is disabled (``states``: see ``info_factors``)."""
        if self.info_up is not None:
            return self.info_delta(parent_tokens, states) @ self.hot_head.T
        rows = self.info_norm(self.info_factors(parent_tokens, states) @ self.w2)
        return rows * self.info_keep(parent_tokens).unsqueeze(-1).to(rows.dtype)

    @torch.no_grad()
    def collapsed_token_info(self, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """The lookup table T[hot row] = RMSNorm(E'(hot token)): [num_hot, num_hot]."""
        if self.info_gate is not None:
            raise ValueError("a state-gated token info (info_gate) has no lookup table")
        return self.token_info(self.hot_ids).to(dtype)

    def read_out(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's raw output of one chain step -> (its state h = out_norm(raw), the next
        step's input: ``raw`` with ``feed_residual``, else ``h``)."""
        h = self.out_norm(raw)
        return h, (raw if self.config.feed_residual else h)

    def chain_logits(self, chain: torch.Tensor) -> torch.Tensor:
        """One-pass raw logits over the hot vocabulary: chain [..., N, n] -> [..., N, num_hot]."""
        return chain @ self.hot_head.T

    # -- training: all anchors of a sequence in parallel, unrolled over the chain ----------

    def unrolled(
        self,
        hidden: torch.Tensor,  # [B, T, n] target hidden states
        tokens: torch.Tensor,  # [B, T] int64
        steps: int,
    ) -> list[torch.Tensor]:  # steps x [B, T-1, n]: step i at anchor j predicts hidden[j + i]
        """Teacher-forced context, self-fed chain: step 1 at anchor j reads fc(H_j ⊕ E(t_j+1))
        with causal attention over the fused context; step i > 1 reads the chain's own
        previous output and attends to the context up to j plus its anchor's earlier steps."""
        B, T, _ = hidden.shape
        x = self.fuse(hidden[:, :-1], tokens[:, 1:])  # [B, T-1, n]
        n_pos = T - 1
        positions = torch.arange(n_pos)
        store = _TrainingKV()
        outputs = []
        causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
        diag = torch.eye(n_pos, dtype=torch.bool)
        for i in range(steps):
            mask = torch.cat([causal] + [diag] * i, dim=1)  # [T-1, (i+1)(T-1)]
            ctx = _training_context(store, positions + i, mask, self.rope_cos, self.rope_sin)
            raw = self.layer(x, ctx, 0)
            y = self.out_norm(raw) if self.config.out_norm else raw
            outputs.append(y)
            x = raw if self.config.feed_residual else y
        return outputs


class CopyRead(nn.Module):
    """The parent's read of the context (``LyannaDraftConfig.info_copy``): cosine attention
    of the parent's embedding (plus a projection of the chain state, zero at the start) over
    the context tokens' embeddings, with a learned temperature and a "no match" sink key,
    over the target's states at those tokens; scaled per dimension (a drafter without it
    loads with the scale at zero: the same drafter) and by a gate sigmoid(h w + b)."""

    def __init__(self, hidden_size: int, dim: int):
        super().__init__()
        proj = torch.randn(hidden_size, dim) / hidden_size**0.5
        self.query = nn.Parameter(proj.clone())  # the same projection: equal tokens match
        self.key = nn.Parameter(proj)
        self.state_query = nn.Parameter(torch.zeros(hidden_size, dim))
        self.sink = nn.Parameter(torch.zeros(dim))  # the sink's score: q . sink + sink_bias
        self.sink_bias = nn.Parameter(torch.zeros(()))
        self.log_temperature = nn.Parameter(torch.tensor(2.3))  # about 10
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.gate = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)

    def forward(
        self,
        parent_emb: torch.Tensor,  # [B, A, n]
        states: torch.Tensor,  # [B, A, n]
        key_emb: torch.Tensor,  # [B, T, n]
        values: torch.Tensor,  # [B, T, n]
        visible: torch.Tensor,  # [A, T] or [B, A, T] bool: which keys each row may read
    ) -> torch.Tensor:
        dtype = states.dtype
        q = parent_emb.to(dtype) @ self.query.to(dtype) + states @ self.state_query.to(dtype)
        k = F.normalize((key_emb.to(dtype) @ self.key.to(dtype)).float(), dim=-1)
        keys, bias = copy_keys(k, visible, self.log_temperature.exp(), self.sink.float(),
                               self.sink_bias.float())  # fmt: skip
        weights = copy_weights(q, keys, bias)
        read = weights.to(values.dtype) @ values  # [B, A, n]
        gate = torch.sigmoid(self.gate(states.float()))
        return (gate * read.float() * self.scale.float()).to(dtype)


def copy_keys(
    keys: torch.Tensor,  # [..., T, dc] normalised keys
    visible: torch.Tensor,  # bool, broadcast to [..., q, T]: the keys each query may read
    temperature: torch.Tensor | float,
    sink: torch.Tensor,  # [dc]
    sink_bias: torch.Tensor | float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The copy read's keys as its scores use them: the visible keys and a "no match" sink
    (score ``q . sink + sink_bias``) as one more key, times the temperature ([..., T + 1, dc]),
    and the scores' additive mask ([..., q | 1, T + 1]: 0 where visible, -inf elsewhere, the
    sink's bias last). Made once per context, then read by every query (``copy_weights``)."""
    sink_key = sink.float().expand(*keys.shape[:-2], 1, keys.shape[-1])
    scaled = torch.cat([keys.float(), sink_key], dim=-2) * temperature
    mask = torch.zeros(visible.shape, device=keys.device).masked_fill(~visible, float("-inf"))
    sink_score = torch.zeros_like(mask[..., :1]) + sink_bias  # (no host tensor: capturable)
    return scaled, torch.cat([mask, sink_score], dim=-1)


def copy_weights(
    query: torch.Tensor,  # [B, q, dc] raw queries E(t) Wq + h Wqs
    keys: torch.Tensor,  # [B, T + 1, dc] ``copy_keys``
    bias: torch.Tensor,  # broadcast to [B, q, T + 1] ``copy_keys``
) -> torch.Tensor:  # [B, q, T] float32
    """The copy read's attention weights: cosine scores times the temperature over the
    visible keys and the sink, softmaxed together; the sink's share is dropped. One rule for
    training (``CopyRead``) and serving (``token_info_tree.ContextCopy``)."""
    q = F.normalize(query.float(), dim=-1)
    return torch.baddbmm(bias, q, keys.transpose(-1, -2)).softmax(-1)[..., :-1]


class _TrainingKV:
    """Keys/values of every unrolled step, concatenated along the key axis (training only)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def write(self, layer, slots, rows, keys, values) -> None:
        self.keys.append(keys)
        self.values.append(values)

    def read(self, layer, slots, kv_len):
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)


def _training_context(store, positions, mask, cos_table, sin_table) -> ForwardContext:
    """The unrolled training pass's context: every key of the chain so far lives in ``store``
    (no slots, no rows), one chain step's queries over them."""
    return ForwardContext(
        cache=store,
        slots=None,
        rows=None,
        kv_len=None,
        cos=cos_table[positions][None, None],  # [1, 1, q, hd]
        sin=sin_table[positions][None, None],
        mask=mask[None, None],  # [1, 1, q, keys]
    )
