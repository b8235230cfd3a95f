"""Recovery with real services: a drafter that lost a sequence is resynced from the full
history, stale or unknown sequences get a clear status, cancellation and a prefill past its
deadline free both services' slots, a killed drafter falls back to target-only steps and
speculation recovers when it returns, a restarted verifier loses no request, and the gloo
data plane carries the hidden states."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.backend import GenerationRequest
from gateway.remote import RemoteBackend
from lyanna.async_engine import BackendUnavailable
from lyanna.sampling import SamplingParams
from services.launch import launch
from services.pb import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.services.remote_client import (
    BUDGET_FLAGS,
    LYANNA_FLAGS,
    MAX_TOKENS,
    PROMPTS,
    Outcome,
    collect,
    config_for,
    plain_greedy,
    run_remote,
)


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
                seq_id = next(iter(backend.scheduler.running))
                request = common_pb2.ReleaseRequest(seq_ids=[seq_id])
                await backend.on_services(
                    lambda e, request=request: e.drafter.stub.Release(request, timeout=5)
                )
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
        *_, last = drafter.Step(drafter_pb2.StepRequest(items=items), timeout=10)
        return last.response

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
        seq_id = next(iter(backend.scheduler.running))
        await stream.aclose()
        for _ in range(100):
            if not backend.scheduler.running:
                break
            await asyncio.sleep(0.05)
        capacity = await backend.on_services(
            lambda e: e.verifier.Capacity(verifier_pb2.CapacityRequest(), timeout=5)
        )
        released = await backend.on_services(
            lambda e: e.drafter.stub.Release(common_pb2.ReleaseRequest(seq_ids=[seq_id]), timeout=5)
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
            # (30 tries once saw only two: each completed try costs a few ms, so try more)
            timed_out = 0
            for i in range(200):
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
                capacity = await backend.on_services(
                    lambda e: e.verifier.Capacity(verifier_pb2.CapacityRequest(), timeout=5)
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
        await backend.on_services(
            lambda e: e.drafter.stub.Info(
                drafter_pb2.InfoRequest(), wait_for_ready=True, timeout=10
            )
        )
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
