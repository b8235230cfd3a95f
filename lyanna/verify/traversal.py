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
        drafts = draft_rows(tree, target_probs)
        # Copy-on-write rows: only nodes that lose a child get new Mb / Ms rows.
        target_rows: dict[int, torch.Tensor] = {}  # Mb
        draft_rows_left: dict[int, torch.Tensor] = {}  # Ms

        def mb(node: int) -> torch.Tensor:  # [vocab]
            return target_rows.get(node, target_probs[node])

        def ms(node: int) -> torch.Tensor:  # [vocab]
            return draft_rows_left.get(node, drafts[node])

        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        live = [list(tree.children(i)) for i in range(tree.num_nodes)]
        level = [1.0] * tree.num_nodes
        fallback = False

        def refresh(node: int) -> None:
            for child in live[node]:
                target_mass = level[node] * mb(node)[tokens[child]]
                level[child] = float(accept_probability(target_mass, ms(node)[tokens[child]]))
                refresh(child)

        refresh(0)
        while True:
            path = [0]
            while live[path[-1]]:
                path.append(live[path[-1]][0])
            leaf = path[-1]
            if leaf == 0:
                yield TraversalTest((0,), 1.0, mb(0), fallback)
                return
            yield TraversalTest(tuple(path), level[leaf], mb(leaf), fallback)
            parent = parents[leaf]
            live[parent].pop(0)
            old_level = level[parent]
            target_rows[parent], excess = positive_residual(
                old_level * mb(parent), ms(parent), target_probs[parent]
            )
            fallback = fallback or bool(excess <= 0)
            denominator = float(excess) + (1.0 - old_level)  # S + (1 - w), not (S + 1) - w
            level[parent] = float(excess) / denominator if denominator > 0 else 0.0
            remaining = ms(parent).clone()
            remaining[tokens[leaf]] = 0.0
            total = remaining.sum()
            draft_rows_left[parent] = remaining / total if total > 0 else remaining
            refresh(parent)

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
