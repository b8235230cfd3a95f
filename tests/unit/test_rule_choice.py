"""Choosing a rule for a (sampling params, tree) pair: a configured rule is refused where it is
not lossless (greedy at temperature > 0, a rule unpaired with the tree's draft scheme), at
config time when it can be, and never silently decodes with another law."""

from __future__ import annotations

import pytest
import torch

from lyanna.drafters.base import NoDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.target import TargetConfig, TargetRunner
from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify import RULES, LossyRuleError, choose_rule, lossless_rules, sampling_rule
from tests.conftest import make_tiny_model

VOCAB = 16


def wor_tree(root: int) -> TokenTree:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    draft_probs = torch.softmax(logits, dim=1)
    return TokenTree.from_parents(
        [root, 3, 5], [-1, 0, 0], scheme=DraftScheme.WITHOUT_REPLACEMENT, draft_probs=draft_probs
    )


@pytest.mark.parametrize("config", [TargetConfig, EngineConfig])
def test_greedy_is_refused_as_the_configured_sampling_rule(config) -> None:
    with pytest.raises(LossyRuleError, match="'greedy'.*temperature 0"):
        config(rule="greedy")
    with pytest.raises(KeyError, match="known"):
        config(rule="no_such_rule")
    assert config(rule="traversal").rule == "traversal"
    assert sampling_rule("specinfer") is RULES["specinfer"]


def test_choose_rule_refuses_rules_not_lossless_for_the_scheme_at_this_temperature() -> None:
    tree = wor_tree(1)
    with pytest.raises(LossyRuleError) as refused:
        choose_rule(tree, 0.7, "tokenwise")
    message = str(refused.value)
    assert "'tokenwise'" in message and "WITHOUT_REPLACEMENT" in message
    assert "temperature 0.7" in message and str(lossless_rules(tree.scheme)) in message
    with pytest.raises(LossyRuleError, match="'greedy'.*WITHOUT_REPLACEMENT.*temperature 1 "):
        choose_rule(tree, 1.0, "greedy")
    with pytest.raises(LossyRuleError, match="'greedy'.*TOPK"):
        choose_rule(TokenTree.root_only(1), 1.0, "greedy")  # argmax even with no draft
    assert issubclass(LossyRuleError, ValueError)


def test_choose_rule_keeps_the_lossless_choices() -> None:
    tree = wor_tree(1)
    assert lossless_rules(tree.scheme) == ["deterministic", "rrs_wor", "traversal"]
    assert choose_rule(tree, 0.0, "tokenwise") is RULES["greedy"]  # configured: T > 0 only
    assert choose_rule(tree, 0.7) is RULES["traversal"]
    assert choose_rule(tree, 0.7, "rrs_wor") is RULES["rrs_wor"]
    assert choose_rule(TokenTree.root_only(1), 0.7, "tokenwise") is RULES["tokenwise"]


def test_runner_refuses_an_unpaired_rule_before_touching_the_sequence() -> None:
    runner = TargetRunner(
        make_tiny_model(1, vocab_size=VOCAB), TargetConfig(max_running=1, max_len=64, rule="block")
    )
    first = runner.prefill(0, [1, 2, 3], SamplingParams(temperature=0.8, seed=0)).first_token
    with pytest.raises(LossyRuleError, match="'block'.*WITHOUT_REPLACEMENT.*temperature 0.8"):
        runner.verify([0], [wor_tree(first)])
    assert runner.num_committed(0) == 3 and runner.next_token(0) == first
    [result] = runner.verify([0], [TokenTree.root_only(first)])  # nothing drafted: any rule
    assert result.num_committed == 4


class TopKDrafter:
    """Declares top-k children, as every tree drafter here does; the engine only stores it."""

    scheme = DraftScheme.TOPK
    needs_hidden = False


def test_engine_refuses_a_rule_unpaired_with_its_drafter_when_built() -> None:
    model = make_tiny_model(1, vocab_size=VOCAB)
    with pytest.raises(LossyRuleError, match="'traversal'.*TOPK.*temperature > 0"):
        SpecEngine(model, TopKDrafter(), EngineConfig(max_len=64, rule="traversal"))
    assert SpecEngine(model, TopKDrafter(), EngineConfig(max_len=64, rule="deterministic"))
    assert SpecEngine(model, NoDrafter(), EngineConfig(max_len=64, rule="block"))  # no drafts
