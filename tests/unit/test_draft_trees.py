"""The draft trees built from vectorised top-k results equal those of the per-node builders
they replaced, on many seeded random inputs: EAGLE-2's dynamic tree (tokens, parents, draft
probabilities, log joints, tree masks and the attention masks of the draft forwards), Lyanna's
token-info tree with re-sampling and fusion, and `TokenTree`'s own masks, pruning and merging.

The references below are the replaced code, copied verbatim but for names and for returning
`ReferenceTree` (the per-node `TokenTree` construction, prune and merge) instead of a tree."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from torch.profiler import record_function

from lyanna.draft_nodes import DraftNodes, merge_trees
from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.lyanna import _token_paths
from lyanna.drafters.scopes import LAYER_SCOPE, SOFTMAX_SCOPE
from lyanna.drafters.token_info_tree import build_subtree, build_subtrees, resample_subtree
from lyanna.model.transformer import ForwardContext
from lyanna.tree import DraftScheme, TokenTree
from tests.conftest import make_tiny_model
from tests.unit.test_eagle import random_head

# -- references: the per-node code as it was ---------------------------------------------


class ReferenceTree:
    """`TokenTree.__post_init__`, `prune` and `merge` as they were, one tensor op per node."""

    def __init__(self, tokens, parents, draft_token_probs: torch.Tensor | None) -> None:
        self.tokens = torch.as_tensor(tokens, dtype=torch.int64)
        self.parents = torch.as_tensor(parents, dtype=torch.int64)
        self.draft_token_probs = draft_token_probs
        parent_list = self.parents.tolist()
        n = len(parent_list)
        children: list[list[int]] = [[] for _ in range(n)]
        depth = [0] * n
        ancestors = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            children[parent_list[i]].append(i)
            depth[i] = depth[parent_list[i]] + 1
            ancestors[i] |= ancestors[parent_list[i]]
        log_joint = [0.0] * n
        if self.draft_token_probs is not None:
            log_q = self.draft_token_probs.double().clamp(0.0, 1.0).log().tolist()
            for i in range(1, n):
                log_joint[i] = log_joint[parent_list[i]] + log_q[i]
        self.depths = torch.tensor(depth, dtype=torch.int64)
        self.log_joint = torch.tensor(log_joint, dtype=torch.float64)
        self.ancestors = ancestors
        self.children = tuple(tuple(c) for c in children)
        self.num_nodes = n

    def prune(self, budget: int) -> ReferenceTree:
        if budget >= self.num_nodes - 1:
            return self
        order = sorted(range(1, self.num_nodes), key=lambda i: (-float(self.log_joint[i]), i))
        kept = {0}
        parent_list = self.parents.tolist()
        for node in order:
            if len(kept) > budget:
                break
            if parent_list[node] in kept:
                kept.add(node)
        keep = torch.tensor(sorted(kept), dtype=torch.int64)
        remap = torch.full((self.num_nodes,), -1, dtype=torch.int64)
        remap[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        probs = None if self.draft_token_probs is None else self.draft_token_probs[keep]
        return ReferenceTree(self.tokens[keep], parents, probs)

    def merge(self, other: ReferenceTree) -> ReferenceTree:
        index: dict[tuple[int, int], int] = {}
        tokens, parents, probs = [int(self.tokens[0])], [-1], [1.0]
        have_probs = self.draft_token_probs is not None and other.draft_token_probs is not None
        for tree in (self, other):
            tree_probs = tree.draft_token_probs.tolist() if have_probs else None
            new_index = [0] * tree.num_nodes
            for i in range(1, tree.num_nodes):
                key = (new_index[int(tree.parents[i])], int(tree.tokens[i]))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(key[1])
                    parents.append(key[0])
                    probs.append(0.0)
                new_index[i] = index[key]
                if tree_probs is not None:
                    probs[new_index[i]] = max(probs[new_index[i]], tree_probs[i])
        return ReferenceTree(
            tokens, parents, torch.tensor(probs, dtype=torch.float64) if have_probs else None
        )

    def token_paths(self) -> frozenset[tuple[int, ...]]:
        tokens = self.tokens.tolist()
        return frozenset(
            tuple(tokens[i] for i in self.ancestors[node].nonzero().squeeze(1).tolist()[1:])
            for node in range(1, self.num_nodes)
        )


def reference_tree_forward(self, lengths, slots, depth, parent_states, tokens, ancestor_rows):
    """``DynamicTreeDrafter._tree_forward``: the attention mask built one node at a time."""
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
    ctx = ForwardContext(
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


def reference_grow(self, states) -> list[ReferenceTree]:
    """``DynamicTreeDrafter._grow``: one ``int()``/``float()`` per node and per mask row."""
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
        out = reference_tree_forward(
            self, lengths, slots, depth, frontier_states, frontier_tokens, ancestors
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
            new_ancestors.append([ancestors[b][int(c) // k] + [row + int(c) // k] for c in best[b]])
            new_frontier[b] = base + best[b]
        parent_slot = best // k  # [B, k] which frontier entry each new node came from
        frontier_states = out.gather(1, parent_slot[..., None].expand(-1, -1, out.shape[-1]))
        frontier_tokens = child_tokens.reshape(B, k * k).gather(1, best)
        joint = cand_joint.gather(1, best)
        frontier, ancestors = new_frontier, new_ancestors
    return [
        ReferenceTree(
            tokens[b], parents[b], torch.tensor(logq[b], dtype=torch.float64).exp()
        ).prune(budget.max_tokens)
        for b in range(B)
    ]


def reference_build_subtree(logits, root_token, top_k, info_table, hot_ids, hot_index):
    """``token_info_tree.build_subtree``, returning the tree it used to make."""
    tokens, parents, probs = [root_token], [-1], [1.0]
    frontier = torch.tensor([0])  # node indices
    frontier_log_joint = torch.zeros(1, dtype=torch.float64)
    frontier_hot = hot_index[torch.tensor([root_token])]  # [f] hot rows of frontier tokens
    for step in range(logits.shape[0]):
        with record_function(SOFTMAX_SCOPE):
            rows = logits[step].expand(frontier.numel(), -1).float()
            if info_table is not None:
                known = frontier_hot >= 0
                if bool(known.any()):
                    rows = rows.clone()
                    rows[known] += info_table[frontier_hot[known]].float()
            probs_rows = torch.softmax(rows, dim=-1)
        child_probs, child_cols = probs_rows.topk(top_k, dim=-1)  # [f, k]
        child_log_joint = frontier_log_joint[:, None] + child_probs.double().log()
        first_new = len(tokens)
        child_tokens = hot_ids[child_cols].flatten().tolist()
        tokens += child_tokens
        parents += frontier.repeat_interleave(top_k).tolist()
        probs += child_probs.flatten().tolist()
        keep = child_log_joint.flatten().topk(min(top_k, child_log_joint.numel())).indices
        frontier = first_new + keep
        frontier_log_joint = child_log_joint.flatten()[keep]
        frontier_hot = child_cols.flatten()[keep]
    return ReferenceTree(tokens, parents, torch.tensor(probs, dtype=torch.float64))


# -- comparison ----------------------------------------------------------------------------


def assert_same_tree(tree: TokenTree, ref: ReferenceTree, exact: bool = True) -> None:
    """``exact``: bit-identical probabilities (else to float32 rounding: the same tokens
    from a forward that reads the KV in another order)."""
    same = torch.equal if exact else partial(torch.allclose, rtol=1e-5, atol=1e-7)
    assert tree.scheme is DraftScheme.TOPK
    assert torch.equal(tree.tokens, ref.tokens)
    assert torch.equal(tree.parents, ref.parents)
    if ref.draft_token_probs is None:
        assert tree.draft_token_probs is None
    else:
        assert tree.draft_token_probs.dtype == ref.draft_token_probs.dtype
        assert same(tree.draft_token_probs, ref.draft_token_probs)
    assert same(tree.log_joint, ref.log_joint)
    assert torch.equal(tree.depths, ref.depths)
    assert torch.equal(tree.attention_mask(), ref.ancestors)
    assert all(tree.children(i) == ref.children[i] for i in range(tree.num_nodes))
    assert all(
        tree.path_to(i) == ref.ancestors[i].nonzero().squeeze(1).tolist()
        for i in range(tree.num_nodes)
    )


# -- EAGLE-2 dynamic tree ------------------------------------------------------------------


def recording_masks(drafter: EagleDrafter) -> list[torch.Tensor]:
    """Record the attention mask of every tree forward the drafter runs."""
    masks: list[torch.Tensor] = []
    node_forward = drafter._node_forward

    def record(ctx, parent_states, tokens):
        masks.append(ctx.mask.clone())
        return node_forward(ctx, parent_states, tokens)

    drafter._node_forward = record
    return masks


@pytest.mark.parametrize(
    "seed, generic",
    # generic: even seeds only. Odd seeds repeat hot tokens, so sibling nodes tie exactly in
    # exact arithmetic, and which one ranks first is then float rounding: the generic path's
    # device steps attend as a captured step does (grouped heads over a KV bucket), the
    # reference as eager attention over the rows in use, and they may round the other way
    [(seed, False) for seed in range(24)] + [(seed, True) for seed in range(0, 12, 2)],
)
def test_dynamic_tree_equals_per_node_builder(seed: int, generic: bool) -> None:
    """Random heads (hot vocabularies with repeated tokens, so equal logits tie), budgets,
    batch sizes and context lengths; three draft steps with random verification outcomes.
    ``generic``: the device-generic path a GPU runs (lyanna.drafters.placement), on the CPU,
    each depth's children copied through the one-copy packing."""
    rng = random.Random(seed)
    vocab = 24
    model = make_tiny_model(seed, vocab_size=vocab)
    head = random_head(model, seed=seed, hot=rng.randint(2, vocab))
    if seed % 2:
        hot = head.hot_vocab
        hot[: hot.numel() // 2] = hot[hot.numel() // 2 : 2 * (hot.numel() // 2)].clone()
    budget = DraftBudget(rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 40))
    batch = rng.randint(1, 4)
    drafter = EagleDrafter(model, head, budget, max_running=batch, max_len=128, generic=generic)
    masks = recording_masks(drafter)
    d = model.config.hidden_size
    for s in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
        drafter.start(s, prompt, torch.randn(len(prompt), d), rng.randrange(vocab))
    for _ in range(3):
        trees = drafter.propose(list(range(batch)))  # catches up, then grows the trees
        new_masks = masks[:]
        masks.clear()
        with torch.inference_mode():
            refs = reference_grow(drafter, [drafter._seqs[s] for s in range(batch)])
        assert len(new_masks) == len(masks) == budget.depth - 1
        # the device steps read a KV bucket (``static_draft``): the reference's columns, then
        # columns nobody may attend to
        assert all(
            torch.equal(a[..., : b.shape[-1]], b) and not a[..., b.shape[-1] :].any()
            for a, b in zip(new_masks, masks, strict=True)
        )
        masks.clear()
        for tree, ref in zip(trees, refs, strict=True):
            # the generic path's device steps attend as the captured step does (grouped
            # heads over a KV bucket), the reference as eager attention over the rows in use
            assert_same_tree(tree, ref, exact=not generic)
        steps = []
        for s, tree in enumerate(trees):
            accepted = tree.path_to(rng.randrange(tree.num_nodes))
            committed = tree.tokens[accepted].tolist()
            steps.append(
                VerifiedStep(
                    s, committed, torch.randn(len(committed), d), rng.randrange(vocab), 0, 0
                )
            )
        drafter.on_verified(steps)


# -- Lyanna token-info tree, re-sampling and fusion ----------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_token_info_trees_equal_per_node_builder(seed: int) -> None:
    """Integer logits and token-info rows (many exact ties), hot and cold roots, with and
    without token info, a batch of chains built at once: fresh, re-sampled and fused trees
    and the re-sampled paths."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab, num_hot, batch = 40, rng.randint(2, 24), rng.randint(1, 5)
    hot_ids = torch.randperm(vocab, generator=gen)[:num_hot]
    hot_index = torch.full((vocab,), -1)
    hot_index[hot_ids] = torch.arange(num_hot)
    steps, top_k, budget = rng.randint(1, 5), rng.randint(1, min(5, num_hot)), rng.randint(1, 30)
    ties = seed % 2 == 0
    logits = torch.randint(-3, 4, (batch, steps, num_hot), generator=gen).float()
    if not ties:
        logits = torch.randn(batch, steps, num_hot, generator=gen) * 3
    info = None if seed % 3 == 0 else torch.randint(-2, 3, (num_hot, num_hot), generator=gen)
    info = info if info is None or ties else torch.randn(num_hot, num_hot, generator=gen)
    info = None if info is None else info.half()  # the drafter's collapsed table is fp16
    roots = [rng.randrange(vocab) for _ in range(batch)]
    args = (top_k, info, hot_ids, hot_index)

    fresh = build_subtrees(logits, roots, *args)
    for nodes, chain, root in zip(fresh, logits, roots, strict=True):
        ref = reference_build_subtree(chain, root, *args)
        assert_same_tree(nodes.to_tree(), ref)
        assert_same_tree(nodes.prune(budget).to_tree(), ref.prune(budget))

    chain = logits[0]
    accepted, bonus = rng.randint(0, steps - 1), rng.randrange(vocab)
    resampled = resample_subtree(chain, accepted, bonus, 1, *args)
    if resampled is None:
        assert steps - accepted - 1 < 1
        return
    ref_resampled = reference_build_subtree(chain[accepted + 1 :], bonus, *args)
    assert_same_tree(resampled.prune(budget).to_tree(), ref_resampled.prune(budget))
    assert _token_paths(resampled.prune(budget)) == ref_resampled.prune(budget).token_paths()

    fresh = build_subtree(chain, bonus, *args).prune(budget)  # fusion needs one root
    ref_fresh = reference_build_subtree(chain, bonus, *args).prune(budget)
    merged = fresh.merge(resampled).prune(budget)
    ref_merged = ref_fresh.merge(ref_resampled).prune(budget)
    assert_same_tree(merged.to_tree(), ref_merged)
    assert _token_paths(merged) == ref_merged.token_paths()


# -- TokenTree itself ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_token_tree_prune_and_merge_equal_per_node_code(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 60)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(5) for _ in range(n)]  # few tokens: merges find shared nodes
    probs = torch.tensor([1.0] + [rng.choice([0.5, 0.25, 1.0, 0.0]) for _ in range(n - 1)])
    probs = None if seed % 4 == 0 else probs
    tree = TokenTree.from_parents(tokens, parents, scheme=DraftScheme.TOPK, draft_token_probs=probs)
    ref = ReferenceTree(tokens, parents, probs)
    assert_same_tree(tree, ref)
    other_n = rng.randint(1, 30)
    other_parents = [-1] + [rng.randrange(i) for i in range(1, other_n)]
    other_tokens = [tokens[0]] + [rng.randrange(5) for _ in range(other_n - 1)]
    other_probs = torch.rand(
        other_n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )
    other = TokenTree.from_parents(
        other_tokens, other_parents, scheme=DraftScheme.TOPK, draft_token_probs=other_probs
    )
    ref_other = ReferenceTree(other_tokens, other_parents, other_probs)
    for budget in (0, 1, 3, 7, 20, 80):
        assert_same_tree(tree.prune(budget), ref.prune(budget))
        assert_same_tree(merge_trees(tree, other).prune(budget), ref.merge(ref_other).prune(budget))
        nodes = DraftNodes.of(tree).merge(DraftNodes.of(other)).prune(budget)
        assert_same_tree(nodes.to_tree(), ref.merge(ref_other).prune(budget))


@pytest.mark.parametrize("seed", range(16))
def test_one_child_chains_equal_per_node_builder(seed: int) -> None:
    """Top-1 without sampled draws takes ``build_subtrees``' chain path: the same nodes and
    probabilities as the per-node builder, ties (integer logits), cold roots and no token
    info included."""
    gen = torch.Generator().manual_seed(seed)
    vocab, num_hot, batch, steps = 30, 12, 1 + seed % 4, 1 + seed % 5
    hot_ids = torch.randperm(vocab, generator=gen)[:num_hot]
    hot_index = torch.full((vocab,), -1)
    hot_index[hot_ids] = torch.arange(num_hot)
    if seed % 2:
        logits = torch.randint(-2, 3, (batch, steps, num_hot), generator=gen).float()
    else:
        logits = torch.randn(batch, steps, num_hot, generator=gen) * 3
    info = None if seed % 3 == 0 else torch.randn(num_hot, num_hot, generator=gen).half()
    roots = torch.randint(0, vocab, (batch,), generator=gen).tolist()
    args = (1, info, hot_ids, hot_index)
    built = build_subtrees(logits, roots, *args)
    for nodes, chain, root in zip(built, logits, roots, strict=True):
        assert nodes.parents == list(range(-1, steps))
        assert_same_tree(nodes.to_tree(), reference_build_subtree(chain, root, *args))
