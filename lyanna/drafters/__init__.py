"""Drafters: the ``Drafter`` protocol and a registry of speculative methods by name.

The registry is the only place a method name turns into code; factories import lazily so a
method whose checkpoint is absent fails with a clear error only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from lyanna.drafters.base import DraftBudget, Drafter, NoDrafter, VerifiedStep
from lyanna.model.transformer import Transformer

DrafterFactory = Callable[[Transformer, DraftBudget], Drafter]


def _ar(model: Transformer, budget: DraftBudget) -> Drafter:
    return NoDrafter()


def _ngram(model: Transformer, budget: DraftBudget) -> Drafter:
    from lyanna.drafters.ngram import NgramDrafter

    return NgramDrafter(budget)


def _eagle(model: Transformer, budget: DraftBudget) -> Drafter:
    from lyanna.drafters.eagle import EagleDrafter

    return EagleDrafter(model, budget=budget)


def _sps(model: Transformer, budget: DraftBudget) -> Drafter:
    from lyanna.drafters.sps import SpsDrafter

    return SpsDrafter.from_checkpoint(model, budget=budget)


def _lyanna_variant(resample_enabled: bool, fusion: bool) -> DrafterFactory:
    def factory(model: Transformer, budget: DraftBudget) -> Drafter:
        from lyanna.drafters.lyanna import LyannaDrafter, ResampleConfig

        resample = ResampleConfig(enabled=resample_enabled, fusion=fusion)
        return LyannaDrafter.from_checkpoint(model, budget=budget, resample=resample)

    return factory


DRAFTERS: Mapping[str, DrafterFactory] = MappingProxyType(
    {
        "ar": _ar,
        "ngram": _ngram,
        "sps": _sps,
        "eagle": _eagle,
        "lyanna": _lyanna_variant(resample_enabled=True, fusion=True),
        "lyanna-unfused": _lyanna_variant(resample_enabled=True, fusion=False),
        "lyanna-noresample": _lyanna_variant(resample_enabled=False, fusion=True),
    }
)


def make_drafter(name: str, model: Transformer, budget: DraftBudget | None = None) -> Drafter:
    try:
        factory = DRAFTERS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; known: {sorted(DRAFTERS)}") from None
    return factory(model, budget or DraftBudget())


__all__ = ["DRAFTERS", "DraftBudget", "Drafter", "NoDrafter", "VerifiedStep", "make_drafter"]
