"""``bench.graph_check`` in CI: the target's step traces without a break or a recompile in
every bucket it meets over 200 verifications, and its verdicts equal the eager forward's;
the check itself fails when the step syncs with the host. The same for the learned drafters'
steps (EAGLE-2, Lyanna): traced per bucket, their trees equal their eager runs', and a host
sync planted in one is named."""

from __future__ import annotations

import pytest

import lyanna.drafters.static_draft as static_draft
import lyanna.model.static_step as static_step
from bench import graph_check


@pytest.fixture(scope="module")
def model():
    return graph_check.random_model("tiny", seed=0)


def test_the_step_is_graph_ready_and_equals_the_eager_path(model) -> None:
    result = graph_check.check(model, steps=200, seed=0)
    assert result.first_break is None
    assert result.graph_breaks == 0 and result.recompiles == 0
    assert result.mismatches == 0 and result.verdicts >= 200
    batches = {b for b, _, _ in result.buckets}
    rows = {r for _, r, _ in result.buckets}
    kv = {k for _, _, k in result.buckets}
    assert len(batches) >= 3 and len(rows) >= 4 and len(kv) >= 2  # buckets really vary


def test_a_host_sync_in_the_step_is_named(model, monkeypatch) -> None:
    step_forward = static_step.step_forward

    def syncing(model, cache, window, kv_len, tokens, positions, lengths, tree_mask):
        if int(lengths.max()) > kv_len:  # a host read of a device value
            raise AssertionError("unreachable")
        return step_forward(model, cache, window, kv_len, tokens, positions, lengths, tree_mask)

    monkeypatch.setattr(static_step, "step_forward", syncing)
    result = graph_check.check(model, steps=5, seed=1)
    assert result.graph_breaks >= 1 and not result.ok
    assert result.first_break is not None and "data-dependent" in result.first_break
    assert graph_check.main(["--steps", "3"]) == 1


@pytest.mark.parametrize("method", graph_check.DRAFTERS)
def test_each_drafter_step_is_graph_ready_and_equals_its_eager_run(model, method) -> None:
    """The learned drafters' device steps, traced per bucket, over many engine steps (the
    bench runs 200; 80 here keep CI short and still cross window and KV buckets)."""
    result, trees = graph_check.check_drafter(model, method, steps=80, seed=0)
    assert result.first_break is None
    assert result.graph_breaks == 0 and result.recompiles == 0
    assert result.mismatches == 0 and result.steps == 80 and trees >= 150
    assert len({fields[0] for fields in result.buckets}) >= 2  # windows
    assert len({fields[-1] for fields in result.buckets if len(fields) == 4}) >= 2  # KV


@pytest.mark.parametrize("method", graph_check.DRAFTERS)
def test_each_drafter_chain_step_is_graph_ready(model, method) -> None:
    """Top-1 chains take their own path inside the steps: traced too."""
    budget = graph_check.CHAIN_BUDGET
    result, trees = graph_check.check_drafter(model, method, steps=30, seed=2, budget=budget)
    assert result.ok and result.first_break is None and result.steps == 30 and trees >= 30
    assert all(fields[1 if method == "eagle" else 2] == 1 for fields in result.buckets)


def test_a_host_sync_in_a_drafter_step_is_named(model, monkeypatch) -> None:
    hot_children = static_draft.hot_children

    def syncing(lm_head, hot_vocab, states, k):
        if float(states.abs().max()) < 0:  # a host read of a device value
            raise AssertionError("unreachable")
        return hot_children(lm_head, hot_vocab, states, k)

    monkeypatch.setattr(static_draft, "hot_children", syncing)
    result, _ = graph_check.check_drafter(model, "eagle", steps=3, seed=1)
    assert result.graph_breaks >= 1 and not result.ok
    assert result.first_break is not None and "data-dependent" in result.first_break.lower()


def test_a_host_sync_in_the_lyanna_tree_is_named(model, monkeypatch) -> None:
    device_subtrees = static_draft.device_subtrees

    def syncing(logits, roots_hot, top_k, info_table):
        if bool((roots_hot < 0).all()):  # a branch on a device value: read on the host
            info_table = None
        return device_subtrees(logits, roots_hot, top_k, info_table)

    monkeypatch.setattr(static_draft, "device_subtrees", syncing)
    result, _ = graph_check.check_drafter(model, "lyanna", steps=3, seed=1)
    assert result.graph_breaks >= 1 and not result.ok
    assert result.first_break is not None and "data-dependent" in result.first_break.lower()
