"""TokenTree: structure, masks and positions, draft probabilities, prune, merge and packing."""

from __future__ import annotations

import random

import pytest
import torch

from lyanna.draft_nodes import DraftNodes, merge_trees
from lyanna.tree import DraftScheme, TokenTree, pack_trees

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
DEEP_PARENTS = [-1, 0, 0, 1, 1, 2, 3]
DEEP_TOKENS = [9, 4, 7, 1, 2, 3, 5]


def deep_tree(**kwargs) -> TokenTree:
    kwargs.setdefault("scheme", DraftScheme.TOPK)
    return TokenTree.from_parents(DEEP_TOKENS, DEEP_PARENTS, **kwargs)


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def test_chain_structure_mask_and_positions() -> None:
    tree = TokenTree.chain(5, [6, 7, 8])
    assert tree.num_nodes == 4 and tree.num_drafted == 3 and tree.is_chain
    assert tree.tokens.tolist() == [5, 6, 7, 8]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.depths.tolist() == [0, 1, 2, 3]
    assert torch.equal(tree.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.positions(10).tolist() == [10, 11, 12, 13]
    assert tree.path_to(3) == [0, 1, 2, 3]
    assert tree.scheme is DraftScheme.CHAIN_SAMPLED


def test_star_mask_sees_only_root_and_self() -> None:
    tree = TokenTree.from_parents([1, 2, 3, 4], [-1, 0, 0, 0], scheme=DraftScheme.IID)
    expected = torch.eye(4, dtype=torch.bool)
    expected[:, 0] = True
    assert torch.equal(tree.attention_mask(), expected)
    assert tree.positions(0).tolist() == [0, 1, 1, 1]
    assert tree.children(0) == (1, 2, 3)
    assert not tree.is_chain


def test_deep_tree_paths_depths_and_counts() -> None:
    tree = deep_tree()
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.path_to(6) == [0, 1, 3, 6]
    assert tree.path_to(5) == [0, 2, 5]
    assert tree.path_to(0) == [0]
    assert tree.max_depth == 3
    assert tree.num_drafted_per_depth() == [2, 3, 1]
    assert tree.attention_mask()[6].nonzero().squeeze(1).tolist() == [0, 1, 3, 6]


@pytest.mark.parametrize("seed", range(5))
def test_mask_matches_paths_on_random_trees(seed: int) -> None:
    rng = random.Random(seed)
    parents = random_parents(rng, 30)
    tree = TokenTree.from_parents(list(range(30)), parents, scheme=DraftScheme.TOPK)
    mask = tree.attention_mask()
    for node in range(30):
        path = tree.path_to(node)
        assert path[0] == 0 and path[-1] == node
        assert all(parents[b] == a for a, b in zip(path, path[1:], strict=False))
        assert mask[node].nonzero().squeeze(1).tolist() == path
        assert int(tree.depths[node]) == len(path) - 1


def test_root_only_tree() -> None:
    tree = TokenTree.root_only(42)
    assert tree.num_nodes == 1 and tree.num_drafted == 0 and tree.max_depth == 0
    assert torch.equal(tree.attention_mask(), torch.ones(1, 1, dtype=torch.bool))
    assert tree.positions(7).tolist() == [7]
    assert tree.num_drafted_per_depth() == []


@pytest.mark.parametrize(
    ("tokens", "parents", "scheme", "message"),
    [
        ([1, 2], [0, 0], DraftScheme.TOPK, "root"),
        ([1, 2, 3], [-1, 2, 0], DraftScheme.TOPK, "parents"),
        ([1, 2, 3], [-1, 0, 0], DraftScheme.CHAIN_SAMPLED, "chain"),
        ([1, 2], [-1, 0, 0], DraftScheme.TOPK, "shaped"),
    ],
)
def test_invalid_structures_are_refused(tokens, parents, scheme, message) -> None:
    with pytest.raises(ValueError, match=message):
        TokenTree.from_parents(tokens, parents, scheme=scheme)


def test_invalid_draft_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="draft_probs"):
        TokenTree.chain(0, [1], draft_probs=torch.ones(3, 4))
    with pytest.raises(ValueError, match="vocab_index"):
        TokenTree.chain(0, [1], vocab_index=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="draft_token_probs"):
        TokenTree.chain(0, [1], draft_token_probs=torch.ones(3))


def test_token_probs_and_joint_from_full_rows() -> None:
    rows = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]])
    tree = TokenTree.chain(0, [1, 2], draft_probs=rows)
    assert torch.allclose(tree.draft_token_probs, torch.tensor([1.0, 0.6, 0.25]))
    assert torch.allclose(tree.joint_probs, torch.tensor([1.0, 0.6, 0.15], dtype=torch.float64))


def test_chain_accepts_rows_without_the_leaf() -> None:
    rows = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]])
    tree = TokenTree.chain(0, [1, 2], draft_probs=rows)
    assert tree.draft_probs.shape == (3, 3) and tree.draft_probs[2].sum() == 0
    assert tree.draft_token_probs.tolist() == pytest.approx([1.0, 0.6, 0.25])
    short = TokenTree.chain(0, [1, 2], draft_token_probs=torch.tensor([0.6, 0.25]))
    assert short.draft_token_probs.tolist() == pytest.approx([1.0, 0.6, 0.25])


def test_hot_vocabulary_rows_scatter_to_full_rows() -> None:
    hot = torch.tensor([7, 2, 5])
    rows = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    tree = TokenTree.chain(3, [5], draft_probs=rows, vocab_index=hot)
    assert float(tree.draft_token_probs[1]) == pytest.approx(0.2)
    full = tree.full_draft_probs(9)
    assert full.shape == (2, 9)
    assert full[0].tolist() == pytest.approx([0, 0, 0.3, 0, 0, 0.2, 0, 0.5, 0])
    with pytest.raises(ValueError, match="columns"):
        TokenTree.chain(3, [1], draft_probs=rows).full_draft_probs(9)


def test_long_chain_joint_probabilities_stay_finite() -> None:
    n = 400
    tree = TokenTree.chain(0, [1] * n, draft_token_probs=torch.full((n + 1,), 0.01))
    assert torch.isfinite(tree.log_joint).all()
    assert float(tree.log_joint[-1]) == pytest.approx(n * torch.log(torch.tensor(0.01)).item())
    assert not tree.joint_probs.isnan().any()
    assert tree.prune(5).tokens.tolist() == [0] + [1] * 5


def test_prune_keeps_best_joint_and_ancestors_and_marks_topk() -> None:
    probs = torch.tensor([1.0, 0.9, 0.1, 0.5, 0.5, 1.0, 0.5])  # joint: .9 .1 .45 .45 .1 .225
    tree = deep_tree(scheme=DraftScheme.IID, draft_token_probs=probs)
    assert tree.prune(2).tokens.tolist() == [9, 4, 1]  # tie between nodes 3 and 4: 3 wins
    pruned = tree.prune(4)
    assert pruned.tokens.tolist() == [9, 4, 1, 2, 5]  # nodes 0, 1, 3, 4, 6
    assert pruned.parents.tolist() == [-1, 0, 1, 1, 2]
    assert pruned.scheme is DraftScheme.TOPK  # a selection by probability is not a sample
    assert torch.allclose(pruned.draft_token_probs, probs[[0, 1, 3, 4, 6]])
    assert tree.prune(10) is tree
    assert tree.prune(0).num_nodes == 1


@pytest.mark.parametrize("seed", range(5))
def test_prune_is_closed_under_ancestors(seed: int) -> None:
    rng = random.Random(seed)
    parents = random_parents(rng, 25)
    probs = torch.tensor([1.0] + [rng.choice([0.5, 0.25, 1.0]) for _ in range(24)])
    tree = TokenTree.from_parents(
        list(range(25)), parents, scheme=DraftScheme.TOPK, draft_token_probs=probs
    )
    for budget in (0, 3, 7, 24):
        pruned = tree.prune(budget)
        assert pruned.num_drafted == budget
        kept = pruned.tokens.tolist()  # tokens are the original node ids
        assert all(parents[node] in kept for node in kept[1:])
        threshold = sorted(tree.log_joint[1:].tolist(), reverse=True)[budget - 1] if budget else 0
        assert all(float(tree.log_joint[node]) >= threshold for node in kept[1:])


def test_prune_of_a_sampled_chain_keeps_its_scheme_and_rows() -> None:
    rows = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), dim=1)
    tree = TokenTree.chain(0, [1, 2, 3], draft_probs=rows)
    pruned = tree.prune(2)
    assert pruned.scheme is DraftScheme.CHAIN_SAMPLED
    assert torch.equal(pruned.draft_probs, rows[:3])


def test_merge_is_a_trie_union() -> None:
    first = TokenTree.from_parents([0, 1, 2, 3], [-1, 0, 0, 1], scheme=DraftScheme.TOPK)
    second = TokenTree.from_parents([0, 1, 1, 4, 5], [-1, 0, 1, 0, 2], scheme=DraftScheme.TOPK)
    merged = merge_trees(first, second)
    # first: 0 -> {1 -> {3}, 2}; second: 0 -> {1 -> {1 -> {5}}, 4}
    assert merged.tokens.tolist() == [0, 1, 2, 3, 1, 4, 5]
    assert merged.parents.tolist() == [-1, 0, 0, 1, 1, 0, 4]
    assert merged.scheme is DraftScheme.TOPK
    assert merged.draft_probs is None
    paths = {tuple(merged.tokens[merged.path_to(i)].tolist()) for i in range(merged.num_nodes)}
    for tree in (first, second):
        for i in range(tree.num_nodes):
            assert tuple(tree.tokens[tree.path_to(i)].tolist()) in paths


def test_merge_deduplicates_siblings_and_keeps_larger_probability() -> None:
    iid = TokenTree.from_parents(
        [0, 3, 3], [-1, 0, 0], scheme=DraftScheme.IID, draft_token_probs=torch.tensor([1, 0.2, 0.2])
    )
    other = TokenTree.from_parents(
        [0, 3], [-1, 0], scheme=DraftScheme.IID, draft_token_probs=torch.tensor([1.0, 0.7])
    )
    merged = merge_trees(iid, other)
    assert merged.tokens.tolist() == [0, 3]
    assert merged.draft_token_probs.tolist() == pytest.approx([1.0, 0.7])
    assert merge_trees(iid, TokenTree.root_only(0)).tokens.tolist() == [0, 3]
    with pytest.raises(ValueError, match="same root"):
        merge_trees(iid, TokenTree.root_only(1))


def test_draft_nodes_prune_merge_and_paths_as_the_tree_does() -> None:
    probs = torch.tensor([1.0, 0.9, 0.1, 0.5, 0.5, 1.0, 0.5], dtype=torch.float64)
    tree = deep_tree(draft_token_probs=probs)
    nodes = DraftNodes.of(tree)
    assert nodes.token_paths()[6] == (4, 1, 5) and nodes.token_paths()[0] == ()
    pruned = nodes.prune(4)
    assert pruned.tokens == tree.prune(4).tokens.tolist() == [9, 4, 1, 2, 5]
    assert pruned.parents == [-1, 0, 1, 1, 2] and pruned.probs == [1.0, 0.9, 0.5, 0.5, 0.5]
    assert nodes.prune(6) is nodes
    other = DraftNodes([9, 7, 8], [-1, 0, 1], [1.0, 0.95, 0.5])
    merged = pruned.merge(other).to_tree()
    assert merged.tokens.tolist() == [9, 4, 1, 2, 5, 7, 8]
    assert merged.draft_token_probs.tolist() == [1.0, 0.9, 0.5, 0.5, 0.5, 0.95, 0.5]
    with pytest.raises(ValueError, match="same root"):
        pruned.merge(DraftNodes([1], [-1]))


def test_pack_trees_pads_with_self_attending_rows() -> None:
    trees = [deep_tree(), TokenTree.chain(8, [6]), TokenTree.root_only(4)]
    packed = pack_trees(trees, [10, 3, 0], pad_token=-7)
    assert packed.tokens.shape == (3, 7) and packed.mask.shape == (3, 7, 7)
    assert packed.num_nodes.tolist() == [7, 2, 1]
    assert packed.tokens[1].tolist() == [8, 6] + [-7] * 5
    assert packed.positions[0].tolist() == [10, 11, 11, 12, 12, 12, 13]
    assert packed.positions[1, :2].tolist() == [3, 4]
    assert torch.equal(packed.mask[0], trees[0].attention_mask())
    assert torch.equal(packed.mask[2], torch.eye(7, dtype=torch.bool))
    assert torch.equal(packed.mask[1, 2:], torch.eye(7, dtype=torch.bool)[2:])
    pieces = packed.unpack(torch.arange(21).reshape(3, 7))
    assert [p.tolist() for p in pieces] == [list(range(7)), [7, 8], [14]]
    with pytest.raises(ValueError):
        pack_trees(trees, [0])
