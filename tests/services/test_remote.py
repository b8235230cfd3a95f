"""Verifier and drafter as real subprocesses on a tiny random model, driven through the
``RemoteBackend``: greedy output equals plain decoding and the in-process engine (n-gram and a
model-based Lyanna drafter, asynchronous pipeline and synchronous), seeded sampling equals
the engine, plain and quiet steps share Verify calls, invalid requests are refused up front,
a request that finds no slot in time is busy, and a hidden history past its bound leaves
sequences target-only."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.backend import GenerationRequest
from gateway.remote import RemoteBackend
from lyanna.async_engine import BackendBusy
from lyanna.drafters.ngram import NgramDrafter
from lyanna.sampling import SamplingParams
from services.launch import launch
from services.pb import common_pb2, verifier_pb2
from tests.services.remote_client import (
    BUDGET,
    BUDGET_FLAGS,
    LYANNA_FLAGS,
    MAX_TOKENS,
    PROMPTS,
    Outcome,
    config_for,
    engine_outputs,
    plain_greedy,
    run_remote,
)
from tests.services.tiny_drafters import tiny_lyanna


@pytest.mark.parametrize("pipeline", [True, False], ids=["async", "sync"])
def test_ngram_greedy_equals_engine_and_plain(ngram_services, tiny_loaded, pipeline) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    outcomes, backend = run_remote(config_for(ngram_services, pipeline=pipeline), PROMPTS, params)
    expected = plain_greedy(tiny_loaded, PROMPTS, MAX_TOKENS)
    assert [o.tokens for o in outcomes] == expected
    assert engine_outputs(tiny_loaded, NgramDrafter(BUDGET), PROMPTS, params) == expected
    assert all(o.finish_reason == "length" for o in outcomes)
    steps = [s for o in outcomes for s in o.steps]
    assert sum(s.num_accepted for s in steps) > 0 and not any(s.drafter_fallback for s in steps)
    assert backend.default_method == "ngram" and all(s.method == "ngram" for s in steps)
    # the scheduler counted each streamed step once, as the gateway's metrics do
    counted = backend.scheduler.stats_by_method["ngram"]
    assert counted.num_steps == len(steps) == backend.num_verified_steps
    assert counted.num_accepted == sum(s.num_accepted for s in steps)
    assert counted.num_drafted == sum(s.num_drafted for s in steps)


def test_seeded_sampling_equals_engine(ngram_services, tiny_loaded) -> None:
    """In the synchronous loop a seeded request reproduces the in-process engine. (With the
    asynchronous pipeline a step may draft before the previous verdict lands, so which
    tree, and so which random draws, a step sees depends on timing: the law is the same,
    the sample is not; measured on a Zen 4 machine.)"""
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=7)
    outcomes, _ = run_remote(config_for(ngram_services, pipeline=False), PROMPTS[:2], params)
    expected = engine_outputs(tiny_loaded, NgramDrafter(BUDGET), PROMPTS[:2], params)
    assert [o.tokens for o in outcomes] == expected


def test_target_only_method(ngram_services, tiny_loaded) -> None:
    async def run():
        backend = RemoteBackend(config_for(ngram_services), frozenset(), lambda ids: "")
        await backend.start()
        request = GenerationRequest("r", PROMPTS[0], SamplingParams(max_tokens=10), method="ar")
        tokens, steps = [], []
        async for delta in backend.generate(request):
            tokens += delta.token_ids
            steps += [delta.step] if delta.step else []
        await backend.stop()
        return tokens, steps

    tokens, steps = asyncio.run(run())
    assert tokens == plain_greedy(tiny_loaded, PROMPTS[:1], 10)[0]
    assert all(s.num_drafted == 0 and not s.drafter_fallback for s in steps)


def test_plain_steps_share_a_verify_call_and_stay_exact(ngram_services, tiny_loaded) -> None:
    """Target-only requests run up to ``max_steps_per_call`` decode steps per Verify: greedy
    output is plain decoding's, seeded sampling the in-process engine's, each token still its
    own step, and far fewer calls than steps."""

    async def run(params: SamplingParams) -> tuple[list[Outcome], RemoteBackend]:
        config = config_for(ngram_services, pipeline=False, max_steps_per_call=8)
        backend = RemoteBackend(config, frozenset(), lambda ids: "")
        await backend.start()

        async def one(prompt: list[int]) -> Outcome:
            outcome = Outcome()
            async for delta in backend.generate(GenerationRequest("p", prompt, params, "ar")):
                outcome.tokens += delta.token_ids
                outcome.steps += [delta.step] if delta.step else []
            return outcome

        try:
            return list(await asyncio.gather(*(one(p) for p in PROMPTS))), backend
        finally:
            await backend.stop()

    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    outcomes, backend = asyncio.run(run(greedy))
    assert [o.tokens for o in outcomes] == plain_greedy(tiny_loaded, PROMPTS, MAX_TOKENS)
    assert all(len(o.steps) == MAX_TOKENS - 1 for o in outcomes)  # the first is the prefill's
    assert backend.num_verified_steps == len(PROMPTS) * (MAX_TOKENS - 1)
    assert backend.num_verify_calls * 4 < backend.num_verified_steps
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=7)
    outcomes, _ = asyncio.run(run(sampled))
    assert [o.tokens for o in outcomes] == engine_outputs(tiny_loaded, None, PROMPTS, sampled)


def test_quiet_steps_skip_the_drafter_and_share_verify_calls(tiny_model_dir, tiny_loaded) -> None:
    """A gated drafter that drafts only its probes: the steps it announces as quiet cost no
    drafter call and ride together in direct Verify calls, the output stays plain greedy
    decoding, and the drafter stays in step (no fallback, no restart)."""
    flags = (*BUDGET_FLAGS, "--factory", "tests.services.tiny_drafters:gated_lyanna")
    max_tokens = 60
    with launch(tiny_model_dir, "lyanna", drafter_args=flags) as deployment:
        params = SamplingParams(max_tokens=max_tokens)
        outcomes, backend = run_remote(config_for(deployment), PROMPTS, params)
    assert [o.tokens for o in outcomes] == plain_greedy(tiny_loaded, PROMPTS, max_tokens)
    steps = [s for o in outcomes for s in o.steps]
    assert not any(s.drafter_fallback for s in steps)
    assert any(s.num_drafted for s in steps)  # its probes
    # drafts counted as the method's came through the drafter's Steps; the rest (the
    # verifier's free drafts on quiet steps) are its fallback's
    method_drafts = [s for s in steps if s.num_drafted and not s.fallback_drafted]
    assert len(method_drafts) <= backend.drafter.num_step_calls * len(PROMPTS)
    assert all(s.num_drafted for s in steps if s.fallback_drafted)
    assert backend.drafter.num_starts == len(PROMPTS)
    assert backend.drafter.num_step_calls * 3 < len(steps)
    assert backend.num_verify_calls * 2 < len(steps)


def test_invalid_requests_fail_alone_past_the_http_edge(ngram_services) -> None:
    """The HTTP intake validates requests (tests/gateway); a Python caller that skips it meets
    the scheduler's capacity refusal, and ids outside the vocabulary are refused at the
    verifier's gRPC edge (the codec): either way that request fails without a token and the
    next one is served."""

    async def attempt(prompt: list[int], max_tokens: int) -> tuple[list[int], str | None]:
        request = GenerationRequest("x", prompt, SamplingParams(max_tokens=max_tokens))
        tokens: list[int] = []
        try:
            async for delta in backend.generate(request):
                tokens += delta.token_ids
        except Exception as error:  # noqa: BLE001 - the test reads the refusal
            return tokens, f"{type(error).__name__}: {error}"
        return tokens, None

    async def run() -> list[tuple[list[int], str | None]]:
        await backend.start()
        try:
            return [await attempt(p, n) for p, n in (([1, 2], 10_000), ([1, 99], 4), ([1, 2], 4))]
        finally:
            await backend.stop()

    backend = RemoteBackend(config_for(ngram_services), frozenset(), lambda ids: "")
    too_long, out_of_vocab, good = asyncio.run(run())
    assert too_long[0] == [] and "ValueError" in too_long[1] and "exceeds" in too_long[1]
    assert out_of_vocab[0] == [] and "[0, 16)" in out_of_vocab[1]
    assert good[1] is None and len(good[0]) == 4


@pytest.mark.parametrize("pipeline", [True, False], ids=["async", "sync"])
def test_lyanna_greedy_equals_engine_and_plain(lyanna_services, tiny_loaded, pipeline) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    config = config_for(lyanna_services, pipeline=pipeline)
    outcomes, backend = run_remote(config, PROMPTS, params)
    expected = plain_greedy(tiny_loaded, PROMPTS, MAX_TOKENS)
    assert [o.tokens for o in outcomes] == expected
    drafter = tiny_lyanna(tiny_loaded, BUDGET)
    assert engine_outputs(tiny_loaded, drafter, PROMPTS, params) == expected
    steps = [s for o in outcomes for s in o.steps]
    assert backend.drafter.needs_hidden and sum(s.num_drafted for s in steps) > 0
    assert not any(s.drafter_fallback for s in steps)


def test_sampled_lyanna_trees_cross_the_wire_and_equal_the_engine(
    tiny_model_dir, tiny_loaded
) -> None:
    """At T > 0 the drafter service drafts sampled trees (rows included, seeded by the
    request) and the verifier verifies them by traversal: the same tokens as in-process.
    Fresh services: a drafter that served earlier requests has learned acceptance rates
    that shape its trees (and so which random draws a step makes), the fresh in-process
    drafter has not."""
    params = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, seed=11)
    with launch(tiny_model_dir, "lyanna", drafter_args=LYANNA_FLAGS) as fresh:
        outcomes, _ = run_remote(config_for(fresh, pipeline=False), PROMPTS[:1], params)
    expected = engine_outputs(tiny_loaded, tiny_lyanna(tiny_loaded, BUDGET), PROMPTS[:1], params)
    assert [o.tokens for o in outcomes] == expected
    assert sum(s.num_drafted for o in outcomes for s in o.steps) > 0


def test_a_request_that_finds_no_slot_in_time_is_busy(ngram_services) -> None:
    """Every verifier slot is held by another client: a request gets BackendBusy after
    queue_timeout instead of waiting forever, and is admitted once slots are free."""

    async def run():
        backend = RemoteBackend(config_for(ngram_services, queue_timeout=0.2), frozenset(), str)
        await backend.start()

        def verifier(call, request):  # where the backend's channels live
            return backend.on_services(lambda engine: getattr(engine.verifier, call)(request))

        free = (await verifier("Capacity", verifier_pb2.CapacityRequest())).free_slots
        held = [10**12 + i for i in range(free)]
        items = [verifier_pb2.PrefillItem(seq_id=i, prompt_ids=[1, 2]) for i in held]
        for item in items:
            item.params.max_tokens = 1
        await verifier("Prefill", verifier_pb2.PrefillRequest(items=items))
        try:
            request = GenerationRequest("b", PROMPTS[1], SamplingParams(max_tokens=4))
            start = time.monotonic()
            with pytest.raises(BackendBusy, match="within 0.2 s"):
                await anext(backend.generate(request))
            waited = time.monotonic() - start
            for _ in range(40):  # the engine's worker applies the abort between steps
                if not backend.scheduler.waiting:
                    break
                await asyncio.sleep(0.05)
            still_waiting = len(backend.scheduler.waiting)
            await verifier("Release", common_pb2.ReleaseRequest(seq_ids=held))
            tokens = [t async for d in backend.generate(request) for t in d.token_ids]
            return waited, still_waiting, tokens
        finally:
            await backend.stop()

    waited, still_waiting, tokens = asyncio.run(run())
    assert 0.15 < waited < 5.0 and still_waiting == 0 and len(tokens) == 4


def test_hidden_history_past_its_bound_leaves_sequences_target_only(
    lyanna_services, tiny_loaded
) -> None:
    """The gateway keeps no more hidden rows per sequence than max_hidden_mb (here less than
    one prompt's): the drafter cannot be started from them, so the sequences decode
    target-only, exactly, instead of sending an oversized Start."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    config = config_for(lyanna_services, max_hidden_mb=0.0001)
    outcomes, backend = run_remote(config, PROMPTS[:2], params)
    assert [o.tokens for o in outcomes] == plain_greedy(tiny_loaded, PROMPTS[:2], MAX_TOKENS)
    assert sum(s.num_drafted for o in outcomes for s in o.steps) == 0
