"""Drafters: the ``Drafter`` protocol and a registry of speculative methods by name.

The registry is the only place a method name turns into code; factories import lazily so a
method whose checkpoint is absent fails with a clear error only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType

from lyanna.drafters.base import DraftBudget, DraftCapacity, Drafter, NoDrafter, VerifiedStep
from lyanna.model.transformer import Transformer

DrafterFactory = Callable[[Transformer, DraftBudget, DraftCapacity], Drafter]


def _ar(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> Drafter:
    return NoDrafter()


def _ngram(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> Drafter:
    from lyanna.drafters.ngram import NgramDrafter

    return NgramDrafter(budget)


def _eagle(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> Drafter:
    from lyanna.drafters.eagle import EagleDrafter

    return EagleDrafter(model, budget=budget, max_seqs=capacity.max_seqs, max_len=capacity.max_len)


def _sps(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> Drafter:
    from lyanna.drafters.sps import SpsDrafter

    return SpsDrafter.from_checkpoint(
        model, budget=budget, max_seqs=capacity.max_seqs, max_len=capacity.max_len
    )


def _lyanna_variant(resample_enabled: bool, fusion: bool) -> DrafterFactory:
    def factory(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> Drafter:
        from lyanna.drafters.lyanna import LyannaDrafter, ResampleConfig

        resample = ResampleConfig(enabled=resample_enabled, fusion=fusion)
        # top-k trees at T > 0 too: measured at T = 1, sampled drafting cost Lyanna more
        # draft time (share 0.26 vs 0.20) for no tau (1.13 vs 1.14); EAGLE-2 and SPS gain
        # (docs/benchmarks.md, "Sampling mode: drafting without replacement")
        return LyannaDrafter.from_checkpoint(
            model,
            budget=budget,
            resample=resample,
            sample_drafts=False,
            max_seqs=capacity.max_seqs,
            max_len=capacity.max_len,
        )

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


# The tree shape each method drafts unless told otherwise (serve, the drafter service,
# spec_bench): the best measured on Spec-Bench, cost-aware (the budget is a cap, the
# target's cost curve picks the size per step); see docs/benchmarks.md, "Tree shapes".
DEFAULT_BUDGETS: Mapping[str, DraftBudget] = MappingProxyType(
    {
        "ngram": DraftBudget(depth=3, top_k=2, max_tokens=8),
        "sps": DraftBudget(depth=3, top_k=2, max_tokens=8),
        "eagle": DraftBudget(depth=5, top_k=2, max_tokens=8),
        "lyanna": DraftBudget(depth=3, top_k=2, max_tokens=8),
        "lyanna-unfused": DraftBudget(depth=3, top_k=2, max_tokens=8),
        "lyanna-noresample": DraftBudget(depth=3, top_k=2, max_tokens=8),
    }
)


def default_budget(method: str) -> DraftBudget:
    """The measured default tree shape of ``method`` (without a cost curve: the caller adds
    the target's, ``lyanna.model.calibrate.verify_cost``)."""
    return DEFAULT_BUDGETS.get(method, DraftBudget())


TREE_MODES = ("cost", "fixed")


def tree_budget(
    method: str, model: Transformer, tree: str = "cost", budget: DraftBudget | None = None
) -> DraftBudget:
    """What an entry point drafts with: ``budget`` (default: the method's measured default)
    and, when ``tree`` is ``cost``, the target's cost curve (measured once per machine)."""
    if tree not in TREE_MODES:
        raise ValueError(f"tree must be one of {TREE_MODES}, got {tree!r}")
    budget = budget or default_budget(method)
    if tree == "cost" and method != "ar":  # plain decoding drafts nothing to size
        from lyanna.model.calibrate import verify_cost

        budget = replace(budget, cost=verify_cost(model))
    return budget


def make_drafter(
    name: str,
    model: Transformer,
    budget: DraftBudget | None = None,
    capacity: DraftCapacity | None = None,
) -> Drafter:
    """The drafter of method ``name`` with ``budget`` (default: the method's measured one)
    and room for ``capacity`` (default: 16 sequences of 4,096 rows)."""
    try:
        factory = DRAFTERS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; known: {sorted(DRAFTERS)}") from None
    return factory(model, budget or default_budget(name), capacity or DraftCapacity())


__all__ = [
    "DEFAULT_BUDGETS",
    "DRAFTERS",
    "DraftBudget",
    "DraftCapacity",
    "Drafter",
    "NoDrafter",
    "TREE_MODES",
    "VerifiedStep",
    "default_budget",
    "make_drafter",
    "tree_budget",
]
