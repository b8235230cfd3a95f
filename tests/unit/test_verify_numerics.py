"""Numerical edge cases of §7: zero draft mass, one-hot targets, p == q (empty residuals), long
chains, strict accept tests, temperature 0 against 1e-5, and the flagged residual fallback."""

from __future__ import annotations

import pytest
import torch

from lyanna.sampling import logits_to_probs
from lyanna.tree import TokenTree
from lyanna.verify import RULES
from lyanna.verify.base import accept_probability, accept_ratio, accept_test, positive_residual

CHAIN_RULES = ["tokenwise", "block", "hsd", "traversal", "specinfer", "rrs_wor"]


def finite_law(rule, tree, target_probs) -> list:
    branches = rule.branches(tree, target_probs)
    assert sum(b.probability for b in branches) == pytest.approx(1.0, abs=1e-9)
    for branch in branches:
        assert 0.0 <= branch.probability <= 1.0 + 1e-12
        assert torch.isfinite(branch.next_token_probs).all()
    return branches


@pytest.mark.parametrize("name", CHAIN_RULES)
def test_zero_draft_mass_for_a_proposed_token_is_accepted_without_nan(name: str) -> None:
    draft_probs = torch.tensor([[0.0, 0.5, 0.5], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    target_probs = torch.tensor([[0.6, 0.2, 0.2], [0.2, 0.2, 0.6], [0.2, 0.3, 0.5]])
    tree = TokenTree.chain(1, [0, 2], draft_probs=draft_probs)  # both tokens have q = 0
    branches = finite_law(RULES[name], tree, target_probs)
    full = next(b for b in branches if b.path == (0, 1, 2))
    assert full.probability == pytest.approx(1.0)  # r = p/q = inf: min(1, .) accepts
    verdict = RULES[name](tree, target_probs, torch.Generator().manual_seed(0))
    assert verdict.num_accepted == 2 and not verdict.residual_fallback


@pytest.mark.parametrize("name", CHAIN_RULES + ["deterministic", "greedy"])
def test_one_hot_target_makes_every_rule_greedy(name: str) -> None:
    target_probs = torch.eye(4)[[2, 3, 1, 0]].double()  # argmax after each node: 2, 3, 1, 0
    draft_probs = torch.full((4, 4), 0.25, dtype=torch.float64)
    for draft, expected in [([2, 3, 1], [2, 3, 1, 0]), ([2, 0, 1], [2, 3]), ([1, 3, 1], [2])]:
        tree = TokenTree.chain(7, draft, draft_probs=draft_probs)
        branches = finite_law(RULES[name], tree, target_probs)
        assert len([b for b in branches if b.probability > 0]) == 1
        verdict = RULES[name](tree, target_probs, torch.Generator().manual_seed(1))
        assert verdict.tokens == expected


@pytest.mark.parametrize("name", CHAIN_RULES)
def test_equal_target_and_draft_accept_everything(name: str) -> None:
    rows = torch.softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(0)), dim=1)
    tree = TokenTree.chain(0, [1, 4, 2, 6], draft_probs=rows)
    branches = finite_law(RULES[name], tree, rows)
    assert {b.path: b.probability for b in branches}[(0, 1, 2, 3, 4)] == pytest.approx(1.0)
    verdicts = RULES[name].verify_batch([tree] * 50, [rows] * 50, torch.Generator().manual_seed(0))
    assert all(v.num_accepted == 4 and not v.residual_fallback for v in verdicts)


def test_equal_rows_give_zero_block_stop_probabilities_not_nan() -> None:
    rows = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), dim=1)
    tree = TokenTree.chain(0, [1, 2, 3], draft_probs=rows)
    for name in ("block", "hsd"):
        h = RULES[name].acceptance_probabilities(tree, rows)
        assert h.tolist() == [1.0, 0.0, 0.0, 1.0]  # den = 0 at t = 1, 2 gives h = 0 (§7.7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["tokenwise", "block", "hsd"])
def test_long_chains_stay_finite(name: str, dtype: torch.dtype) -> None:
    g, vocab = 300, 64
    generator = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(torch.randn(g + 1, vocab, generator=generator) * 2, 1).to(dtype)
    draft_probs = torch.softmax(torch.randn(g + 1, vocab, generator=generator) * 2, 1).to(dtype)
    tokens = torch.multinomial(draft_probs[:g].float(), 1, generator=generator).squeeze(1)
    tree = TokenTree.chain(0, tokens, draft_probs=draft_probs)
    assert tree.joint_probs[-1] == 0.0 and torch.isfinite(tree.log_joint).all()  # underflow
    rule = RULES[name]
    if name != "tokenwise":
        h = rule.acceptance_probabilities(tree, target_probs)
        assert torch.isfinite(h).all() and (h >= 0).all() and (h <= 1).all()
    finite_law(rule, tree, target_probs)
    verdicts = rule.verify_batch([tree] * 8, [target_probs] * 8, generator)
    assert all(0 <= v.num_accepted <= g for v in verdicts)


def test_accept_test_is_strict_and_needs_no_division() -> None:
    target_mass = torch.tensor([0.0, 0.0, 0.3, 0.5])
    draft_mass = torch.tensor([0.4, 0.0, 0.0, 0.5])
    assert accept_probability(target_mass, draft_mass).tolist() == [0.0, 0.0, 1.0, 1.0]
    pairs = [(0.0, 0.4), (0.0, 0.0), (0.3, 0.0), (0.5, 0.5), (0.2, 0.8), (0.9, 0.3)]
    for p, q in pairs:
        expected = float(
            accept_probability(
                torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
            )
        )
        assert accept_ratio(p, q) == expected
    generator = torch.Generator().manual_seed(0)
    hits = torch.stack([accept_test(target_mass, draft_mass, generator) for _ in range(2000)])
    assert hits.all(0).tolist() == [False, False, True, True]
    assert not hits[:, :2].any()  # p = 0 is never accepted, even for u = 0


def test_empty_residual_falls_back_to_the_target_row_and_is_flagged() -> None:
    rows, mass = positive_residual(
        torch.tensor([[0.5, 0.5], [0.2, 0.8]]),
        torch.tensor([[0.5, 0.5], [0.1, 0.1]]),
        torch.tensor([[1.0, 3.0], [0.2, 0.8]]),
    )
    assert mass.tolist() == pytest.approx([0.0, 0.8])
    assert rows[0].tolist() == [0.25, 0.75]
    assert torch.allclose(rows[1], torch.tensor([1 / 8, 7 / 8]))
    # A draft row that rounds above the target everywhere (inconsistent inputs): the
    # rejection then has an empty residual; the verdict must flag it and never emit NaN.
    target_probs = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    draft_probs = torch.tensor([[0.7, 0.5], [0.5, 0.5]])
    tree = TokenTree.chain(0, [0], draft_probs=draft_probs)
    verdicts = RULES["tokenwise"].verify_batch(
        [tree] * 200, [target_probs] * 200, torch.Generator().manual_seed(0)
    )
    rejected = [v for v in verdicts if v.num_accepted == 0]
    assert rejected and all(v.residual_fallback for v in rejected)
    assert not any(v.residual_fallback for v in verdicts if v.num_accepted == 1)


@pytest.mark.parametrize("name", ["tokenwise", "block", "hsd", "traversal", "deterministic"])
def test_temperature_1e5_matches_greedy_at_temperature_0(name: str) -> None:
    generator = torch.Generator().manual_seed(3)
    target_logits = torch.randn(4, 32, generator=generator)
    draft_logits = target_logits + 0.01 * torch.randn(4, 32, generator=generator)
    draft_logits[2] = torch.randn(32, generator=generator)  # agrees twice, then differs
    draft_cold = logits_to_probs(draft_logits, 1e-5)
    assert torch.equal(draft_cold, logits_to_probs(draft_logits, 0.0))
    tokens = draft_cold[:3].argmax(dim=1)  # what sampling from the cold draft yields
    tree = TokenTree.chain(5, tokens, draft_probs=draft_cold)
    expected = RULES["greedy"](tree, logits_to_probs(target_logits, 0.0))
    assert expected.num_accepted == 2
    verdict = RULES[name](tree, logits_to_probs(target_logits, 1e-5), generator)
    assert verdict.tokens == expected.tokens and verdict.path == expected.path
