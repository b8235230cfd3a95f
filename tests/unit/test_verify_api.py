"""The rule interface: registry, scheme pairing, input checks, verdict fields, empty trees,
seeded determinism and hot-vocabulary draft rows."""

from __future__ import annotations

import pytest
import torch

from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify import (
    DEFAULT_RULES,
    RULES,
    AcceptanceRule,
    SchemeMismatchError,
    Verdict,
    get_rule,
    rule_for,
)
from lyanna.verify.block import LossyUncappedHSD
from tests.unit.exact_law import ToyModel, draft_tree, enumerate_drafts

SAMPLED_SCHEMES = [DraftScheme.IID, DraftScheme.WITHOUT_REPLACEMENT, DraftScheme.TOPK]


def sampled_tree(scheme: DraftScheme, parents=(-1, 0, 0, 1), seed: int = 0):
    target = ToyModel(5, seed)
    draft = ToyModel(5, seed + 50, base=target)
    tokens, _ = next(iter(enumerate_drafts(draft, list(parents), scheme)))
    return draft_tree(tokens, list(parents), scheme, draft, target)


def test_registry_holds_the_lossless_rules_only() -> None:
    assert set(RULES) == {
        "greedy",
        "tokenwise",
        "specinfer",
        "rrs_wor",
        "deterministic",
        "block",
        "hsd",
        "traversal",
    }
    assert LossyUncappedHSD.name not in RULES
    assert all(not isinstance(rule, LossyUncappedHSD) for rule in RULES.values())
    assert all(isinstance(rule, AcceptanceRule) for rule in RULES.values())
    assert all(rule.name == name for name, rule in RULES.items())
    assert get_rule("hsd") is RULES["hsd"]
    with pytest.raises(KeyError, match="known"):
        get_rule("hsd_uncapped")
    with pytest.raises(TypeError):
        RULES["lossy"] = LossyUncappedHSD()  # type: ignore[index]


def test_rule_for_pairs_every_scheme_with_a_rule_that_accepts_it() -> None:
    assert set(DEFAULT_RULES) == set(DraftScheme)
    for scheme in DraftScheme:
        assert scheme in rule_for(scheme, greedy=False).schemes
        assert rule_for(scheme, greedy=True) is RULES["greedy"]
    assert rule_for(DraftScheme.TOPK, greedy=False) is RULES["deterministic"]
    assert rule_for(DraftScheme.IID, greedy=False) is RULES["specinfer"]


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("scheme", SAMPLED_SCHEMES)
def test_rules_refuse_trees_drafted_for_another_rule(name: str, scheme: DraftScheme) -> None:
    rule = RULES[name]
    tree, target_probs = sampled_tree(scheme)
    if scheme in rule.schemes and not rule.needs_chain:
        assert rule(tree, target_probs, torch.Generator().manual_seed(0)).path[0] == 0
    else:
        with pytest.raises(SchemeMismatchError, match=name):
            rule(tree, target_probs)


def test_draft_rows_are_required_by_rules_that_need_them() -> None:
    tree = TokenTree.chain(0, [1, 2])
    target_probs = torch.full((3, 4), 0.25)
    for name in ("tokenwise", "block", "hsd", "traversal", "specinfer", "rrs_wor"):
        assert RULES[name].needs_draft_probs
        with pytest.raises(ValueError, match="draft_probs"):
            RULES[name](tree, target_probs)
    for name in ("greedy", "deterministic"):
        assert not RULES[name].needs_draft_probs
        assert RULES[name](tree, target_probs).num_accepted in (0, 1, 2)


def test_target_rows_must_match_the_tree() -> None:
    tree = TokenTree.chain(0, [1, 2], draft_probs=torch.full((3, 4), 0.25))
    for rule in RULES.values():
        with pytest.raises(ValueError, match="num_nodes"):
            rule(tree, torch.full((2, 4), 0.25))


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_verifies_a_root_only_tree_as_one_decoding_step(name: str) -> None:
    tree = TokenTree.root_only(3)
    one_hot = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    verdict = RULES[name](tree, one_hot, torch.Generator().manual_seed(0))
    assert verdict == Verdict([0], [2], 0, [], [], False)
    spread = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    counts = torch.zeros(4)
    generator = torch.Generator().manual_seed(1)
    for verdict in RULES[name].verify_batch([tree] * 400, [spread] * 400, generator):
        counts[verdict.tokens[0]] += 1
    if name != "greedy":
        assert (counts / 400 - spread[0]).abs().max() < 0.08
    else:
        assert counts.tolist() == [0, 0, 0, 400]


def test_verdict_fields_describe_the_accepted_path() -> None:
    tree = TokenTree.from_parents([0, 1, 2, 3, 4], [-1, 0, 0, 1, 3], scheme=DraftScheme.TOPK)
    target_probs = torch.zeros(5, 6)
    target_probs[0, 1] = target_probs[1, 3] = target_probs[3, 5] = 1.0  # accept 1 and 3
    target_probs[2, 0] = target_probs[4, 0] = 1.0
    for name in ("greedy", "deterministic"):
        verdict = RULES[name](tree, target_probs, torch.Generator().manual_seed(0))
        assert verdict.path == [0, 1, 3]
        assert verdict.tokens == [1, 3, 5]
        assert verdict.num_accepted == 2 and verdict.acceptance_length == 3
        assert verdict.accepted_per_depth == [True, True, False]
        assert verdict.num_drafted_per_depth == [2, 1, 1]
        assert not verdict.residual_fallback
    with pytest.raises(ValueError):
        Verdict([0, 1], [5], 1, [True], [1])


@pytest.mark.parametrize("name", sorted(RULES))
def test_same_seed_same_verdicts(name: str) -> None:
    rule = RULES[name]
    scheme = next(iter(rule.schemes - {DraftScheme.CHAIN_SAMPLED}), DraftScheme.CHAIN_SAMPLED)
    parents = [-1, 0, 1, 2] if rule.needs_chain else [-1, 0, 0, 1, 2]
    if rule.needs_chain:
        scheme = DraftScheme.CHAIN_SAMPLED
    tree, target_probs = sampled_tree(scheme, parents, seed=3)
    runs = [
        rule.verify_batch([tree] * 30, [target_probs] * 30, torch.Generator().manual_seed(5))
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ["tokenwise", "block", "hsd", "traversal", "rrs_wor"])
def test_hot_vocabulary_rows_give_the_same_law_as_full_rows(name: str) -> None:
    vocab, hot = 10, torch.tensor([8, 1, 4, 6])
    generator = torch.Generator().manual_seed(0)
    hot_rows = torch.softmax(torch.randn(3, 4, generator=generator, dtype=torch.float64), 1)
    full_rows = torch.zeros(3, vocab, dtype=torch.float64).index_copy_(1, hot, hot_rows)
    target_probs = torch.softmax(torch.randn(3, vocab, generator=generator, dtype=torch.float64), 1)
    with_hot = TokenTree.chain(0, [4, 8], draft_probs=hot_rows, vocab_index=hot)
    with_full = TokenTree.chain(0, [4, 8], draft_probs=full_rows)
    assert torch.allclose(with_hot.draft_token_probs, with_full.draft_token_probs)
    rule = RULES[name]
    hot_law, full_law = (
        rule.branches(with_hot, target_probs),
        rule.branches(with_full, target_probs),
    )
    assert [b.path for b in hot_law] == [b.path for b in full_law]
    for a, b in zip(hot_law, full_law, strict=True):
        assert a.probability == pytest.approx(b.probability, abs=1e-15)
        assert torch.allclose(a.next_token_probs, b.next_token_probs, atol=1e-15)
