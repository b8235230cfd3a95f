"""EAGLE-2's dynamic draft tree (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees"), shared by every drafter that runs a small network over tree nodes:
the EAGLE head (node input = its parent's predicted state fused with the node's token) and the
standalone draft model of SPS (node input = the node's token only).

Tree growth (batched over sequences): the root's children are the top-k hot tokens of the
root state. At each further depth the ``top_k`` newest nodes with the highest joint draft
probability (product of draft probabilities along the path) are expanded: one forward over
them - a node attends to the committed draft-KV rows, its expanded ancestors and itself, at
position ``num_committed_rows + depth - 1`` - and each gets its top-k children. Finally all
nodes are reranked by joint probability and the best ``max_tokens`` kept, or as many as pay
for their verification when the budget has a cost curve (``DraftBudget.prune``; a child never
outranks its parent, so the kept set is a tree). Candidates are a deterministic
top-k set: ``DraftScheme.TOPK``; at temperature > 0 children are drawn without replacement
instead (``lyanna.drafters.sampled``). Every step is a few tensor ops over the whole batch: no
Python loop runs per node, per mask row or per sequence until the nodes are read back.

Top-k trees (every greedy batch) grow through fixed-shape device steps
(``lyanna.drafters.static_draft``, ``_grow_on_device``): a root step, then one depth step per
depth over a window of draft-KV slots, the frontier (states, tokens, joint probabilities,
ancestor rows) handed from depth to depth on the device and the whole tree read back in one
copy; a GPU captures each step once per bucket as a CUDA graph, the CPU runs the same steps
eagerly (with its fast paths inside: prepacked heads, the native decoder's layer). Sampled
trees (temperature > 0) draw on CPU generators and keep ``_grow``: on a GPU
(``lyanna.drafters.placement``) its forwards, LM head, softmax and draws run on the drafter's
device and each depth's children come to the CPU in one copy (``Children.to_host``); the
tree's bookkeeping (tokens, parents, joint probabilities, frontier, masks) is CPU tensors, and
the few index tensors a forward needs (rows, mask, positions, parent slots) go back.

A subclass provides the draft KV cache, the hot vocabulary and its LM head, the rotary tables,
``_catch_up`` (committed tokens into the draft KV) and ``_node_forward`` (what one tree step
computes); its per-sequence states (``_seqs``) follow ``RootedState``.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
from torch import nn

from lyanna.draft_nodes import DraftNodes
from lyanna.drafters.base import DraftBudget
from lyanna.drafters.placement import to_host
from lyanna.drafters.sampled import DraftSampling, SampledDrafting, SampledTrees, head_children
from lyanna.drafters.scopes import LAYER_SCOPE, scope
from lyanna.drafters.static_draft import (
    DepthKey,
    RootKey,
    draft_window,
    eagle_steps,
    kv_bucket,
)
from lyanna.model.kv_cache import KVCache
from lyanna.model.static_step import CapturedSteps
from lyanna.model.transformer import ForwardContext
from lyanna.tree import TokenTree


class RootedState(Protocol):
    slot: int  # draft KV slot
    root: int  # the next tree's root token
    root_state: torch.Tensor | None  # [d] the drafter's state at the root
    pending_tokens: list[int]  # committed tokens (and root) the draft KV has not seen yet


class DynamicTreeDrafter(SampledDrafting):
    budget: DraftBudget
    cache: KVCache
    hot_vocab: torch.Tensor  # [num_hot] int64
    lm_head: nn.Module  # [d] -> [num_hot] logits
    rope_cos: torch.Tensor  # [max_positions, hd]
    rope_sin: torch.Tensor
    _seqs: dict[int, RootedState]
    _depth_seconds: float | None = None  # how long the last draft depth took
    generic: bool = False  # the device-generic path (placement): children copied to the CPU
    # top-k trees grow through the fixed-shape device steps (``static_draft``); a subclass
    # opts in (False: the host-built tree of ``_grow``, which sampled trees always take)
    device_steps: bool = False
    _steps: CapturedSteps | None = None

    @torch.inference_mode()
    def propose(self, seq_ids: list[int]) -> list[TokenTree]:
        start = time.perf_counter()
        states = [self._seqs[s] for s in seq_ids]
        behind = [s for s in states if s.pending_tokens]
        if behind:
            self._catch_up(behind)
        draws = self._draws(seq_ids)
        if self.device_steps and all(d is None for d in draws):
            nodes = self._grow_on_device(states, start)
        else:
            nodes = self._grow(states, start, draws)
        elapsed = time.perf_counter() - start
        calibrations = self._calibrations_for(seq_ids)
        return [n.to_tree() for n in self.budget.prune(nodes, elapsed, calibrations)]

    def release(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        self._stop_sampling(seq_id)
        if state is not None:
            self.cache.release(state.slot)

    def _catch_up(self, states: list[RootedState]) -> None:
        """Run the pending tokens into the draft KV; set each sequence's ``root_state``."""
        raise NotImplementedError

    def _node_forward(
        self,
        ctx: ForwardContext,
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
        visible: torch.Tensor,  # [B, k, depth * k] bool: tree rows each node attends to
    ) -> torch.Tensor:  # [B, k, d]
        """Run the nodes of one depth at tree rows ``lengths + (depth - 1) * k + j``; tree row
        r (relative to the sequence's committed rows) holds the depth ``r // k + 1`` node run
        from frontier entry ``r % k``; ``visible`` holds each node's ancestors and itself."""
        B, k = tokens.shape
        width = depth * k
        rows = lengths[:, None] + (depth - 1) * k + torch.arange(k)  # [B, k]
        kv_len = int(lengths.max()) + width
        self.cache.check_room(slots, width)
        tree_row = torch.arange(kv_len) - lengths[:, None]  # [B, kv_len], < 0: committed
        in_tree = visible.gather(2, tree_row.clamp(0, width - 1)[:, None].expand(B, k, kv_len))
        mask = (tree_row < 0)[:, None] | (in_tree & (tree_row < width)[:, None])
        positions = (lengths + depth - 1)[:, None].expand(B, k)
        device = self.rope_cos.device  # the drafter's: built on the CPU, moved (CPU: no-op)
        positions = positions.to(device)
        ctx = ForwardContext(
            cache=self.cache,
            slots=slots,  # CPU bookkeeping, as in ForwardContext
            rows=rows.to(device),
            kv_len=kv_len,
            cos=self.rope_cos[positions].unsqueeze(1),
            sin=self.rope_sin[positions].unsqueeze(1),
            mask=mask.unsqueeze(1).to(device),
        )
        with scope(LAYER_SCOPE):
            return self._node_forward(ctx, parent_states, tokens)

    def _top_children(self, states: torch.Tensor, k: int):
        """states [B, n, d] -> (log probs [B, n, k], token ids [B, n, k]) of the top-k hot
        tokens of each node."""
        children = head_children(self.lm_head, states, k, [None] * states.shape[0])
        children = children.to_host(self.generic)
        return children.values, self.hot_vocab[children.columns]

    def _grow(
        self,
        states: list[RootedState],
        start: float,
        draws: list[DraftSampling | None] | None = None,
    ) -> list[DraftNodes]:
        """Every sequence's tree has the same shape: the root, k children, then k * k nodes
        per further depth (child j of frontier entry i at ``i * k + j`` of its block), so
        the nodes are grown as [B, block] tensors and read back once. With a cost curve,
        growth stops at the first depth that cannot raise the step's expected rate
        (``VerifyCost.worth_drafting_deeper``; ``start``: when this step began drafting).
        ``draws``: how each sequence samples (None: all top-k)."""
        budget = self.budget
        k = min(budget.top_k, self.hot_vocab.numel())
        B = len(states)
        draws = draws or [None] * B
        root_states = torch.stack([s.root_state for s in states])[:, None]  # [B, 1, d]
        children = head_children(self.lm_head, root_states, k, draws).to_host(self.generic)
        sampled = SampledTrees(children.sampled)
        if sampled.batch:
            sampled.add(children, torch.zeros(B, 1, dtype=torch.int64), torch.zeros(B, 1))
        child_logq, child_tokens = children.values, self.hot_vocab[children.columns]
        tokens = [torch.tensor([[s.root] for s in states]), child_tokens[:, 0]]  # blocks
        parents = [torch.full((B, 1), -1), torch.zeros(B, k, dtype=torch.int64)]
        logq = [torch.zeros(B, 1), child_logq[:, 0]]  # log draft probability of each token
        joint = child_logq[:, 0]  # [B, k] joint log probability of the frontier
        joints = [joint]  # log joint probability of every drafted node, block by block
        if budget.depth > 1:  # what growing deeper needs (a depth-1 tree is done here)
            slots = torch.tensor([s.slot for s in states])
            lengths = self.cache.lengths[slots].clone()
            num_nodes = 1 + k
            frontier = torch.arange(1, k + 1).expand(B, k)  # node index of each frontier entry
            frontier_tokens = child_tokens[:, 0]  # [B, k]
            frontier_states = root_states.expand(B, k, -1)  # parents' states
            # tree rows (see _tree_forward) of each frontier entry's strict ancestors
            ancestors = torch.zeros(B, k, (budget.depth - 1) * k, dtype=torch.bool)
            own_row = torch.arange(k)
        for depth in range(1, budget.depth):
            if not self._worth_deeper(joints, joint, start, sampled):
                break
            depth_start = time.perf_counter()
            visible = ancestors.clone()
            visible[:, own_row, (depth - 1) * k + own_row] = True
            out = self._tree_forward(
                lengths, slots, depth, frontier_states, frontier_tokens, visible[..., : depth * k]
            )
            children = head_children(self.lm_head, out, k, draws).to_host(self.generic)
            sampled.add(children, frontier, joint)
            child_logq, child_tokens = children.values, self.hot_vocab[children.columns]
            tokens.append(child_tokens.reshape(B, k * k))
            parents.append(frontier.repeat_interleave(k, dim=1))
            logq.append(child_logq.reshape(B, k * k))
            cand_joint = (joint[:, :, None] + child_logq).reshape(B, k * k)
            best = cand_joint.topk(k, dim=-1).indices  # [B, k] candidates expanded next
            parent_slot = best // k  # [B, k] which frontier entry each new node came from
            frontier = num_nodes + best
            num_nodes += k * k
            index = parent_slot.to(out.device)[..., None].expand(-1, -1, out.shape[-1])
            frontier_states = out.gather(1, index)  # on the device
            frontier_tokens = tokens[-1].gather(1, best)  # CPU: _node_forward moves them
            joint = cand_joint.gather(1, best)
            ancestors = visible.gather(1, parent_slot[..., None].expand(-1, -1, visible.shape[-1]))
            joints.append(cand_joint)
            self._depth_seconds = time.perf_counter() - depth_start
        nodes = _nodes(torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(logq, 1))
        return sampled.attach(nodes, self.hot_vocab)

    @property
    def steps(self) -> CapturedSteps:
        """The draft steps by bucket (made on first use; ``bench.graph_check`` sets its own)."""
        if self._steps is None:
            self._steps = eagle_steps(self)
        return self._steps

    @steps.setter
    def steps(self, steps: CapturedSteps) -> None:
        self._steps = steps

    def _grow_on_device(self, states: list[RootedState], start: float) -> list[DraftNodes]:
        """``_grow`` for top-k trees through the fixed-shape steps of ``static_draft``: the
        root step, then one depth step per depth over the window of draft slots, each
        depth's frontier (states, tokens, joint probabilities, ancestor rows, node indices)
        handed to the next on the device. The host only builds the inputs from its own
        bookkeeping and, at the end, reads the tree back in one copy (a cost curve's decision
        to grow deeper also reads the joint probabilities: one small copy per depth). The
        same nodes as ``_grow`` (tests/unit/test_static_draft.py)."""
        budget, cache, steps = self.budget, self.cache, self.steps
        k = min(budget.top_k, self.hot_vocab.numel())
        slots = [s.slot for s in states]
        batch = draft_window(cache, slots)
        index = torch.tensor(slots)
        first = states[0].root_state
        device = first.device
        rows = index.to(device)  # each sequence's row of the window
        root = first.new_zeros(batch, 1, first.shape[-1])
        root[rows, 0] = torch.stack([s.root_state for s in states])
        joint, child_tokens = steps.run(RootKey(batch, k), (root,))
        keep = _clone if steps.capture else _same  # a graph's outputs: its next replay's
        blocks = [(keep(child_tokens), None, keep(joint))]  # per depth: tokens, parents, logq
        joints = [blocks[0][2]]  # log joint probability of every drafted node (cost curve)
        if budget.depth > 1:
            width = (budget.depth - 1) * k
            key = DepthKey(batch, k, width, kv_bucket(cache, index, width))
            lengths = cache.lengths[:batch].to(device)
            depths = torch.arange(budget.depth, device=device)
            # contiguous as every later depth's frontier (a traced step guards on strides)
            frontier = torch.arange(1, k + 1, device=device).repeat(batch, 1)
            frontier_states = root.expand(batch, k, -1).contiguous()
            frontier_tokens = child_tokens
            ancestors = torch.zeros(batch, k, width, dtype=torch.bool, device=device)
        for depth in range(1, budget.depth):
            if budget.cost is not None and not self._worth_deeper(
                [j[rows] for j in joints], joint[rows], start
            ):
                break
            depth_start = time.perf_counter()
            cache.check_room(index, depth * k)
            (tokens, parents, logq, cand_joint, *frontier_out) = steps.run(
                key,
                (lengths, depths[depth], frontier_states, frontier_tokens, joint)
                + (ancestors, frontier),
            )
            frontier_states, frontier_tokens, joint, ancestors, frontier = frontier_out
            blocks.append((keep(tokens), keep(parents), keep(logq)))
            if budget.cost is not None:
                joints.append(keep(cand_joint))
            self._depth_seconds = time.perf_counter() - depth_start
        # the one copy to the host: every depth's children of the drafting rows
        parts = [torch.cat([b[0] for b in blocks], 1), torch.cat([b[2] for b in blocks], 1)]
        if len(blocks) > 1:
            parts.append(torch.cat([b[1] for b in blocks[1:]], 1))
        tokens, logq, *deeper = to_host(*(part[rows] for part in parts))
        B = len(states)
        roots = torch.tensor([[s.root] for s in states])
        parents = [torch.full((B, 1), -1), torch.zeros(B, k, dtype=torch.int64), *deeper]
        return _nodes(
            torch.cat([roots, tokens], 1),
            torch.cat(parents, 1),
            torch.cat([torch.zeros(B, 1), logq], 1),
        )

    def _worth_deeper(
        self,
        joints: list[torch.Tensor],
        frontier: torch.Tensor,
        start: float,
        sampled: SampledTrees | None = None,
    ) -> bool:
        """Another depth, unless the cost curve says it cannot pay (always without one, and
        until one depth has been timed). Sampled trees are judged by their own gains; the
        decision only adds children to nodes already drawn, so it may look at their draws."""
        cost, depth_seconds = self.budget.cost, self._depth_seconds
        if cost is None or depth_seconds is None:
            return True
        cap = self.budget.max_tokens
        drawn = torch.cat(joints, 1).exp()  # [B, drafted]
        scale = torch.full((len(drawn), 1), self.calibration.scale)
        if sampled is not None and sampled.batch:
            drawn[sampled.batch] = sampled.gains()[:, 1:].to(drawn.dtype)
            scale[sampled.batch] = self.sampled_calibration.scale
        gains = drawn.sort(dim=1, descending=True).values[:, :cap] * scale
        return cost.worth_drafting_deeper(
            gains.tolist(),
            float((frontier.exp() * scale).sum()),
            cap,
            time.perf_counter() - start,
            depth_seconds,
        )


def _nodes(
    tokens: torch.Tensor,  # [B, n] int64
    parents: torch.Tensor,  # [B, n] int64
    logq: torch.Tensor,  # [B, n] float32 log draft probability of each node's token
) -> list[DraftNodes]:
    """One candidate set per row, not yet pruned. Each row is exponentiated on its own, a
    1-D float64 tensor of n values as the per-node builder made it, so the probabilities
    stay bit-identical."""
    logq = logq.double()
    return [
        DraftNodes(row_tokens, row_parents, logq[b].exp().tolist())
        for b, (row_tokens, row_parents) in enumerate(
            zip(tokens.tolist(), parents.tolist(), strict=True)
        )
    ]


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
