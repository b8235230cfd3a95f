"""Exact-law checker for the verification tests (shared helper, not a test module).

Toy auto-regressive "models" are tables of conditional distributions over a tiny vocabulary,
filled lazily from a seeded RNG. For a tree shape and a drafting scheme the checker enumerates
every draft with its probability, takes each rule's exact law (`rule.branches`), emits the
accepted tokens and the final token, continues with the target, and returns the exact law of
the first `max_depth + 1` emitted tokens next to the target's own law.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lyanna.sampling import logits_to_probs
from lyanna.tree import DraftScheme, TokenTree

ROOT = 0  # the committed token every toy draft starts from (the context is just this token)


@dataclass
class ToyModel:
    """p(. | prefix) for prefixes of a tiny vocabulary. `base` + `noise` makes a draft model
    that resembles `base`; `zero_fraction` masks tokens out (exact zeros in the table);
    `fixed` makes every conditional the same row."""

    vocab: int
    seed: int
    base: ToyModel | None = None
    noise: float = 1.0
    zero_fraction: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    fixed: tuple[float, ...] | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def logits(self, prefix: tuple[int, ...]) -> np.ndarray:  # [vocab]
        rng = np.random.default_rng([self.seed, len(prefix), *prefix])
        logits = rng.normal(size=self.vocab) * 1.5
        if self.base is not None:
            logits = self.base.logits(prefix) + self.noise * logits
        masked = rng.random(self.vocab) < self.zero_fraction
        masked[int(np.argmax(logits))] = False
        return np.where(masked, -np.inf, logits)

    def probs(self, prefix: tuple[int, ...]) -> torch.Tensor:  # [vocab] float64
        if self.fixed is not None:
            return torch.tensor(self.fixed, dtype=torch.float64)
        if prefix not in self._cache:
            logits = torch.tensor(self.logits(prefix), dtype=torch.float64)
            probs = logits_to_probs(logits, self.temperature, self.top_p).double()
            self._cache[prefix] = probs / probs.sum()
        return self._cache[prefix]


def textbook_models() -> tuple[ToyModel, ToyModel]:
    """Target p = (1/3, 2/3) and draft q = (2/3, 1/3) after every prefix (§4 of the design)."""
    return ToyModel(2, 0, fixed=(1 / 3, 2 / 3)), ToyModel(2, 0, fixed=(2 / 3, 1 / 3))


def _prefixes(tokens: Sequence[int], parents: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for i, parent in enumerate(parents):
        out.append((tokens[i],) if parent < 0 else out[parent] + (tokens[i],))
    return out


def _child_choices(
    row: torch.Tensor, count: int, scheme: DraftScheme
) -> Iterator[tuple[tuple[int, ...], float]]:
    probs = row.tolist()
    vocab = len(probs)
    if scheme is DraftScheme.TOPK:
        order = torch.sort(row, descending=True, stable=True).indices[:count].tolist()
        yield tuple(order), 1.0
    elif scheme is DraftScheme.WITHOUT_REPLACEMENT:
        for combo in itertools.permutations(range(vocab), count):
            prob, used = 1.0, 0.0
            for token in combo:
                prob *= probs[token] / (1.0 - used) if used < 1.0 else 0.0
                used += probs[token]
            yield combo, prob
    else:  # IID and CHAIN_SAMPLED: independent draws
        for combo in itertools.product(range(vocab), repeat=count):
            yield combo, float(np.prod([probs[t] for t in combo]))


def enumerate_drafts(
    draft: ToyModel, parents: Sequence[int], scheme: DraftScheme
) -> Iterator[tuple[list[int], float]]:
    """Every token assignment of the tree shape `parents` the drafter can produce, with its
    probability under `scheme` (children in sampling order)."""
    children = [[c for c in range(len(parents)) if parents[c] == i] for i in range(len(parents))]
    internal = [i for i in range(len(parents)) if children[i]]
    tokens = [ROOT] * len(parents)

    def assign(k: int, prob: float) -> Iterator[tuple[list[int], float]]:
        if k == len(internal):
            yield list(tokens), prob
            return
        node = internal[k]
        row = draft.probs(_prefixes(tokens, parents)[node])
        for combo, combo_prob in _child_choices(row, len(children[node]), scheme):
            if combo_prob > 0:
                for child, token in zip(children[node], combo, strict=True):
                    tokens[child] = token
                yield from assign(k + 1, prob * combo_prob)

    yield from assign(0, 1.0)


def draft_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    scheme: DraftScheme,
    draft: ToyModel,
    target: ToyModel,
) -> tuple[TokenTree, torch.Tensor]:  # tree, target_probs [num_nodes, vocab]
    """The tree with its draft rows, and the target rows at every node."""
    prefixes = _prefixes(tokens, parents)
    draft_probs = torch.stack([draft.probs(p) for p in prefixes])
    tree = TokenTree.from_parents(tokens, parents, scheme=scheme, draft_probs=draft_probs)
    return tree, torch.stack([target.probs(p) for p in prefixes])


@dataclass(frozen=True)
class LawCheck:
    max_error: float  # max |emitted law - target law| over all sequences of the checked length
    total_mass: float  # total probability of all enumerated (draft, branch) events
    expected_accepted: float  # E[num_accepted] over drafts and verdicts


class _TargetContinuation:
    """C(e) = the target's law of the tokens after emitted prefix e, up to `length` tokens."""

    def __init__(self, target: ToyModel, length: int) -> None:
        self.target, self.length, self.cache = target, length, {}

    def law(self, emitted: tuple[int, ...]) -> torch.Tensor:  # [vocab] * (length - len(e))
        if len(emitted) >= self.length:
            return torch.ones((), dtype=torch.float64)
        if emitted not in self.cache:
            row = self.target.probs((ROOT,) + emitted)
            self.cache[emitted] = self.after(emitted, row)
        return self.cache[emitted]

    def after(self, emitted: tuple[int, ...], next_probs: torch.Tensor) -> torch.Tensor:
        """Law of the rest when the next token is drawn from `next_probs`, then the target."""
        rest = [self.law(emitted + (y,)) for y in range(next_probs.shape[0])]
        return torch.stack([next_probs[y].double() * r for y, r in enumerate(rest)])


def check_rule(
    rule,
    target: ToyModel,
    draft: ToyModel,
    parents: Sequence[int],
    scheme: DraftScheme,
    tree_scheme: DraftScheme | None = None,
) -> LawCheck:
    """Exact law of the first max_depth + 1 emitted tokens under `rule` vs the target's.
    `tree_scheme` mislabels the drafts (only for negative controls)."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    trees = (
        (draft_tree(tokens, parents, tree_scheme or scheme, draft, target)[0], prob)
        for tokens, prob in enumerate_drafts(draft, parents, scheme)
    )
    return check_trees(rule, target, trees, length=max(depth) + 1)


def check_trees(
    rule, target: ToyModel, trees: Iterable[tuple[TokenTree, float]], length: int
) -> LawCheck:
    """Exact law of the first `length` emitted tokens when a drafter proposes each tree (its
    root is ROOT, its draft rows set) with the given probability, vs the target's."""
    continuation = _TargetContinuation(target, length)
    law = torch.zeros((target.vocab,) * length, dtype=torch.float64)
    total, expected = 0.0, 0.0
    for tree, draft_prob in trees:
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        target_probs = torch.stack([target.probs(p) for p in _prefixes(tokens, parents)])
        for branch in rule.branches(tree, target_probs):
            mass = draft_prob * branch.probability
            if mass == 0.0:
                continue
            accepted = tuple(tokens[i] for i in branch.path[1:])
            law[accepted] += mass * continuation.after(accepted, branch.next_token_probs)
            total += mass
            expected += mass * len(accepted)
    error = float((law - continuation.law(())).abs().max())
    return LawCheck(max_error=error, total_mass=total, expected_accepted=expected)


def expected_accepted(
    rule, target: ToyModel, draft: ToyModel, parents: Sequence[int], scheme: DraftScheme
) -> float:
    """E[num_accepted] of `rule` averaged over the drafter's trees."""
    return sum(
        prob * rule.expected_accepted(*draft_tree(tokens, parents, scheme, draft, target))
        for tokens, prob in enumerate_drafts(draft, parents, scheme)
    )


def verdict_law(rule, tree: TokenTree, target_probs: torch.Tensor) -> dict:
    """Exact probability of each (accepted path, final token) outcome of one verification."""
    law: dict[tuple[tuple[int, ...], int], float] = {}
    for branch in rule.branches(tree, target_probs):
        for token, prob in enumerate(branch.next_token_probs.tolist()):
            if branch.probability * prob > 0:
                key = (branch.path, token)
                law[key] = law.get(key, 0.0) + branch.probability * prob
    return law


def chi_square_pvalue(law: dict, verdicts) -> float:
    """Goodness of fit of sampled verdicts to an exact verdict law (bins with an expected count
    below 5 are pooled). Fails outright if a verdict has probability zero under the law."""
    from scipy.stats import chisquare

    counts: dict = {}
    for verdict in verdicts:
        key = (tuple(verdict.path), verdict.tokens[-1])
        assert key in law, f"impossible verdict {key}"
        counts[key] = counts.get(key, 0) + 1
    n = len(verdicts)
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for key, prob in law.items():
        if prob * n >= 5:
            observed.append(counts.get(key, 0))
            expected.append(prob * n)
        else:
            pooled_obs += counts.get(key, 0)
            pooled_exp += prob * n
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    if len(observed) < 2:
        return 1.0  # a single possible outcome, already checked above
    expected = np.array(expected) * (n / sum(expected))
    return float(chisquare(observed, expected).pvalue)
