"""The acceptance-rule interface and the arithmetic every rule shares.

This module owns the `Verdict` a rule returns for one sequence, the `Branch` list that states a
rule's exact output law (used for expected accepted tokens and by the exact losslessness tests),
the `AcceptanceRule` protocol, the check that a rule is paired with the drafting scheme it is
lossless for, and the two numerically delicate primitives of §7 of the verification design:
the accept test `u * q < p` and the positive residual `norm(max(p - q, 0))` with its flagged
fallback. Probability rows are float32 in serving and float64 in the exact tests; every rule
computes in the dtype it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from lyanna.sampling import sample
from lyanna.tree import DraftScheme, TokenTree


class SchemeMismatchError(ValueError):
    """The tree was drafted in a way the rule is not lossless for."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of verifying one sequence's tree.

    `tokens` holds the accepted draft tokens followed by exactly one residual-or-bonus token,
    so `len(tokens) == num_accepted + 1` (the acceptance length). Callers stop at EOS inside
    `tokens`: a prefix of a lossless output is lossless. `residual_fallback` flags the
    probability-zero branch where a residual the verdict used (for a later trial or the final
    token) was empty in floating point and a fallback row stood in for it (§7.3).
    """

    path: list[int]  # accepted node indices, root (0) first
    tokens: list[int]  # accepted draft tokens + one residual-or-bonus token
    num_accepted: int
    accepted_per_depth: list[bool]  # depth d at index d - 1, for d = 1..max_depth
    num_drafted_per_depth: list[int]  # draft nodes at depth d at index d - 1
    residual_fallback: bool = False

    def __post_init__(self) -> None:
        if not self.path or self.path[0] != 0:
            raise ValueError("a verdict path starts at the root node 0")
        if len(self.path) != self.num_accepted + 1 or len(self.tokens) != self.num_accepted + 1:
            raise ValueError("path and tokens must hold num_accepted + 1 entries")

    @property
    def acceptance_length(self) -> int:
        return self.num_accepted + 1


@dataclass(frozen=True, slots=True, eq=False)
class Branch:
    """One terminal event of a rule: with `probability`, the rule accepts exactly `path` and
    then emits a token distributed as `next_token_probs`. A rule's branches for a tree are its
    exact output law."""

    path: tuple[int, ...]
    probability: float
    next_token_probs: torch.Tensor  # [vocab]


@runtime_checkable
class AcceptanceRule(Protocol):
    """Decides which draft tokens of a tree to accept and which one token to add.

    Invariant (lossless rules): if the tree was drafted as one of `schemes` from the draft
    rows it carries, the emitted tokens, followed by plain target sampling, have exactly the
    target's law. Example: target p = (1/3, 2/3), draft q = (2/3, 1/3), chain [A]: token-wise
    accepts A with probability 1/2 and otherwise emits B, so Pr(first token = A) = 2/3 * 1/2
    = 1/3 = p(A).
    """

    name: str
    needs_draft_probs: bool  # False: the tree's draft rows are never read
    needs_chain: bool  # True: verifies chains only
    schemes: frozenset[DraftScheme]  # drafting schemes this rule is lossless for
    greedy_only: bool  # True: lossless only for one-hot (temperature-0) target rows

    def __call__(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
        generator: torch.Generator | None = None,
    ) -> Verdict: ...

    def verify_batch(
        self,
        trees: Sequence[TokenTree],
        target_probs: Sequence[torch.Tensor],  # each [num_nodes_b, vocab]
        generator: torch.Generator | None = None,
    ) -> list[Verdict]: ...

    def branches(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> list[Branch]: ...


class RuleBase:
    """Shared plumbing: input checks, the default batch loop and the exact-law helpers."""

    name: str = ""
    needs_draft_probs: bool = True
    needs_chain: bool = False
    schemes: frozenset[DraftScheme] = frozenset(DraftScheme)
    greedy_only: bool = False

    def __call__(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
        generator: torch.Generator | None = None,
    ) -> Verdict:
        return self.verify_batch([tree], [target_probs], generator)[0]

    def verify_batch(
        self,
        trees: Sequence[TokenTree],
        target_probs: Sequence[torch.Tensor],  # each [num_nodes_b, vocab]
        generator: torch.Generator | None = None,
    ) -> list[Verdict]:
        if len(trees) != len(target_probs):
            raise ValueError("one target_probs tensor per tree is required")
        for tree, probs in zip(trees, target_probs, strict=True):
            self.check(tree, probs)
        return self._verify_batch(trees, target_probs, generator)

    def _verify_batch(
        self,
        trees: Sequence[TokenTree],
        target_probs: Sequence[torch.Tensor],  # each [num_nodes_b, vocab]
        generator: torch.Generator | None,
    ) -> list[Verdict]:
        """Checked inputs; rules with a vectorized batch path override this."""
        return [self._verify(t, p, generator) for t, p in zip(trees, target_probs, strict=True)]

    def _verify(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
        generator: torch.Generator | None,
    ) -> Verdict:
        raise NotImplementedError

    def branches(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> list[Branch]:
        self.check(tree, target_probs)
        return self._branches(tree, target_probs)

    def _branches(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> list[Branch]:
        raise NotImplementedError

    def expected_accepted(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> float:
        """E[num_accepted] for this tree, from the exact law."""
        return sum(b.probability * (len(b.path) - 1) for b in self.branches(tree, target_probs))

    def check(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> None:
        """Raise unless this rule may verify `tree` losslessly with these inputs."""
        if target_probs.dim() != 2 or target_probs.shape[0] != tree.num_nodes:
            raise ValueError(
                f"target_probs must be [num_nodes={tree.num_nodes}, vocab], "
                f"got {tuple(target_probs.shape)}"
            )
        if tree.num_drafted == 0:
            return  # nothing drafted: every rule is plain sampling from the root row
        if tree.scheme not in self.schemes:
            allowed = ", ".join(sorted(s.name for s in self.schemes))
            raise SchemeMismatchError(
                f"rule '{self.name}' is lossless only for trees drafted as {{{allowed}}}, "
                f"this tree is {tree.scheme.name}; see lyanna.verify.rule_for"
            )
        if self.needs_chain and not tree.is_chain:
            raise SchemeMismatchError(f"rule '{self.name}' verifies chains only")
        if self.needs_draft_probs and tree.draft_probs is None:
            raise ValueError(f"rule '{self.name}' needs the tree's draft_probs rows")


def draft_rows(
    tree: TokenTree,
    target_probs: torch.Tensor,  # [num_nodes, vocab]
) -> torch.Tensor:
    """The tree's draft rows over the full vocabulary, in the target's dtype."""
    vocab = target_probs.shape[-1]
    return tree.full_draft_probs(vocab).to(target_probs.dtype)  # [num_nodes, vocab]


def accept_probability(
    target_mass: torch.Tensor,  # [...]
    draft_mass: torch.Tensor,  # [...]
) -> torch.Tensor:  # [...] min(1, target/draft); 0 when the target mass is 0
    """The exact probability that `u * draft_mass < target_mass` for u ~ U[0, 1)."""
    ratio = target_mass / draft_mass.clamp_min(torch.finfo(draft_mass.dtype).tiny)
    return torch.where(target_mass >= draft_mass, (target_mass > 0).to(ratio.dtype), ratio)


def accept_ratio(target_mass: float, draft_mass: float) -> float:
    """`accept_probability` for Python floats (the same cases, no tensor overhead)."""
    if target_mass >= draft_mass:
        return 1.0 if target_mass > 0 else 0.0
    return target_mass / draft_mass


def accept_test(
    target_mass: torch.Tensor,  # [...]
    draft_mass: torch.Tensor,  # [...]
    generator: torch.Generator | None,
) -> torch.Tensor:  # [...] bool
    """One fresh uniform per entry; strict `u * q < p` (no division, q = 0 cannot NaN)."""
    u = torch.rand(target_mass.shape, generator=generator, dtype=torch.float64)
    return u * draft_mass.double() < target_mass.double()


def positive_residual(
    target_rows: torch.Tensor,  # [..., vocab]
    draft_rows: torch.Tensor,  # [..., vocab]
    fallback_rows: torch.Tensor,  # [..., vocab]
) -> tuple[torch.Tensor, torch.Tensor]:  # [..., vocab] rows, [...] residual mass
    """norm(max(target - draft, 0)) per row, and the mass sum(max(target - draft, 0)) before
    normalising. Where the mass is 0 (probability zero in exact arithmetic, §7.3) the row is
    `fallback_rows` normalised instead; callers flag that case as `mass <= 0`."""
    residual = (target_rows - draft_rows).clamp_min_(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    empty = mass <= 0
    if bool(empty.any()):
        fallback = fallback_rows / fallback_rows.sum(dim=-1, keepdim=True)
        residual = torch.where(
            empty, fallback, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny)
        )
    else:
        residual.div_(mass)
    return residual, mass.squeeze(-1)


def without_tokens(
    rows: torch.Tensor,  # [..., vocab]
    tokens: torch.Tensor,  # [..., k] int64 tokens to remove from each row
) -> torch.Tensor:  # [..., vocab] normalised
    """`rows` with `tokens` zeroed, renormalised: the fallback for an empty residual after
    rejections, since in exact arithmetic a residual never puts mass on a rejected token. A row
    whose whole mass is on `tokens` (a degenerate, probability-zero case) is kept whole."""
    kept = rows.scatter(-1, tokens, 0.0)
    chosen = torch.where(kept.sum(dim=-1, keepdim=True) > 0, kept, rows)
    return chosen / chosen.sum(dim=-1, keepdim=True)


def draw(
    probs: torch.Tensor,  # [vocab]
    generator: torch.Generator | None,
) -> int:
    """One token from a (possibly unnormalised) row."""
    return int(sample(probs[None], generator)[0])


def draw_rows(
    probs: torch.Tensor,  # [batch, vocab]
    generator: torch.Generator | None,
) -> list[int]:
    """One token per (possibly unnormalised) row, all in one call."""
    if probs.shape[0] == 0:
        return []
    return sample(probs, generator).tolist()


def make_verdict(tree: TokenTree, path: Sequence[int], token: int, fallback: bool) -> Verdict:
    """Assemble a verdict from an accepted path and the final token."""
    path = list(path)
    num_accepted = len(path) - 1
    accepted_tokens = [tree.token_list[i] for i in path[1:]]
    return Verdict(
        path=path,
        tokens=accepted_tokens + [int(token)],
        num_accepted=num_accepted,
        accepted_per_depth=[d <= num_accepted for d in range(1, tree.max_depth + 1)],
        num_drafted_per_depth=tree.num_drafted_per_depth(),
        residual_fallback=bool(fallback),
    )
