"""Token-info tree sampling (Lyanna paper, Algorithm 1) and the re-sampled subtree
(Algorithm 2), as pure functions of a chain's raw logits and the collapsed token-info table
(or a state-gated token info, ``GatedTokenInfo``: issue 41's ``info_gate``; and the parent's
read of the context, ``ContextCopy``: ``info_copy``).

For each chain step i, every frontier node gets ``softmax(l_i + T[node token])`` over the hot
vocabulary and proposes its top-k tokens as children (joint probability = parent joint x
child probability); the k children with the highest joint probability form the next
frontier. Every proposed child stays in the candidate nodes (``DraftNodes``: plain lists, a
few tensor ops per step and none per node); the caller prunes them to the verification budget
by joint probability and makes the one tree it proposes. Children are chosen
deterministically, so the tree is a ``DraftScheme.TOPK`` candidate set (lossless with the
deterministic-candidate rule); at temperature > 0 they are drawn without replacement from
the processed rows instead (``lyanna.drafters.sampled``: a WITHOUT_REPLACEMENT tree).

The logits and the table may live on a GPU (``lyanna.drafters.placement``): each step's rows,
softmax and draws run there and its children come to the CPU in one copy; the nodes, the
frontier and the hot maps (``hot_ids``, ``hot_index``) are CPU bookkeeping.

Worked example (k = 2, two steps): root "model" -> children "training" (0.6), "inference"
(0.3); both are kept as frontier; step 2 gives "training" -> "server" (0.7 -> joint 0.42) and
"data" (0.2 -> 0.12), "inference" -> "speed" (0.8 -> 0.24), "cost" (0.1 -> 0.03); the next
frontier is {server, speed}.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from lyanna.draft_nodes import DraftNodes
from lyanna.drafters.lyanna_model import copy_keys, copy_weights
from lyanna.drafters.placement import to_host
from lyanna.drafters.sampled import DraftSampling, SampledTrees, draw_children
from lyanna.drafters.scopes import COPY_SCOPE, LM_HEAD_SCOPE, scope


@dataclass(frozen=True, slots=True, eq=False)
class GatedTokenInfo:
    """State-gated token info (``LyannaDraftConfig.info_gate``) of B chains: the bias of
    parent ``t`` at chain step ``i`` is ``RMSNorm((A[t] * gates[:, i]) W2)`` (or, for a state
    correction, ``(A[t] * gates[:, i]) U W_head`` without RMSNorm) with the
    collapsed factors ``A = W_E[hot] W1`` and ``gates = 1 + G h_i`` of each chain's states
    (made once per chain, with its one-pass logits). No lookup table: one ``[rank x
    num_hot]`` product per frontier row, the price of a bias that knows the context."""

    factors: torch.Tensor  # [num_hot, rank] float32
    w2: torch.Tensor  # [rank, num_hot] float32 (``info_space="state"``: U W_head)
    weight: torch.Tensor | None  # [num_hot] the info RMSNorm's weight (None: no RMSNorm)
    eps: float
    gate: torch.Tensor  # [rank, n] float32: G
    gates: torch.Tensor | None = None  # [B, steps, rank] float32 of the chains (``for_chains``)

    def for_chains(
        self, chains: torch.Tensor, contexts: object = None, root_embeddings: object = None
    ) -> GatedTokenInfo:
        """The token info of the chains ``chains`` [B, steps, n] (a copy read's arguments
        ignored: ``ContextCopy.for_chains``'s signature)."""
        return replace(self, gates=1.0 + chains.float() @ self.gate.T)

    def rows(self, hot: torch.Tensor, step: int) -> torch.Tensor:
        """Bias rows [B, f, num_hot] of the frontier's hot rows ``hot`` [B, f] (-1: a cold
        root, no token info)."""
        u = (self.factors[hot.clamp(min=0)] * self.gates[:, step, None, :]) @ self.w2
        if self.weight is not None:  # (None: a state correction's bias D W_head)
            u = F.rms_norm(u, self.weight.shape, self.weight, self.eps)
        return u * (hot >= 0)[..., None]

    def after(self, start: int) -> GatedTokenInfo:
        """The same chains from step ``start`` on (a re-sampled subtree's remaining steps)."""
        return replace(self, gates=self.gates[:, start:])

    def chain(self, b: int) -> GatedTokenInfo:
        """Chain ``b``'s token info alone (B = 1), kept for its re-sampling."""
        return replace(self, gates=self.gates[b : b + 1])


@dataclass(frozen=True, slots=True, eq=False)
class ContextCopy:
    """The parent's copy read of the context (``LyannaDraftConfig.info_copy``) on top of its
    token info ``base``: parent ``t`` at chain step ``i`` queries its sequence's committed
    tokens, ``q = normalize(E(t) Wq + h_i Wqs) * temperature`` against their normalised keys
    ``E(t_p) Wk`` and a sink, reads the target's states there and adds
    ``(sigmoid(h_i w + b) * read * scale) W_head`` to the logits (``lyanna_model.CopyRead``,
    the same numbers). One attention read over the context per frontier row."""

    base: torch.Tensor | GatedTokenInfo | None  # the parent's own token info (its fixed parts)
    query: torch.Tensor  # [n, dc] Wq
    vocab_keys: torch.Tensor  # [vocab, dc] normalize(E(t) Wk) of every token, made once
    state_weight: torch.Tensor  # [n, dc] Wqs
    gate_weight: torch.Tensor  # [n] w
    gate_bias: float
    hot_query: torch.Tensor  # [num_hot, dc] E(hot) Wq
    scale: torch.Tensor  # [n]
    temperature: float
    sink: torch.Tensor  # [dc]
    sink_bias: float
    # the hot LM head, [..., n] -> [..., num_hot] float32 logits: the drafter's own (prepacked)
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    # per chain (``for_chains``)
    state_query: torch.Tensor | None = None  # [B, steps, dc] h_i Wqs
    gains: torch.Tensor | None = None  # [B, steps, n] sigmoid(h_i w + b) * scale
    keys: torch.Tensor | None = None  # [B, L + 1, dc] the context's keys and the sink (copy_keys)
    key_bias: torch.Tensor | None = None  # [B, 1, L + 1] their scores' mask (padding: -inf)
    values: torch.Tensor | None = None  # [B, L, n] the target's states at the context's tokens
    root_query: torch.Tensor | None = None  # [B, dc] E(root) Wq (a root may be cold)

    def context_keys(self, tokens: torch.Tensor) -> torch.Tensor:
        """Copy keys [m, dc] of committed tokens [m] (a lookup: no product per step)."""
        return self.vocab_keys[tokens]

    def for_chains(
        self,
        chains: torch.Tensor,  # [B, steps, n] the chains' states
        contexts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # keys, values, visible
        root_embeddings: torch.Tensor,  # [B, n] E(root) of each chain
    ) -> ContextCopy:
        """The copy read of these chains over their sequences' (padded) contexts."""
        h = chains.float()
        base = self.base.for_chains(h) if isinstance(self.base, GatedTokenInfo) else self.base
        keys, values, visible = contexts
        keys, key_bias = copy_keys(keys, visible[:, None], self.temperature, self.sink,
                                   self.sink_bias)  # fmt: skip
        gates = torch.sigmoid(h @ self.gate_weight + self.gate_bias)[..., None]
        return replace(self, base=base, state_query=h @ self.state_weight,
                       gains=gates * self.scale, keys=keys, key_bias=key_bias, values=values,
                       root_query=self.rooted(root_embeddings))  # fmt: skip

    def rooted(self, root_embeddings: torch.Tensor) -> torch.Tensor:
        """``E(root) Wq`` [B, dc] of root embeddings [B, n]."""
        return root_embeddings.float() @ self.query

    def rows(self, hot: torch.Tensor, step: int) -> torch.Tensor:
        """Bias rows [B, f, num_hot] of the frontier's hot rows ``hot`` [B, f]: the base
        token info (none for a cold root) plus the copy read."""
        token = self.root_query[:, None] if step == 0 else self.hot_query[hot]  # [B, f|1, dc]
        with scope(COPY_SCOPE):
            query = token + self.state_query[:, step, None]
            weights = copy_weights(query, self.keys, self.key_bias)
            read = (weights @ self.values) * self.gains[:, step, None]  # [B, f, n]
        with scope(LM_HEAD_SCOPE):
            logits = self.head(read)
        return _with_token_info(logits, hot, self.base, step)

    def after(self, start: int) -> ContextCopy:
        """The same chains from step ``start`` on (the caller sets the new root's query)."""
        base = self.base.after(start) if isinstance(self.base, GatedTokenInfo) else self.base
        return replace(self, base=base, state_query=self.state_query[:, start:],
                       gains=self.gains[:, start:])  # fmt: skip

    def chain(self, b: int) -> ContextCopy:
        """Chain ``b``'s token info alone (B = 1), kept for its re-sampling."""
        base = self.base.chain(b) if isinstance(self.base, GatedTokenInfo) else self.base
        one = slice(b, b + 1)
        return replace(self, base=base, state_query=self.state_query[one],
                       gains=self.gains[one], keys=self.keys[one], key_bias=self.key_bias[one],
                       values=self.values[one], root_query=self.root_query[one])  # fmt: skip


# a collapsed [num_hot, num_hot] table, a state-gated token info, or either with a copy read
TokenInfo = torch.Tensor | GatedTokenInfo | ContextCopy


def build_subtrees(
    logits: torch.Tensor,  # [B, steps, num_hot] raw chain logits (no token info yet)
    root_tokens: list[int],  # [B]
    top_k: int,
    info_table: TokenInfo | None,  # [num_hot, num_hot] collapsed token info, gated, or None
    hot_ids: torch.Tensor,  # [num_hot] full-vocabulary id of each hot column
    hot_index: torch.Tensor,  # [vocab] hot row of each token, -1 if not hot
    draws: list[DraftSampling | None] | None = None,  # per tree; None: all top-k
) -> list[DraftNodes]:
    """BuildSubtree of Algorithm 1 for B chains at once: trees of depth ``steps`` rooted at
    ``root_tokens``. Every tree has the same shape (the root, then frontier x k nodes per
    step), so a step is one batch of row-wise tensor ops (each row sees what it would see
    alone: a tree never depends on the rest of the batch) and the nodes are read back once.
    A sampling sequence (``draws``) draws its children without replacement from the processed
    rows instead (``lyanna.drafters.sampled``)."""
    B = logits.shape[0]
    draws = draws or [None] * B
    if top_k == 1 and logits.shape[1] > 0 and all(d is None for d in draws):
        return _greedy_chains(logits, root_tokens, info_table, hot_ids, hot_index)
    roots = torch.tensor(root_tokens, dtype=torch.int64)
    tokens, parents, probs = [roots[:, None]], [torch.full((B, 1), -1)], [torch.ones(B, 1)]
    num_nodes = 1
    frontier = torch.zeros(B, 1, dtype=torch.int64)  # [B, f] node indices
    frontier_log_joint = torch.zeros(B, 1, dtype=torch.float64)
    frontier_hot = hot_index[roots][:, None]  # [B, f] hot rows of frontier tokens
    sampled = SampledTrees([b for b, draw in enumerate(draws) if draw is not None])
    for step in range(logits.shape[1]):
        rows = logits[:, step, None].expand(-1, frontier.shape[1], -1).float()
        rows = _with_token_info(rows, frontier_hot, info_table, step)
        children = draw_children(rows, top_k, draws, log_space=False).to_host()  # [B, f, k]
        sampled.add(children, frontier, frontier_log_joint)
        child_probs, child_cols = children.values, children.columns
        tokens.append(hot_ids[child_cols].flatten(1))
        parents.append(frontier.repeat_interleave(top_k, dim=1))
        probs.append(child_probs.flatten(1))
        frontier, frontier_log_joint, frontier_hot, num_nodes = _next_frontier(
            frontier_log_joint, child_probs, child_cols, num_nodes, top_k
        )
    columns = (torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(probs, 1))
    nodes = [DraftNodes(*row) for row in zip(*(c.tolist() for c in columns), strict=True)]
    return sampled.attach(nodes, hot_ids)


def device_subtrees(
    logits: torch.Tensor,  # [B, steps, num_hot] raw chain logits (no token info yet)
    roots_hot: torch.Tensor,  # [B] int64 hot row of each root token, -1 if cold
    top_k: int,
    info_table: TokenInfo | None,  # collapsed table, per-chain info (``for_chains``) or None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # hot columns, parents, probs [B, M]
    """``build_subtrees`` for top-k trees, every step on the logits' device and nothing read
    back: each drafted node's hot column, parent index and draft probability in node order
    (node i + 1 of the tree is column i: the root is left out). The same row arithmetic,
    ``draw_children``'s softmax and top-k, and the same float64 joint probabilities, so
    the same nodes; ``lyanna.drafters.static_draft`` runs it inside Lyanna's draft step."""
    B, steps = logits.shape[:2]
    device = logits.device
    if top_k == 1:  # a chain (the 4-bit CPU default): ``_greedy_chains``'s few ops per step
        hot, columns, probs = roots_hot[:, None], [], []
        for step in range(steps):
            rows = _with_token_info(logits[:, step, None].float(), hot, info_table, step)
            top = rows.softmax(-1).topk(1, dim=-1)  # [B, 1, 1]
            hot = top.indices[:, 0]
            columns.append(hot)
            probs.append(top.values[:, 0])
        parents = torch.arange(steps, device=device).expand(B, steps)
        return torch.cat(columns, 1), parents, torch.cat(probs, 1)
    frontier = torch.zeros(B, 1, dtype=torch.int64, device=device)  # [B, f] node indices
    frontier_log_joint = torch.zeros(B, 1, dtype=torch.float64, device=device)
    frontier_hot = roots_hot[:, None]  # [B, f] hot rows of frontier tokens
    columns, parents, probs = [], [], []
    num_nodes = 1
    for step in range(steps):
        rows = logits[:, step, None].expand(-1, frontier.shape[1], -1).float()
        rows = _with_token_info(rows, frontier_hot, info_table, step)
        top = rows.softmax(-1).topk(top_k, dim=-1)  # [B, f, k]
        child_probs, child_cols = top.values, top.indices
        columns.append(child_cols.flatten(1))
        parents.append(frontier.repeat_interleave(top_k, dim=1))
        probs.append(child_probs.flatten(1))
        frontier, frontier_log_joint, frontier_hot, num_nodes = _next_frontier(
            frontier_log_joint, child_probs, child_cols, num_nodes, top_k
        )
    return torch.cat(columns, 1), torch.cat(parents, 1), torch.cat(probs, 1)


def _next_frontier(
    frontier_log_joint: torch.Tensor,  # [B, f] float64
    child_probs: torch.Tensor,  # [B, f, k] draft probabilities of each frontier node's children
    child_cols: torch.Tensor,  # [B, f, k] their hot columns
    num_nodes: int,  # nodes in the tree before these children
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The ``top_k`` new nodes of highest joint probability become the next frontier (node
    indices, float64 joint log-probabilities, hot columns) after the ``f * k`` just added;
    one rule for the host-built and the device-built trees."""
    log_joint = (frontier_log_joint[..., None] + child_probs.double().log()).flatten(1)
    keep = log_joint.topk(min(top_k, log_joint.shape[1]), dim=-1).indices  # [B, f']
    hot = child_cols.flatten(1).gather(1, keep)
    return num_nodes + keep, log_joint.gather(1, keep), hot, num_nodes + log_joint.shape[1]


def _greedy_chains(
    logits: torch.Tensor,  # [B, steps, num_hot]
    root_tokens: list[int],
    info_table: TokenInfo | None,
    hot_ids: torch.Tensor,
    hot_index: torch.Tensor,
) -> list[DraftNodes]:
    """``build_subtrees`` with ``top_k`` 1 and no sampled draws (the serving default on a
    4-bit CPU target): every tree is a chain whose frontier is its one child, so a step is
    the general path's row arithmetic and ``draw_children`` without the joint bookkeeping
    that only a wider frontier needs (the same nodes and probabilities). Off the CPU the
    chain stays on the device until its columns and probabilities come back in one copy."""
    B, steps = logits.shape[:2]
    roots = torch.tensor(root_tokens, dtype=torch.int64)
    hot = hot_index[roots][:, None]  # [B, 1] hot row of each chain's newest token, -1 if cold
    columns, probs = [], []
    for step in range(steps):
        rows = _with_token_info(logits[:, step, None].float(), hot, info_table, step)
        children = draw_children(rows, 1, [None] * B, log_space=False)  # [B, 1, 1]
        hot = children.columns[:, 0]
        columns.append(hot)
        probs.append(children.values[:, 0])
    chain_columns, chain_probs = to_host(torch.cat(columns, 1), torch.cat(probs, 1))
    tokens = torch.cat([roots[:, None], hot_ids[chain_columns]], 1).tolist()
    chain_probs = torch.cat([torch.ones(B, 1), chain_probs], 1).tolist()
    parents = list(range(-1, steps))
    return [DraftNodes(t, list(parents), p) for t, p in zip(tokens, chain_probs, strict=True)]


def _with_token_info(
    rows: torch.Tensor,  # [B, f, num_hot] float32 raw logits of each frontier node's children
    hot: torch.Tensor,  # [B, f] hot row of each frontier token, -1 if cold
    info_table: TokenInfo | None,
    step: int,  # the chain step the rows belong to
) -> torch.Tensor:
    """The rows plus their parents' token info. Only the first step's parent (the root) can
    be cold, and a cold token has no token-info row; later parents are drafted children,
    always hot."""
    if info_table is None:
        return rows
    hot = hot.to(rows.device)  # a CPU frontier meets a GPU table (CPU: no-op)
    if not isinstance(info_table, torch.Tensor):  # per-chain info: cold roots handled there
        return rows + info_table.rows(hot, step)
    parents = hot.clamp(min=0) if step == 0 else hot
    info = info_table[parents].float()
    if step == 0:
        return torch.where((hot >= 0)[..., None], rows + info, rows)
    return rows + info


def build_subtree(
    logits: torch.Tensor,  # [steps, num_hot] raw chain logits (no token info yet)
    root_token: int,
    top_k: int,
    info_table: TokenInfo | None,
    hot_ids: torch.Tensor,
    hot_index: torch.Tensor,
) -> DraftNodes:
    """BuildSubtree of Algorithm 1 for one chain (``build_subtrees`` with B = 1)."""
    return build_subtrees(logits[None], [root_token], top_k, info_table, hot_ids, hot_index)[0]


def resample_subtree(
    logits: torch.Tensor,  # [N, num_hot] the previous chain's raw logits
    num_accepted: int,  # m: draft tokens accepted from that chain's tree
    bonus_token: int,  # the residual/bonus token: root of the new subtree
    min_remaining: int,  # r: build only if at least r chain steps remain
    top_k: int,
    info_table: TokenInfo | None,  # gated: this one chain's (B = 1)
    hot_ids: torch.Tensor,
    hot_index: torch.Tensor,
) -> DraftNodes | None:
    """Algorithm 2: the bonus token sits at depth m + 1 of the old chain, so the tokens after
    it are predicted by the remaining logits l(m+2..N) (rows m+1.. here), with the bonus
    token's token info on the first of them. None when fewer than r steps remain."""
    remaining = logits[num_accepted + 1 :]
    if remaining.shape[0] < max(min_remaining, 1):
        return None
    if not isinstance(info_table, torch.Tensor | None):
        info_table = info_table.after(num_accepted + 1)
    return build_subtree(remaining, bonus_token, top_k, info_table, hot_ids, hot_index)
