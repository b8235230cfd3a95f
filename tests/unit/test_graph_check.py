"""``bench.graph_check`` in CI: the target's step traces without a break or a recompile in
every bucket it meets over 200 verifications, and its verdicts equal the eager forward's;
the check itself fails when the step syncs with the host."""

from __future__ import annotations

import pytest

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
