"""Greedy verification (temperature 0) of chains and trees, batched.

Owns the argmax-match rule of §2 of the verification design (as in EAGLE's
`evaluate_posterior` at temperature 0 and gpt-fast's greedy speculative loop): a node is
accepted when its token equals the target's argmax at its parent and its parent is accepted;
the verdict ends at the deepest accepted node (lowest index among equally deep ones) and emits
the target's argmax there. Draft probabilities are never needed, and logits work as well as
probabilities (same argmax, lowest index on ties like `torch.argmax`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lyanna.sampling import argmax_rows
from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify.base import Branch, RuleBase, Verdict, make_verdict


class Greedy(RuleBase):
    """Accept the longest path whose every token is the target's argmax at its parent.

    Invariant: with one-hot (temperature-0) target rows the emitted tokens are exactly those
    of plain greedy decoding, whatever the drafting scheme. Example: root r, children a (node
    1) and b (node 2), a's child c (node 3); argmax after r is a, after a is d: the path is
    [0, 1] and the tokens are [a, d].
    """

    name = "greedy"
    needs_draft_probs = False
    schemes = frozenset(DraftScheme)
    greedy_only = True  # argmax of sampled rows is not the target's law

    def _verify_batch(
        self,
        trees: Sequence[TokenTree],
        target_probs: Sequence[torch.Tensor],  # each [num_nodes_b, vocab]
        generator: torch.Generator | None = None,
    ) -> list[Verdict]:
        return [
            greedy_verdict(tree, argmax_rows(probs))  # no copy of the rows
            for tree, probs in zip(trees, target_probs, strict=True)
        ]

    def _branches(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> list[Branch]:
        verdict = self._verify_batch([tree], [target_probs])[0]
        one_hot = torch.zeros(target_probs.shape[-1], dtype=target_probs.dtype)
        one_hot[verdict.tokens[-1]] = 1.0
        return [Branch(path=tuple(verdict.path), probability=1.0, next_token_probs=one_hot)]


def greedy_verdict(tree: TokenTree, best: list[int]) -> Verdict:
    """Walk the tree in node order (parents come first): a node is accepted when its parent
    is and its token is the target's argmax there; the verdict ends at the first of the
    deepest accepted nodes. A few list lookups per node, no tensor op."""
    tokens, parents, depths = tree.token_list, tree.parent_list, tree.depth_list
    accepted = [True] + [False] * (len(tokens) - 1)
    end = 0
    for i in range(1, len(tokens)):
        parent = parents[i]
        if accepted[parent] and tokens[i] == best[parent]:
            accepted[i] = True
            if depths[i] > depths[end]:
                end = i
    return make_verdict(tree, tree.path_to(end), best[end], fallback=False)
