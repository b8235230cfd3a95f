"""Verifier and drafter as real subprocesses on a tiny random model, driven through the
``RemoteBackend``: greedy output equals plain decoding and the in-process engine (n-gram and a
model-based Lyanna drafter, asynchronous pipeline and synchronous), seeded sampling equals
the engine, invalid requests are refused up front, stale or unknown sequences get a clear
status, a drafter that lost a sequence is resynced from the full history, a killed drafter
falls back to target-only steps and speculation recovers when it returns, cancellation frees
both services, both serve health and reflection, and the gloo data plane carries the hidden
states."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from gateway.backend import BackendBusy, BackendUnavailable, GenerationRequest
from gateway.remote import RemoteBackend, RemoteConfig
from lyanna.drafters import DraftBudget
from lyanna.drafters.ngram import NgramDrafter
from lyanna.sampling import SamplingParams
from services.launch import free_port, launch
from services.pb import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.services.remote_client import (
    PROMPTS,
    Outcome,
    collect,
    engine_outputs,
    plain_greedy,
    run_remote,
)
from tests.services.tiny_drafters import tiny_lyanna

BUDGET = DraftBudget(depth=4, top_k=2, max_tokens=6)
# --tree fixed: the in-process references draft with BUDGET as it is; a cost-sized tree would
# follow this machine's measured cost curve, which differs from run to run (a seeded sample
# then differed from the engine's whenever the curve pruned a node)
BUDGET_FLAGS = ("--depth", "4", "--top-k", "2", "--max-draft-tokens", "6", "--tree", "fixed")
LYANNA_FLAGS = (*BUDGET_FLAGS, "--factory", "tests.services.tiny_drafters:tiny_lyanna")
MAX_TOKENS = 24
METRICS_PORTS: dict[str, int] = {}  # the ngram deployment's /metrics ports


@pytest.fixture(scope="module")
def ngram_services(tiny_model_dir):
    ports = METRICS_PORTS
    ports.update(verifier=free_port(), drafter=free_port())
    with launch(
        tiny_model_dir,
        "ngram",
        verifier_args=["--reflection", "true", "--metrics-port", str(ports["verifier"])],
        drafter_args=[
            *BUDGET_FLAGS,
            "--reflection",
            "true",
            "--metrics-port",
            str(ports["drafter"]),
        ],
    ) as deployment:
        yield deployment
    # SIGTERM drained the services and they exited cleanly
    assert all(c.process.returncode == 0 for c in deployment.children.values())


@pytest.fixture(scope="module")
def lyanna_services(tiny_model_dir):
    with launch(tiny_model_dir, "lyanna", drafter_args=LYANNA_FLAGS) as deployment:
        yield deployment


def config_for(deployment, **overrides) -> RemoteConfig:
    return RemoteConfig(deployment.verifier_addr, deployment.drafter_addr, **overrides)


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
    assert backend.drafter.num_starts == len(PROMPTS)
    assert backend.drafter.num_step_calls * 3 < len(steps)
    assert backend.num_verify_calls * 2 < len(steps)


def test_invalid_requests_are_refused_before_admission(ngram_services) -> None:
    async def refused(prompt: list[int], max_tokens: int, method: str | None = None) -> str:
        backend = RemoteBackend(config_for(ngram_services), frozenset(), lambda ids: "")
        await backend.start()
        request = GenerationRequest("x", prompt, SamplingParams(max_tokens=max_tokens), method)
        try:
            async for _ in backend.generate(request):
                raise AssertionError("an invalid request produced tokens")
        except ValueError as error:
            return str(error)
        finally:
            await backend.stop()
        raise AssertionError("no error")

    assert "[0, 16)" in asyncio.run(refused([1, 99], 4))
    assert "exceeds" in asyncio.run(refused([1, 2], 10_000))
    assert "unknown method" in asyncio.run(refused([1, 2], 4, "eagle"))


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
        verifier = backend._verifier
        free = (await verifier.Capacity(verifier_pb2.CapacityRequest())).free_slots
        held = [10**12 + i for i in range(free)]
        items = [verifier_pb2.PrefillItem(seq_id=i, prompt_ids=[1, 2]) for i in held]
        for item in items:
            item.params.max_tokens = 1
        await verifier.Prefill(verifier_pb2.PrefillRequest(items=items))
        try:
            request = GenerationRequest("b", PROMPTS[1], SamplingParams(max_tokens=4))
            start = time.monotonic()
            with pytest.raises(BackendBusy, match="within 0.2 s"):
                await anext(backend.generate(request))
            waited, still_waiting = time.monotonic() - start, len(backend._waiting)
            await verifier.Release(common_pb2.ReleaseRequest(seq_ids=held))
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


def test_lost_drafter_state_is_rebuilt_from_the_history(lyanna_services, tiny_loaded) -> None:
    """The drafter forgets a running sequence (as after a restart): the backend starts it
    again from every committed token and hidden state, and speculation goes on."""
    params = SamplingParams(max_tokens=60)

    async def run():
        backend = RemoteBackend(config_for(lyanna_services), frozenset(), lambda ids: "")
        await backend.start()
        stream = backend.generate(GenerationRequest("l", PROMPTS[0], params))
        outcome = Outcome()
        async for delta in stream:
            outcome.tokens += delta.token_ids
            outcome.steps += [delta.step] if delta.step else []
            if len(outcome.steps) == 5:
                seq_id = next(s.seq_id for lane in backend._lanes for s in lane.seqs)
                request = common_pb2.ReleaseRequest(seq_ids=[seq_id])
                await backend.drafter.stub.Release(request, timeout=5)
        await backend.stop()
        return outcome, backend.drafter.num_starts

    outcome, num_starts = asyncio.run(run())
    assert outcome.tokens == plain_greedy(tiny_loaded, PROMPTS[:1], 60)[0]
    assert num_starts == 2  # the first start and one resync
    assert sum(s.num_drafted for s in outcome.steps[8:]) > 0


def test_stale_and_unknown_sequences_get_clear_status(ngram_services) -> None:
    verifier = verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(ngram_services.verifier_addr))
    drafter = drafter_pb2_grpc.DrafterStub(grpc.insecure_channel(ngram_services.drafter_addr))
    seq_id, prompt = 987_654_321, [1, 2, 3, 1]
    item = verifier_pb2.PrefillItem(seq_id=seq_id, prompt_ids=prompt)
    item.params.max_tokens = 8
    first = verifier.Prefill(verifier_pb2.PrefillRequest(items=[item]), timeout=10)
    first_token = first.results[0].first_token
    start = drafter_pb2.StartItem(ref=first.results[0].ref, prompt_ids=prompt)
    start.first_token = first_token
    drafter.Start(drafter_pb2.StartRequest(items=[start]), timeout=10)
    tree = common_pb2.TokenTree(tokens=[first_token], parents=[-1], scheme=4)

    def verify(seq, committed):
        ref = common_pb2.SeqRef(seq_id=seq, num_committed=committed)
        return verifier.Verify(
            verifier_pb2.VerifyRequest(items=[verifier_pb2.VerifyItem(ref=ref, tree=tree)]),
            timeout=10,
        )

    def step(seq, committed):
        ref = common_pb2.SeqRef(seq_id=seq, num_committed=committed)
        items = [drafter_pb2.StepItem(ref=ref, next_token=first_token, draft=True)]
        return drafter.Step(drafter_pb2.StepRequest(items=items), timeout=10)

    try:
        with pytest.raises(grpc.RpcError) as stale:
            verify(seq_id, len(prompt) + 3)
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "4 committed" in stale.value.details() or "has 4" in stale.value.details()
        with pytest.raises(grpc.RpcError) as unknown:
            verify(seq_id + 1, len(prompt))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert "unknown sequence" in unknown.value.details()
        with pytest.raises(grpc.RpcError) as stale:
            step(seq_id, 2)
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as unknown:
            step(seq_id + 1, 0)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        (stepped,) = step(seq_id, len(prompt)).results  # drafted and verified in one call
        after = stepped.verified.ref.num_committed
        assert after == len(prompt) + len(stepped.verified.committed)
        # a retry of that step straight to the verifier (its relay died): the same result
        assert verify(seq_id, len(prompt)).results[0] == stepped.verified
        bad = common_pb2.TokenTree(tokens=[first_token, 99], parents=[-1, 0], scheme=4)
        ref = common_pb2.SeqRef(seq_id=seq_id, num_committed=after)
        with pytest.raises(grpc.RpcError) as invalid:
            request = verifier_pb2.VerifyRequest(items=[verifier_pb2.VerifyItem(ref=ref, tree=bad)])
            verifier.Verify(request, timeout=10)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        release = common_pb2.ReleaseRequest(seq_ids=[seq_id])
        assert verifier.Release(release, timeout=10).num_released == 1
        assert drafter.Release(release, timeout=10).num_released == 1


def test_cancel_releases_both_services(ngram_services) -> None:
    async def run():
        backend = RemoteBackend(config_for(ngram_services), frozenset(), lambda ids: "")
        await backend.start()
        request = GenerationRequest("c", PROMPTS[0], SamplingParams(max_tokens=200))
        stream = backend.generate(request)
        await stream.__anext__()
        await stream.__anext__()
        seq_id = next(s.seq_id for lane in backend._lanes for s in lane.seqs)
        await stream.aclose()
        for _ in range(100):
            if not backend.scheduler.running:
                break
            await asyncio.sleep(0.05)
        capacity = await backend._verifier.Capacity(verifier_pb2.CapacityRequest(), timeout=5)
        released = await backend.drafter.stub.Release(
            common_pb2.ReleaseRequest(seq_ids=[seq_id]), timeout=5
        )
        await backend.stop()
        return len(backend.scheduler.running), capacity, released.num_released

    running, capacity, drafter_released = asyncio.run(run())
    assert running == 0 and capacity.free_slots == capacity.total_slots
    assert drafter_released == 0  # the backend already released it


def test_a_prefill_past_its_deadline_keeps_no_verifier_slot(ngram_services) -> None:
    """The gateway gives up on a Prefill (its deadline) that the verifier runs anyway: the
    gateway releases the batch and the verifier drops a prefill whose caller is gone, so no
    KV slot leaks (each such prefill used to hold a slot until the verifier restarted)."""

    async def run() -> tuple[int, list[tuple[int, int]]]:
        config = config_for(ngram_services, prefill_deadline=0.001)
        backend = RemoteBackend(config, frozenset(), lambda ids: "")
        await backend.start()
        try:
            # gRPC may notice a 1 ms deadline only after a fast prefill has answered: then
            # the request simply completes; go on until three have passed their deadline
            timed_out = 0
            for i in range(30):
                request = GenerationRequest(
                    f"d{i}", [1, 2, 3, 4] * 75, SamplingParams(max_tokens=4)
                )
                try:
                    async for _ in backend.generate(request):
                        pass
                except BackendUnavailable:
                    timed_out += 1
                if timed_out == 3:
                    break
            await asyncio.sleep(1.0)  # let the verifier finish whatever it started
            seen = []
            for _ in range(3):
                capacity = await backend._verifier.Capacity(
                    verifier_pb2.CapacityRequest(), timeout=5
                )
                seen.append((capacity.free_slots, capacity.total_slots))
                await asyncio.sleep(0.1)
            return timed_out, seen
        finally:
            await backend.stop()

    timed_out, seen = asyncio.run(run())
    assert timed_out == 3
    assert all(free == total for free, total in seen)


def test_killed_drafter_falls_back_then_recovers(tiny_model_dir, tiny_loaded) -> None:
    params = SamplingParams(max_tokens=120)
    expected = plain_greedy(tiny_loaded, PROMPTS[:2], 120)

    async def run(deployment):
        config = config_for(deployment, drafter_retry_seconds=0.2, draft_deadline=2.0)
        backend = RemoteBackend(config, frozenset(), lambda ids: "")
        await backend.start()

        outcomes = await asyncio.gather(
            collect(backend, PROMPTS[0], params),
            collect(backend, PROMPTS[1], params),
            killer_of(backend, deployment),
        )
        await asyncio.to_thread(deployment.restart, "drafter")
        # the channel reconnects with a backoff of at most 2 s; wait until it has
        await backend.drafter.stub.Info(drafter_pb2.InfoRequest(), wait_for_ready=True, timeout=10)
        await asyncio.sleep(0.3)  # past the retry interval of the last failure
        after = await collect(backend, PROMPTS[0], SamplingParams(max_tokens=24))
        await backend.stop()
        return outcomes[:2], after

    with launch(tiny_model_dir, "ngram", drafter_args=BUDGET_FLAGS) as deployment:
        outcomes, after = asyncio.run(run(deployment))
    assert [o.tokens for o in outcomes] == expected
    steps = [s for o in outcomes for s in o.steps]
    assert any(s.drafter_fallback for s in steps) and any(not s.drafter_fallback for s in steps)
    assert after.tokens == expected[0][:24]
    # the channel may still be reconnecting for the first steps; then speculation is back
    assert any(not s.drafter_fallback and s.num_drafted > 0 for s in after.steps)
    assert not after.steps[-1].drafter_fallback


def test_a_restarted_verifier_loses_no_request(tiny_model_dir, tiny_loaded) -> None:
    """The verifier is killed mid-generation and comes back empty: every running sequence is
    re-prefilled from the gateway's history (the drafter resynced from it) and the answers
    equal an uninterrupted run, token for token."""
    params = SamplingParams(max_tokens=120)
    expected = plain_greedy(tiny_loaded, PROMPTS[:2], 120)

    async def run(deployment):
        backend = RemoteBackend(config_for(deployment), frozenset(), lambda ids: "")
        await backend.start()

        async def kill_and_restart() -> None:
            while backend.num_verified_steps < 6:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(deployment.restart, "verifier")

        outcomes = await asyncio.gather(
            collect(backend, PROMPTS[0], params),
            collect(backend, PROMPTS[1], params),
            kill_and_restart(),
        )
        await backend.stop()
        return outcomes[:2], backend.num_resumed

    with launch(tiny_model_dir, "lyanna", drafter_args=LYANNA_FLAGS) as deployment:
        outcomes, resumed = asyncio.run(run(deployment))
    assert [o.tokens for o in outcomes] == expected
    assert [o.finish_reason for o in outcomes] == ["length", "length"] and resumed >= 1
    steps = [s for o in outcomes for s in o.steps]
    assert sum(s.num_accepted for s in steps) > 0  # speculation went on around the restart


async def killer_of(backend: RemoteBackend, deployment) -> None:
    """Kill the drafter once a few verifications have gone through."""
    while backend.num_verified_steps < 6:
        await asyncio.sleep(0.005)
    await asyncio.to_thread(deployment.kill, "drafter")


def test_gloo_data_plane_carries_hidden_states(tiny_model_dir, tiny_loaded) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with launch(tiny_model_dir, "lyanna", drafter_args=LYANNA_FLAGS, plane="gloo") as deployment:
        config = config_for(deployment, use_data_plane=True)
        outcomes, backend = run_remote(config, PROMPTS, params)
    assert [o.tokens for o in outcomes] == plain_greedy(tiny_loaded, PROMPTS, MAX_TOKENS)
    assert backend.drafter.num_plane_transfers > 0
    steps = [s for o in outcomes for s in o.steps]
    assert not any(s.drafter_fallback for s in steps)


def scrape(port: int) -> dict[str, float]:
    """Every sample of a /metrics page, keyed by name and labels."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_verifier_and_drafter_export_their_own_metrics(ngram_services) -> None:
    ports = METRICS_PORTS
    before = scrape(ports["verifier"]), scrape(ports["drafter"])
    outcomes, _ = run_remote(config_for(ngram_services), PROMPTS[:2], SamplingParams(max_tokens=12))
    verifier, drafter = scrape(ports["verifier"]), scrape(ports["drafter"])

    def grew(now, then, name):
        return now[name] - then.get(name, 0.0)

    verified = grew(verifier, before[0], "lyanna_verifier_sequences_verified_total")
    assert verified == sum(len(o.steps) for o in outcomes) > 0
    accepted = grew(verifier, before[0], "lyanna_verifier_accepted_tokens_total")
    assert accepted == sum(s.num_accepted for o in outcomes for s in o.steps)
    assert grew(verifier, before[0], "lyanna_verifier_tree_tokens_count") == verified
    verify_calls = grew(verifier, before[0], "lyanna_verifier_forward_seconds_count,op=verify")
    assert grew(verifier, before[0], "lyanna_verifier_rule_seconds_count") == verify_calls >= 1
    assert grew(verifier, before[0], "lyanna_verifier_rule_seconds_sum") > 0
    assert grew(verifier, before[0], "lyanna_verifier_forward_seconds_count,op=prefill") >= 1
    assert verifier["lyanna_verifier_kv_slots,state=free"] == 8  # released after the requests
    assert verifier["lyanna_verifier_kv_slots,state=used"] == 0
    drafted = sum(s.num_drafted for o in outcomes for s in o.steps)
    assert grew(drafter, before[1], "lyanna_drafter_proposed_tokens_total") >= drafted > 0
    assert grew(drafter, before[1], "lyanna_drafter_starts_total") == 2
    assert grew(drafter, before[1], "lyanna_drafter_draft_seconds_count") >= 1


def test_reflection_is_off_unless_asked(lyanna_services) -> None:
    with grpc.insecure_channel(lyanna_services.verifier_addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="lyanna.v1.Verifier"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as refused:
            list(reflection.ServerReflectionInfo(iter([ask]), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_health_and_reflection(ngram_services) -> None:
    for addr, service in (
        (ngram_services.verifier_addr, "lyanna.v1.Verifier"),
        (ngram_services.drafter_addr, "lyanna.v1.Drafter"),
    ):
        with grpc.insecure_channel(addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            [answer] = list(reflection.ServerReflectionInfo(iter([ask]), timeout=5))
            names = {s.name for s in answer.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names
