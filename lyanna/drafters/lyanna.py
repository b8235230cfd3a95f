"""The Lyanna drafter at inference: hidden-state chain, token-info tree sampling, re-sampling
and verification fusion (paper Sections 4-6).

Per step and sequence: the fused inputs ``fc(H_j ⊕ E(t_j+1))`` of the newly committed tokens
enter the draft layer's KV cache; the last one yields ``h1``; ``h2..hN`` follow from the chain
alone (their KV rows are rolled back afterwards); the LM head runs once over the chain; the
tree is built by token-info sampling and pruned to the budget. After verification, if the
accepted path stopped early, the chain's remaining logits are re-sampled from the bonus
token (no new forward) and the subtree is either merged into the next verification tree
(fusion) or verified on its own in the next step (unfused ablation).

The draft model runs on the target's device (``lyanna.drafters.placement``): on the CPU with
the fast paths of ``lyanna.drafters.heads``, elsewhere (a GPU) as plain modules in the
target's dtype with its draft KV, chain logits and token-info table there. A top-k draft (every
greedy batch) runs after the context catch-up as one fixed-shape device step
(``lyanna.drafters.static_draft``: chain, one-pass logits, token-info tree), captured per bucket
as a CUDA graph on a GPU and run eagerly on the CPU, its tree read back in one copy; sampled
trees are built on the CPU from each depth's children (one copy per depth).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from lyanna.draft_nodes import DraftNodes
from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.checkpoint import checkpoint_dir, read_checkpoint
from lyanna.drafters.copy_context import CopyContexts
from lyanna.drafters.heads import (
    draft_weight_dtype,
    embedding_blocks,
    hot_lm_head,
    prepare_draft_layers,
)
from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
from lyanna.drafters.placement import DraftPlacement, to_host
from lyanna.drafters.sampled import DraftSampling, SampledDrafting
from lyanna.drafters.scopes import LAYER_SCOPE, LM_HEAD_SCOPE, scope
from lyanna.drafters.static_draft import ChainKey, draft_window, kv_bucket, lyanna_steps
from lyanna.drafters.token_info_tree import (
    ContextCopy,
    GatedTokenInfo,
    TokenInfo,
    build_subtrees,
    resample_subtree,
)
from lyanna.model.kv_cache import KVCache
from lyanna.model.quant import runs_q4
from lyanna.model.static_step import CapturedSteps
from lyanna.model.transformer import Transformer, eager_context
from lyanna.tree import TokenTree

DEFAULT_CHECKPOINT = checkpoint_dir("lyanna-smollm2-135m")


@dataclass(frozen=True, slots=True)
class ResampleConfig:
    enabled: bool = True
    fusion: bool = True  # merge into the next tree; False = verify it in a step of its own
    min_remaining: int = 1  # r: re-sample only if at least r chain steps remain


@dataclass(slots=True, eq=False)
class _SeqState:
    slot: int
    root: int  # next tree's root token (not yet in the target KV)
    pending: torch.Tensor  # [m, n] fused inputs waiting for the draft KV
    next_position: int  # position of pending[0]
    # verified steps' hidden rows and following tokens not yet fused: fused together when the
    # sequence next drafts (a gated-off sequence may not draft for many steps)
    unfused: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    chain_logits: torch.Tensor | None = None  # [N, num_hot] of the last fresh chain
    # its per-chain token info (info_gate, info_copy), B = 1: what re-sampling reads
    chain_info: GatedTokenInfo | ContextCopy | None = None
    resampled: DraftNodes | None = None
    resampled_paths: frozenset[tuple[int, ...]] = frozenset()  # token paths only it proposed


class LyannaDrafter(SampledDrafting):
    """At temperature > 0 the fresh tree's children are drawn without replacement (a
    WITHOUT_REPLACEMENT tree, ``lyanna.drafters.sampled``); a re-sampled subtree stays top-k,
    so a step that fuses one proposes a TOPK union, verified by the deterministic rule."""

    needs_hidden = True

    def __init__(
        self,
        target: Transformer,
        draft: LyannaDraftModel,
        budget: DraftBudget | None = None,
        resample: ResampleConfig | None = None,
        max_running: int = 16,
        max_len: int = 4096,
        weight_dtype: torch.dtype | str | None = "auto",  # "auto": see DraftPlacement.of
        sample_drafts: bool = True,  # at T > 0: children drawn without replacement
        generic: bool = False,  # the device-generic path on the CPU too (tests)
        device_steps: bool | None = None,  # top-k trees through static_draft's steps
        #   (False: the host loop; None: where the draft runs the device-generic path, as a
        #   GPU does, while the CPU's fast paths keep the host loop, faster there: measured)
    ) -> None:
        self.draft = draft.eval()
        self._steps: CapturedSteps | None = None
        self.placement = place = DraftPlacement.of(target, weight_dtype, generic)
        self.device_steps = place.generic if device_steps is None else device_steps
        # the hot maps build trees and index their rows: CPU bookkeeping on every device
        self.hot_ids, self.hot_index = draft.hot_ids.cpu(), draft.hot_index.cpu()
        if place.generic:  # plain modules on the target's device (the table from fp32 weights)
            place.move(draft)
            info, per_chain = _token_info(draft)
            place.move(draft, draft.fc, draft.layer, draft.out_norm)
            self.lm_head = hot_lm_head(draft.embedding, self.hot_ids, place.dtype, generic=True)
        else:  # the CPU fast paths
            dtype = draft_weight_dtype(target) if weight_dtype == "auto" else weight_dtype
            info, per_chain = _token_info(draft)  # from the fp32 weights, before packing
            prepare_draft_layers(draft, dtype, q4_layers=runs_q4(target))  # once, in place
            shared = draft.embedding.data_ptr() == target.embed_tokens.weight.data_ptr()
            blocks = embedding_blocks(target) if shared else None  # the target's own rows
            self.lm_head = hot_lm_head(draft.embedding, draft.hot_ids, dtype, blocks)
        if isinstance(per_chain, ContextCopy):  # its logits through the drafter's own head
            own = draft.out_norm.weight.dtype
            per_chain = replace(per_chain, head=lambda rows: self.lm_head(rows.to(own)).float())
        self.info_table = info  # [num_hot, num_hot] on the draft's device, or None
        # an info_gate / info_copy drafter's token info instead, made per chain (on the host
        # loop and inside the captured device step alike)
        self.per_chain_info = per_chain
        self.budget = budget or DraftBudget()
        self._init_sampling(sample_drafts)  # and the gain calibrations
        self.resample = resample or ResampleConfig()
        layer_config = replace(draft.config.target, num_layers=1)
        self.cache = KVCache(  # spare rows: a device step's inactive window rows write a chain
            layer_config,
            max_running,
            max_len + self.budget.depth + 1,
            place.dtype,
            place.device,
            spare_rows=self.budget.depth,
        )
        self.copy_contexts = None  # info_copy: each slot's committed keys and target states
        if isinstance(per_chain, ContextCopy):  # fixed rows where a captured step reads them
            rows = self.cache.num_rows if self.device_steps else None
            self.copy_contexts = CopyContexts(self.cache.num_slots, per_chain.query.shape[1],
                                              draft.config.target.hidden_size, place.device,
                                              rows)  # fmt: skip
        self.seqs: dict[int, _SeqState] = {}
        self._target = target

    def drop_token_info(self) -> None:
        """Ablation ("token info off at inference"): trees from the chain's logits alone, no
        table, gated info or copy read."""
        self.info_table = self.per_chain_info = self.copy_contexts = None

    def chain_token_info(
        self,
        chains: torch.Tensor,  # [B, N, n]
        contexts: tuple[torch.Tensor, ...] | None = None,  # a copy read's (keys, values, visible)
        root_embeddings: torch.Tensor | None = None,  # [B, n]: a copy read's roots
    ) -> TokenInfo | None:
        """The token info of these chains: the table, or made from their states (a copy read
        also reads their contexts from their roots). One rule for the host loop and the
        device step (``static_draft.lyanna_steps``)."""
        if self.per_chain_info is None:
            return self.info_table
        return self.per_chain_info.for_chains(chains, contexts, root_embeddings)

    def _chain_info(self, chains: torch.Tensor, states: list[_SeqState]) -> TokenInfo | None:
        """``chain_token_info`` of these sequences' chains [B, N, n] on the host loop."""
        if self.copy_contexts is None:
            return self.chain_token_info(chains)
        contexts = self.copy_contexts.padded([s.slot for s in states])
        roots = self.draft.embedding[self.placement.ids([s.root for s in states])]
        return self.chain_token_info(chains, contexts, roots)

    def _remember_context(
        self, state: _SeqState, tokens: list[int] | torch.Tensor, hidden: torch.Tensor
    ) -> None:
        """info_copy: append committed tokens and the target's states at them to the
        sequence's copy context (keys ``normalize(E(t) Wk)``)."""
        if self.copy_contexts is None:  # (set exactly when per_chain_info is a ContextCopy)
            return
        keys = self.per_chain_info.context_keys(self.placement.ids(list(tokens)))
        self.copy_contexts.append(state.slot, keys, hidden.to(self.placement.device))

    @classmethod
    def from_checkpoint(
        cls, target: Transformer, path: Path = DEFAULT_CHECKPOINT, **kwargs
    ) -> LyannaDrafter:
        values, state = read_checkpoint(path, "Lyanna")
        config = LyannaDraftConfig.from_dict(values)
        state = {k: v.float() for k, v in state.items()}
        draft = LyannaDraftModel(config, target.embed_tokens.weight, state["hot_ids"].long())
        draft.load_state_dict(state, strict=True)
        return cls(target, draft, **kwargs)

    # -- Drafter protocol ------------------------------------------------------------------

    def start(self, seq_id, prompt_ids, prompt_hidden, first_token, params=None) -> None:
        self._start_sampling(seq_id, params)
        following = self.placement.ids([*prompt_ids[1:], first_token])
        with torch.inference_mode():
            pending = self.draft.fuse(self._own_dtype(prompt_hidden), following)
        self.seqs[seq_id] = state = _SeqState(self.cache.allocate(), first_token, pending, 0)
        if self.copy_contexts is not None:
            self.copy_contexts.reset(state.slot)
        self._remember_context(state, prompt_ids, prompt_hidden)

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        self._learn_acceptance(steps)
        resampled = {}
        for step in steps:
            state = self.seqs[step.seq_id]
            following = torch.tensor([*step.committed[1:], step.next_token])
            state.unfused.append((step.hidden, following))
            self._remember_context(state, step.committed, step.hidden)
            if count := _resampled_accepted(state, step):
                resampled[step.seq_id] = count
            state.root = step.next_token
            state.resampled, state.resampled_paths = None, frozenset()
            if self.resample.enabled and state.chain_logits is not None:
                info = self.info_table if state.chain_info is None else state.chain_info
                if isinstance(info, ContextCopy):  # the bonus token roots the subtree
                    bonus = self.draft.embedding[self.placement.ids([step.next_token])]
                    info = replace(info, root_query=info.rooted(bonus))
                state.resampled = resample_subtree(
                    state.chain_logits,
                    step.num_accepted,
                    step.next_token,
                    self.resample.min_remaining,
                    self.budget.top_k,
                    info,
                    self.hot_ids,
                    self.hot_index,
                )
            state.chain_logits = state.chain_info = None
        return resampled

    def release(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id, None)
        self._stop_sampling(seq_id)
        if state is not None:
            self.cache.release(state.slot)

    def propose(self, seq_ids: list[int]) -> list[TokenTree]:
        start = time.perf_counter()
        states = [self.seqs[s] for s in seq_ids]
        if self.resample.fusion:
            fresh = self._fresh_trees(states, self._draws(seq_ids))
            candidates = [
                nodes if s.resampled is None else nodes.merge(s.resampled)
                for s, nodes in zip(states, fresh, strict=True)
            ]
        else:  # a re-sampled subtree is verified alone, in the step after its rejection
            drafting = [i for i, s in enumerate(states) if s.resampled is None]
            drafted = [states[i] for i in drafting]
            draws = self._draws([seq_ids[i] for i in drafting])
            new = iter(self._fresh_trees(drafted, draws) if drafting else [])
            fresh = [None if s.resampled is not None else next(new) for s in states]
            candidates = [
                s.resampled if f is None else f for s, f in zip(states, fresh, strict=True)
            ]
        # fused re-sampled nodes compete with fresh ones for the same verification budget
        calibrations = self._calibrations_for(seq_ids)
        trees = self.budget.prune(candidates, time.perf_counter() - start, calibrations)
        for state, kept, own in zip(states, trees, fresh, strict=True):
            if state.resampled is not None:
                state.resampled_paths = _token_paths(kept) - (
                    _token_paths(own) if own is not None else frozenset()
                )
        return [nodes.to_tree() for nodes in trees]

    # -- internals -------------------------------------------------------------------------

    def _fuse_pending(self, state: _SeqState) -> None:
        """Fuse the verified steps' rows waiting since the sequence last drafted, in one call."""
        if state.unfused:
            hidden = torch.cat([h for h, _ in state.unfused])
            following = self.placement.ids(torch.cat([t for _, t in state.unfused]))
            fused = self.draft.fuse(self._own_dtype(hidden), following)
            state.pending = torch.cat([state.pending, fused])
            state.unfused.clear()

    def _own_dtype(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden rows on the draft's device in its own dtype (a bf16 target's
        rows run through a float32 CPU draft; a no-op when they agree)."""
        return hidden.to(self.placement.device, self.draft.out_norm.weight.dtype)

    @torch.inference_mode()
    def _fresh_trees(
        self, states: list[_SeqState], draws: list[DraftSampling | None]
    ) -> list[DraftNodes]:
        """Each sequence's fresh candidates, pruned to the budget (not yet a tree: fusion
        may still merge the re-sampled subtree into them)."""
        if self.device_steps and all(d is None for d in draws):
            return self._fresh_on_device(states)
        with scope(LAYER_SCOPE):
            chains = self._chains(states)  # [B, N, n]
        with scope(LM_HEAD_SCOPE):
            logits = self.lm_head(chains)  # [B, N, num_hot]: one GEMM
        info = self._chain_info(chains, states)
        for b, state in enumerate(states):
            state.chain_logits = logits[b]
            if not isinstance(info, torch.Tensor | None):
                state.chain_info = info.chain(b)
        fresh = build_subtrees(
            logits,
            [s.root for s in states],
            self.budget.top_k,
            info,
            self.hot_ids,
            self.hot_index,
            draws,
        )
        return [nodes.prune(self.budget.max_tokens) for nodes in fresh]  # the cap

    def _chains(self, states: list[_SeqState]) -> torch.Tensor:  # [B, N, n]
        """h1 from the pending context, then h2..hN from the chain alone."""
        draft, cache, place = self.draft, self.cache, self.placement
        h, x = draft.read_out(self._context(states))
        if self.budget.depth == 1:  # h1 alone (the 4-bit CPU default): no chain step to run
            return h[:, None]
        slots = torch.tensor([s.slot for s in states])  # CPU bookkeeping, as the target's
        context_len = [s.next_position for s in states]
        chain = [h]
        for step in range(1, self.budget.depth):
            pos = place.ids([[p + step - 1] for p in context_len])
            ctx = eager_context(cache, slots, pos, None, draft.rope_cos, draft.rope_sin)
            h, x = draft.read_out(draft.layer(x[:, None], ctx, 0)[:, 0])
            for s in states:
                cache.commit_prefix(s.slot, 1)
            chain.append(h)
        for s, length in zip(states, context_len, strict=True):
            cache.truncate(s.slot, length)
        return torch.stack(chain, dim=1)

    def _context(self, states: list[_SeqState]) -> torch.Tensor:  # [B, n] raw h1
        """Run each sequence's pending fused inputs into the draft KV (one eager forward:
        their counts vary like a prompt's) and commit them; the last raw output yields h1
        (``draft.read_out``)."""
        draft, cache, place = self.draft, self.cache, self.placement
        for s in states:
            self._fuse_pending(s)
        slots = torch.tensor([s.slot for s in states])  # CPU bookkeeping, as the target's
        counts = [s.pending.shape[0] for s in states]
        width = max(counts)
        if min(counts) == width:  # nothing to pad (always so for one sequence)
            x = torch.stack([s.pending for s in states])
        else:
            x = states[0].pending.new_zeros(len(states), width, draft.config.target.hidden_size)
            for b, s in enumerate(states):
                x[b, : counts[b]] = s.pending
        positions = place.ids(  # padding rows repeat the last position
            [
                [s.next_position + min(j, m - 1) for j in range(width)]
                for s, m in zip(states, counts, strict=True)
            ]
        )
        out = draft.layer(
            x, eager_context(cache, slots, positions, None, draft.rope_cos, draft.rope_sin), 0
        )
        if min(counts) == width:
            last = out[:, -1]
        else:
            last = out[place.ids(list(range(len(states)))), place.ids(counts) - 1]
        for s, m in zip(states, counts, strict=True):
            cache.commit_prefix(s.slot, m)
            s.next_position += m
            s.pending = s.pending[:0]
        return last  # [B, n]: h1 = out_norm(last)

    @property
    def steps(self) -> CapturedSteps:
        """The chain-and-tree step by bucket (made on first use; ``bench.graph_check`` sets
        its own)."""
        if self._steps is None:
            self._steps = lyanna_steps(self)
        return self._steps

    @steps.setter
    def steps(self, steps: CapturedSteps) -> None:
        self._steps = steps

    def _fresh_on_device(self, states: list[_SeqState]) -> list[DraftNodes]:
        """``_fresh_trees`` for top-k trees: after the context catch-up, the chain, its
        logits and the token-info tree in one fixed-shape step over the window of draft
        slots (``static_draft.chain_step``), read back in one copy. The same nodes as the
        host path (tests/unit/test_static_draft.py)."""
        cache, steps = self.cache, self.steps
        with scope(LAYER_SCOPE):
            h1 = self._context(states)  # [B, n] raw (the step reads it out)
        slots = [s.slot for s in states]
        batch = draft_window(cache, slots)
        index = torch.tensor(slots)
        chain_rows = self.budget.depth - 1
        cache.check_room(index, chain_rows)
        kv_len = kv_bucket(cache, index, max(chain_rows, 1))
        key = ChainKey(batch, self.budget.depth, self.budget.top_k, kv_len)
        rows = index.to(h1.device)  # each sequence's row of the window
        x = h1.new_zeros(batch, h1.shape[-1])
        x[rows] = h1
        window_roots = torch.zeros(batch, dtype=torch.int64)  # idle window rows: any token
        window_roots[index] = torch.tensor([s.root for s in states])
        roots_hot = torch.full((batch,), -1, dtype=torch.int64)
        roots_hot[index] = self.hot_index[window_roots[index]]
        lengths = cache.lengths[:batch]
        copies = self.copy_contexts  # the step reads each context by its slot's KV length
        if copies is not None and any(copies.lengths[s] != int(cache.lengths[s]) for s in slots):
            raise RuntimeError("a copy context out of step with its draft KV rows")
        inputs = (x, lengths, roots_hot, window_roots)
        columns, parents, probs, logits, chains = steps.run(key, inputs)
        for state, row in zip(states, slots, strict=True):  # for re-sampling after verification
            state.chain_logits = logits[row].clone() if steps.capture else logits[row]
            if self.per_chain_info is not None:  # (made from the chain, not keeping it)
                state.chain_info = self._chain_info(chains[row : row + 1], [state])
        columns, parents, probs = to_host(columns[rows], parents[rows], probs[rows])
        B = len(states)
        roots = torch.tensor([[s.root] for s in states])
        tokens = torch.cat([roots, self.hot_ids[columns]], 1).tolist()
        parents = torch.cat([torch.full((B, 1), -1), parents], 1).tolist()
        probs = torch.cat([torch.ones(B, 1), probs], 1).tolist()
        return [
            DraftNodes(*node).prune(self.budget.max_tokens)  # the cap
            for node in zip(tokens, parents, probs, strict=True)
        ]


def _token_info(
    draft: LyannaDraftModel,
) -> tuple[torch.Tensor | None, GatedTokenInfo | ContextCopy | None]:
    """(the collapsed table, None), or with ``info_gate`` or ``info_copy`` (None, the per-chain
    info's fixed parts, float32 on the draft's device); (None, None) without token info."""
    table, gated = _own_token_info(draft)
    copy = draft.copy
    if copy is None:
        return table, gated
    with torch.no_grad():
        query = copy.query.float().clone()
        return None, ContextCopy(
            base=gated if gated is not None else table,
            query=query,
            vocab_keys=F.normalize(draft.embedding.float() @ copy.key.float(), dim=-1),
            state_weight=copy.state_query.float().clone(),
            gate_weight=copy.gate.weight.float()[0].clone(),
            gate_bias=float(copy.gate.bias),
            hot_query=draft.embedding[draft.hot_ids].float() @ query,
            scale=copy.scale.float().clone(),
            temperature=float(copy.log_temperature.exp()),
            sink=copy.sink.float().clone(),
            sink_bias=float(copy.sink_bias),
        )


def _own_token_info(draft: LyannaDraftModel) -> tuple[torch.Tensor | None, GatedTokenInfo | None]:
    """The parent's own token info: (the collapsed table, None), or with ``info_gate`` (None,
    the gated info's fixed parts); (None, None) without token info."""
    if not draft.config.use_token_info:
        return None, None
    if draft.info_gate is None:
        return draft.collapsed_token_info(), None
    with torch.no_grad():
        w1 = draft.w1.float()
        factors = draft.embedding[draft.hot_ids].to(w1.dtype) @ w1
        norm = draft.info_norm
        weight, eps = (None, 0.0) if norm is None else (norm.weight.float(), norm.eps)
        gated = GatedTokenInfo(factors, draft.info_out().float(), weight, eps,
                               draft.info_gate.weight.float().clone())  # fmt: skip
    return None, gated


def _token_paths(nodes: DraftNodes) -> frozenset[tuple[int, ...]]:
    """The token sequence from the root (exclusive) to every draft node."""
    return frozenset(nodes.token_paths()[1:])


def _resampled_accepted(state: _SeqState, step: VerifiedStep) -> int:
    """Accepted tokens whose path only the re-sampled subtree had proposed."""
    if not state.resampled_paths:
        return 0
    accepted = step.committed[1:]
    return sum(tuple(accepted[: d + 1]) in state.resampled_paths for d in range(len(accepted)))
