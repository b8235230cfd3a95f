"""Drafter factories for the service tests (``--factory tests.services.tiny_drafters:NAME``):
model-based drafters with seeded random weights sized for the tiny test model, a slow
drafter for deadline and draining tests, and one that dies between the verifier's answer and
its own."""

from __future__ import annotations

import os
import time

from lyanna.drafters import DraftBudget, DraftCapacity, Drafter, VerifiedStep
from lyanna.drafters.gate import DraftGate, GateConfig, GatedDrafter
from lyanna.drafters.lyanna import LyannaDrafter
from lyanna.drafters.ngram import NgramDrafter
from lyanna.model.transformer import Transformer
from lyanna.tree import TokenTree
from lyanna.tree_cost import VerifyCost
from tests.unit.test_lyanna_drafter import tiny_draft


def tiny_lyanna(
    model: Transformer, budget: DraftBudget, capacity: DraftCapacity | None = None
) -> LyannaDrafter:
    capacity = capacity or DraftCapacity()
    return LyannaDrafter(
        model, tiny_draft(model), budget, max_running=capacity.max_running, max_len=capacity.max_len
    )


class SlowDrafter:
    """Delegates to a drafter but sleeps before every proposal (an overloaded drafter)."""

    def __init__(self, inner: Drafter, delay_seconds: float) -> None:
        self.inner = inner
        self.delay_seconds = delay_seconds
        self.scheme, self.needs_hidden = inner.scheme, inner.needs_hidden

    def start(self, seq_id, prompt_ids, prompt_hidden, first_token, params=None) -> None:
        self.inner.start(seq_id, prompt_ids, prompt_hidden, first_token, params)

    def propose(self, seq_ids: list[int]) -> list[TokenTree]:
        time.sleep(self.delay_seconds)
        return self.inner.propose(seq_ids)

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        return self.inner.on_verified(steps)

    def release(self, seq_id: int) -> None:
        self.inner.release(seq_id)


def slow_ngram(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> SlowDrafter:
    """An n-gram drafter whose proposals take ``$LYANNA_TEST_PROPOSE_DELAY`` seconds."""
    return SlowDrafter(NgramDrafter(budget), float(os.environ["LYANNA_TEST_PROPOSE_DELAY"]))


def gated_lyanna(
    model: Transformer, budget: DraftBudget, capacity: DraftCapacity | None = None
) -> GatedDrafter:
    """``tiny_lyanna`` behind a gate that finds no draft worth its rows (each row costs 0.9 of
    a step: only a draft accepted whole would pay): it drafts only its probes, and announces
    the quiet steps in between."""
    hardly_pays = VerifyCost((1, 2, 32), (1.0, 1.9, 28.9))
    return GatedDrafter(tiny_lyanna(model, budget, capacity), DraftGate(hardly_pays, GateConfig()))


class DyingDrafter(SlowDrafter):
    """Delegates to a drafter, but the process dies while learning its ``die_at``-th
    verification that accepted a draft token: after the verifier committed the step, before
    the drafter answered the gateway."""

    def __init__(self, inner: Drafter, die_at: int) -> None:
        super().__init__(inner, 0.0)
        self.die_at, self.accepted_steps = die_at, 0

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        self.accepted_steps += sum(step.num_accepted > 0 for step in steps)
        if self.accepted_steps >= self.die_at:
            os._exit(3)
        return self.inner.on_verified(steps)


def dying_ngram(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> DyingDrafter:
    """An n-gram drafter that dies at its ``$LYANNA_TEST_DIE_AT``-th accepting verification."""
    return DyingDrafter(NgramDrafter(budget), int(os.environ["LYANNA_TEST_DIE_AT"]))
