"""Traversal verification (Weng et al. 2025, arXiv 2505.12398) of trees drafted without
replacement, as reconstructed in §3.5 of the verification design and checked exactly there.

Owns the bottom-up rule: every node keeps a target row Mb (initially p(. | node)), a draft row
Ms (initially q(. | node)) and a sequence-level acceptance level pa (pa(root) = 1,
pa(c) = min(1, pa(n) Mb_n(c) / Ms_n(c)) for a child c of n). Repeatedly test the first leaf in
post-order (follow the first live child from the root): accept its whole path with probability
pa(leaf) and emit a token from its Mb row; otherwise delete it and update its parent a with
block verification's stop probability pa(a) = S / (S + (1 - pa(a))), S = sum max(pa Mb - Ms, 0),
Mb_a = norm(max(pa Mb_a - Ms_a, 0)), the deleted token removed from Ms_a, and recompute pa
below a. Reaching the root (all children deleted) emits from Mb_root. On a chain this is block
verification; on trees it accepts at least as much as RRS without replacement in our
measurements (not a theorem). Sequential: O(num_nodes * vocab) work per rejection.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify.base import (
    Branch,
    RuleBase,
    Verdict,
    accept_probability,
    draft_rows,
    draw,
    make_verdict,
    positive_residual,
)


@dataclass(frozen=True, slots=True, eq=False)
class TraversalTest:
    """One Bernoulli test of the traversal: accept `path` with `accept_probability` and then
    emit from `next_token_probs`; on failure the traversal moves on to the next test."""

    path: tuple[int, ...]
    accept_probability: float
    next_token_probs: torch.Tensor  # [vocab]
    fallback: bool  # an empty residual was replaced by the target row so far


class _TraversalState:
    """Live children, Mb / Ms rows and levels pa of one traversal. Rows are copy-on-write:
    only a node that loses a child gets its own rows. Ms is kept unnormalised with its total
    (removing a token costs O(1)); residuals are scale-free, so S is rescaled instead."""

    def __init__(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab] p(. | node)
        drafts: torch.Tensor,  # [num_nodes, vocab] q(. | node)
    ) -> None:
        self.target_probs, self.drafts = target_probs, drafts
        self.tokens, self.parents = tree.tokens.tolist(), tree.parents.tolist()
        self.live = [list(tree.children(i)) for i in range(tree.num_nodes)]
        self.level = [1.0] * tree.num_nodes
        self.target_rows: dict[int, torch.Tensor] = {}  # Mb, once it differs from p
        self.draft_left: dict[int, tuple[torch.Tensor, float]] = {}  # Ms * total, total
        self.fallback = False
        self.refresh(0)

    def mb(self, node: int) -> torch.Tensor:  # [vocab]
        return self.target_rows.get(node, self.target_probs[node])

    def ms(self, node: int) -> tuple[torch.Tensor, float]:  # [vocab] unnormalised Ms, total
        return self.draft_left.get(node, (self.drafts[node], 1.0))

    def refresh(self, node: int) -> None:
        """pa(c) = min(1, pa(n) Mb_n(c) / Ms_n(c)) for every live descendant c of `node`."""
        children = self.live[node]
        if not children:
            return
        index = torch.tensor([self.tokens[c] for c in children])
        draft_row, total = self.ms(node)
        draft_mass = draft_row[index] / total if total > 0 else draft_row[index]
        levels = accept_probability(self.level[node] * self.mb(node)[index], draft_mass)
        for child, level in zip(children, levels.tolist(), strict=True):
            self.level[child] = level
            self.refresh(child)

    def first_leaf_path(self) -> tuple[int, ...]:
        """Root to the first leaf in post-order (first live child at every step)."""
        path = [0]
        while self.live[path[-1]]:
            path.append(self.live[path[-1]][0])
        return tuple(path)

    def delete(self, leaf: int) -> None:
        """Remove a rejected leaf and update its parent as block verification would."""
        parent = self.parents[leaf]
        self.live[parent].pop(0)
        old_level = self.level[parent]
        draft_row, total = self.ms(parent)
        scale = old_level * total if total > 0 else old_level
        weighted = self.mb(parent) * scale if scale != 1.0 else self.mb(parent)
        self.target_rows[parent], mass = positive_residual(
            weighted, draft_row, self.target_probs[parent]
        )
        self.fallback = self.fallback or bool(mass <= 0)
        excess = float(mass) / total if total > 0 else float(mass)  # S
        denominator = excess + (1.0 - old_level)  # S + (1 - w), never (S + 1) - w
        self.level[parent] = excess / denominator if denominator > 0 else 0.0
        if parent not in self.draft_left:
            draft_row = draft_row.clone()
        draft_row[self.tokens[leaf]] = 0.0
        self.draft_left[parent] = (draft_row, float(draft_row.sum()))
        self.refresh(parent)


class TraversalVerification(RuleBase):
    """Traversal verification for trees drafted without replacement (and sampled chains).

    Invariant: lossless; on a chain its law equals block verification's. Example: chain [B]
    with p = (1/3, 2/3), q = (2/3, 1/3): pa(B) = min(1, (2/3)/(1/3)) = 1, so B is always
    accepted and the bonus comes from p after B.
    """

    name = "traversal"
    needs_draft_probs = True
    schemes = frozenset({DraftScheme.WITHOUT_REPLACEMENT, DraftScheme.CHAIN_SAMPLED})

    def tests(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> Iterator[TraversalTest]:
        """The sequence of tests; the first success decides the verdict (the last test,
        at the root, always succeeds)."""
        self.check(tree, target_probs)
        if tree.num_drafted == 0:
            yield TraversalTest((0,), 1.0, target_probs[0], False)
            return
        state = _TraversalState(tree, target_probs, draft_rows(tree, target_probs))
        while True:
            path = state.first_leaf_path()
            leaf = path[-1]
            level = 1.0 if leaf == 0 else state.level[leaf]
            yield TraversalTest(path, level, state.mb(leaf), state.fallback)
            if leaf == 0:
                return
            state.delete(leaf)

    def _verify(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
        generator: torch.Generator | None,
    ) -> Verdict:
        for test in self.tests(tree, target_probs):
            u = float(torch.rand(1, generator=generator, dtype=torch.float64))
            if u < test.accept_probability:
                token = draw(test.next_token_probs, generator)
                return make_verdict(tree, test.path, token, test.fallback)
        raise AssertionError("the root test always succeeds")

    def _branches(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> list[Branch]:
        branches, survive = [], 1.0
        for test in self.tests(tree, target_probs):
            branches.append(
                Branch(test.path, survive * test.accept_probability, test.next_token_probs)
            )
            survive *= 1.0 - test.accept_probability
        return branches
