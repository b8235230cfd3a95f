"""Drafter factories for the service tests (``--factory tests.services.tiny_drafters:NAME``):
model-based drafters with seeded random weights sized for the tiny test model."""

from __future__ import annotations

from lyanna.drafters import DraftBudget
from lyanna.drafters.lyanna import LyannaDrafter
from lyanna.model.transformer import Transformer
from tests.unit.test_lyanna_drafter import tiny_draft


def tiny_lyanna(model: Transformer, budget: DraftBudget) -> LyannaDrafter:
    return LyannaDrafter(model, tiny_draft(model), budget)
