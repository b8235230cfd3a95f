"""Exact losslessness: for every rule and every drafting scheme it is paired with, the exact law
of the first max_depth + 1 emitted tokens equals the target's (enumeration over every draft and
every accept/reject event, tiny vocabularies). Negative controls must fail the same check."""

from __future__ import annotations

import pytest

from lyanna.tree import DraftScheme
from lyanna.verify import RULES
from lyanna.verify.block import LossyUncappedHSD
from tests.unit.exact_law import ToyModel, check_rule, textbook_models

TOLERANCE = 1e-9
CHAINS = {"g1": [-1, 0], "g2": [-1, 0, 1], "g3": [-1, 0, 1, 2]}
TREES = {
    "star2": [-1, 0, 0],
    "star3": [-1, 0, 0, 0],
    "two_by_one": [-1, 0, 0, 1, 2],
    "lopsided": [-1, 0, 0, 1, 1],
    "deep": [-1, 0, 1, 1, 2],
}
CHAIN_RULES = ["tokenwise", "block", "hsd", "traversal", "specinfer", "rrs_wor", "deterministic"]
TREE_RULES = {
    DraftScheme.IID: ["specinfer", "deterministic"],
    DraftScheme.WITHOUT_REPLACEMENT: ["rrs_wor", "traversal", "deterministic"],
    DraftScheme.TOPK: ["deterministic"],
}


def models(seed: int, vocab: int, zero_fraction: float, **processing) -> tuple[ToyModel, ToyModel]:
    target = ToyModel(vocab, seed, zero_fraction=zero_fraction, **processing)
    draft = ToyModel(vocab, 1000 + seed, base=target, zero_fraction=zero_fraction, **processing)
    return target, draft


def assert_lossless(rule, target, draft, parents, scheme) -> None:
    result = check_rule(rule, target, draft, parents, scheme)
    assert result.total_mass == pytest.approx(1.0, abs=TOLERANCE)
    assert result.max_error < TOLERANCE, result


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("shape", list(CHAINS))
@pytest.mark.parametrize("name", CHAIN_RULES)
def test_chain_rules_are_lossless(name: str, shape: str, seed: int) -> None:
    target, draft = models(seed, vocab=4, zero_fraction=0.25)
    assert_lossless(RULES[name], target, draft, CHAINS[shape], DraftScheme.CHAIN_SAMPLED)


@pytest.mark.parametrize("name", ["tokenwise", "block", "hsd", "traversal"])
def test_chain_rules_are_lossless_after_temperature_and_top_p(name: str) -> None:
    target, draft = models(3, vocab=5, zero_fraction=0.0, temperature=0.7, top_p=0.8)
    assert_lossless(RULES[name], target, draft, CHAINS["g2"], DraftScheme.CHAIN_SAMPLED)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("shape", list(TREES))
@pytest.mark.parametrize(
    ("scheme", "name"), [(s, n) for s, names in TREE_RULES.items() for n in names]
)
def test_tree_rules_are_lossless_for_their_scheme(
    scheme: DraftScheme, name: str, shape: str, seed: int
) -> None:
    # Drafting without replacement needs a full-support draft row for three children.
    zero_fraction = 0.0 if scheme is DraftScheme.WITHOUT_REPLACEMENT else 0.25
    target, draft = models(seed, vocab=3 if shape == "deep" else 4, zero_fraction=zero_fraction)
    assert_lossless(RULES[name], target, draft, TREES[shape], scheme)


@pytest.mark.parametrize("scheme", [DraftScheme.IID, DraftScheme.TOPK])
def test_greedy_is_lossless_against_a_greedy_target(scheme: DraftScheme) -> None:
    target = ToyModel(4, 5, temperature=0.0)  # one-hot rows: the target law is plain greedy
    draft = ToyModel(4, 6, base=target)
    assert_lossless(RULES["greedy"], target, draft, TREES["lopsided"], scheme)


# -- negative controls: each must fail the very same check --------------------------------


def signed_residual(target_row, draft_row, fallback_row):
    """The residual without max(0, .): (p - q) / sum(max(p - q, 0)) has negative mass."""
    difference = target_row - draft_row
    mass = difference.clamp_min(0.0).sum(dim=-1)
    return difference / mass[..., None], mass


@pytest.mark.parametrize(
    ("module", "name", "parents", "scheme"),
    [
        ("lyanna.verify.chain", "tokenwise", CHAINS["g2"], DraftScheme.CHAIN_SAMPLED),
        ("lyanna.verify.tree_sampling", "specinfer", TREES["star2"], DraftScheme.IID),
    ],
)
def test_control_residual_without_max_is_lossy(monkeypatch, module, name, parents, scheme) -> None:
    target, draft = models(0, vocab=4, zero_fraction=0.0)
    assert_lossless(RULES[name], target, draft, parents, scheme)  # the real rule passes
    monkeypatch.setattr(f"{module}.positive_residual", signed_residual)
    assert check_rule(RULES[name], target, draft, parents, scheme).max_error > 1e-3


MISPAIRED = [
    ("specinfer", DraftScheme.TOPK),  # the multi-step rule on top-k children (§3.4)
    ("specinfer", DraftScheme.WITHOUT_REPLACEMENT),
    ("rrs_wor", DraftScheme.TOPK),
    ("rrs_wor", DraftScheme.IID),
    ("traversal", DraftScheme.TOPK),
    ("traversal", DraftScheme.IID),
]


@pytest.mark.parametrize("shape", ["star2", "lopsided"])
@pytest.mark.parametrize(("name", "drafted"), MISPAIRED)
def test_control_rule_on_the_wrong_drafting_scheme_is_lossy(
    name: str, drafted: DraftScheme, shape: str
) -> None:
    rule = RULES[name]
    assert drafted not in rule.schemes  # so the rule refuses such trees (test_verify_api)
    claimed = next(iter(rule.schemes - {DraftScheme.CHAIN_SAMPLED}))
    target, draft = models(1, vocab=4, zero_fraction=0.0)
    result = check_rule(rule, target, draft, TREES[shape], drafted, tree_scheme=claimed)
    assert result.max_error > 1e-2, result
    assert_lossless(RULES["deterministic"], target, draft, TREES[shape], drafted)


def test_control_uncapped_hsd_is_lossy_on_random_cases() -> None:
    errors = []
    for seed in range(3):
        target, draft = models(seed, vocab=4, zero_fraction=0.0)
        errors.append(
            check_rule(
                LossyUncappedHSD(), target, draft, CHAINS["g3"], DraftScheme.CHAIN_SAMPLED
            ).max_error
        )
    assert min(errors) > 1e-3, errors


def test_control_uncapped_hsd_textbook_counterexample() -> None:
    """p = (1/3, 2/3), q = (2/3, 1/3), g = 2: Pr(first two = BA) is 1/3 instead of 2/9."""
    target, draft = textbook_models()
    lossy = check_rule(LossyUncappedHSD(), target, draft, CHAINS["g2"], DraftScheme.CHAIN_SAMPLED)
    assert lossy.max_error > 0.07
    assert lossy.expected_accepted == pytest.approx(12 / 9)
    capped = check_rule(RULES["hsd"], target, draft, CHAINS["g2"], DraftScheme.CHAIN_SAMPLED)
    assert capped.max_error < TOLERANCE
    assert capped.expected_accepted == pytest.approx(11 / 9)
