"""Top-down verification of sampled token trees, one rule per way of drafting the children.

Owns §3.1-3.4 of the verification design: starting at the root, try the children of the current
node in sibling order; child c is accepted when `u * q_k(c) < p'(c)`, which moves to c; a
rejection replaces the target row by the residual `norm(max(p' - q_k, 0))`; when every child is
rejected the residual gives the final token, and at a leaf the bonus comes from the target row.
A residual empty in floating point (probability zero in exact arithmetic) is replaced by p'
without the tokens rejected so far, flagged, so a rejected token is never emitted.
The rules differ only in the trial row q_k and how it changes after a rejection:
- `SpecInferMultiStep` (Miao et al. 2024) for i.i.d. children: q_k = q, never updated;
- `RecursiveRejectionWithoutReplacement` (Yang et al. 2024, EAGLE-1) for children drawn without
  replacement: q_k = q', and the rejected token is removed from q' and q' renormalised;
- `DeterministicCandidates` (EAGLE-2/3) for top-k or any target-independent candidate set:
  q_k = one_hot(c), i.e. accept with probability p'(c), then zero it.
"""

from __future__ import annotations

import torch

from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify.base import (
    Branch,
    RuleBase,
    Verdict,
    accept_probability,
    accept_test,
    draft_rows,
    draw,
    make_verdict,
    positive_residual,
    without_tokens,
)


class SiblingTrials:
    """The trials at one node, in sibling order, computed lazily: `masses(token)` gives the two
    masses compared for the next child, `reject(token)` applies the rule's residual update.
    After every child is rejected, `target_row` is the distribution of the final token."""

    def __init__(
        self,
        rule: _TopDownRule,
        target_row: torch.Tensor,  # [vocab] p(. | node)
        draft_row: torch.Tensor | None,  # [vocab] q(. | node); None if the rule needs none
    ) -> None:
        self.rule = rule
        self.target_row, self.draft_row = target_row, draft_row  # p', q'
        self.rejected: list[int] = []  # tokens tried and rejected here, in order
        self.fallback = False  # an empty residual was replaced by a fallback row

    def masses(self, token: int) -> tuple[torch.Tensor, torch.Tensor]:  # p'(c), q_k(c)
        return self.target_row[token], self.rule._trial_mass(self.draft_row, token)

    def reject(self, token: int) -> None:
        self.rejected.append(token)
        residual, mass = self.rule._residual(self.target_row, self.draft_row, token)
        if bool(mass <= 0):  # empty in floating point only (§7.3)
            residual, self.fallback = self._fallback_row(), True
        self.target_row = residual
        self.draft_row = self.rule._after_rejection(self.draft_row, token)

    def _fallback_row(self) -> torch.Tensor:  # [vocab]
        """p' before this subtraction without the rejected tokens: a residual never puts mass
        on a rejected token, and p(. | node) would re-emit them."""
        return without_tokens(self.target_row, torch.tensor(self.rejected))


class _TopDownRule(RuleBase):
    """The shared skeleton of §3.1; subclasses define the trial row q_k through its mass at
    the tried token, the residual after a rejection, and the update of q'."""

    def _trial_mass(
        self,
        draft_row: torch.Tensor | None,  # [vocab] q' (None if the rule needs no draft rows)
        token: int,
    ) -> torch.Tensor:  # [] q_k(token)
        return draft_row[token]

    def _residual(
        self,
        target_row: torch.Tensor,  # [vocab] p'
        draft_row: torch.Tensor | None,  # [vocab] q' (None if the rule needs no draft rows)
        token: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [vocab] norm(max(p' - q_k, 0)), [] its mass
        """The row is meaningless where the mass is 0; `SiblingTrials` replaces it then."""
        return positive_residual(target_row, draft_row, target_row)

    def _after_rejection(
        self,
        draft_row: torch.Tensor | None,  # [vocab] q' (None if the rule needs no draft rows)
        token: int,
    ) -> torch.Tensor | None:
        return draft_row

    def _drafts(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> torch.Tensor | None:
        if not self.needs_draft_probs or tree.num_drafted == 0:
            return None
        return draft_rows(tree, target_probs)  # [num_nodes, vocab]

    def _trials(
        self,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
        drafts: torch.Tensor | None,  # [num_nodes, vocab] or None
        node: int,
    ) -> SiblingTrials:
        return SiblingTrials(self, target_probs[node], None if drafts is None else drafts[node])

    def _verify(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
        generator: torch.Generator | None,
    ) -> Verdict:
        drafts = self._drafts(tree, target_probs)
        tokens = tree.tokens.tolist()
        node, path, fallback = 0, [0], False
        while tree.children(node):
            trials = self._trials(target_probs, drafts, node)
            accepted = None
            for child in tree.children(node):
                if bool(accept_test(*trials.masses(tokens[child]), generator)):  # fresh uniform
                    accepted = child
                    break
                trials.reject(tokens[child])
            fallback = fallback or trials.fallback
            if accepted is None:
                return make_verdict(tree, path, draw(trials.target_row, generator), fallback)
            node = accepted
            path.append(node)
        return make_verdict(tree, path, draw(target_probs[node], generator), fallback)

    def _branches(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> list[Branch]:
        drafts = self._drafts(tree, target_probs)
        tokens = tree.tokens.tolist()
        branches: list[Branch] = []

        def visit(node: int, path: tuple[int, ...], mass: float) -> None:
            if not tree.children(node):
                branches.append(Branch(path, mass, target_probs[node]))
                return
            trials = self._trials(target_probs, drafts, node)
            for child in tree.children(node):
                accept = float(accept_probability(*trials.masses(tokens[child])))
                if mass * accept > 0:
                    visit(child, path + (child,), mass * accept)
                mass *= 1.0 - accept
                trials.reject(tokens[child])
            branches.append(Branch(path, mass, trials.target_row))

        visit(0, (0,), 1.0)
        return branches


class SpecInferMultiStep(_TopDownRule):
    """SpecInfer multi-step speculative sampling (RRS with replacement) for i.i.d. children.

    Invariant: lossless when each child was drawn independently from its node's draft row;
    duplicates keep their own trial. Example: p = (1/2, 1/2, 0), q = (1/2, 0, 1/2), children
    [C, A]: C has p'(C) = 0 and is rejected, p' becomes norm(max(p - q, 0)) = (0, 1, 0), so A
    (q = 1/2) is rejected too and B is emitted: Pr(B | these children) = 1.
    """

    name = "specinfer"
    needs_draft_probs = True
    schemes = frozenset({DraftScheme.IID, DraftScheme.CHAIN_SAMPLED})


class RecursiveRejectionWithoutReplacement(_TopDownRule):
    """Recursive rejection sampling without replacement (Yang et al. 2024; EAGLE-1).

    Invariant: lossless when the children were drawn without replacement from the draft row,
    in the listed order. Example: p = (0, 1/2, 1/2), q = (1/2, 1/2, 0), children [A, B]: A is
    rejected (p'(A) = 0), p' = norm(max(p - q, 0)) = (0, 0, 1), q' = (0, 1, 0); B is rejected
    (p'(B) = 0) and C is emitted.
    """

    name = "rrs_wor"
    needs_draft_probs = True
    schemes = frozenset({DraftScheme.WITHOUT_REPLACEMENT, DraftScheme.CHAIN_SAMPLED})

    def _after_rejection(
        self,
        draft_row: torch.Tensor | None,  # [vocab] q' (None if the rule needs no draft rows)
        token: int,
    ) -> torch.Tensor:
        remaining = draft_row.clone()
        remaining[token] = 0.0
        total = remaining.sum()
        return remaining.div_(total) if total > 0 else remaining


class DeterministicCandidates(_TopDownRule):
    """The deterministic-candidate rule for top-k children (EAGLE-2/3, Lyanna token trees).

    Invariant: lossless for any candidate set chosen without the target's randomness, hence
    for every drafting scheme; it is the only lossless rule of this module for TOPK trees
    (and for pruned or merged trees). Draft rows are not needed. Example: p = (1/2, 1/4, 1/4),
    children [A, B]: accept A w.p. 1/2; else p' = (0, 1/2, 1/2), accept B w.p. 1/2; else emit
    C. Pr(first token = C) = 1/2 * 1/2 = 1/4 = p(C).
    """

    name = "deterministic"
    needs_draft_probs = False
    schemes = frozenset(DraftScheme)

    def _trial_mass(
        self,
        draft_row: torch.Tensor | None,  # [vocab] unused
        token: int,
    ) -> torch.Tensor:  # [] one_hot(c)(c) = 1
        return torch.ones((), dtype=torch.float64)

    def _residual(
        self,
        target_row: torch.Tensor,  # [vocab] p'
        draft_row: torch.Tensor | None,  # [vocab] unused
        token: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [vocab], [] residual mass
        """max(p' - one_hot(c), 0) is p' with c zeroed, since p'(c) <= 1."""
        residual = target_row.clone()
        residual[token] = 0.0
        mass = residual.sum()
        return (residual.div_(mass) if mass > 0 else residual), mass
