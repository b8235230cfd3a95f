"""Lossless verification rules for speculative decoding: the interface, the registry and the
pairing between drafting schemes and rules.

Every rule is a pure function of a `TokenTree`, the processed target rows (the request's
logits processors, each row with its own path's output history, then temperature and top-p:
`lyanna.sampling`) and a `torch.Generator`, returning one `Verdict` per sequence; `branches`
gives its exact output law. The tree's draft rows need only be what each draft was really
drawn from: a rule is lossless for any target rows, so a drafter that skips the processors
still proposes losslessly.
Which rule is lossless depends on how the tree was drafted (`DraftScheme`); each rule refuses
trees drafted in a way it is not lossless for, `rule_for` picks the default rule of a scheme,
and `choose_rule` refuses a configured rule that is not lossless for the tree's scheme at the
request's temperature (greedy is lossless at temperature 0 only). The lossy `LossyUncappedHSD`
control is importable from `lyanna.verify.block` only and is never registered.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from lyanna.tree import DraftScheme, TokenTree
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


class LossyRuleError(ValueError):
    """A configured rule is not lossless where it would be used: greedy at temperature > 0, or a
    rule not paired with the tree's draft scheme. Refused, never silently decoded."""


def rule_for(scheme: DraftScheme, greedy: bool) -> AcceptanceRule:
    """The default rule for trees drafted with `scheme`: greedy at temperature 0, else the
    scheme's lossless rule with the highest acceptance."""
    return RULES["greedy"] if greedy else RULES[DEFAULT_RULES[scheme]]


def lossless_rules(scheme: DraftScheme) -> list[str]:
    """Names of the rules lossless at temperature > 0 for trees drafted as `scheme`."""
    return sorted(n for n, r in RULES.items() if scheme in r.schemes and not r.greedy_only)


def sampling_rule(name: str, scheme: DraftScheme | None = None) -> AcceptanceRule:
    """The rule `name` as configured for temperature > 0, checked before any tree exists: a
    greedy-only rule would decode the argmax of sampled rows whatever the scheme, and a rule
    unpaired with the drafter's declared `scheme` (when known) could verify none of its trees."""
    rule = get_rule(name)
    if rule.greedy_only:
        raise LossyRuleError(
            f"rule {name!r} is lossless only at temperature 0 (it emits the target's argmax); "
            "a configured rule applies at temperature > 0, to trees of every draft scheme"
        )
    if scheme is not None and scheme not in rule.schemes:
        raise LossyRuleError(
            f"rule {name!r} is not lossless for trees drafted as {scheme.name} at temperature "
            f"> 0; lossless there: {lossless_rules(scheme)}"
        )
    return rule


def choose_rule(tree: TokenTree, temperature: float, name: str | None = None) -> AcceptanceRule:
    """The rule that verifies `tree` at `temperature`: greedy at 0, else the configured `name`
    (refused unless lossless for this tree's scheme at this temperature) or the default."""
    if temperature == 0.0 or name is None:
        return rule_for(tree.scheme, greedy=temperature == 0.0)
    rule = get_rule(name)
    paired = tree.num_drafted == 0 or tree.scheme in rule.schemes  # nothing drafted: any rule
    if rule.greedy_only or not paired:
        why = "it emits the target's argmax" if rule.greedy_only else "the scheme is unpaired"
        raise LossyRuleError(
            f"rule {name!r} is not lossless for trees drafted as {tree.scheme.name} at "
            f"temperature {temperature:g} ({why}); lossless there: "
            f"{lossless_rules(tree.scheme)}"
        )
    return rule


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
    "LossyRuleError",
    "RecursiveRejectionWithoutReplacement",
    "SchemeMismatchError",
    "SpecInferMultiStep",
    "TokenWise",
    "TraversalVerification",
    "Verdict",
    "choose_rule",
    "get_rule",
    "lossless_rules",
    "rule_for",
    "sampling_rule",
]
