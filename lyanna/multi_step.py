"""Several decode steps of a batch in one call at the target, and the model-free drafts that
ride on them (``FreeDrafts``): what a verifier runs for a ``VerifyItem`` with ``steps`` > 1.

Each round is the engine's step for these sequences: the drafter proposes (here: the free
drafts for root-only trees), ONE target forward verifies every tree, the drafter learns the
verdicts. A sequence leaves the loop once it has committed the tokens it asked for.

Why free drafts: a sequence whose learned drafter is gated off (it does not pay) is verified
straight against the target, several plain steps per call. In one process such steps draft
from the n-gram fallback instead (``GatedDrafter``), which costs no forward and on chat
prompts raised the acceptance length from 1.00 to 1.37 at concurrency 1. Across processes the
same fallback in the drafter service costs a round trip per step (measured: 7.55 ms per step
against 3.54), so the verifier drafts those steps itself, where the tokens are: the request's
text and the target's corpus store, trees cut by the target's cost curve. Lossless as any
n-gram tree: a deterministic candidate set (``DraftScheme.TOPK``) verified with its scheme's
rule. The drafter hears every verification of the sequences it knows, whoever drafted the
tree, so its history stays the sequence's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lyanna.drafters import make_drafter, tree_budget
from lyanna.drafters.base import Drafter, VerifiedStep
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.target import TargetRunner, Verified
from lyanna.tree import TokenTree

log = logging.getLogger(__name__)

# a draft node must be accepted at least this often to pay for its row: about the n-gram
# store's first-token acceptance on chat prompts at T = 0 (0.40-0.42, docs/benchmarks.md)
MIN_ACCEPTANCE = 0.4

Runs = list[tuple[TokenTree, Verified]]  # one sequence's verifications in one call, in order
# after each forward: its trees, verifications, seconds and acceptance-rule seconds
OnForward = Callable[[list[TokenTree], list[Verified], float, float], None]


class FreeDrafts:
    """The target side's drafts (``drafter`` None: none; every call is then a no-op)."""

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
            # its history ends at the sequence's next token, or it lost a step: a bug
            assert int(tree.tokens[0]) == int(trees[i].tokens[0]), "free draft rooted elsewhere"
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


def verify_steps(
    runner: TargetRunner,
    seq_ids: list[int],
    trees: list[TokenTree],
    steps: list[int],
    free: FreeDrafts,
    allowed: list[bool],  # which sequences the free drafts may draft for
    on_forward: OnForward | None = None,
) -> list[Runs]:
    """Each sequence's verifications: its tree, then root-only decode steps until ``steps``
    tokens are committed (one per plain step, more with free drafts: never past what the
    caller allowed), with the accepted paths' hidden rows."""
    runs: list[Runs] = [[] for _ in seq_ids]
    committed = [0] * len(seq_ids)
    active, step_trees = list(range(len(seq_ids))), trees
    while active:
        ids = [seq_ids[i] for i in active]
        if runs[active[0]]:  # after the first forward: root-only steps
            step_trees = [TokenTree.root_only(runner.next_token(s)) for s in ids]
        step_trees = free.trees(ids, step_trees, [allowed[i] for i in active])
        start, rules_before = time.perf_counter(), runner.rule_seconds
        verified = runner.verify(ids, step_trees, return_hidden=True)
        if on_forward is not None:
            seconds = time.perf_counter() - start
            on_forward(step_trees, verified, seconds, runner.rule_seconds - rules_before)
        for i, tree, v in zip(active, step_trees, verified, strict=True):
            runs[i].append((tree, v))
            committed[i] += len(v.committed)
        free.learn(ids, verified)
        active = [i for i in active if committed[i] < steps[i]]
    return runs
