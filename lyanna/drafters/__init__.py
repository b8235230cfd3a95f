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
TARGET_ONLY = "ar"  # plain decoding: the engine's NoDrafter, root-only trees, always served
FALLBACK_METHODS = ("eagle", "ngram", TARGET_ONLY)  # in order, when a default cannot start


def _ar(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> Drafter:
    return NoDrafter()


def _ngram_variant(corpus: bool) -> DrafterFactory:
    def factory(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> Drafter:
        from lyanna.drafters.ngram import NgramDrafter
        from lyanna.drafters.ngram_store import load_default_store

        store = load_default_store(model.config.vocab_size) if corpus else None
        return NgramDrafter(budget, store=store)

    return factory


def _eagle(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> Drafter:
    from lyanna.drafters.eagle import EagleDrafter

    return EagleDrafter(
        model, budget=budget, max_running=capacity.max_running, max_len=capacity.max_len
    )


def _sps(model: Transformer, budget: DraftBudget, capacity: DraftCapacity) -> Drafter:
    from lyanna.drafters.sps import SpsDrafter

    return SpsDrafter.from_checkpoint(
        model, budget=budget, max_running=capacity.max_running, max_len=capacity.max_len
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
            max_running=capacity.max_running,
            max_len=capacity.max_len,
        )

    return factory


DRAFTERS: Mapping[str, DrafterFactory] = MappingProxyType(
    {
        TARGET_ONLY: _ar,
        # the request's text, then what the target wrote in its training answers
        "ngram": _ngram_variant(corpus=True),
        "ngram-prompt": _ngram_variant(corpus=False),  # the request's text only
        "sps": _sps,
        "eagle": _eagle,
        "lyanna": _lyanna_variant(resample_enabled=True, fusion=True),
        "lyanna-unfused": _lyanna_variant(resample_enabled=True, fusion=False),
        "lyanna-noresample": _lyanna_variant(resample_enabled=False, fusion=True),
    }
)


# The tree shape each method drafts unless told otherwise (serve, the drafter service,
# spec_bench), by how verification cost grows with the rows verified. Deep trees were the best
# measured where a forward over 8 rows costs little more than over 1 (fp32 weights on CPU, a
# GPU). A 4-bit target on CPU is compute bound beyond 2 rows (each further row about 20 % of a
# decode step), and there one draft token per step is the best measured for every method:
# decode speedup over AR, 13 Spec-Bench prompts, T = 0, one interleaved run - EAGLE-2 0.93x
# vs 0.82x with the deep shape, Lyanna 0.89x vs 0.74x, n-gram 1.06x vs 1.04x (see
# docs/benchmarks.md, "Tree shapes on the 4-bit engine"). Cost-aware trees use the shape as a
# cap (the target's cost curve picks the size per step, down to no draft at all).
DEFAULT_BUDGETS: Mapping[str, DraftBudget] = MappingProxyType(
    {
        "ngram": DraftBudget(depth=3, top_k=2, max_tokens=8),
        "ngram-prompt": DraftBudget(depth=3, top_k=2, max_tokens=8),
        "sps": DraftBudget(depth=3, top_k=2, max_tokens=8),
        "eagle": DraftBudget(depth=5, top_k=2, max_tokens=8),
        "lyanna": DraftBudget(depth=3, top_k=2, max_tokens=8),
        "lyanna-unfused": DraftBudget(depth=3, top_k=2, max_tokens=8),
        "lyanna-noresample": DraftBudget(depth=3, top_k=2, max_tokens=8),
    }
)
ONE_TOKEN = DraftBudget(depth=1, top_k=1, max_tokens=1)
# n-gram chains cost no forward to draft, and the target's text repeats in runs: a chain of
# up to 3 cut by the cost curve measured 1.21-1.35x AR (mean 1.31x over four paired runs)
# against 1.21-1.29x (1.26x) with one token (greedy; tau 1.69 against 1.44; depth 5: 1.30x;
# the chain lost only in the host's fastest state), so the n-gram drafters, and the learned
# drafters' n-gram fallback, chain on a 4-bit target too. Sampled sequences draft one token:
# at T = 1 the chain's later tokens are accepted too rarely for their rows (tau 1.17 -> 1.22
# but 1.00x -> 0.95x AR; docs/benchmarks.md, "N-gram chains on the 4-bit engine")
NGRAM_CHAIN = DraftBudget(depth=3, top_k=1, max_tokens=3, sampled_depth=1)
STEEP_COST_BUDGETS: Mapping[str, DraftBudget] = MappingProxyType(
    {**dict.fromkeys(DEFAULT_BUDGETS, ONE_TOKEN), "ngram": NGRAM_CHAIN, "ngram-prompt": NGRAM_CHAIN}
)


def default_budget(method: str, model: Transformer | None = None) -> DraftBudget:
    """The measured default tree shape of ``method`` for ``model``'s engine: one draft token
    for a 4-bit target (steep verification cost), the deep shape otherwise or when no model
    is given (without a cost curve: the caller adds the target's,
    ``lyanna.model.calibrate.verify_cost``)."""
    from lyanna.model.quant import runs_q4

    table = STEEP_COST_BUDGETS if model is not None and runs_q4(model) else DEFAULT_BUDGETS
    return table.get(method, DraftBudget())


TREE_MODES = ("cost", "fixed")
# methods that run no draft network
MODEL_FREE_METHODS = (TARGET_ONLY, "ngram", "ngram-prompt")
# what drafts next to a target off the CPU (a GPU): the model-free methods, and the learned
# drafters whose draft network runs on the target's device (``lyanna.drafters.placement``)
DEVICE_METHODS = (
    *MODEL_FREE_METHODS,
    "eagle",
    "lyanna",
    "lyanna-unfused",
    "lyanna-noresample",
)
FREE_FALLBACK = "ngram"  # what a gated learned drafter's gated-off steps draft from


def tree_budget(
    method: str, model: Transformer, tree: str = "cost", budget: DraftBudget | None = None
) -> DraftBudget:
    """What an entry point drafts with: ``budget`` (default: the method's measured default)
    and, when ``tree`` is ``cost``, the target's cost curve (measured once per machine)."""
    if tree not in TREE_MODES:
        raise ValueError(f"tree must be one of {TREE_MODES}, got {tree!r}")
    budget = budget or default_budget(method, model)
    if tree == "cost" and method != TARGET_ONLY:  # plain decoding drafts nothing to size
        from lyanna.model.calibrate import verify_cost

        budget = replace(budget, cost=verify_cost(model))
    return budget


def make_drafter(
    name: str,
    model: Transformer,
    budget: DraftBudget | None = None,
    capacity: DraftCapacity | None = None,
    gate: bool = True,
    free_fallback: bool = True,
) -> Drafter:
    """The drafter of method ``name`` with ``budget`` (default: the method's measured one)
    and room for ``capacity`` (default: 16 sequences of 4,096 rows). With ``gate`` and a
    budget that knows the target's cost curve, each sequence drafts only while drafting pays
    (``lyanna.drafters.gate``): every learned drafter; n-gram drafting is free. With
    ``free_fallback`` a gated-off step drafts from ``FREE_FALLBACK`` instead of nothing. Next
    to a target off the CPU (a GPU) only ``DEVICE_METHODS`` draft: EAGLE-2 and Lyanna run
    their draft networks on its device (``lyanna.drafters.placement``); SPS is refused."""
    try:
        factory = DRAFTERS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; known: {sorted(DRAFTERS)}") from None
    device = model.embed_tokens.weight.device
    if device.type != "cpu" and name not in DEVICE_METHODS:
        raise ValueError(
            f"the {name!r} drafter runs on the CPU only (its draft network and KV are CPU "
            f"tensors); the target is on {device}: serve one of {DEVICE_METHODS} there"
        )
    budget = budget or default_budget(name, model)
    capacity = capacity or DraftCapacity()
    drafter = factory(model, budget, capacity)
    # n-gram drafting costs no forward, and its empty drafts (no match) cost no rows: ungated
    # (measured: gating it cost tau 1.25 -> 1.09, 1.05x -> 1.02x; docs/benchmarks.md)
    if gate and budget.cost is not None and name not in MODEL_FREE_METHODS:
        from lyanna.drafters.gate import DraftGate, GatedDrafter

        fallback = None
        if free_fallback:  # gated-off steps draft what costs no forward
            free = replace(default_budget(FREE_FALLBACK, model), cost=budget.cost)
            fallback = DRAFTERS[FREE_FALLBACK](model, free, capacity)
        drafter = GatedDrafter(drafter, DraftGate(budget.cost), fallback)
    return drafter


__all__ = [
    "DEFAULT_BUDGETS",
    "DEVICE_METHODS",
    "DRAFTERS",
    "DraftBudget",
    "DraftCapacity",
    "Drafter",
    "FREE_FALLBACK",
    "MODEL_FREE_METHODS",
    "NoDrafter",
    "STEEP_COST_BUDGETS",
    "TREE_MODES",
    "VerifiedStep",
    "default_budget",
    "make_drafter",
    "tree_budget",
]
