"""Lossless verification rules for speculative decoding: the interface, the registry and the
pairing between drafting schemes and rules.

Every rule is a pure function of a `TokenTree`, the processed target rows
(`lyanna.sampling.logits_to_probs`, the same processing as the drafter's) and a
`torch.Generator`, returning one `Verdict` per sequence; `branches` gives its exact output law.
Which rule is lossless depends on how the tree was drafted (`DraftScheme`); each rule refuses
trees drafted in a way it is not lossless for, and `rule_for` picks the default rule of a
scheme. The lossy `LossyUncappedHSD` control is importable from `lyanna.verify.block` only and
is never registered.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from lyanna.tree import DraftScheme
from lyanna.verify.base import (
    AcceptanceRule,
    Branch,
    SchemeMismatchError,
    Verdict,
)
from lyanna.verify.block import HSD, BlockVerification
from lyanna.verify.greedy import Greedy
from lyanna.verify.tokenwise import TokenWise
from lyanna.verify.traversal import TraversalVerification
from lyanna.verify.tree_sampling import (
    DeterministicCandidates,
    RecursiveRejectionWithoutReplacement,
    SpecInferMultiStep,
)

RULES: Mapping[str, AcceptanceRule] = MappingProxyType(
    {
        rule.name: rule
        for rule in (
            Greedy(),
            TokenWise(),
            SpecInferMultiStep(),
            RecursiveRejectionWithoutReplacement(),
            DeterministicCandidates(),
            BlockVerification(),
            HSD(),
            TraversalVerification(),
        )
    }
)

# The default lossless rule for each drafting scheme when sampling (temperature > 0).
DEFAULT_RULES: Mapping[DraftScheme, str] = MappingProxyType(
    {
        DraftScheme.CHAIN_SAMPLED: "block",
        DraftScheme.IID: "specinfer",
        DraftScheme.WITHOUT_REPLACEMENT: "traversal",
        DraftScheme.TOPK: "deterministic",
    }
)


def get_rule(name: str) -> AcceptanceRule:
    """The registered rule called `name`."""
    try:
        return RULES[name]
    except KeyError:
        raise KeyError(f"unknown acceptance rule {name!r}; known: {sorted(RULES)}") from None


def rule_for(scheme: DraftScheme, greedy: bool) -> AcceptanceRule:
    """The default rule for trees drafted with `scheme`: greedy at temperature 0, else the
    scheme's lossless rule with the highest acceptance."""
    return RULES["greedy"] if greedy else RULES[DEFAULT_RULES[scheme]]


__all__ = [
    "DEFAULT_RULES",
    "HSD",
    "RULES",
    "AcceptanceRule",
    "BlockVerification",
    "Branch",
    "DeterministicCandidates",
    "DraftScheme",
    "Greedy",
    "RecursiveRejectionWithoutReplacement",
    "SchemeMismatchError",
    "SpecInferMultiStep",
    "TokenWise",
    "TraversalVerification",
    "Verdict",
    "get_rule",
    "rule_for",
]
