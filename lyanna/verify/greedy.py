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

from lyanna.tree import DraftScheme, TokenTree, pack_trees
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
        best_per_tree = [probs.argmax(dim=-1) for probs in target_probs]  # no copy of the rows
        packed = pack_trees(trees, [0] * len(trees))
        width = packed.tokens.shape[1]
        best = torch.zeros(len(trees), width, dtype=torch.int64)
        parents = torch.zeros(len(trees), width, dtype=torch.int64)
        valid = torch.zeros(len(trees), width, dtype=torch.bool)
        for b, (tree, best_b) in enumerate(zip(trees, best_per_tree, strict=True)):
            best[b, : tree.num_nodes] = best_b
            parents[b, 1 : tree.num_nodes] = tree.parents[1:]
            valid[b, : tree.num_nodes] = True
        match = (packed.tokens == best.gather(1, parents)) & valid  # [batch, width]
        match[:, 0] = True
        on_path = ~(packed.mask & ~match[:, None, :]).any(dim=-1)  # [batch, width]
        depth_score = torch.where(on_path, packed.positions, -1)  # positions = depths here
        ends = depth_score.argmax(dim=-1).tolist()  # first (lowest) index among the deepest
        return [
            make_verdict(tree, tree.path_to(end), int(best[b, end]), fallback=False)
            for b, (tree, end) in enumerate(zip(trees, ends, strict=True))
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
