"""Drafts the verifier makes itself: an n-gram drafter (no model) for root-only steps.

Why: a sequence whose learned drafter is gated off (it does not pay) is verified straight
against the verifier, several plain steps per call (``VerifyItem.steps``), one token each.
In one process such steps draft from the n-gram fallback instead (``GatedDrafter``), which
costs no forward and on chat prompts raised the acceptance length from 1.00 to 1.37 at
concurrency 1. Across processes the same fallback in the drafter service costs a round trip
per step (measured: 7.55 ms per step against 3.54), so the verifier drafts those steps
itself, where the tokens are: the request's text and the target's corpus store, trees cut by
the target's cost curve. Lossless as any n-gram tree: a deterministic candidate set
(``DraftScheme.TOPK``) verified with its scheme's rule.

The drafter hears every verification of the sequences it knows, whoever drafted the tree, so
its history stays the sequence's.
"""

from __future__ import annotations

import logging

from lyanna.drafters import make_drafter, tree_budget
from lyanna.drafters.base import Drafter, VerifiedStep
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.target import Verified
from lyanna.tree import TokenTree

log = logging.getLogger(__name__)

# a draft node must be accepted at least this often to pay for its row: about the n-gram
# store's first-token acceptance on chat prompts at T = 0 (0.40-0.42, docs/benchmarks.md)
MIN_ACCEPTANCE = 0.4


class FreeDrafts:
    """The verifier's drafts (``drafter`` None: none; every call is then a no-op)."""

    def __init__(self, drafter: Drafter | None = None) -> None:
        self.drafter = drafter
        self._known: set[int] = set()

    @classmethod
    def build(cls, model: Transformer, enabled: bool = True) -> FreeDrafts:
        """The n-gram drafter with the target's cost curve, or none where it cannot draft
        (logged) or is not ``enabled``."""
        if not enabled:
            return cls()
        try:
            return cls(make_drafter("ngram", model, tree_budget("ngram", model)))
        except (ValueError, KeyError) as error:
            log.warning("no free drafts: %s", error)
            return cls()

    def start(
        self, seq_id: int, prompt_ids: list[int], first_token: int, params: SamplingParams
    ) -> None:
        if self.drafter is not None:
            self.drafter.start(seq_id, prompt_ids, None, first_token, params)
            self._known.add(seq_id)

    def release(self, seq_id: int) -> None:
        if seq_id in self._known and self.drafter is not None:
            self._known.discard(seq_id)
            self.drafter.release(seq_id)

    def trees(
        self, seq_ids: list[int], trees: list[TokenTree], allowed: list[bool]
    ) -> list[TokenTree]:
        """``trees`` with each root-only one of an allowed, known sequence replaced by the
        drafter's tree for it (rooted at the same token: the drafter's history ends there)."""
        if self.drafter is None or not self.pays(len(seq_ids)):  # (every step: cheap first)
            return trees
        chosen = [
            i
            for i, (seq_id, tree, ok) in enumerate(zip(seq_ids, trees, allowed, strict=True))
            if ok and tree.num_nodes == 1 and seq_id in self._known
        ]
        if not chosen:
            return trees
        drafted = self.drafter.propose([seq_ids[i] for i in chosen])
        out = list(trees)
        for i, tree in zip(chosen, drafted, strict=True):
            if int(tree.tokens[0]) != int(trees[i].tokens[0]):  # its history lost step: a bug
                raise RuntimeError(f"sequence {seq_ids[i]}: free draft rooted elsewhere")
            out[i] = tree
        return out

    def pays(self, batch: int) -> bool:
        """Whether one more row can pay at this batch size: its cost T(B + 1) - T(B) against
        ``MIN_ACCEPTANCE`` of a token's share of the step, T(B) / B. Where it cannot, drafting
        would cost its Python for nothing (measured: free drafts at every batch size, 4 and 16
        sequences served 6-14 % fewer tokens/s; one sequence 10 % more)."""
        cost = self.drafter.budget.cost if self.drafter is not None else None
        if cost is None:
            return True
        step = cost.forward_seconds(batch)
        return cost.forward_seconds(batch + 1) - step <= MIN_ACCEPTANCE * step / batch

    def learn(self, seq_ids: list[int], verified: list[Verified]) -> None:
        """Every verification of a known sequence, in order."""
        steps = [
            VerifiedStep.of(seq_id, v, hidden=False)
            for seq_id, v in zip(seq_ids, verified, strict=True)
            if seq_id in self._known
        ]
        if steps and self.drafter is not None:
            self.drafter.on_verified(steps)
