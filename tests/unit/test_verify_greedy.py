"""Greedy verification: hand-built chains and trees, batching, logits, and a speculative loop
that must reproduce plain greedy decoding of a toy model token for token."""

from __future__ import annotations

import random

import pytest
import torch

from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify import RULES
from tests.unit.exact_law import ToyModel

GREEDY = RULES["greedy"]


def one_hot_rows(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:  # [n, vocab]
    rows = torch.full((len(argmaxes), vocab), 0.01)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.9
    return rows


@pytest.mark.parametrize(
    ("draft", "argmaxes", "tokens"),
    [
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # perfect match: all accepted + bonus
        ([1, 5, 3], [1, 2, 3, 4], [1, 2]),  # early mismatch: correction is the argmax
        ([6, 2, 3], [1, 2, 3, 4], [1]),  # first token wrong
        ([], [7], [7]),  # empty draft
    ],
)
def test_greedy_chain_cases(draft, argmaxes, tokens) -> None:
    verdict = GREEDY(TokenTree.chain(0, draft), one_hot_rows(argmaxes))
    assert verdict.tokens == tokens
    assert verdict.path == list(range(len(tokens)))


def test_greedy_tree_takes_the_matching_branch() -> None:
    #   0 -> 1(a=3) -> 3(b=4) ; 0 -> 2(a'=5) -> 4(c=6)
    tree = TokenTree.from_parents([0, 3, 5, 4, 6], [-1, 0, 0, 1, 2], scheme=DraftScheme.TOPK)
    verdict = GREEDY(tree, one_hot_rows([5, 0, 6, 0, 2]))
    assert verdict.path == [0, 2, 4] and verdict.tokens == [5, 6, 2]


def test_greedy_with_duplicate_siblings_takes_the_deepest_match() -> None:
    # i.i.d. drafting produced token 3 twice; only the second copy has a matching child.
    tree = TokenTree.from_parents([0, 3, 3, 1, 2], [-1, 0, 0, 1, 2], scheme=DraftScheme.IID)
    verdict = GREEDY(tree, one_hot_rows([3, 7, 2, 0, 6]))
    assert verdict.path == [0, 2, 4] and verdict.tokens == [3, 2, 6]
    shallow = GREEDY(tree, one_hot_rows([3, 7, 7, 0, 6]))
    assert shallow.path == [0, 1] and shallow.tokens == [3, 7]  # equal depth: lowest index


def test_greedy_ties_break_to_the_lowest_token_like_argmax() -> None:
    rows = torch.tensor([[0.4, 0.4, 0.2], [0.1, 0.45, 0.45]])
    assert GREEDY(TokenTree.chain(0, [1]), rows).tokens == [0]
    assert GREEDY(TokenTree.chain(0, [0]), rows).tokens == [0, 1]


def test_greedy_accepts_logits_as_well_as_probabilities() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    tree = TokenTree.from_parents([0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 3], scheme=DraftScheme.TOPK)
    assert GREEDY(tree, logits) == GREEDY(tree, torch.softmax(logits, dim=-1))


def test_greedy_batch_equals_single_calls() -> None:
    rng = random.Random(0)
    trees, rows = [], []
    for n in (1, 3, 7, 12, 5):
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        argmaxes = [rng.randrange(3) for _ in range(n)]
        trees.append(
            TokenTree.from_parents(
                [rng.randrange(3) for _ in range(n)], parents, scheme=DraftScheme.TOPK
            )
        )
        rows.append(one_hot_rows(argmaxes, vocab=3))
    assert GREEDY.verify_batch(trees, rows) == [
        GREEDY(t, r) for t, r in zip(trees, rows, strict=True)
    ]
    assert max(GREEDY(t, r).num_accepted for t, r in zip(trees, rows, strict=True)) > 0


def plain_greedy(target: ToyModel, start: tuple[int, ...], count: int) -> list[int]:
    history = list(start)
    for _ in range(count):
        history.append(int(target.probs(tuple(history)).argmax()))
    return history[len(start) :]


def topk_tree(draft: ToyModel, history: tuple[int, ...], parents: list[int]) -> TokenTree:
    """Top-k expansion of the draft model over a fixed shape (k = number of children)."""
    tokens, prefixes = [history[-1]], [history]
    for node in range(1, len(parents)):
        parent = parents[node]
        rank = sum(1 for c in range(1, node) if parents[c] == parent)  # k-th child: k-th best
        row = draft.probs(prefixes[parent])
        token = int(torch.sort(row, descending=True, stable=True).indices[rank])
        tokens.append(token)
        prefixes.append(prefixes[parent] + (token,))
    return TokenTree.from_parents(tokens, parents, scheme=DraftScheme.TOPK)


@pytest.mark.parametrize("parents", [[-1, 0, 1, 2], [-1, 0, 0, 1, 1, 2, 3]])
def test_greedy_speculative_loop_reproduces_plain_greedy_decoding(parents) -> None:
    target = ToyModel(6, 3, temperature=0.0)
    draft = ToyModel(6, 4, base=target, noise=0.7)
    start, count = (0,), 24
    history, accepted_total = list(start), 0
    while len(history) - len(start) < count:
        tree = topk_tree(draft, tuple(history), parents)
        rows = torch.stack(
            [
                target.probs(tuple(history[:-1]) + tuple(tree.tokens[tree.path_to(i)].tolist()))
                for i in range(tree.num_nodes)
            ]
        )
        verdict = GREEDY(tree, rows)
        accepted_total += verdict.num_accepted
        history.extend(verdict.tokens)
    assert history[len(start) : len(start) + count] == plain_greedy(target, start, count)
    assert accepted_total > 0  # the drafts were sometimes right, so the loop was exercised


def test_argmax_rows_breaks_ties_and_nans_like_torch() -> None:
    """The NumPy argmax greedy verification uses picks the same index as ``torch.argmax``:
    the first of equal maxima, the first NaN when a row has one, in float32 and float64."""
    from lyanna.sampling import argmax_rows

    nan = float("nan")
    rows = torch.tensor(
        [[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 0.0], [0.0, 0.0, 0.0, 0.0], [-1.0, -5.0, -1.0, -2.0]]
    )
    gen = torch.Generator().manual_seed(0)
    wide = torch.randint(-3, 3, (6, 4096), generator=gen).float()  # many ties
    for x in (rows, rows.double(), wide, wide[:, ::2], wide.T.contiguous().T):
        assert argmax_rows(x) == x.argmax(dim=-1).tolist()
