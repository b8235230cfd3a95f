"""Block verification, HSD and traversal: the same law where the design says so, and the
expected-accepted-tokens orderings (block = HSD >= token-wise; traversal >= RRS-wor)."""

from __future__ import annotations

import pytest
import torch

from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify import RULES
from tests.unit.exact_law import (
    ToyModel,
    draft_tree,
    enumerate_drafts,
    expected_accepted,
    textbook_models,
)

CHAIN3 = [-1, 0, 1, 2]
WOR_TREES = [[-1, 0, 0], [-1, 0, 0, 1, 1], [-1, 0, 0, 0, 1, 2], [-1, 0, 1, 1, 2, 2]]


def random_models(seed: int, vocab: int = 4) -> tuple[ToyModel, ToyModel]:
    target = ToyModel(vocab, seed)
    return target, ToyModel(vocab, 500 + seed, base=target, noise=1.5)


def assert_same_branches(first, second, tol: float) -> None:
    assert [b.path for b in first] == [b.path for b in second]
    for a, b in zip(first, second, strict=True):
        assert a.probability == pytest.approx(b.probability, abs=tol)
        if a.probability > 0:
            assert torch.allclose(a.next_token_probs, b.next_token_probs, atol=tol, rtol=0)


def test_textbook_expected_accepted_tokens() -> None:
    target, draft = textbook_models()
    chain = [-1, 0, 1]
    scheme = DraftScheme.CHAIN_SAMPLED
    assert expected_accepted(RULES["tokenwise"], target, draft, chain, scheme) == pytest.approx(
        10 / 9, abs=1e-12
    )
    for name in ("block", "hsd", "traversal"):
        value = expected_accepted(RULES[name], target, draft, chain, scheme)
        assert value == pytest.approx(11 / 9, abs=1e-12), name


@pytest.mark.parametrize("seed", range(4))
def test_hsd_and_block_have_identical_acceptance_and_residuals_on_every_draft(seed: int) -> None:
    target, draft = random_models(seed)
    block, hsd = RULES["block"], RULES["hsd"]
    for tokens, _ in enumerate_drafts(draft, CHAIN3, DraftScheme.CHAIN_SAMPLED):
        tree, target_probs = draft_tree(tokens, CHAIN3, DraftScheme.CHAIN_SAMPLED, draft, target)
        h_block = block.acceptance_probabilities(tree, target_probs)
        h_hsd = hsd.acceptance_probabilities(tree, target_probs)
        assert torch.allclose(h_block, h_hsd, atol=1e-12, rtol=0)
        assert_same_branches(
            block.branches(tree, target_probs), hsd.branches(tree, target_probs), 1e-12
        )


@pytest.mark.parametrize("seed", range(3))
def test_hsd_equals_block_on_large_random_chains(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    g, vocab = 12, 200
    target_probs = torch.softmax(
        torch.randn(g + 1, vocab, generator=generator, dtype=torch.float64), 1
    )
    noise = torch.randn(g + 1, vocab, generator=generator, dtype=torch.float64)
    draft_probs = torch.softmax(target_probs.log() + noise, dim=1)
    tokens = torch.multinomial(draft_probs[:g], 1, generator=generator).squeeze(1)
    tree = TokenTree.chain(0, tokens, draft_probs=draft_probs)
    h_block = RULES["block"].acceptance_probabilities(tree, target_probs)
    h_hsd = RULES["hsd"].acceptance_probabilities(tree, target_probs)
    assert torch.allclose(h_block, h_hsd, atol=1e-11, rtol=0)
    assert float(h_block.min()) >= 0.0 and float(h_block.max()) <= 1.0
    assert_same_branches(
        RULES["block"].branches(tree, target_probs),
        RULES["hsd"].branches(tree, target_probs),
        1e-11,
    )


@pytest.mark.parametrize("seed", range(4))
def test_expected_accepted_block_equals_hsd_and_beats_tokenwise(seed: int) -> None:
    target, draft = random_models(seed)
    scheme = DraftScheme.CHAIN_SAMPLED
    values = {
        n: expected_accepted(RULES[n], target, draft, CHAIN3, scheme)
        for n in ("tokenwise", "block", "hsd", "traversal")
    }
    assert values["block"] == pytest.approx(values["hsd"], abs=1e-12)
    assert values["traversal"] == pytest.approx(values["block"], abs=1e-12)
    assert values["block"] >= values["tokenwise"] - 1e-12
    assert values["block"] > values["tokenwise"] + 1e-4  # strictly better on these cases


def test_one_hot_drafter_makes_block_hsd_and_tokenwise_equal() -> None:
    target = ToyModel(4, 11)
    draft = ToyModel(4, 12, base=target, temperature=0.0)
    scheme = DraftScheme.CHAIN_SAMPLED
    values = [
        expected_accepted(RULES[n], target, draft, CHAIN3, scheme)
        for n in ("tokenwise", "block", "hsd")
    ]
    assert values == pytest.approx([values[0]] * 3, abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_traversal_law_on_a_chain_is_block_verification(seed: int) -> None:
    target, draft = random_models(seed)
    for tokens, _ in enumerate_drafts(draft, CHAIN3, DraftScheme.CHAIN_SAMPLED):
        tree, target_probs = draft_tree(tokens, CHAIN3, DraftScheme.CHAIN_SAMPLED, draft, target)
        assert_same_branches(
            RULES["traversal"].branches(tree, target_probs),
            RULES["block"].branches(tree, target_probs),
            1e-12,
        )


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", range(len(WOR_TREES)))
def test_traversal_accepts_at_least_as_much_as_rrs_without_replacement(
    shape: int, seed: int
) -> None:
    target, draft = random_models(seed, vocab=3)
    parents, scheme = WOR_TREES[shape], DraftScheme.WITHOUT_REPLACEMENT
    traversal = expected_accepted(RULES["traversal"], target, draft, parents, scheme)
    rrs = expected_accepted(RULES["rrs_wor"], target, draft, parents, scheme)
    assert traversal >= rrs - 1e-12, (traversal, rrs)


def test_deterministic_rule_expected_length_is_sum_of_target_path_probabilities() -> None:
    target = ToyModel(4, 21)
    tree = TokenTree.from_parents([0, 1, 2, 3, 0, 1], [-1, 0, 0, 1, 1, 2], scheme=DraftScheme.TOPK)
    prefixes = [tuple(tree.tokens[tree.path_to(i)].tolist()) for i in range(tree.num_nodes)]
    target_probs = torch.stack([target.probs(p) for p in prefixes])
    path_prob = []
    for node in range(1, tree.num_nodes):
        path = tree.path_to(node)
        steps = [target_probs[a, tree.tokens[b]] for a, b in zip(path, path[1:], strict=False)]
        path_prob.append(float(torch.stack(steps).prod()))
    value = RULES["deterministic"].expected_accepted(tree, target_probs)
    assert value == pytest.approx(sum(path_prob), abs=1e-12)
