"""KV slot leases and the services' health: a slot nobody renews is reclaimed after its TTL
(a gateway SIGKILLed without a Release) while steps keep a live sequence's lease; a late call
for a reclaimed sequence gets NOT_FOUND and the gateway re-prefills it without losing or
repeating a token; liveness turns NOT_SERVING when the compute thread stops making progress
(a hung forward, simulated by blocking it) and readiness at drain start."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.backend import GenerationRequest
from gateway.remote import RemoteBackend
from lyanna.drafters.base import DraftBudget
from lyanna.drafters.ngram import NgramDrafter
from lyanna.multi_step import FreeDrafts
from lyanna.sampling import SamplingParams
from lyanna.target import TargetConfig, TargetRunner
from services.config import ServerConfig
from services.drafter.server import DrafterConfig, DrafterServicer
from services.hidden import HiddenReceiver, HiddenSender
from services.launch import launch
from services.pb import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from services.server import LIVENESS, READINESS, ComputeWatch, start_server
from services.verifier.config import VerifierConfig
from services.verifier.server import SERVICE_NAME, VerifierServicer
from tests.conftest import make_tiny_model
from tests.services.remote_client import PROMPTS, Outcome, config_for, plain_greedy
from tests.services.test_free_drafts import ChainDrafter
from tests.services.test_servicers import Aborted, FakeContext, prefill, verify_item

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.hook: Callable[[], float] | None = None  # once: what happens as time is read

    def __call__(self) -> float:
        return self.now if self.hook is None else self.hook()


def leased_verifier(clock: Clock, lease_seconds: float = 10.0) -> VerifierServicer:
    runner = TargetRunner(
        make_tiny_model(2, vocab_size=16), TargetConfig(max_running=2, max_len=128)
    )
    config = VerifierConfig(max_tree_nodes=32, lease_seconds=lease_seconds)
    return VerifierServicer(runner, config, HiddenSender(), clock=clock)


def test_an_unrenewed_slot_is_reclaimed_and_a_stepped_one_is_kept() -> None:
    clock = Clock()
    servicer = leased_verifier(clock)
    idle_root = prefill(servicer, 1, [1, 2, 3])  # its gateway dies: nobody renews it
    root = prefill(servicer, 2, [4, 5, 6])
    committed = 3
    # sequence 2 steps every 6 s: each Verify renews its 10 s lease; 1's runs out at 1010
    for reclaimed in ([], [1], []):
        clock.now += 6
        request = verifier_pb2.VerifyRequest(items=[verify_item(2, committed, root)])
        result = servicer.Verify(request, FakeContext()).results[0]
        committed, root = result.ref.num_committed, result.tokens[-1]
        assert servicer.reclaim_expired() == reclaimed
    assert 1 not in servicer.runner and 2 in servicer.runner
    assert servicer.runner.num_free_slots == 1 and servicer.leases.num_reclaimed == 1
    assert servicer.metrics.kv_slots.labels("free")._value.get() == 1  # the gauge knows
    # the late call of the dead gateway's sequence: a clear NOT_FOUND, not a crash
    late = verifier_pb2.VerifyRequest(items=[verify_item(1, 3, idle_root)])
    with pytest.raises(Aborted) as aborted:
        servicer.Verify(late, FakeContext())
    assert aborted.value.args[0] == grpc.StatusCode.NOT_FOUND
    clock.now += 11  # sequence 2 stops stepping: its lease runs out as well
    assert servicer.reclaim_expired() == [2] and servicer.runner.num_free_slots == 2


def test_a_dead_gateway_s_draft_state_is_dropped_after_its_lease() -> None:
    """The drafter's per-sequence state is leased too: a killed gateway's sequences would
    otherwise fill its slots, and every later sequence would decode target-only."""
    clock = Clock()
    config = DrafterConfig(method="ngram", depth=4, top_k=2, max_draft_tokens=6)
    config = dataclasses.replace(config, lease_seconds=10.0)
    receiver = HiddenReceiver(32, torch.float32)
    servicer = DrafterServicer(NgramDrafter(config.shape()), config, receiver, 16, clock=clock)
    for seq_id in (1, 2):
        start = drafter_pb2.StartItem(
            ref=common_pb2.SeqRef(seq_id=seq_id, num_committed=2), prompt_ids=[1, 2], first_token=1
        )
        servicer.Start(drafter_pb2.StartRequest(items=[start]), FakeContext())
    clock.now += 6
    servicer.leases.hold(2)  # what a Step naming sequence 2 does
    assert servicer.reclaim_expired() == []
    clock.now += 5
    assert servicer.reclaim_expired() == [1] and servicer.leases.num_reclaimed == 1
    release = common_pb2.ReleaseRequest(seq_ids=[1, 2])
    assert servicer.Release(release, FakeContext()).num_released == 1  # 2 was still held
    with pytest.raises(ValueError):
        DrafterConfig(lease_seconds=-1)


def test_no_lease_keeps_slots_until_released() -> None:
    clock = Clock()
    servicer = leased_verifier(clock, lease_seconds=0)
    prefill(servicer, 1, [1, 2, 3])
    clock.now += 10_000
    assert servicer.reclaim_expired() == [] and 1 in servicer.runner
    with pytest.raises(ValueError):
        VerifierConfig(lease_seconds=-1)


class FreeDrafter(ChainDrafter):
    """Free drafts that learn nothing and whose release may fail."""

    fails: bool = False

    def on_verified(self, steps) -> dict[int, int]:
        return {}

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        if self.fails:
            raise RuntimeError("release failed")


def test_a_release_or_a_reap_leaves_nothing_of_the_sequence() -> None:
    """A sequence ends in one place: its slot, its lease and last step, its free drafts go
    together, the slot even when the free drafts' release fails (the lease gone, nothing
    would reclaim it), and a lease renewed by a Verify (on arrival, off the compute thread)
    that a Release overtakes stays gone: the reaper finds nothing to reclaim later."""
    clock = Clock()
    drafter = FreeDrafter(DraftBudget(), {})
    drafter.fails = True  # the sequence's other state must go all the same
    servicer = leased_verifier(clock)
    servicer.free = FreeDrafts(drafter)
    root = prefill(servicer, 1, [1, 2, 3])
    verify = verifier_pb2.VerifyRequest(items=[verify_item(1, 3, root)])
    servicer.Verify(verify, FakeContext())
    release = common_pb2.ReleaseRequest(seq_ids=[1])
    with pytest.raises(Aborted) as failed:  # the drafter's error is the caller's to see
        servicer.Release(release, FakeContext())
    assert failed.value.args[0] == grpc.StatusCode.INTERNAL
    assert 1 not in servicer.runner and servicer.runner.num_free_slots == 2
    assert drafter.roots == {} and servicer.leases.get(1) is None
    clock.now += 11
    assert servicer.reclaim_expired() == []  # nothing left to reap
    servicer.free = FreeDrafts(FreeDrafter(DraftBudget(), {}))
    root = prefill(servicer, 1, [1, 2, 3])  # the same id again: nothing was left behind
    servicer.Verify(verifier_pb2.VerifyRequest(items=[verify_item(1, 3, root)]), FakeContext())

    def release_first() -> float:  # the Release the compute thread runs meanwhile
        clock.hook = None
        assert servicer.Release(release, FakeContext()).num_released == 1
        return clock.now

    clock.hook = release_first
    with pytest.raises(Aborted) as late:  # its renew ran, then the sequence was gone
        servicer.Verify(verify, FakeContext())
    assert late.value.args[0] == grpc.StatusCode.NOT_FOUND and clock.hook is None
    clock.now += 11
    assert servicer.reclaim_expired() == [] and servicer.leases.num_reclaimed == 0
    prefill(servicer, 2, [4, 5])  # reaped: every piece of its state goes with the slot
    clock.now += 11
    assert servicer.reclaim_expired() == [2] and servicer.runner.num_free_slots == 2
    assert servicer.free.drafter.roots == {} and servicer.leases.get(2) is None


def test_a_reclaimed_sequence_is_re_prefilled_without_losing_a_token(
    tiny_model_dir, tiny_loaded
) -> None:
    """The gateway stalls longer than the lease (its engine's event loop, where every call to
    the services runs, blocked): the verifier
    reclaims its slots; when it wakes, its next Verify gets NOT_FOUND and it re-prefills the
    sequences from its history; the answers equal plain greedy decoding."""
    params = SamplingParams(max_tokens=60)
    expected = plain_greedy(tiny_loaded, PROMPTS[:2], 60)

    async def run(deployment) -> tuple[list[Outcome], int, int]:
        backend = RemoteBackend(config_for(deployment), frozenset(), lambda ids: "")
        await backend.start()

        async def collect(prompt: list[int], stall: bool) -> Outcome:
            outcome = Outcome()
            stream = backend.generate(GenerationRequest("l", prompt, params))
            async for delta in stream:
                outcome.tokens += delta.token_ids
                if stall and len(outcome.tokens) >= 8 and not outcome.steps:
                    outcome.steps.append(None)  # (once)
                    # blocks every call to the services past the 1 s lease
                    backend.engine.loop.call_soon_threadsafe(time.sleep, 4.0)
            return outcome

        outcomes = await asyncio.gather(collect(PROMPTS[0], True), collect(PROMPTS[1], False))
        for _ in range(100):  # the finished sequences' releases may still be in flight
            capacity = await backend.on_services(
                lambda e: e.verifier.Capacity(verifier_pb2.CapacityRequest(), timeout=10)
            )
            if capacity.free_slots == capacity.total_slots:
                break
            await asyncio.sleep(0.1)
        await backend.stop()
        return list(outcomes), backend.num_resumed, capacity.total_slots - capacity.free_slots

    with launch(tiny_model_dir, "ngram", verifier_args=["--lease-seconds", "1"]) as deployment:
        outcomes, resumed, held = asyncio.run(run(deployment))
        log = (deployment.log_dir / "verifier.log").read_text()
    assert [o.tokens for o in outcomes] == expected
    assert resumed >= 1 and "reclaimed" in log
    assert held == 0


def health_status(channel: grpc.Channel, name: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status


def wait_for_status(channel: grpc.Channel, name: str, status: int, within: float) -> float:
    start = time.monotonic()
    while health_status(channel, name) != status:
        assert time.monotonic() - start < within, f"{name} did not turn {status} in {within}s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_liveness_turns_false_when_the_compute_thread_hangs() -> None:
    servicer = leased_verifier(Clock())
    servicer.compute.watch = servicer.watch = ComputeWatch()  # the real clock for the watchdog
    config = ServerConfig(hang_seconds=1.0)

    def add(server: grpc.Server) -> None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)

    running = start_server(config, add, (SERVICE_NAME,), watch=servicer.watch)
    gate = threading.Event()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            time.sleep(2.5)  # idle for longer than hang_seconds: no work pending, still alive
            assert health_status(channel, LIVENESS) == SERVING
            assert health_status(channel, READINESS) == SERVING
            # a hung forward: the compute thread blocks inside a job, and a call queues behind
            hung = threading.Thread(target=servicer.compute.run, args=(lambda: gate.wait(60),))
            hung.start()
            # within hang_seconds plus the watchdog's period (generous on a loaded machine)
            wait_for_status(channel, LIVENESS, NOT_SERVING, within=30)
            assert health_status(channel, READINESS) == NOT_SERVING
            assert health_status(channel, "") == NOT_SERVING
            gate.set()  # the forward returns: alive and ready again
            hung.join(30)
            wait_for_status(channel, LIVENESS, SERVING, within=30)
            assert health_status(channel, READINESS) == SERVING
            running.health.drain()  # SIGTERM: readiness at once, liveness stays
            assert health_status(channel, READINESS) == NOT_SERVING
            assert health_status(channel, SERVICE_NAME) == NOT_SERVING
            assert health_status(channel, LIVENESS) == SERVING
    finally:
        gate.set()
        running.server.stop(0).wait()


def test_the_drafter_s_liveness_turns_false_when_a_forward_hangs_under_its_lock() -> None:
    """The drafter's RPCs run one at a time under a watched lock: a forward that hangs while
    holding it (another call queued behind) turns liveness NOT_SERVING, and it recovers."""
    config = DrafterConfig(method="ngram", depth=4, top_k=2, max_draft_tokens=6)
    receiver = HiddenReceiver(32, torch.float32)
    servicer = DrafterServicer(NgramDrafter(config.shape()), config, receiver, 16)

    def add(server: grpc.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)

    running = start_server(
        ServerConfig(hang_seconds=1.0), add, ("lyanna.v1.Drafter",), watch=servicer.watch
    )
    gate, holding = threading.Event(), threading.Event()

    def hung_forward() -> None:
        with servicer._lock:
            holding.set()
            gate.wait(60)

    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            time.sleep(2.5)  # idle past hang_seconds: alive
            assert health_status(channel, LIVENESS) == SERVING
            hung = threading.Thread(target=hung_forward)
            hung.start()
            assert holding.wait(30)
            queued = threading.Thread(target=lambda: servicer._lock.__enter__() and None)
            queued.start()  # a second call waits behind the hung one
            wait_for_status(channel, LIVENESS, NOT_SERVING, within=30)
            gate.set()
            hung.join(30)
            queued.join(30)
            servicer._lock.__exit__(None, None, None)  # the queued call finishes
            wait_for_status(channel, LIVENESS, SERVING, within=30)
    finally:
        gate.set()
        running.server.stop(0).wait()


def test_compute_watch_counts_a_stall_only_while_work_is_pending() -> None:
    clock = Clock()
    watch = ComputeWatch(clock)
    clock.now += 100
    assert watch.stalled_for() == 0.0  # idle
    watch.submitted()
    clock.now += 5
    assert watch.stalled_for() == 5.0  # queued, nothing moved
    watch.started()
    clock.now += 2
    assert watch.stalled_for() == 2.0  # running for 2 s
    watch.finished()
    assert watch.pending == 0 and watch.stalled_for() == 0.0
