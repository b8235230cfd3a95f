"""The learned drafters' device steps (``lyanna.drafters.static_draft``) draft the same trees,
token for token and parent for parent, as the host-built trees they replace: EAGLE-2 and
Lyanna, on the CPU fast paths and on the device-generic path a GPU runs, over many engine
steps of random prompts, batches and releases that cross window and KV buckets."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bench.graph_check import lockstep, one_thread, random_drafter, random_model
from lyanna.drafters.base import DraftBudget
from lyanna.drafters.static_draft import ChainKey, DepthKey, RootKey


@pytest.fixture(scope="module")
def model():
    return random_model("tiny", seed=1)


def _pair(method: str, model, budget: DraftBudget, generic: bool, seed: int = 3):
    host = random_drafter(method, model, seed, budget, generic=generic, device_steps=False)
    device = random_drafter(method, model, seed, budget, generic=generic, device_steps=True)
    return host, device


@pytest.mark.parametrize("method", ["eagle", "lyanna"])
@pytest.mark.parametrize("generic", [False, True], ids=["cpu-fast", "generic"])
@pytest.mark.parametrize(
    "budget",
    [DraftBudget(depth=4, top_k=3, max_tokens=16), DraftBudget(depth=3, top_k=1, max_tokens=8)],
    ids=["top3", "chain"],
)
def test_device_steps_draft_the_host_trees(method, generic, budget, model) -> None:
    host, device = _pair(method, model, budget, generic)
    with one_thread():
        run = lockstep(model, [host, device], steps=120, seed=5)
    assert run.first_break is None
    assert run.mismatches == 0, run.first_mismatch
    assert run.steps == 120 and run.trees >= 200
    assert host._steps is None  # the host path never ran a device step
    keys = device.steps.keys_seen
    assert len({k.batch for k in keys}) >= 2
    if method == "eagle":
        assert {type(k) for k in keys} == {RootKey, DepthKey}
        assert len({k.kv_len for k in keys if isinstance(k, DepthKey)}) >= 2
    else:
        assert {type(k) for k in keys} == {ChainKey}
        assert len({k.kv_len for k in keys}) >= 2


@pytest.mark.parametrize("generic", [False, True], ids=["cpu-fast", "generic"])
def test_a_residual_fed_chain_drafts_the_host_trees(generic, model) -> None:
    """The device chain step feeds itself what the host chain does when the chain reads the
    layer's raw output (``feed_residual``), not only the normed state."""
    budget = DraftBudget(depth=4, top_k=3, max_tokens=16)
    host, device = (
        random_drafter("lyanna", model, 3, budget, generic=generic, device_steps=steps,
                       feed_residual=True)
        for steps in (False, True)
    )  # fmt: skip
    assert device.draft.config.feed_residual
    with one_thread():
        run = lockstep(model, [host, device], steps=40, seed=5)
    assert run.mismatches == 0, run.first_mismatch
    assert run.steps == 40 and run.trees >= 60


@pytest.mark.parametrize("info", ["copy", "gate", "gate+copy"])
@pytest.mark.parametrize("generic", [False, True], ids=["cpu-fast", "generic"])
def test_per_chain_token_info_drafts_the_host_trees(info, generic, model) -> None:
    """The gated token info and the copy read (each slot's context read inside the step)
    draft on the device what the host loop drafts, over batches, releases and re-sampling."""
    budget = DraftBudget(depth=4, top_k=3, max_tokens=16)
    flags = dict(info_gate="gate" in info, info_copy="copy" in info, generic=generic)
    host, device = (random_drafter("lyanna", model, 3, budget, device_steps=steps, **flags)
                    for steps in (False, True))  # fmt: skip
    assert device.info_table is None and device.per_chain_info is not None
    with one_thread():
        run = lockstep(model, [host, device], steps=60, seed=5)
    assert run.first_break is None
    assert run.mismatches == 0, run.first_mismatch
    assert run.steps == 60 and run.trees >= 100
    assert host._steps is None and len({k.kv_len for k in device.steps.keys_seen}) >= 2
    if "copy" in info:
        assert device.copy_contexts.fixed and not host.copy_contexts.fixed


def test_the_copy_read_changes_the_device_trees(model) -> None:
    """Without its copy read the same drafter drafts other trees on the device: the check
    above sees the read."""
    budget = DraftBudget(depth=4, top_k=3, max_tokens=16)
    with_read = random_drafter("lyanna", model, 3, budget, info_copy=True, device_steps=True)
    without = random_drafter("lyanna", model, 3, budget, info_copy=True, device_steps=True)
    silent = torch.zeros_like(without.per_chain_info.scale)
    without.per_chain_info = replace(without.per_chain_info, scale=silent)
    with one_thread():
        run = lockstep(model, [with_read, without], steps=20, seed=5)
    assert run.mismatches > 0


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@CUDA
@pytest.mark.parametrize("method", ["eagle", "lyanna", "lyanna-copy"])
def test_captured_draft_steps_draft_the_host_trees_on_a_gpu(method) -> None:
    """On a GPU the device steps are captured as CUDA graphs (one per bucket) and replayed:
    the same trees as the host path on the same device (a copy read too)."""
    model = random_model("tiny", seed=1).to("cuda")
    budget = DraftBudget(depth=4, top_k=3, max_tokens=16)
    name, copy = method.split("-")[0], method.endswith("copy")
    host, device = (random_drafter(name, model, 3, budget, device_steps=steps,
                                   **(dict(info_copy=True) if copy else {}))
                    for steps in (False, True))  # fmt: skip
    run = lockstep(model, [host, device], steps=60, seed=5)
    assert run.first_break is None
    assert run.mismatches == 0, run.first_mismatch
    assert device.steps.capture and len(device.steps._graphs) >= 2


@pytest.mark.parametrize("method", ["eagle", "lyanna"])
def test_the_comparison_sees_other_trees(method, model) -> None:
    """Drafters with other weights draft other trees: the check above can fail."""
    budget = DraftBudget(depth=4, top_k=3, max_tokens=16)
    host = random_drafter(method, model, 3, budget, device_steps=False)
    other = random_drafter(method, model, 4, budget)
    with one_thread():
        run = lockstep(model, [host, other], steps=10, seed=5)
    assert run.mismatches > 0


def test_a_depth_one_eagle_tree_is_the_root_step_alone(model) -> None:
    budget = DraftBudget(depth=1, top_k=4, max_tokens=4)
    host, device = _pair("eagle", model, budget, generic=True)
    with one_thread():
        run = lockstep(model, [host, device], steps=20, seed=2)
    assert run.mismatches == 0 and run.trees >= 20
    assert {type(k) for k in device.steps.keys_seen} == {RootKey}


def test_sampled_sequences_keep_the_host_path(model) -> None:
    """At temperature > 0 children are drawn on CPU generators: no device step runs."""
    from lyanna.sampling import SamplingParams

    drafter = random_drafter("lyanna", model, 3)
    runner_hidden = torch.randn(5, model.config.hidden_size)
    drafter.start(0, [1, 2, 3, 4, 5], runner_hidden, 7, SamplingParams(temperature=1.0, seed=1))
    tree = drafter.propose([0])[0]
    assert tree.num_nodes > 1 and drafter._steps is None
