"""EAGLE-2 drafter (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees") on the one-layer EAGLE head of ``lyanna.drafters.eagle_head``.

Draft state per sequence: a KV cache of the head's single layer whose row j holds position j,
computed from ``fc(h_j, embed(t_{j+1}))`` with the target's own hidden state h_j, so the draft
KV always has exactly as many committed rows as the target KV. ``start`` fills it with the
prompt (the first token completes the last pair); ``on_verified`` queues the newly committed
tokens' hidden states, which the next ``propose`` runs as one batched catch-up forward whose
last output is the *root feature* (the predicted state of the root token).

Tree growth (batched over sequences): the root's children are the top-k hot tokens of the
root feature. At each further depth the ``top_k`` newest nodes with the highest joint draft
probability (product of draft probabilities along the path) are expanded: one forward of the
head over them - a node attends to the committed rows, its expanded ancestors and itself, at
position ``num_committed + depth - 1`` - and each gets its top-k children. Finally all nodes
are reranked by joint probability and the best ``max_tokens`` kept (``TokenTree.prune``; a
child never outranks its parent, so the kept set is a tree). Candidates are a deterministic
top-k set: ``DraftScheme.TOPK``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.eagle_head import DEFAULT_CHECKPOINT, EagleHead, load_eagle_head
from lyanna.kv_cache import KVCache
from lyanna.model.cpu_kernels import PackedLinear, prepack_linears, prepacking_available
from lyanna.model.transformer import ForwardContext, Transformer
from lyanna.tree import DraftScheme, TokenTree


@dataclass(slots=True)
class _DraftState:
    slot: int
    root: int  # the next token: root of the next tree
    root_feature: torch.Tensor | None  # [d] predicted state at the root
    pending_hidden: list[torch.Tensor] = field(default_factory=list)  # each [n, d]
    pending_tokens: list[int] = field(default_factory=list)  # the token after each row


@dataclass(slots=True, eq=False)
class _TreeContext:
    """Duck-types ``ForwardContext`` for a tree step: explicit rows and mask."""

    cache: KVCache
    slots: torch.Tensor  # [B] int64
    rows: torch.Tensor  # [B, q] int64 cache row of each query
    kv_len: int
    cos: torch.Tensor  # [B, 1, q, hd]
    sin: torch.Tensor  # [B, 1, q, hd]
    mask: torch.Tensor  # [B, 1, q, kv_len] bool


class EagleDrafter:
    scheme = DraftScheme.TOPK
    needs_hidden = True

    def __init__(
        self,
        target: Transformer,
        head: EagleHead | None = None,
        budget: DraftBudget | None = None,
        max_sequences: int = 8,
        max_len: int = 4096,
    ) -> None:
        self.budget = budget or DraftBudget()
        head = head if head is not None else load_eagle_head(DEFAULT_CHECKPOINT)
        self.head = head.float().eval()
        prepack_linears(self.head)
        self.embedding = target.embed_tokens  # shared, frozen
        self.hot_vocab = self.head.hot_vocab  # [num_hot] int64
        hot_rows = target.embed_tokens.weight.detach()[self.hot_vocab].float().contiguous()
        self.lm_head = (
            PackedLinear(hot_rows) if prepacking_available(hot_rows) else _Linear(hot_rows)
        )
        config = self.head.config.layer_config()
        max_len = min(max_len, config.max_position_embeddings)
        self.cache = KVCache(config, max_sequences, max_len, torch.float32)
        self._seqs: dict[int, _DraftState] = {}

    # -- Drafter protocol --------------------------------------------------------------

    @torch.inference_mode()
    def start(self, seq_id, prompt_ids, prompt_hidden, first_token) -> None:
        if prompt_hidden is None:
            raise ValueError("the EAGLE drafter needs the prompt's hidden states")
        state = _DraftState(slot=self.cache.allocate(), root=first_token, root_feature=None)
        self._seqs[seq_id] = state
        state.pending_hidden.append(prompt_hidden)
        state.pending_tokens += [*prompt_ids[1:], first_token]
        self._catch_up([state])

    def on_verified(self, steps: list[VerifiedStep]) -> None:
        for step in steps:
            state = self._seqs[step.seq_id]
            state.pending_hidden.append(step.hidden)
            state.pending_tokens += [*step.committed[1:], step.next_token]
            state.root = step.next_token

    def release(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self.cache.release(state.slot)

    @torch.inference_mode()
    def propose(self, seq_ids: list[int]) -> list[TokenTree]:
        states = [self._seqs[s] for s in seq_ids]
        behind = [s for s in states if s.pending_tokens]
        if behind:
            self._catch_up(behind)
        return self._grow([s for s in states])

    # -- draft KV ----------------------------------------------------------------------

    def _catch_up(self, states: list[_DraftState]) -> None:
        """Run the queued (hidden state, next token) pairs into the draft KV and commit them;
        the last output of each sequence becomes its root feature."""
        hidden = [torch.cat(s.pending_hidden).float() for s in states]
        q = max(h.shape[0] for h in hidden)
        d = hidden[0].shape[1]
        B = len(states)
        slots = torch.tensor([s.slot for s in states])
        feats = torch.zeros(B, q, d)
        tokens = torch.zeros(B, q, dtype=torch.int64)
        for b, (s, h) in enumerate(zip(states, hidden, strict=True)):
            feats[b, : h.shape[0]] = h
            tokens[b, : h.shape[0]] = torch.tensor(s.pending_tokens)
        positions = self.cache.lengths[slots][:, None] + torch.arange(q)
        ctx = ForwardContext(
            self.cache, slots, positions, None, self.head.rope_cos, self.head.rope_sin
        )
        out = self.head.layer(self.head.fuse(feats, self.embedding(tokens)), ctx, 0)
        for b, (s, h) in enumerate(zip(states, hidden, strict=True)):
            n = h.shape[0]
            self.cache.commit(s.slot, torch.arange(n))
            s.root_feature = out[b, n - 1]
            s.pending_hidden.clear()
            s.pending_tokens.clear()

    def _tree_forward(
        self,
        lengths: torch.Tensor,  # [B] committed draft rows
        slots: torch.Tensor,  # [B]
        depth: int,  # depth of the nodes run (>= 1)
        features: torch.Tensor,  # [B, k, d] their parents' outputs
        tokens: torch.Tensor,  # [B, k] their tokens
        ancestor_rows: list[list[list[int]]],  # [B][k] tree rows of strict ancestors
    ) -> torch.Tensor:  # [B, k, d] predicted states of the nodes
        B, k, _ = features.shape
        rows = lengths[:, None] + (depth - 1) * k + torch.arange(k)  # [B, k]
        kv_len = int(lengths.max()) + depth * k
        self.cache.check_room(slots, depth * k)
        cols = torch.arange(kv_len)
        mask = (cols[None, None, :] < lengths[:, None, None]).expand(B, k, kv_len).clone()
        for b in range(B):
            for j in range(k):
                mask[b, j, ancestor_rows[b][j] + [int(rows[b, j])]] = True
        positions = (lengths + depth - 1)[:, None].expand(B, k)
        ctx = _TreeContext(
            cache=self.cache,
            slots=slots,
            rows=rows,
            kv_len=kv_len,
            cos=self.head.rope_cos[positions].unsqueeze(1),
            sin=self.head.rope_sin[positions].unsqueeze(1),
            mask=mask.unsqueeze(1),
        )
        return self.head.layer(self.head.fuse(features, self.embedding(tokens)), ctx, 0)

    # -- tree growth -------------------------------------------------------------------

    def _top_children(self, features: torch.Tensor, k: int):
        """features [B, n, d] -> (log probs [B, n, k], token ids [B, n, k]) of the top-k hot
        tokens of each node."""
        log_probs = self.lm_head(features).float().log_softmax(-1)
        top = log_probs.topk(k, dim=-1)
        return top.values, self.hot_vocab[top.indices]

    def _grow(self, states: list[_DraftState]) -> list[TokenTree]:
        budget = self.budget
        k = min(budget.top_k, self.hot_vocab.numel())
        B = len(states)
        slots = torch.tensor([s.slot for s in states])
        lengths = self.cache.lengths[slots].clone()
        tokens = [[s.root] for s in states]
        parents = [[-1] for _ in states]
        logq = [[0.0] for _ in states]  # log draft probability of each node's token
        root_features = torch.stack([s.root_feature for s in states])[:, None]  # [B, 1, d]
        child_logq, child_tokens = self._top_children(root_features, k)  # [B, 1, k]
        joint = child_logq[:, 0]  # [B, k] joint log probability of the frontier
        frontier = torch.zeros(B, k, dtype=torch.int64)  # node index of each frontier entry
        for b in range(B):
            for j in range(k):
                frontier[b, j] = len(tokens[b])
                tokens[b].append(int(child_tokens[b, 0, j]))
                parents[b].append(0)
                logq[b].append(float(child_logq[b, 0, j]))
        frontier_tokens = child_tokens[:, 0]  # [B, k]
        frontier_features = root_features.expand(B, k, -1)  # parents' outputs
        ancestors = [[[] for _ in range(k)] for _ in range(B)]  # tree rows of strict ancestors
        for depth in range(1, budget.depth):
            out = self._tree_forward(
                lengths, slots, depth, frontier_features, frontier_tokens, ancestors
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
            frontier_features = out.gather(1, parent_slot[..., None].expand(-1, -1, out.shape[-1]))
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


class _Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:  # weight [out, in]
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
