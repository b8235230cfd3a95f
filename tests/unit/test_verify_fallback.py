"""The residual fallback of §7.3: flagged only when a fallback row is really used (traversal),
and never a way back for a rejected token (top-down tree rules and the chain rules)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lyanna.verify.traversal as traversal
from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify import RULES
from tests.unit.exact_law import ToyModel, draft_tree, enumerate_drafts

WOR = DraftScheme.WITHOUT_REPLACEMENT
SHAPES = [[-1, 0, 0], [-1, 0, 0, 1, 1], [-1, 0, 1, 1, 2], [-1, 0, 0, 1, 2], [-1, 0, 0, 0, 1]]


def random_wor_cases(count: int) -> list[tuple[TokenTree, torch.Tensor]]:
    """Small trees drafted without replacement, each draft picked by its probability. The
    top-p target often gives a drafted token mass 0, whose subtree then has pa = 0."""
    rng = np.random.default_rng(0)
    cases = []
    for seed in range(count):
        target = ToyModel(5, seed, top_p=0.7)
        draft = ToyModel(5, 1000 + seed)
        parents = SHAPES[seed % len(SHAPES)]
        drafts = list(enumerate_drafts(draft, parents, WOR))
        probs = np.array([prob for _, prob in drafts])
        tokens = drafts[rng.choice(len(drafts), p=probs / probs.sum())][0]
        cases.append(draft_tree(tokens, parents, WOR, draft, target))
    return cases


class EmptyResidualSpy:
    """Wraps `positive_residual` in the traversal module: `met` counts empty residuals of any
    kind; `live` those whose weighted row pa * Mb had mass, the only kind a fallback row can
    be sampled after (an empty residual sets pa = 0, and a node with pa = 0 is never accepted
    unless it is the root, whose first empty residual had pa = 1)."""

    def __init__(self) -> None:
        self.met = self.live = 0
        self.inner = traversal.positive_residual

    def __call__(self, weighted, draft_rows, fallback_rows):
        rows, mass = self.inner(weighted, draft_rows, fallback_rows)
        empty = mass <= 0
        self.met += int(empty.sum())
        self.live += int((empty & (weighted.sum(dim=-1) > 0)).sum())
        return rows, mass


def test_traversal_flags_only_verdicts_drawn_from_a_fallback_row(monkeypatch) -> None:
    spy = EmptyResidualSpy()
    monkeypatch.setattr(traversal, "positive_residual", spy)
    rule, generator = RULES["traversal"], torch.Generator().manual_seed(0)
    met, flagged_without_fallback, verdicts = 0, 0, 0
    for tree, target_probs in random_wor_cases(40):
        for _ in range(25):
            spy.met = spy.live = 0
            verdict = rule(tree, target_probs, generator)
            verdicts += 1
            met += spy.met > 0
            flagged_without_fallback += verdict.residual_fallback and spy.live == 0
    assert met / verdicts > 0.2  # empty residuals are common here (pa = 0 subtrees)
    assert flagged_without_fallback == 0  # 465 of these 1000 verdicts before the fix


def test_traversal_flags_a_real_fallback_at_the_root() -> None:
    """Draft row above the target everywhere (inconsistent rows): after the child is rejected
    the root's residual is empty and the final token comes from the fallback row."""
    target_probs = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)
    draft_probs = torch.tensor([[0.7, 0.5], [0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)
    tree = TokenTree.from_parents([0, 0, 1], [-1, 0, 1], scheme=WOR, draft_probs=draft_probs)
    verdicts = RULES["traversal"].verify_batch(
        [tree] * 200, [target_probs] * 200, torch.Generator().manual_seed(0)
    )
    at_root = [v for v in verdicts if v.num_accepted == 0]
    assert at_root and all(v.residual_fallback for v in at_root)
    assert not any(v.residual_fallback for v in verdicts if v.num_accepted > 0)


def underflow_cases() -> list[tuple[str, TokenTree, torch.Tensor, list[int]]]:
    """(rule, tree, target rows, rejected-at-the-root tokens) where a residual after
    rejection is positive in exact arithmetic but 0 in float64 (1 - 2e-20 rounds to 1)."""
    rows = torch.full((3, 3), 1 / 3, dtype=torch.float64)
    # RRS without replacement, children [A, B]: A is rejected w.p. 1/2, leaving p' = C;
    # q' = (0, 2e-20, 1 - 2e-20) rounds to (0, 2e-20, 1), so B's residual C - q' is empty.
    target = torch.cat([torch.tensor([[0.25, 0.0, 0.75]], dtype=torch.float64), rows[1:]])
    draft = torch.cat([torch.tensor([[0.5, 1e-20, 0.5]], dtype=torch.float64), rows[1:]])
    star = TokenTree.from_parents([2, 0, 1], [-1, 0, 0], scheme=WOR, draft_probs=draft)
    cases = [("rrs_wor", star, target, [0, 1])]
    # One drafted token A with p(A) = 1e-30 < q(A) = 1e-20: rejected almost surely, and
    # p - q = (0, 1e-20, 0) exactly but (0, 0, 0) in float64.
    target = torch.cat([torch.tensor([[1e-30, 0.5, 0.5]], dtype=torch.float64), rows[1:2]])
    draft = torch.cat([torch.tensor([[1e-20, 0.5, 0.5]], dtype=torch.float64), rows[1:2]])
    for name in ("specinfer", "tokenwise", "block", "hsd"):
        scheme = DraftScheme.IID if name == "specinfer" else DraftScheme.CHAIN_SAMPLED
        cases.append((name, TokenTree.chain(2, [0], scheme=scheme, draft_probs=draft), target, [0]))
    return cases


@pytest.mark.parametrize(("name", "tree", "target_probs", "rejected"), underflow_cases())
def test_an_underflowed_residual_never_re_emits_a_rejected_token(
    name: str, tree: TokenTree, target_probs: torch.Tensor, rejected: list[int]
) -> None:
    rule = RULES[name]
    [at_root] = [b for b in rule.branches(tree, target_probs) if b.path == (0,)]
    assert at_root.probability > 0.4
    assert at_root.next_token_probs[rejected].tolist() == [0.0] * len(rejected)
    assert at_root.next_token_probs.sum().item() == pytest.approx(1.0)
    verdicts = rule.verify_batch(
        [tree] * 400, [target_probs] * 400, torch.Generator().manual_seed(0)
    )
    stopped = [v for v in verdicts if v.num_accepted == 0]
    assert stopped and all(v.residual_fallback for v in stopped)
    assert not any(v.tokens[-1] in rejected for v in stopped)


def one_child_batches() -> list[list[tuple[TokenTree, torch.Tensor]]]:
    """Batches of trees that draft one token (a sampled draft step's default), one vocabulary
    per batch: toy drafts with a top-p target (x often has target mass 0), a draft row above
    the target everywhere (the root's residual is empty: a real fallback), and a draft over a
    hot vocabulary."""
    cases = []
    for seed in range(12):
        target, draft = ToyModel(5, seed, top_p=0.7), ToyModel(5, 1000 + seed)
        for tokens, _ in list(enumerate_drafts(draft, [-1, 0], WOR))[:3]:
            cases.append(draft_tree(tokens, [-1, 0], WOR, draft, target))
    inconsistent = torch.tensor([[0.7, 0.5], [0.5, 0.5]], dtype=torch.float64)
    half = torch.full((2, 2), 0.5, dtype=torch.float64)
    fallback = TokenTree.from_parents([0, 0], [-1, 0], scheme=WOR, draft_probs=inconsistent)
    hot_rows = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    hot = TokenTree.from_parents(
        [2, 4], [-1, 0], scheme=WOR, draft_probs=hot_rows, vocab_index=torch.tensor([1, 4, 5])
    )
    target_rows = torch.tensor([[0.1, 0.3, 0.2, 0.0, 0.3, 0.1], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]])
    return [cases, [(fallback, half)] * 10, [(hot, target_rows)] * 10]


def test_one_drafted_token_takes_a_short_path_with_the_general_traversals_draws() -> None:
    """Batches of one-child trees go through ``_one_child_verdicts``; with the same seed they
    give exactly what the general traversal gives (paths, tokens, fallback flags)."""
    rule, outcomes = RULES["traversal"], set()
    for cases in one_child_batches():
        trees, target_probs = [t for t, _ in cases] * 5, [p for _, p in cases] * 5
        for seed in range(3):
            short = rule.verify_batch(trees, target_probs, torch.Generator().manual_seed(seed))
            general = rule.traverse(trees, target_probs, torch.Generator().manual_seed(seed))
            assert [(v.path, v.tokens, v.residual_fallback) for v in short] == [
                (v.path, v.tokens, v.residual_fallback) for v in general
            ]
            outcomes |= {(v.num_accepted, v.residual_fallback) for v in short}
    assert outcomes == {(1, False), (0, False), (0, True)}  # every branch was compared
