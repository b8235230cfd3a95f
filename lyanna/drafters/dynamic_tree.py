"""EAGLE-2's dynamic draft tree (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees"), shared by every drafter that runs a small network over tree nodes:
the EAGLE head (node input = its parent's predicted state fused with the node's token) and the
standalone draft model of SPS (node input = the node's token only).

Tree growth (batched over sequences): the root's children are the top-k hot tokens of the
root state. At each further depth the ``top_k`` newest nodes with the highest joint draft
probability (product of draft probabilities along the path) are expanded: one forward over
them - a node attends to the committed draft-KV rows, its expanded ancestors and itself, at
position ``num_committed_rows + depth - 1`` - and each gets its top-k children. Finally all
nodes are reranked by joint probability and the best ``max_tokens`` kept (``TokenTree.prune``;
a child never outranks its parent, so the kept set is a tree). Candidates are a deterministic
top-k set: ``DraftScheme.TOPK``.

A subclass provides the draft KV cache, the hot vocabulary and its LM head, the rotary tables,
``_catch_up`` (committed tokens into the draft KV) and ``_node_forward`` (what one tree step
computes); its per-sequence states (``_seqs``) follow ``RootedState``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from lyanna.drafters.base import DraftBudget
from lyanna.drafters.scopes import LAYER_SCOPE, LM_HEAD_SCOPE, SOFTMAX_SCOPE
from lyanna.kv_cache import KVCache
from lyanna.model.cpu_kernels import PackedLinear, prepacking_available
from lyanna.tree import DraftScheme, TokenTree


class RootedState(Protocol):
    slot: int  # draft KV slot
    root: int  # the next tree's root token
    root_state: torch.Tensor | None  # [d] the drafter's state at the root
    pending_tokens: list[int]  # committed tokens (and root) the draft KV has not seen yet


@dataclass(slots=True, eq=False)
class TreeContext:
    """Duck-types ``ForwardContext`` for a tree step: explicit rows and mask."""

    cache: KVCache
    slots: torch.Tensor  # [B] int64
    rows: torch.Tensor  # [B, q] int64 cache row of each query
    kv_len: int
    cos: torch.Tensor  # [B, 1, q, hd]
    sin: torch.Tensor  # [B, 1, q, hd]
    mask: torch.Tensor  # [B, 1, q, kv_len] bool


class Linear(nn.Module):
    """A bias-free linear over fixed rows (fallback where oneDNN prepacking is unavailable)."""

    def __init__(self, weight: torch.Tensor) -> None:  # weight [out, in]
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def hot_lm_head(embedding: torch.Tensor, hot_vocab: torch.Tensor) -> nn.Module:
    """The tied LM head restricted to the hot rows, prepacked on CPU."""
    rows = embedding.detach()[hot_vocab].float().contiguous()  # [num_hot, d]
    return PackedLinear(rows) if prepacking_available(rows) else Linear(rows)


class DynamicTreeDrafter:
    scheme = DraftScheme.TOPK
    budget: DraftBudget
    cache: KVCache
    hot_vocab: torch.Tensor  # [num_hot] int64
    lm_head: nn.Module  # [d] -> [num_hot] logits
    rope_cos: torch.Tensor  # [max_positions, hd]
    rope_sin: torch.Tensor
    _seqs: dict[int, RootedState]

    @torch.inference_mode()
    def propose(self, seq_ids: list[int]) -> list[TokenTree]:
        states = [self._seqs[s] for s in seq_ids]
        behind = [s for s in states if s.pending_tokens]
        if behind:
            self._catch_up(behind)
        return self._grow(states)

    def release(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self.cache.release(state.slot)

    def _catch_up(self, states: list[RootedState]) -> None:
        """Run the pending tokens into the draft KV; set each sequence's ``root_state``."""
        raise NotImplementedError

    def _node_forward(
        self,
        ctx: TreeContext,
        parent_states: torch.Tensor,  # [B, k, d]
        tokens: torch.Tensor,  # [B, k] int64
    ) -> torch.Tensor:  # [B, k, d] the nodes' states (their children's distributions)
        raise NotImplementedError

    def _tree_forward(
        self,
        lengths: torch.Tensor,  # [B] committed draft rows
        slots: torch.Tensor,  # [B]
        depth: int,  # depth of the nodes run (>= 1)
        parent_states: torch.Tensor,  # [B, k, d] their parents' states
        tokens: torch.Tensor,  # [B, k] their tokens
        ancestor_rows: list[list[list[int]]],  # [B][k] tree rows of strict ancestors
    ) -> torch.Tensor:  # [B, k, d]
        B, k = tokens.shape
        rows = lengths[:, None] + (depth - 1) * k + torch.arange(k)  # [B, k]
        kv_len = int(lengths.max()) + depth * k
        self.cache.check_room(slots, depth * k)
        cols = torch.arange(kv_len)
        mask = (cols[None, None, :] < lengths[:, None, None]).expand(B, k, kv_len).clone()
        for b in range(B):
            for j in range(k):
                mask[b, j, ancestor_rows[b][j] + [int(rows[b, j])]] = True
        positions = (lengths + depth - 1)[:, None].expand(B, k)
        ctx = TreeContext(
            cache=self.cache,
            slots=slots,
            rows=rows,
            kv_len=kv_len,
            cos=self.rope_cos[positions].unsqueeze(1),
            sin=self.rope_sin[positions].unsqueeze(1),
            mask=mask.unsqueeze(1),
        )
        with record_function(LAYER_SCOPE):
            return self._node_forward(ctx, parent_states, tokens)

    def _top_children(self, states: torch.Tensor, k: int):
        """states [B, n, d] -> (log probs [B, n, k], token ids [B, n, k]) of the top-k hot
        tokens of each node."""
        with record_function(LM_HEAD_SCOPE):
            logits = self.lm_head(states).float()
        with record_function(SOFTMAX_SCOPE):
            log_probs = logits.log_softmax(-1)
        top = log_probs.topk(k, dim=-1)
        return top.values, self.hot_vocab[top.indices]

    def _grow(self, states: list[RootedState]) -> list[TokenTree]:
        budget = self.budget
        k = min(budget.top_k, self.hot_vocab.numel())
        B = len(states)
        slots = torch.tensor([s.slot for s in states])
        lengths = self.cache.lengths[slots].clone()
        tokens = [[s.root] for s in states]
        parents = [[-1] for _ in states]
        logq = [[0.0] for _ in states]  # log draft probability of each node's token
        root_states = torch.stack([s.root_state for s in states])[:, None]  # [B, 1, d]
        child_logq, child_tokens = self._top_children(root_states, k)  # [B, 1, k]
        joint = child_logq[:, 0]  # [B, k] joint log probability of the frontier
        frontier = torch.zeros(B, k, dtype=torch.int64)  # node index of each frontier entry
        for b in range(B):
            for j in range(k):
                frontier[b, j] = len(tokens[b])
                tokens[b].append(int(child_tokens[b, 0, j]))
                parents[b].append(0)
                logq[b].append(float(child_logq[b, 0, j]))
        frontier_tokens = child_tokens[:, 0]  # [B, k]
        frontier_states = root_states.expand(B, k, -1)  # parents' states
        ancestors = [[[] for _ in range(k)] for _ in range(B)]  # tree rows of strict ancestors
        for depth in range(1, budget.depth):
            out = self._tree_forward(
                lengths, slots, depth, frontier_states, frontier_tokens, ancestors
            )
            child_logq, child_tokens = self._top_children(out, k)  # [B, k, k]
            cand_joint = (joint[:, :, None] + child_logq).reshape(B, k * k)
            best = cand_joint.topk(k, dim=-1).indices  # [B, k] candidates expanded next
            new_frontier = torch.zeros(B, k, dtype=torch.int64)
            new_ancestors = []
            for b in range(B):
                base = len(tokens[b])
                for i in range(k):
                    for j in range(k):
                        tokens[b].append(int(child_tokens[b, i, j]))
                        parents[b].append(int(frontier[b, i]))
                        logq[b].append(float(child_logq[b, i, j]))
                row = int(lengths[b]) + (depth - 1) * k
                new_ancestors.append(
                    [ancestors[b][int(c) // k] + [row + int(c) // k] for c in best[b]]
                )
                new_frontier[b] = base + best[b]
            parent_slot = best // k  # [B, k] which frontier entry each new node came from
            frontier_states = out.gather(1, parent_slot[..., None].expand(-1, -1, out.shape[-1]))
            frontier_tokens = child_tokens.reshape(B, k * k).gather(1, best)
            joint = cand_joint.gather(1, best)
            frontier, ancestors = new_frontier, new_ancestors
        return [
            TokenTree.from_parents(
                tokens[b],
                parents[b],
                scheme=DraftScheme.TOPK,
                draft_token_probs=torch.tensor(logq[b], dtype=torch.float64).exp(),
            ).prune(budget.max_tokens)
            for b in range(B)
        ]
