"""The learned drafters' draft steps over device-resident state of fixed shapes, one step
function per bucket on ``lyanna.model.static_step.CapturedSteps`` (a CUDA graph per bucket on a
GPU, plain eager calls on the CPU, ``torch.compile`` in ``bench.graph_check``), as the target's
verify step.

Like the target's step, a draft step runs a *window* of draft-KV slots ``[0, batch)``: batch row
b is slot b, sequences that do not draft this step ride along as inactive rows (they write
rows past their committed prefix, which nobody keeps), and attention reads ``kv_len`` rows per
slot under a mask built on the device (``window_context``). A bucket is fixed by the window,
the tree's shape (``DraftBudget``: depth and top-k) and ``kv_len``: nothing else changes a
shape, and nothing inside a step reads a device value on the host.

* EAGLE-2 (``lyanna.drafters.dynamic_tree``): ``root_step`` gives the root's top-k children;
  ``depth_step`` runs one depth of the dynamic tree: the frontier's forward through the head
  at its tree rows, the hot LM head, the top-k children of every frontier node, their joint
  (cumulative) log probabilities and the top-k of those as the next frontier, with its states,
  tokens and ancestor rows. The host replays it once per depth (one launch per depth, as
  vLLM's EAGLE), feeding each depth's frontier to the next on the device; every depth's
  children stay on the device and the tree comes to the host in one copy at the end.
* Lyanna (``lyanna.drafters.lyanna``): ``chain_step`` runs the whole draft after the
  context catch-up in one call: the chain ``h2..hN`` from ``h1`` alone (its KV rows written
  past the committed prefix and never committed), the hot LM head once over the chain, and
  token-info tree sampling (``token_info_tree.device_subtrees``) with the collapsed bias
  table (or the per-chain token info: the gated info, the copy read over each slot's
  ``copy_context.CopyContexts`` rows), all on the device.

The context catch-ups (the newly committed rows entering the draft KV) keep the eager
forward: their row counts vary like a prompt's. Sampled (temperature > 0) trees draw on the
sequences' CPU generators and keep the host path (``lyanna.drafters.sampled``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from lyanna.drafters.copy_context import CopyContexts
from lyanna.drafters.token_info_tree import TokenInfo, device_subtrees
from lyanna.model.kv_cache import KVCache
from lyanna.model.static_step import (
    CapturedSteps,
    StepFunction,
    bucket,
    kv_buckets,
    window_buckets,
    window_context,
)
from lyanna.model.transformer import ForwardContext


class TreeDrafter(Protocol):
    """What EAGLE-2's steps read of a drafter (``dynamic_tree.DynamicTreeDrafter``)."""

    cache: KVCache
    hot_vocab: torch.Tensor  # [num_hot] int64
    lm_head: nn.Module
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def _node_forward(
        self, ctx: ForwardContext, parent_states: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor: ...


class ChainDrafter(Protocol):
    """What Lyanna's step reads of a drafter (``lyanna.LyannaDrafter``)."""

    cache: KVCache
    draft: nn.Module  # layer, out_norm, embedding and rotary tables (``LyannaDraftModel``)
    lm_head: nn.Module
    copy_contexts: CopyContexts | None  # with a copy read: each slot's context

    def chain_token_info(
        self,
        chains: torch.Tensor,
        contexts: tuple[torch.Tensor, ...] | None = None,
        root_embeddings: torch.Tensor | None = None,
    ) -> TokenInfo | None: ...


@dataclass(frozen=True, slots=True)
class RootKey:
    """EAGLE-2's root expansion: the window and the children per node."""

    batch: int
    k: int


@dataclass(frozen=True, slots=True)
class DepthKey:
    """One depth of EAGLE-2's tree: the window, children per node, tree rows (all depths') and
    the rows attention reads per slot."""

    batch: int
    k: int
    width: int
    kv_len: int


@dataclass(frozen=True, slots=True)
class ChainKey:
    """Lyanna's chain and tree: the window, chain steps, children per node, rows read per slot."""

    batch: int
    steps: int
    k: int
    kv_len: int


def draft_window(cache: KVCache, slots: list[int]) -> int:
    """The window of a step whose sequences hold ``slots``: the smallest bucket past the
    highest (the host's bookkeeping: no device read)."""
    return bucket(max(slots) + 1, window_buckets(cache.num_slots))


def kv_bucket(cache: KVCache, slots: torch.Tensor, new_rows: int) -> int:
    """Rows attention must read for the drafting slots to see their committed rows and
    ``new_rows`` more (the cache's CPU lengths), as a bucket."""
    return bucket(int(cache.lengths[slots].max()) + new_rows, kv_buckets(cache.num_rows))


def hot_children(
    lm_head: torch.nn.Module,
    hot_vocab: torch.Tensor,  # [num_hot] int64 on the device
    states: torch.Tensor,  # [B, n, d]
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # log probs [B, n, k] float32, token ids [B, n, k]
    """The top-k hot tokens of each node and their log draft probabilities (the numbers of
    ``sampled.draw_children`` for a greedy batch)."""
    top = lm_head(states).float().log_softmax(-1).topk(k, dim=-1)
    return top.values, hot_vocab[top.indices]


def eagle_steps(
    drafter: TreeDrafter,
    capture: bool | None = None,
    wrap=None,
) -> CapturedSteps:
    """EAGLE-2's root and depth steps for ``drafter`` (its cache, head and rotary tables)."""
    device = drafter.rope_cos.device
    window = torch.arange(drafter.cache.num_slots, device=device)
    hot_vocab = drafter.hot_vocab.to(device)
    last_position = drafter.rope_cos.shape[0] - 1

    def make(key: RootKey | DepthKey) -> StepFunction:
        if isinstance(key, RootKey):

            def root_step(root_states):  # [B, 1, d]
                logq, tokens = hot_children(drafter.lm_head, hot_vocab, root_states, key.k)
                return logq[:, 0], tokens[:, 0]  # [B, k] each

            return root_step
        return _depth_step(drafter, window[: key.batch], key, hot_vocab, last_position)

    return CapturedSteps(device, make, capture, wrap)


def _depth_step(
    drafter: TreeDrafter,
    window: torch.Tensor,
    key: DepthKey,
    hot_vocab: torch.Tensor,
    last_position: int,
) -> StepFunction:
    k, width = key.k, key.width

    def depth_step(
        lengths: torch.Tensor,  # [B] committed draft rows of each slot
        depth: torch.Tensor,  # [] int64: depth of the frontier nodes run (>= 1)
        parent_states: torch.Tensor,  # [B, k, d] their parents' states
        tokens: torch.Tensor,  # [B, k] their tokens
        joint: torch.Tensor,  # [B, k] float32 their log joint probabilities
        ancestors: torch.Tensor,  # [B, k, width] bool: tree rows of their strict ancestors
        frontier: torch.Tensor,  # [B, k] int64 their node indices
    ):
        """Tree row r (relative to the slot's committed rows) holds the depth ``r // k + 1``
        node run from frontier entry ``r % k``; a node sees its ancestors and itself."""
        B = tokens.shape[0]
        device = tokens.device
        own = (depth - 1) * k + torch.arange(k, device=device)  # [k] tree rows run now
        visible = ancestors | (torch.arange(width, device=device) == own[:, None])[None]
        rows = lengths[:, None] + own[None]  # [B, k]
        positions = (lengths + depth - 1).clamp(max=last_position)[:, None].expand(B, k)
        ctx = window_context(
            drafter.cache,
            window,
            key.kv_len,
            lengths,
            rows,
            positions,
            visible,
            drafter.rope_cos,
            drafter.rope_sin,
        )
        out = drafter._node_forward(ctx, parent_states, tokens)  # [B, k, d]
        child_logq, child_tokens = hot_children(drafter.lm_head, hot_vocab, out, k)
        cand_joint = (joint[:, :, None] + child_logq).reshape(B, k * k)
        best = cand_joint.topk(k, dim=-1).indices  # [B, k] candidates expanded next
        parent_slot = best // k  # [B, k] which frontier entry each new node came from
        num_nodes = 1 + k + (depth - 1) * k * k  # nodes before this depth's children
        d = out.shape[-1]
        return (
            child_tokens.reshape(B, k * k),
            frontier.repeat_interleave(k, dim=1),  # parents of the children
            child_logq.reshape(B, k * k),
            cand_joint,
            out.gather(1, parent_slot[..., None].expand(B, k, d)),  # next frontier: states
            child_tokens.reshape(B, k * k).gather(1, best),  # tokens
            cand_joint.gather(1, best),  # log joint probabilities
            visible.gather(1, parent_slot[..., None].expand(B, k, width)),  # ancestors
            num_nodes + best,  # node indices
        )

    return depth_step


def lyanna_steps(drafter: ChainDrafter, capture: bool | None = None, wrap=None) -> CapturedSteps:
    """Lyanna's chain-and-tree step for ``drafter``."""
    draft = drafter.draft
    device = draft.rope_cos.device
    window = torch.arange(drafter.cache.num_slots, device=device)
    last_position = draft.rope_cos.shape[0] - 1

    def make(key: ChainKey) -> StepFunction:
        steps, width = key.steps, max(key.steps - 1, 1)

        def chain_step(
            h1: torch.Tensor,  # [B, n] the layer's raw last output over the context
            lengths: torch.Tensor,  # [B] committed draft rows (the context) of each slot
            roots_hot: torch.Tensor,  # [B] int64 hot row of each root token, -1 if cold
            roots: torch.Tensor,  # [B] int64 root tokens (a copy read queries with them)
        ):
            """Chain step j (1..N-1) reads the previous state at position ``lengths + j - 1``
            and writes that row; it sees the context and the chain rows before it. A copy
            read reads each slot's first ``lengths`` context rows (as many as its KV)."""
            B = h1.shape[0]
            chain_rows = torch.arange(width, device=h1.device)
            h, x = draft.read_out(h1)
            chain = [h]
            for j in range(1, steps):
                rows = (lengths + j - 1)[:, None]  # [B, 1]
                visible = (chain_rows < j)[None, None].expand(B, 1, width)
                ctx = window_context(
                    drafter.cache,
                    window[:B],
                    key.kv_len,
                    lengths,
                    rows,
                    rows.clamp(max=last_position),
                    visible,
                    draft.rope_cos,
                    draft.rope_sin,
                )
                h, x = draft.read_out(draft.layer(x[:, None], ctx, 0)[:, 0])
                chain.append(h)
            chains = torch.stack(chain, dim=1)  # [B, N, n]
            logits = drafter.lm_head(chains)  # [B, N, num_hot]: one GEMM
            if drafter.copy_contexts is None:
                info = drafter.chain_token_info(chains)
            else:
                contexts = drafter.copy_contexts.window(B, key.kv_len, lengths)
                info = drafter.chain_token_info(chains, contexts, draft.embedding[roots])
            columns, parents, probs = device_subtrees(logits, roots_hot, key.k, info)
            return columns, parents, probs, logits, chains

        return chain_step

    return CapturedSteps(device, make, capture, wrap)
