"""N-gram drafter: no model, a trie of continuations of the current suffix.

Every sequence keeps an index from each n-gram (n = 1..max_n) of its prompt and its own output
to the positions that follow it. To draft, the longest suffix of the history (ending at the
pending root token) that occurred before selects those positions; their continuations form a
trie whose nodes are weighted by how many continuations pass through them. Each node keeps its
``top_k`` most frequent children and the tree is pruned to the budget by that frequency, so
the candidates are a deterministic set (``DraftScheme.TOPK``): lossless with the
deterministic-candidate rule at any temperature.

Example: history ``a b c a b d a b`` with root ``b``: the suffix ``a b`` occurred twice, followed
by ``c a b ...`` and ``d a b ...``, so the root gets children ``c`` and ``d`` (weight 1/2 each).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from lyanna.draft_nodes import DraftNodes
from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.tree import DraftScheme, TokenTree
from lyanna.tree_cost import GainCalibration

MAX_MATCHES = 64  # most recent occurrences of the suffix that feed the trie


@dataclass(slots=True)
class _History:
    tokens: list[int]
    index: defaultdict[tuple[int, ...], list[int]]  # n-gram -> positions right after it


class NgramDrafter:
    scheme = DraftScheme.TOPK
    needs_hidden = False

    def __init__(self, budget: DraftBudget | None = None, max_n: int = 3) -> None:
        self.budget = budget or DraftBudget()
        self.calibration = GainCalibration()  # what the predicted gains are worth
        self.max_n = max_n
        self._seqs: dict[int, _History] = {}

    def start(self, seq_id, prompt_ids, prompt_hidden, first_token, params=None) -> None:
        history = _History([], defaultdict(list))
        self._seqs[seq_id] = history
        self._extend(history, [*prompt_ids, first_token])

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        self.calibration.verified(sum(step.num_accepted for step in steps))
        for step in steps:
            # committed[0] is the old root, already in the history
            self._extend(self._seqs[step.seq_id], [*step.committed[1:], step.next_token])
        return {}

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def propose(self, seq_ids: list[int]) -> list[TokenTree]:
        nodes = [self._candidates(self._seqs[s]) for s in seq_ids]
        calibrations = [self.calibration] * len(nodes)
        return [n.to_tree() for n in self.budget.prune(nodes, calibrations=calibrations)]

    def _extend(self, history: _History, new_tokens: list[int]) -> None:
        tokens = history.tokens
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens)
            for n in range(1, min(self.max_n, end) + 1):
                history.index[tuple(tokens[end - n :])].append(end)

    def _candidates(self, history: _History) -> DraftNodes:
        tokens = history.tokens
        root = tokens[-1]
        end = len(tokens)
        starts: list[int] = []
        for n in range(min(self.max_n, end), 0, -1):
            starts = [p for p in history.index.get(tuple(tokens[end - n :]), ()) if p < end]
            if starts:
                break
        if not starts:
            return DraftNodes([root], [-1], [1.0])
        depth = self.budget.depth
        continuations = [tokens[p : p + depth] for p in starts[-MAX_MATCHES:]]
        return self._trie(root, continuations)

    def _trie(self, root: int, continuations: list[list[int]]) -> DraftNodes:
        """Trie of the continuations, top_k children per node by frequency."""
        node_tokens, parents, counts = [root], [-1], [len(continuations)]
        frontier = [(0, continuations)]
        while frontier:
            node, group = frontier.pop(0)
            by_token: dict[int, list[list[int]]] = defaultdict(list)
            for cont in group:
                if cont:
                    by_token[cont[0]].append(cont[1:])
            ranked = sorted(by_token.items(), key=lambda kv: -len(kv[1]))[: self.budget.top_k]
            for token, rest in ranked:
                node_tokens.append(token)
                parents.append(node)
                counts.append(len(rest))
                frontier.append((len(node_tokens) - 1, rest))
        probs = [1.0] + [counts[i] / counts[parents[i]] for i in range(1, len(counts))]
        return DraftNodes(node_tokens, parents, probs)
