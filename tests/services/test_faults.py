"""Fault handling with real processes: a drafter slower than the draft deadline leaves every
step target-only with exactly the plain greedy output, and SIGTERM lets an in-flight call
finish while refusing new ones, then the service exits cleanly; services started by a launcher
that crashes exit with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from gateway.remote import RemoteConfig
from lyanna.sampling import SamplingParams
from services.launch import launch
from services.pb import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.services.remote_client import PROMPTS, plain_greedy, run_remote

SLOW = ("--factory", "tests.services.tiny_drafters:slow_ngram", "--grace-seconds", "3")


@pytest.mark.parametrize("free_drafts", ["false", "true"])
def test_drafter_past_its_deadline_falls_back(tiny_model_dir, tiny_loaded, free_drafts) -> None:
    """Every step falls back to the verifier; without its free drafts each is a plain step,
    with them some carry the verifier's own n-gram drafts. Greedy output is plain greedy's."""
    env = {"LYANNA_TEST_PROPOSE_DELAY": "0.3"}
    verifier_args = ("--free-drafts", free_drafts)
    with launch(
        tiny_model_dir, "ngram", verifier_args=verifier_args, drafter_args=SLOW, env=env
    ) as deployment:
        config = RemoteConfig(deployment.verifier_addr, deployment.drafter_addr, draft_deadline=0.1)
        outcomes, backend = run_remote(config, PROMPTS[:2], SamplingParams(max_tokens=12))
    assert [o.tokens for o in outcomes] == plain_greedy(tiny_loaded, PROMPTS[:2], 12)
    steps = [s for o in outcomes for s in o.steps]
    assert steps and all(s.drafter_fallback for s in steps)
    drafted = sum(s.num_drafted for s in steps)
    assert drafted > 0 if free_drafts == "true" else drafted == 0
    assert backend.num_fallback_steps == len(steps)


def test_a_hung_drafter_costs_seconds_not_a_step_deadline(tiny_model_dir, tiny_loaded) -> None:
    """A drafter stuck in drafting (its proposals take 60 s) never reports `drafted`: the
    gateway gives up on it one draft deadline plus a second later, steps run without it (the
    verifier's free drafts at most) with exactly the greedy output, and the whole request
    takes seconds, not minutes."""
    env = {"LYANNA_TEST_PROPOSE_DELAY": "60"}
    with launch(tiny_model_dir, "ngram", drafter_args=SLOW, env=env) as deployment:
        config = RemoteConfig(deployment.verifier_addr, deployment.drafter_addr,
                              draft_deadline=0.2, drafter_retry_seconds=30.0)  # fmt: skip
        started = time.monotonic()
        outcomes, backend = run_remote(config, PROMPTS[:1], SamplingParams(max_tokens=12))
        elapsed = time.monotonic() - started
    assert [o.tokens for o in outcomes] == plain_greedy(tiny_loaded, PROMPTS[:1], 12)
    steps = [s for o in outcomes for s in o.steps]
    assert steps and all(s.drafter_fallback for s in steps)
    assert elapsed < 10.0  # one 1.2 s wait for the stuck Step, then target-only steps


def test_sigterm_drains_in_flight_calls(tiny_model_dir) -> None:
    env = {"LYANNA_TEST_PROPOSE_DELAY": "1.5"}
    with launch(tiny_model_dir, "ngram", drafter_args=SLOW, env=env) as deployment:
        verifier = verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(deployment.verifier_addr))
        item = verifier_pb2.PrefillItem(seq_id=1, prompt_ids=[1, 2, 1])
        item.params.max_tokens = 8
        (first,) = verifier.Prefill(verifier_pb2.PrefillRequest(items=[item]), timeout=10).results
        stub = drafter_pb2_grpc.DrafterStub(grpc.insecure_channel(deployment.drafter_addr))
        start = drafter_pb2.StartItem(
            ref=first.ref, prompt_ids=[1, 2, 1], first_token=first.first_token
        )
        stub.Start(drafter_pb2.StartRequest(items=[start]), timeout=10)
        step = drafter_pb2.StepItem(ref=first.ref, next_token=first.first_token, draft=True)
        replies: list = []
        in_flight = threading.Thread(
            target=lambda: replies.extend(
                stub.Step(drafter_pb2.StepRequest(items=[step]), timeout=20)
            )
        )
        in_flight.start()
        time.sleep(0.5)
        process = deployment.children["drafter"].process
        process.send_signal(signal.SIGTERM)
        time.sleep(0.8)  # the handler polls every 0.5 s
        with pytest.raises(grpc.RpcError):
            stub.Info(drafter_pb2.InfoRequest(), timeout=2)
        in_flight.join(20)  # drafted, verified through the verifier, answered
        assert [r.WhichOneof("event") for r in replies] == ["drafted", "response"]
        answer = replies[-1].response
        assert list(answer.results[0].verified.committed)[0] == first.first_token
        assert process.wait(15) == 0


def test_a_burst_of_signals_still_stops_a_service(tiny_model_dir) -> None:
    """Signals that land while the main loop waits must not wedge it (a handler that set a
    threading.Event could deadlock on the Event's own lock and ignore every later SIGTERM).
    A signal that lands after the drain, while Python shuts down, ends the process by
    SIGTERM's default action: that is a stop too; hanging is the failure."""
    with launch(tiny_model_dir, "ngram") as deployment:
        processes = [deployment.children[name].process for name in ("verifier", "drafter")]
        for _ in range(50):
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            time.sleep(0.001)
        codes = [p.wait(30) for p in processes]  # TimeoutExpired: a wedged service
        assert set(codes) <= {0, -signal.SIGTERM}, codes


def test_services_die_with_a_crashed_launcher(tiny_model_dir, tmp_path) -> None:
    script = (
        "import os, sys\n"
        "from services.launch import launch\n"
        "d = launch(sys.argv[1], 'ngram', log_dir=sys.argv[2])\n"
        "print(d.pid('verifier'), d.pid('drafter'), flush=True)\n"
        "os._exit(1)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_model_dir), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[2],
    )
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2, done.stderr
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.is_file() and status.read_text().split()[2] != "Z"  # zombies are gone
