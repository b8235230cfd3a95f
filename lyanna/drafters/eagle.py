"""EAGLE-2 drafter (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees") on the one-layer EAGLE head of ``lyanna.drafters.eagle_head``.

Draft state per sequence: a KV cache of the head's single layer whose row j holds position j,
computed from ``fc(h_j, embed(t_{j+1}))`` with the target's own hidden state h_j, so the draft
KV always has exactly as many committed rows as the target KV. ``start`` fills it with the
prompt (the first token completes the last pair); ``on_verified`` queues the newly committed
tokens' hidden states, which the next ``propose`` runs as one batched catch-up forward whose
last output is the *root feature* (the predicted state of the root token).

Tree growth is EAGLE-2's dynamic tree (``lyanna.drafters.dynamic_tree``): a tree node runs
``fc(parent state, embed(node token))`` through the head at its tree position.

The head runs on the target's device (``lyanna.drafters.placement``): on the CPU with the fast
paths of ``lyanna.drafters.heads``, elsewhere (a GPU) as plain modules in the target's dtype
with its draft KV there; the target's hidden states are used where they arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.dynamic_tree import DynamicTreeDrafter
from lyanna.drafters.eagle_head import DEFAULT_CHECKPOINT, EagleHead, load_eagle_head
from lyanna.drafters.heads import (
    draft_weight_dtype,
    embedding_blocks,
    hot_lm_head,
    prepare_draft_layers,
)
from lyanna.drafters.placement import DraftPlacement
from lyanna.drafters.scopes import LAYER_SCOPE, scope
from lyanna.model.kv_cache import KVCache
from lyanna.model.quant import runs_q4
from lyanna.model.transformer import ForwardContext, Transformer, eager_context


@dataclass(slots=True)
class _DraftState:
    slot: int
    root: int  # the next token: root of the next tree
    root_state: torch.Tensor | None  # [d] predicted state at the root
    pending_hidden: list[torch.Tensor] = field(default_factory=list)  # each [n, d]
    pending_tokens: list[int] = field(default_factory=list)  # the token after each row


class EagleDrafter(DynamicTreeDrafter):
    needs_hidden = True

    def __init__(
        self,
        target: Transformer,
        head: EagleHead | None = None,
        budget: DraftBudget | None = None,
        max_running: int = 16,
        max_len: int = 4096,
        sample_drafts: bool = True,  # at T > 0: children drawn without replacement
        weight_dtype: torch.dtype | str | None = "auto",  # "auto": see DraftPlacement.of
        generic: bool = False,  # the device-generic path on the CPU too (tests)
        device_steps: bool | None = None,  # top-k trees through static_draft's steps
        #   (False: the host loop; None: where the draft runs the device-generic path, as a
        #   GPU does, while the CPU's fast paths keep the host loop, faster there: measured)
    ) -> None:
        self.budget = budget or DraftBudget()
        self._init_sampling(sample_drafts)
        head = head if head is not None else load_eagle_head(DEFAULT_CHECKPOINT)
        self.head = head.float().eval()
        self.placement = place = DraftPlacement.of(target, weight_dtype, generic)
        self.generic = place.generic
        self.embedding = target.embed_tokens  # shared, frozen
        self.hot_vocab = self.head.hot_vocab.cpu()  # [num_hot] int64: tree bookkeeping
        if place.generic:  # plain modules on the target's device
            place.move(self.head, self.head.fc, self.head.layer)
            self.lm_head = hot_lm_head(
                target.embed_tokens.weight, self.hot_vocab, place.dtype, generic=True
            )
        else:  # the CPU fast paths
            dtype = draft_weight_dtype(target) if weight_dtype == "auto" else weight_dtype
            prepare_draft_layers(self.head, dtype, q4_layers=runs_q4(target))
            self.lm_head = hot_lm_head(
                target.embed_tokens.weight, self.hot_vocab, dtype, embedding_blocks(target)
            )
        self.rope_cos, self.rope_sin = self.head.rope_cos, self.head.rope_sin  # float32
        config = self.head.config.layer_config()
        max_len = min(max_len, config.max_position_embeddings)
        # spare rows: a device step's inactive window rows write a tree past a full prefix
        spare = (self.budget.depth - 1) * self.budget.top_k
        self.cache = KVCache(config, max_running, max_len, place.dtype, place.device, spare)
        self._seqs: dict[int, _DraftState] = {}
        self.device_steps = place.generic if device_steps is None else device_steps

    # -- Drafter protocol --------------------------------------------------------------

    @torch.inference_mode()
    def start(self, seq_id, prompt_ids, prompt_hidden, first_token, params=None) -> None:
        self._start_sampling(seq_id, params)
        if prompt_hidden is None:
            raise ValueError("the EAGLE drafter needs the prompt's hidden states")
        state = _DraftState(slot=self.cache.allocate(), root=first_token, root_state=None)
        self._seqs[seq_id] = state
        state.pending_hidden.append(prompt_hidden)
        state.pending_tokens += [*prompt_ids[1:], first_token]
        self._catch_up([state])

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        self._learn_acceptance(steps)
        for step in steps:
            state = self._seqs[step.seq_id]
            state.pending_hidden.append(step.hidden)
            state.pending_tokens += [*step.committed[1:], step.next_token]
            state.root = step.next_token
        return {}

    # -- draft KV ----------------------------------------------------------------------

    def _catch_up(self, states: list[_DraftState]) -> None:
        """Run the queued (hidden state, next token) pairs into the draft KV and commit them;
        the last output of each sequence becomes its root feature."""
        place = self.placement
        hidden = [place.rows(torch.cat(s.pending_hidden)) for s in states]
        counts = [h.shape[0] for h in hidden]
        q = max(counts)
        slots = torch.tensor([s.slot for s in states])  # CPU bookkeeping, as the target's
        if min(counts) == q:  # nothing to pad (always so for one sequence)
            feats = torch.stack(hidden)
        else:
            feats = hidden[0].new_zeros(len(states), q, hidden[0].shape[1])
            for b, h in enumerate(hidden):
                feats[b, : h.shape[0]] = h
        tokens = [s.pending_tokens + [0] * (q - len(s.pending_tokens)) for s in states]
        positions = place.ids(self.cache.lengths[slots][:, None] + torch.arange(q))
        ctx = eager_context(self.cache, slots, positions, None, self.rope_cos, self.rope_sin)
        with scope(LAYER_SCOPE):
            out = self.head.layer(self.head.fuse(feats, self._embed(tokens)), ctx, 0)
        for b, (s, h) in enumerate(zip(states, hidden, strict=True)):
            n = h.shape[0]
            self.cache.commit_prefix(s.slot, n)
            s.root_state = out[b, n - 1]
            s.pending_hidden.clear()
            s.pending_tokens.clear()

    def _node_forward(
        self,
        ctx: ForwardContext,
        parent_states: torch.Tensor,  # [B, k, d] parents' predicted states
        tokens: torch.Tensor,  # [B, k]
    ) -> torch.Tensor:  # [B, k, d] predicted states of the nodes
        return self.head.layer(self.head.fuse(parent_states, self._embed(tokens)), ctx, 0)

    def _embed(self, tokens: list[list[int]] | torch.Tensor) -> torch.Tensor:  # [B, q, d]
        """The target's embeddings of ``tokens`` (built on the CPU) in the head's dtype."""
        return self.embedding(self.placement.ids(tokens)).to(self.placement.dtype)
