"""Each sampler against its own exact law (`rule.branches`): chi-square goodness of fit of the
(accepted path, final token) outcomes with a fixed seed, through the batch entry point."""

from __future__ import annotations

import pytest
import torch

from lyanna.tree import DraftScheme
from lyanna.verify import RULES
from tests.unit.exact_law import (
    ToyModel,
    chi_square_pvalue,
    draft_tree,
    enumerate_drafts,
    verdict_law,
)

MIN_PVALUE = 1e-3


def a_draft(parents, scheme, pick: float, seed: int = 0):
    """One fixed tree drafted by a toy drafter, with the toy target's rows."""
    target = ToyModel(5, seed)
    draft = ToyModel(5, 300 + seed, base=target, noise=0.8)
    drafts = [tokens for tokens, _ in enumerate_drafts(draft, parents, scheme)]
    return draft_tree(drafts[int(pick * len(drafts))], parents, scheme, draft, target)


@pytest.mark.parametrize("name", ["tokenwise", "block", "hsd", "traversal", "specinfer"])
def test_chain_samplers_match_their_law_in_a_mixed_length_batch(name: str) -> None:
    rule = RULES[name]
    long_tree, long_probs = a_draft([-1, 0, 1, 2], DraftScheme.CHAIN_SAMPLED, pick=0.4)
    short_tree, short_probs = a_draft([-1, 0, 1], DraftScheme.CHAIN_SAMPLED, pick=0.6, seed=1)
    n = 3000
    verdicts = rule.verify_batch(
        [long_tree, short_tree] * n, [long_probs, short_probs] * n, torch.Generator().manual_seed(7)
    )
    for offset, (tree, probs) in enumerate([(long_tree, long_probs), (short_tree, short_probs)]):
        law = verdict_law(rule, tree, probs)
        assert len(law) > 3  # a law with several outcomes, or the test would be vacuous
        assert chi_square_pvalue(law, verdicts[offset::2]) > MIN_PVALUE


@pytest.mark.parametrize(
    ("name", "scheme", "parents"),
    [
        ("specinfer", DraftScheme.IID, [-1, 0, 0, 1, 1, 2]),
        ("rrs_wor", DraftScheme.WITHOUT_REPLACEMENT, [-1, 0, 0, 1, 1, 2]),
        ("traversal", DraftScheme.WITHOUT_REPLACEMENT, [-1, 0, 0, 1, 1, 2]),
        ("traversal", DraftScheme.WITHOUT_REPLACEMENT, [-1, 0]),  # its one-child path
        ("deterministic", DraftScheme.TOPK, [-1, 0, 0, 0, 1, 1, 2]),
    ],
)
def test_tree_samplers_match_their_law(name: str, scheme: DraftScheme, parents) -> None:
    rule = RULES[name]
    tree, probs = a_draft(parents, scheme, pick=0.5)
    small, small_probs = a_draft([-1, 0, 0], scheme, pick=0.3, seed=2)
    generator = torch.Generator().manual_seed(11)
    single = [rule(tree, probs, generator) for _ in range(1500)]
    mixed = rule.verify_batch([tree, small] * 1500, [probs, small_probs] * 1500, generator)
    law = verdict_law(rule, tree, probs)
    assert len(law) > 3
    assert chi_square_pvalue(law, single) > MIN_PVALUE
    alike = rule.verify_batch([tree] * 3000, [probs] * 3000, generator)  # one call, all alike
    assert chi_square_pvalue(law, alike) > MIN_PVALUE
    assert chi_square_pvalue(law, mixed[0::2]) > MIN_PVALUE
    assert chi_square_pvalue(verdict_law(rule, small, small_probs), mixed[1::2]) > MIN_PVALUE


def test_chi_square_detects_a_wrong_sampler() -> None:
    """Sanity check of the harness: token-wise samples do not fit block verification's law."""
    tree, probs = a_draft([-1, 0, 1, 2], DraftScheme.CHAIN_SAMPLED, pick=0.4)
    law = verdict_law(RULES["block"], tree, probs)
    verdicts = RULES["tokenwise"].verify_batch(
        [tree] * 3000, [probs] * 3000, torch.Generator().manual_seed(7)
    )
    keys = {(tuple(v.path), v.tokens[-1]) for v in verdicts}
    assert not keys <= set(law) or chi_square_pvalue(law, verdicts) < MIN_PVALUE
