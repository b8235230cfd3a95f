"""Cost-aware tree size: the cost curve, the width that pays, and pruning to it."""

from __future__ import annotations

import math
import random

import pytest

from lyanna.draft_nodes import DraftNodes
from lyanna.drafters.base import DraftBudget
from lyanna.tree_cost import VerifyCost


def linear_curve(first: float, per_row: float, rows=(1, 2, 4, 8, 16, 32)) -> VerifyCost:
    return VerifyCost(tuple(rows), tuple(first + per_row * (r - 1) for r in rows))


def test_curve_interpolates_between_and_extends_beyond_measurements() -> None:
    cost = VerifyCost((1, 2, 4), (10.0, 12.0, 20.0))
    assert cost.forward_seconds(1) == 10.0
    assert cost.forward_seconds(3) == pytest.approx(16.0)  # halfway between 12 and 20
    assert cost.forward_seconds(6) == pytest.approx(28.0)  # the last slope, 4 per row
    with pytest.raises(ValueError):
        cost.forward_seconds(0)


def test_noisy_measurements_never_make_more_rows_cheaper() -> None:
    cost = VerifyCost.from_measurements({4: 0.012, 1: 0.010, 2: 0.009, 8: 0.011})
    assert cost.rows == (1, 2, 4, 8)
    assert cost.seconds == (0.010, 0.010, 0.012, 0.012)


@pytest.mark.parametrize(
    "rows, seconds",
    [((), ()), ((2, 4), (1.0, 2.0)), ((1, 1), (1.0, 1.0)), ((1, 2), (1.0, 0.5)), ((1,), (0.0,))],
)
def test_malformed_curves_are_refused(rows, seconds) -> None:
    with pytest.raises(ValueError):
        VerifyCost(rows, seconds)


def test_width_is_worked_out_by_hand() -> None:
    # T(r) = 0.75 + 0.25 r: the first row costs 1, each further row a quarter of that.
    # tokens per second for w = 0..3: 1/1, 1.9/1.25 = 1.52, 2.4/1.5 = 1.6, 2.7/1.75 = 1.54
    cost = linear_curve(1.0, 0.25)
    assert cost.best_width([[0.9, 0.5, 0.3, 0.2, 0.05]], max_width=5) == 2
    assert cost.best_width([[0.9, 0.5, 0.3, 0.2, 0.05]], max_width=1) == 1  # the cap holds
    # draft time already spent favours a larger tree: with 1.0 s of drafting,
    # w = 3 gives 2.7 / 2.75 = 0.982 > w = 2: 2.4 / 2.5 = 0.96 > w = 4: 2.9 / 3.0 = 0.967
    assert cost.best_width([[0.9, 0.5, 0.3, 0.2, 0.05]], 5, draft_seconds=1.0) == 3


def test_free_rows_keep_every_node_and_dear_rows_keep_none() -> None:
    gains = [[0.9, 0.8, 0.1, 0.01]]
    assert VerifyCost((1, 32), (1.0, 1.0)).best_width(gains, max_width=4) == 4
    # each row costs a whole decode step: a node pays only if it is accepted for sure
    assert linear_curve(1.0, 1.0).best_width(gains, max_width=4) == 0


def test_a_batch_shares_one_width_over_padded_rows() -> None:
    # two trees, T(r) = r / 4 + 0.75 (r rows in the padded batch forward: 2 * (w + 1))
    # w = 0: 2 / 1.25 = 1.6; w = 1: (2 + 0.9 + 0.1) / 1.75 = 1.714; w = 2: 3.8 / 2.25 = 1.689
    cost = linear_curve(1.0, 0.25)
    assert cost.best_width([[0.9, 0.8, 0.7], [0.1]], max_width=3) == 1
    assert cost.best_width([], max_width=3) == 0


def random_nodes(rng: random.Random, n: int) -> DraftNodes:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    probs = [1.0] + [rng.uniform(0.01, 1.0) for _ in range(1, n)]
    return DraftNodes([rng.randrange(50) for _ in range(n)], parents, probs)


def joint(nodes: DraftNodes, i: int) -> float:
    p = 1.0
    while i > 0:
        p *= nodes.probs[i]
        i = nodes.parents[i]
    return p


def test_ranked_gains_are_the_joint_probabilities_prune_keeps_first() -> None:
    rng = random.Random(0)
    for _ in range(50):
        nodes = random_nodes(rng, rng.randrange(1, 20))
        gains = nodes.ranked_gains()
        assert gains == sorted(gains, reverse=True)
        assert len(gains) == nodes.num_drafted
        for width in range(nodes.num_drafted + 1):
            kept = nodes.prune(width)
            kept_joint = sum(joint(kept, i) for i in range(1, len(kept.tokens)))
            assert math.isclose(kept_joint, sum(gains[:width]), rel_tol=1e-9)
    assert DraftNodes([3, 4], [-1, 0]).ranked_gains() is None


def test_budget_prunes_every_tree_to_the_width_that_pays() -> None:
    rng = random.Random(1)
    trees = [random_nodes(rng, 12) for _ in range(3)]
    cost = linear_curve(1.0, 0.1)
    budget = DraftBudget(depth=4, top_k=2, max_tokens=8, cost=cost)
    width = cost.best_width([t.ranked_gains()[:8] for t in trees], 8)
    assert 0 < width < 8  # the case is a real choice, not the cap or nothing
    pruned = budget.prune(trees)
    assert [p.tokens for p in pruned] == [t.prune(width).tokens for t in trees]
    # without a curve the budget is the fixed cap, as in EAGLE-2
    fixed = DraftBudget(depth=4, top_k=2, max_tokens=8).prune(trees)
    assert [p.num_drafted for p in fixed] == [8, 8, 8]
    # trees without probabilities cannot be ranked by gain: the cap applies
    plain = DraftNodes(list(range(12)), trees[0].parents)
    assert budget.prune([plain])[0].num_drafted == 8


def test_another_draft_depth_must_beat_stopping() -> None:
    cost = linear_curve(1.0, 0.25)
    # stopping keeps both nodes: 2.4 tokens in 1.5 s. One more depth adds at most 0.2 tokens
    # (free to verify, optimistically): worth 0.1 s of drafting (2.6 / 1.6 > 2.4 / 1.5),
    # not 0.2 s (2.6 / 1.7 < 2.4 / 1.5)
    assert cost.worth_drafting_deeper([[0.9, 0.5]], 0.2, 4, 0.0, depth_seconds=0.1)
    assert not cost.worth_drafting_deeper([[0.9, 0.5]], 0.2, 4, 0.0, depth_seconds=0.2)


def test_eagle_stops_growing_when_verification_is_cheaper_than_a_draft_depth() -> None:
    import torch

    from lyanna.drafters.eagle import EagleDrafter
    from tests.conftest import make_tiny_model
    from tests.unit.test_eagle import random_head

    model = make_tiny_model(2, vocab_size=16)

    def max_depth(cost: VerifyCost | None) -> int:
        drafter = EagleDrafter(model, random_head(model), DraftBudget(5, 2, 40, cost=cost))
        hidden = torch.randn(4, model.config.hidden_size)
        depths = []
        for seq_id in range(3):  # the first step times a depth, the later ones use it
            drafter.start(seq_id, [1, 2, 3, 4], hidden, 5)
            depths.append(int(drafter.propose([seq_id])[0].depths.max()))
        return max(depths[1:])

    assert max_depth(None) == 5
    # a verified row costs a kilosecond: any node that may be accepted pays for a draft depth
    assert max_depth(VerifyCost((1, 2), (1e3, 1e3 + 1e-9))) == 5
    # a verification costs a microsecond: one draft depth (milliseconds) never pays
    assert max_depth(VerifyCost((1, 2), (1e-6, 2e-6))) <= 2


def test_serving_services_and_spec_bench_draft_the_same_measured_default(
    monkeypatch, tmp_path
) -> None:
    import argparse

    from bench.common import method_budget
    from gateway.embedded import EmbeddedBackend, EmbeddedConfig
    from lyanna.drafters import DEFAULT_BUDGETS, tree_budget
    from services.drafter.server import DrafterConfig
    from tests.conftest import make_tiny_model

    monkeypatch.setenv("LYANNA_CACHE", str(tmp_path))
    model = make_tiny_model(3, vocab_size=32)
    served = EmbeddedBackend(model, frozenset({0}), EmbeddedConfig(default_method="ngram"))
    served._build()  # the engine and the default method's drafter, as at start
    embedded = served.engine.drafters["ngram"].budget
    service = DrafterConfig(method="ngram").budget(model)
    flags = argparse.Namespace(depth=None, top_k=None, budget=None, tree="cost")
    benched = method_budget(flags, "ngram", model)
    assert embedded == service == benched == tree_budget("ngram", model)
    default = DEFAULT_BUDGETS["ngram"]
    assert (embedded.depth, embedded.top_k, embedded.max_tokens) == (
        default.depth,
        default.top_k,
        default.max_tokens,
    )
    # the curve was measured on this model once, then read back from the machine's cache
    assert embedded.cost is not None and embedded.cost.rows[0] == 1
    assert "verify_cost" in (tmp_path / "calibration.json").read_text()
    # --tree fixed drafts the full budget with no curve; a flag overrides one field only
    fixed = method_budget(
        argparse.Namespace(depth=2, top_k=None, budget=None, tree="fixed"), "ngram", model
    )
    assert fixed.cost is None and (fixed.depth, fixed.top_k) == (2, default.top_k)


def test_calibration_learns_what_predicted_gains_are_worth() -> None:
    from lyanna.tree_cost import GainCalibration

    calibration = GainCalibration()
    assert calibration.scale == 1.0  # nothing seen yet: trust the draft probabilities
    for _ in range(200):  # n-gram-like: 5 tokens predicted per step, 1 accepted
        calibration.proposed(5.0)
        calibration.verified(1)
    assert calibration.scale == pytest.approx(0.2, abs=0.02)
    # an overconfident drafter gets narrower trees: the same nodes, a lower gain each
    rng = random.Random(3)
    trees = [random_nodes(rng, 12)]
    budget = DraftBudget(depth=4, top_k=2, max_tokens=8, cost=linear_curve(1.0, 0.1))
    trusted = budget.prune(trees)[0].num_drafted
    doubted = budget.prune(trees, calibrations=[calibration])[0].num_drafted
    assert doubted < trusted
    # the kept nodes' unscaled gains are what the next verification is compared with
    assert calibration.pending == pytest.approx(sum(trees[0].ranked_gains()[:doubted]))


def test_a_4bit_target_drafts_one_token_by_default_everywhere(tmp_path, monkeypatch) -> None:
    """The 4-bit engine's verification cost is steep, so serve, the drafter service and
    spec_bench all default to the measured one-token shape there (n-gram: a chain of up to
    3, which costs no forward), and to the deep shape on a target whose verification is
    flat."""
    import argparse

    from bench.common import method_budget
    from lyanna.drafters import DEFAULT_BUDGETS, default_budget, tree_budget
    from lyanna.model.quant import Int4Linear, quantize_q4_1, runs_q4
    from services.drafter.server import DrafterConfig
    from tests.conftest import make_tiny_model

    monkeypatch.setenv("LYANNA_CACHE", str(tmp_path))
    dense = make_tiny_model(3, vocab_size=32)
    q4 = make_tiny_model(3, vocab_size=32)
    mlp = q4.layers[0].feed_forward
    mlp.w2 = Int4Linear(quantize_q4_1(mlp.w2.weight))
    assert runs_q4(q4) and not runs_q4(dense)
    flags = argparse.Namespace(depth=None, top_k=None, budget=None, tree="fixed")
    for method in ("eagle", "lyanna", "ngram"):
        deep, one = default_budget(method, dense), default_budget(method, q4)
        assert deep == DEFAULT_BUDGETS[method] and deep.max_tokens > 1
        chain = 3 if method == "ngram" else 1
        assert (one.depth, one.top_k, one.max_tokens) == (chain, 1, chain)
        assert one.depth_for(greedy=False) == 1 and deep.depth_for(greedy=False) == deep.depth
        assert tree_budget(method, q4, "fixed") == one
        assert DrafterConfig(method=method, tree="fixed").budget(q4) == one
        assert method_budget(flags, method, q4) == one
        assert method_budget(flags, method, dense) == deep


def test_forward_seconds_times_each_row_count_settled(monkeypatch) -> None:
    """The cost curve must price the rows decoding pays in steady state. On a fake clock where
    a forward over r rows costs 1 + 0.25 (r - 1) seconds, plus 0.5 s when the previous forward
    had another size (the switch), plus a slow drift: every increment comes back without the
    switch, within the drift of one round. (Timing one row right before each other count,
    as before, put the switch into every one-row time and priced a second row at a fraction
    of its cost.)"""
    from lyanna.model import calibrate
    from tests.conftest import make_tiny_model

    model = make_tiny_model(1, vocab_size=32)
    clock = {"now": 0.0, "calls": 0, "last": None}
    real_forward = type(model).forward

    def fake_forward(self, tokens, positions, cache, slots, tree_mask=None):
        out = real_forward(self, tokens, positions, cache, slots, tree_mask)
        rows = tokens.shape[1]
        switch = 0.5 if clock["last"] not in (None, rows) else 0.0
        clock["calls"] += 1
        clock["last"] = rows
        clock["now"] += 1.0 + 0.25 * (rows - 1) + switch + 0.001 * clock["calls"]
        return out

    monkeypatch.setattr(type(model), "forward", fake_forward)
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock["now"])
    rows = (1, 2, 4, 8)
    seconds = calibrate.forward_seconds(model, rows, context=8, repeats=5)
    assert seconds[1] == pytest.approx(1.0, abs=0.1)  # no switch in it
    for r in rows[1:]:
        assert seconds[r] - seconds[1] == pytest.approx(0.25 * (r - 1), abs=0.01)


def test_a_curve_measured_on_a_busy_machine_is_measured_again(monkeypatch, tmp_path) -> None:
    """Defect: the cost curve, measured once per machine, was measured during a build and a
    test suite (8.9 ms cached for a 3.0 ms step), and every later gate drafted where drafting
    lost. On a fake clock: a curve cached at 3x the speed of now is measured again; one that
    still agrees is read back with only a short check, once per process."""
    from lyanna.model import calibrate
    from tests.conftest import make_tiny_model

    monkeypatch.setenv("LYANNA_CACHE", str(tmp_path))
    model = make_tiny_model(1, vocab_size=32)
    clock = {"now": 0.0, "slowdown": 3.0, "calls": 0}
    real_forward = type(model).forward

    def fake_forward(self, tokens, positions, cache, slots, tree_mask=None):
        out = real_forward(self, tokens, positions, cache, slots, tree_mask)
        clock["calls"] += 1
        clock["now"] += clock["slowdown"] * (1.0 + 0.25 * (tokens.shape[1] - 1))
        return out

    monkeypatch.setattr(type(model), "forward", fake_forward)
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(calibrate, "_CHECKED", set())
    busy = calibrate.verify_cost(model)
    assert busy.forward_seconds(1) == pytest.approx(3.0)
    clock["slowdown"] = 1.0  # the build is over
    assert calibrate.verify_cost(model).forward_seconds(1) == pytest.approx(3.0)  # same process
    calibrate._CHECKED.clear()  # a new process starts
    quiet = calibrate.verify_cost(model)
    assert quiet.forward_seconds(1) == pytest.approx(1.0)
    assert quiet.forward_seconds(2) == pytest.approx(1.25)
    calibrate._CHECKED.clear()
    clock["calls"] = 0
    again = calibrate.verify_cost(model)
    assert again.forward_seconds(1) == pytest.approx(1.0)
    assert 0 < clock["calls"] < 16  # the check (a prompt and a dozen one-row forwards) only
    clock["calls"] = 0
    calibrate.verify_cost(model)
    assert clock["calls"] == 0  # checked once per process
