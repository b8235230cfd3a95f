"""A drafter's candidate nodes before they become a ``TokenTree``: plain Python lists that
drafters build, prune (by joint draft probability, or for sampled nodes by the gain known
before each draw) and merge (verification fusion), so a draft step costs no tensor op per
node and only the tree finally proposed pays for ``TokenTree``'s checks and mask."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from lyanna.tree import DraftScheme, TokenTree, best_nodes, log_joint_of


@dataclass(frozen=True, slots=True, eq=False)
class DraftNodes:
    """A drafter's candidate nodes before they become a `TokenTree`, as plain Python lists:
    building, pruning and merging them costs no tensor op per node, and only the tree finally
    proposed pays for `TokenTree`'s checks and attention mask. Same conventions as `TokenTree`
    (node 0 is the root, `parents[i] < i`, children in drawing order); `probs[i]` is the draft
    probability of node i's token (1 for the root), as in `TokenTree.draft_token_probs`.

    Sampled nodes (`draft_rows` given: children drawn without replacement from each node's
    row) are ranked by what was known *before* each was drawn, never by its own token:
    `gains[i]` is the parent's joint probability times the parent row's j-th largest
    probability (j = the node's drawing position). Pruning keeps a prefix of a best-first
    order over those gains (`_sampled_order`): whether a node is kept then depends on its
    ancestors, its earlier siblings and other branches, all independent of its own draw, so
    every kept sibling set is still a without-replacement draw and the tree keeps its scheme
    (checked exactly in tests/unit/test_sampled_drafting.py). Ranking by the node's own
    probability would bias it: keeping a child only when it drew a likely token over-weights
    likely tokens."""

    tokens: list[int]
    parents: list[int]
    probs: list[float] | None = None
    draft_rows: torch.Tensor | None = None  # [num_nodes, vocab or num_hot]: sampled nodes
    vocab_index: torch.Tensor | None = None  # [num_hot] int64 when the rows are hot rows
    gains: list[float] | None = None  # sampled: predicted gain of each node (root: 0)

    @classmethod
    def of(cls, tree: TokenTree) -> DraftNodes:
        probs = tree.draft_token_probs
        return cls(
            tree.tokens.tolist(), tree.parents.tolist(), None if probs is None else probs.tolist()
        )

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1

    @property
    def sampled(self) -> bool:
        return self.draft_rows is not None

    def to_tree(self) -> TokenTree:
        """The proposal: sampled nodes as a WITHOUT_REPLACEMENT tree with their rows, any
        other candidate set (top-k, pruned by probability, merged) as TOPK."""
        probs = None if self.probs is None else torch.tensor(self.probs, dtype=torch.float64)
        scheme = DraftScheme.WITHOUT_REPLACEMENT if self.sampled else DraftScheme.TOPK
        return TokenTree.from_parents(
            self.tokens,
            self.parents,
            scheme=scheme,
            draft_token_probs=probs,
            draft_probs=self.draft_rows,
            vocab_index=self.vocab_index,
        )

    def token_paths(self) -> list[tuple[int, ...]]:
        """The token sequence from the root (exclusive) to every node (the root's is empty)."""
        paths: list[tuple[int, ...]] = [()]
        for token, parent in zip(self.tokens[1:], self.parents[1:], strict=True):
            paths.append((*paths[parent], token))
        return paths

    def prune(self, budget: int) -> DraftNodes:
        """`TokenTree.prune` on the lists: the same nodes, in the same order; sampled nodes
        keep the first `budget` of `_sampled_order` instead."""
        if self.sampled:
            return self._keep([0, *sorted(self._sampled_order()[:budget])])
        if budget >= self.num_drafted:
            return self
        return self._keep(best_nodes(self.parents, log_joint_of(self.parents, self.probs), budget))

    def _keep(self, keep: list[int]) -> DraftNodes:  # ascending node indices, root first
        if len(keep) == len(self.tokens):
            return self
        new_index = {node: i for i, node in enumerate(keep)}
        return DraftNodes(
            [self.tokens[i] for i in keep],
            [-1] + [new_index[self.parents[i]] for i in keep[1:]],
            None if self.probs is None else [self.probs[i] for i in keep],
            None if self.draft_rows is None else self.draft_rows[keep],
            self.vocab_index,
            None if self.gains is None else [self.gains[i] for i in keep],
        )

    def _sampled_order(self) -> list[int]:
        """Drawn nodes (zero-probability padding and its subtree left out), best first: the
        node with the highest gain among those whose parent is already in the order (ties:
        lower index, so siblings follow their drawing order). A node's place then depends
        only on gains known before its draw and on nodes outside its subtree; every prefix
        is a tree."""
        children: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            if self.probs[i] > 0:
                children[self.parents[i]].append(i)
        order: list[int] = []
        frontier = [(-self.gains[c], c) for c in children[0]]
        heapq.heapify(frontier)
        while frontier:
            _, node = heapq.heappop(frontier)
            order.append(node)
            for c in children[node]:
                heapq.heappush(frontier, (-self.gains[c], c))
        return order

    def ranked_gains(self) -> list[float] | None:
        """The expected accepted tokens each draft node adds, in the order `prune` keeps them:
        its joint draft probability (EAGLE-2's estimate), or for sampled nodes `gains`;
        None without probabilities."""
        if self.probs is None:
            return None
        if self.sampled:
            return [self.gains[i] for i in self._sampled_order()]
        log_joint = log_joint_of(self.parents, self.probs)
        order = sorted(range(1, len(self.parents)), key=lambda i: (-log_joint[i], i))
        return [math.exp(log_joint[i]) for i in order]

    def merge(self, other: DraftNodes) -> DraftNodes:
        """Trie union of two candidate sets with the same root token (verification fusion):
        nodes with the same token under the same (merged) parent become one, including
        duplicate siblings inside either set. Node order: this set's nodes first, then the new
        ones from `other`. A shared node keeps the larger draft token probability (known only
        if both sets have them). The union is a deterministic candidate set (TOPK) and carries
        no draft rows."""
        if self.tokens[0] != other.tokens[0]:
            raise ValueError("merge needs trees with the same root token")
        have_probs = self.probs is not None and other.probs is not None
        index: dict[tuple[int, int], int] = {}
        tokens, parents, probs = [self.tokens[0]], [-1], [1.0]
        for nodes in (self, other):
            new_index = [0] * len(nodes.tokens)
            for i in range(1, len(nodes.tokens)):
                key = (new_index[nodes.parents[i]], nodes.tokens[i])
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(key[1])
                    parents.append(key[0])
                    probs.append(0.0)
                new_index[i] = index[key]
                if have_probs:
                    probs[new_index[i]] = max(probs[new_index[i]], nodes.probs[i])
        return DraftNodes(tokens, parents, probs if have_probs else None)


def merge_trees(first: TokenTree, second: TokenTree) -> TokenTree:
    """Trie union of two trees with the same root token (`DraftNodes.merge`), as a tree."""
    return DraftNodes.of(first).merge(DraftNodes.of(second)).to_tree()
