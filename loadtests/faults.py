"""Scripted fault runs against a real three-process deployment: each fault is injected at a
random point of a batch of greedy requests, many times over, and every answer is compared
token for token with plain greedy decoding on the same weights (lost, duplicated or changed
tokens all show as a mismatch). Results feed ``docs/reliability.md``.

    python -m loadtests.faults [--reps 20] [--method lyanna] [--max-tokens 48]

Faults: ``drafter-kill`` (SIGKILL the drafter mid-generation, restart it before the next
rep), ``verifier-restart`` (SIGKILL the verifier and start it again on its port),
``verifier-pause`` (SIGSTOP the verifier for 4 s with 2 s call deadlines: a stalled node whose
calls time out while it still holds, and may still change, their sequences),
``drafter-restart`` (stale state: SIGKILL the drafter and start a new one on its port at
once, so the gateway's next Step names sequences the new drafter never saw and must start
them again from its history), ``drafter-late`` (every draft misses a 1 ms deadline:
target-only steps), and
``client-disconnect`` (one client walks away mid-stream: its slot must come back, the other
answers stay exact). Loopback only; every rep is bounded in tokens and time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from gateway.backend import GenerationRequest
from gateway.remote import RemoteBackend, RemoteConfig
from loadtests.load import load_prompts
from lyanna.decode import generate
from lyanna.model.default import fetch_default_model
from lyanna.model.loader import load_model
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.tokenizer import chat_prompt_ids, load_tokenizer
from services.launch import Deployment, launch
from services.pb import verifier_pb2

FAULTS = (
    "drafter-kill",
    "drafter-restart",
    "verifier-restart",
    "verifier-pause",
    "drafter-late",
    "client-disconnect",
)
REP_SECONDS = 300.0
PAUSE_SECONDS = 4.0  # verifier-pause: the stall (the calls' deadlines are half of it)


@dataclass(slots=True)
class Tally:
    reps: int = 0
    requests: int = 0
    exact: int = 0  # answers equal to plain greedy (complete ones)
    cut_prefix: int = 0  # disconnected clients whose partial answer is a prefix of it
    mismatched: int = 0  # lost, duplicated or changed tokens
    client_errors: int = 0  # requests that ended in an error the client saw
    slots_leaked: int = 0  # verifier slots still held after the rep


async def collect(backend: RemoteBackend, prompt: list[int], max_tokens: int, stop_after=None):
    tokens, error = [], None
    stream = backend.generate(GenerationRequest("f", prompt, SamplingParams(max_tokens=max_tokens)))
    try:
        async for delta in stream:
            tokens += delta.token_ids
            if stop_after is not None and len(tokens) >= stop_after:
                await stream.aclose()  # the client walks away
                break
    except Exception as err:  # counted: what the client saw
        error = type(err).__name__
    return tokens, error


def greedy_references(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Plain greedy answers on the weights the verifier loads, with its numerics (one thread):
    what every answer of a run must equal."""
    torch.set_num_threads(1)
    model = load_model(model_dir, weights="auto")
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    generate(model, seqs)
    return [s.output_ids for s in seqs]


def pause(pid: int, seconds: float) -> None:
    """A stalled verifier (SIGSTOP, then SIGCONT): calls in flight pass their deadline, the
    verifier may still hold their slots and finish their work after it resumes."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


async def one_rep(
    deployment: Deployment,
    fault: str,
    prompts: list[list[int]],
    expected: list[list[int]],
    max_tokens: int,
    rng: random.Random,
    tally: Tally,
) -> None:
    config = RemoteConfig(
        deployment.verifier_addr,
        deployment.drafter_addr,
        draft_deadline=0.001 if fault == "drafter-late" else 10.0,
        verify_deadline=PAUSE_SECONDS / 2 if fault == "verifier-pause" else 60.0,
        control_deadline=PAUSE_SECONDS / 2 if fault == "verifier-pause" else 10.0,
        drafter_retry_seconds=0.2,
        queue_timeout=120.0,
    )
    backend = RemoteBackend(config, frozenset(), lambda ids: "")
    await backend.start()
    at = rng.randint(2, 3 * max_tokens // 4)  # verified steps before the fault
    stop_after = rng.randint(1, max_tokens - 1) if fault == "client-disconnect" else None

    async def inject() -> None:
        actions: dict[str, Callable[[], None]] = {
            "drafter-kill": lambda: deployment.kill("drafter"),
            "drafter-restart": lambda: deployment.restart("drafter"),
            "verifier-restart": lambda: deployment.restart("verifier"),
            "verifier-pause": lambda: pause(deployment.pid("verifier"), PAUSE_SECONDS),
        }
        if fault not in actions:
            return
        while backend.num_verified_steps < at and not done.is_set():
            await asyncio.sleep(0.002)
        await asyncio.to_thread(actions[fault])

    done = asyncio.Event()

    async def requests() -> list[tuple[list[int], str | None]]:
        jobs: list[Awaitable] = [
            collect(backend, p, max_tokens, stop_after if i == 0 else None)
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*jobs)
        done.set()
        return results

    results, _ = await asyncio.wait_for(asyncio.gather(requests(), inject()), REP_SECONDS)
    await asyncio.sleep(0.2)  # releases of the walked-away client are in flight
    capacity = await backend._verifier.Capacity(verifier_pb2.CapacityRequest(), timeout=10)
    await backend.stop()
    tally.reps += 1
    tally.slots_leaked += capacity.total_slots - capacity.free_slots
    for i, ((tokens, error), reference) in enumerate(zip(results, expected, strict=True)):
        tally.requests += 1
        tally.client_errors += error is not None
        if fault == "client-disconnect" and i == 0:
            ok = tokens == reference[: len(tokens)]
            tally.cut_prefix += ok
        else:
            ok = tokens == reference
            tally.exact += ok
        tally.mismatched += not ok
    if fault == "drafter-kill":
        await asyncio.to_thread(deployment.restart, "drafter")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--method", default="lyanna")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, default=3, help="concurrent requests per rep")
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir)
    texts = load_prompts()[: args.requests]
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    expected = greedy_references(model_dir, prompts, args.max_tokens)
    rng = random.Random(args.seed)
    rows = []
    with launch(model_dir, args.method) as deployment:
        for fault in args.faults.split(","):
            tally, start = Tally(), time.perf_counter()
            for _ in range(args.reps):
                asyncio.run(
                    one_rep(deployment, fault, prompts, expected, args.max_tokens, rng, tally)
                )
            rows.append((fault, tally, time.perf_counter() - start))
            print(f"  {fault}: {tally}", flush=True)
    print(f"\n{args.method}, {args.requests} greedy requests of {args.max_tokens} tokens per rep\n")
    print(
        "| fault | reps | requests | exact | disconnected, prefix intact | mismatched "
        "| client errors | slots leaked | seconds |\n|---|---|---|---|---|---|---|---|---|"
    )
    for fault, t, seconds in rows:
        print(
            f"| {fault} | {t.reps} | {t.requests} | {t.exact} | {t.cut_prefix} | {t.mismatched} "
            f"| {t.client_errors} | {t.slots_leaked} | {seconds:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
