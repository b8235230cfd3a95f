"""N-gram drafter: no model, a trie of continuations of the current suffix.

Two sources, tried in order: the request's own text (prompt lookup), when a suffix of at
least ``HISTORY_MIN_N`` tokens occurred in it before; else a corpus store of what the target
itself wrote after the longest known suffix (``NgramStore``, optional); else a one-token
suffix of the request's text. Each source keeps its own gain calibration, since their
frequencies are worth different numbers of accepted tokens.

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

import heapq
from collections import defaultdict
from dataclasses import dataclass

from lyanna.draft_nodes import DraftNodes
from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.ngram_store import NgramStore
from lyanna.tree import DraftScheme, TokenTree
from lyanna.tree_cost import GainCalibration

MAX_MATCHES = 64  # most recent occurrences of the suffix that feed the trie
# a one-token match in the request's own text loses to the corpus store: replaying the
# target's greedy answers to 52 Spec-Bench prompts through a one-token drafter, the request's
# text alone accepted 1.32 tokens per step, its 2+ token matches and then the store 1.45
HISTORY_MIN_N = 2
HISTORY, STORE = 0, 1  # where a sequence's last draft came from


@dataclass(slots=True)
class _History:
    tokens: list[int]
    index: defaultdict[tuple[int, ...], list[int]]  # n-gram -> positions right after it
    depth: int  # deepest draft (``DraftBudget.depth_for``: a sampled sequence's may be less)


class NgramDrafter:
    scheme = DraftScheme.TOPK
    needs_hidden = False

    def __init__(
        self, budget: DraftBudget | None = None, max_n: int = 3, store: NgramStore | None = None
    ) -> None:
        self.budget = budget or DraftBudget()
        # what each source's predicted gains are worth (HISTORY, STORE)
        self.calibrations = (GainCalibration(), GainCalibration())
        self.max_n = max_n
        self.store = store
        self._seqs: dict[int, _History] = {}
        self._sources: dict[int, int] = {}  # sequence -> source of its pending draft

    @property
    def calibration(self) -> GainCalibration:
        """The request-text source's calibration."""
        return self.calibrations[HISTORY]

    def start(self, seq_id, prompt_ids, prompt_hidden, first_token, params=None) -> None:
        depth = self.budget.depth_for(params is None or params.greedy)
        history = _History([], defaultdict(list), depth)
        self._seqs[seq_id] = history
        self._extend(history, [*prompt_ids, first_token])

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        accepted = [0, 0]
        for step in steps:
            source = self._sources.pop(step.seq_id, None)
            if source is not None:  # (not a step another drafter drafted: see GatedDrafter)
                accepted[source] += step.num_accepted
        for calibration, tokens in zip(self.calibrations, accepted, strict=True):
            calibration.verified(tokens)
        for step in steps:
            # committed[0] is the old root, already in the history
            self._extend(self._seqs[step.seq_id], [*step.committed[1:], step.next_token])
        return {}

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._sources.pop(seq_id, None)

    def propose(self, seq_ids: list[int]) -> list[TokenTree]:
        nodes, calibrations = [], []
        for seq_id in seq_ids:
            candidates, source = self._candidates(self._seqs[seq_id])
            self._sources[seq_id] = source
            nodes.append(candidates)
            calibrations.append(self.calibrations[source])
        return [n.to_tree() for n in self.budget.prune(nodes, calibrations=calibrations)]

    def _extend(self, history: _History, new_tokens: list[int]) -> None:
        tokens = history.tokens
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens)
            for n in range(1, min(self.max_n, end) + 1):
                history.index[tuple(tokens[end - n :])].append(end)

    def _candidates(self, history: _History) -> tuple[DraftNodes, int]:
        tokens = history.tokens
        root = tokens[-1]
        end = len(tokens)
        starts: list[int] = []
        for n in range(min(self.max_n, end), 0, -1):
            if n < HISTORY_MIN_N and self.store is not None:
                from_store = self._from_store(tokens, history.depth)
                if from_store is not None:
                    return from_store, STORE
            starts = [p for p in history.index.get(tuple(tokens[end - n :]), ()) if p < end]
            if starts:
                break
        if not starts:
            return DraftNodes([root], [-1], [1.0]), HISTORY
        continuations = [tokens[p : p + history.depth] for p in starts[-MAX_MATCHES:]]
        return self._trie(root, continuations), HISTORY

    def _from_store(self, tokens: list[int], depth: int) -> DraftNodes | None:
        """The store's continuations, best-first by joint share: each expanded node looks
        up its own context (the history plus the path to it), at most ``max_tokens``
        expansions, ``top_k`` children each, down to ``depth``."""
        store, budget = self.store, self.budget
        context = tokens[-store.config.max_n :]
        first = store.continuations(context)
        if first is None:
            return None
        node_tokens, parents, probs = [tokens[-1]], [-1], [1.0]
        paths: list[list[int]] = [[]]  # each node's tokens after the root
        joint = [1.0]
        frontier = [(-1.0, 0, first)]  # (-joint share, node, its continuations)
        for _ in range(budget.max_tokens):
            if not frontier:
                break
            _, node, (_, next_tokens, shares) = heapq.heappop(frontier)
            for token, share in list(zip(next_tokens, shares, strict=True))[: budget.top_k]:
                child = len(node_tokens)
                node_tokens.append(token)
                parents.append(node)
                probs.append(share)
                joint.append(joint[node] * share)
                paths.append([*paths[node], token])
                if len(paths[child]) < depth:
                    more = store.continuations((context + paths[child])[-store.config.max_n :])
                    if more is not None:
                        heapq.heappush(frontier, (-joint[child], child, more))
        return DraftNodes(node_tokens, parents, probs)

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
