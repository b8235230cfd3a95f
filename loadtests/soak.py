"""A bounded soak of the three-process deployment: concurrent greedy requests for a fixed
time, some cancelled at random points, every answer checked token for token against plain
greedy decoding, verifier slots counted after each wave, and the resident memory of the
verifier, drafter and gateway (this process) sampled throughout. Not run in CI.

    python -m loadtests.soak --minutes 15 [--concurrency 4] [--cancel 0.25] [--json out.json]

Memory growth is reported as the median RSS of the last quarter of the run over that of the
first quarter (after warm-up), per process; a leak grows it steadily, allocator noise does not.
Loopback only; the run stops at ``--minutes`` (each wave is bounded too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
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
from services.launch import launch
from services.pb import verifier_pb2

WAVE_SECONDS = 300.0  # one wave of concurrent requests can take no longer


async def collect(backend: RemoteBackend, prompt: list[int], max_tokens: int, stop_after=None):
    """One greedy request's tokens through the backend (in process), and the error the client
    saw; ``stop_after`` tokens, then the client walks away."""
    tokens, error = [], None
    stream = backend.generate(GenerationRequest("s", prompt, SamplingParams(max_tokens=max_tokens)))
    try:
        async for delta in stream:
            tokens += delta.token_ids
            if stop_after is not None and len(tokens) >= stop_after:
                await stream.aclose()
                break
    except Exception as err:  # counted: what the client saw
        error = type(err).__name__
    return tokens, error


def greedy_references(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Plain greedy answers on the weights the verifier loads, with its numerics (one thread):
    what every answer must equal."""
    torch.set_num_threads(1)
    model = load_model(model_dir, weights="auto")
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    generate(model, seqs)
    return [s.output_ids for s in seqs]


@dataclass(slots=True)
class SoakTally:
    waves: int = 0
    requests: int = 0
    exact: int = 0
    cancelled_prefix_intact: int = 0
    mismatched: int = 0
    client_errors: int = 0
    slots_leaked_max: int = 0  # verifier slots held after a wave (all requests done)
    rss_mb: dict[str, list[float]] = field(default_factory=dict)  # per process, one per wave

    def growth(self, name: str) -> float:
        """Median RSS of the last quarter over the first quarter (1.0: flat)."""
        samples = self.rss_mb[name]
        quarter = max(1, len(samples) // 4)
        return statistics.median(samples[-quarter:]) / statistics.median(samples[:quarter])


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


async def wave(
    backend: RemoteBackend,
    prompts: list[list[int]],
    expected: list[list[int]],
    concurrency: int,
    max_tokens: int,
    cancel: float,
    rng: random.Random,
    tally: SoakTally,
) -> None:
    picks = [rng.randrange(len(prompts)) for _ in range(concurrency)]
    stops = [rng.randint(1, max_tokens - 1) if rng.random() < cancel else None for _ in picks]
    pairs = zip(picks, stops, strict=True)
    jobs = [collect(backend, prompts[i], max_tokens, stop) for i, stop in pairs]
    results = await asyncio.wait_for(asyncio.gather(*jobs), WAVE_SECONDS)
    for (tokens, error), i, stop in zip(results, picks, stops, strict=True):
        tally.requests += 1
        tally.client_errors += error is not None
        if stop is None:
            ok = tokens == expected[i]
            tally.exact += ok
        else:
            ok = tokens == expected[i][: len(tokens)]
            tally.cancelled_prefix_intact += ok
        tally.mismatched += not ok


async def soak(args: argparse.Namespace) -> SoakTally:
    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir)
    texts = load_prompts()[: args.prompts]
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    # in a child process, so the model's memory never counts as the gateway's
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        expected = pool.submit(greedy_references, model_dir, prompts, args.max_tokens).result()
    rng, tally = random.Random(args.seed), SoakTally()
    with launch(model_dir, args.method) as deployment:
        pids = {"verifier": deployment.pid("verifier"), "drafter": deployment.pid("drafter")}
        pids["gateway"] = psutil.Process().pid
        config = RemoteConfig(
            deployment.verifier_addr, deployment.drafter_addr, max_running=args.concurrency
        )
        backend = RemoteBackend(config, frozenset(), lambda ids: "")
        await backend.start()
        try:
            end = time.monotonic() + 60.0 * args.minutes
            while time.monotonic() < end:
                await wave(
                    backend,
                    prompts,
                    expected,
                    args.concurrency,
                    args.max_tokens,
                    args.cancel,
                    rng,
                    tally,
                )
                await asyncio.sleep(0.2)  # releases of cancelled requests are in flight
                capacity = await backend.on_services(
                    lambda e: e.verifier.Capacity(verifier_pb2.CapacityRequest(), timeout=10)
                )
                held = capacity.total_slots - capacity.free_slots
                tally.slots_leaked_max = max(tally.slots_leaked_max, held)
                tally.waves += 1
                for name, pid in pids.items():
                    tally.rss_mb.setdefault(name, []).append(rss_mb(pid))
                if tally.waves % 10 == 0:
                    rss = ", ".join(f"{n} {v[-1]:.0f} MB" for n, v in tally.rss_mb.items())
                    print(
                        f"  wave {tally.waves}: {tally.requests} requests, "
                        f"{tally.mismatched} mismatched, {tally.client_errors} errors; {rss}",
                        flush=True,
                    )
        finally:
            await backend.stop()
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--method", default="lyanna")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts cycled through")
    parser.add_argument("--cancel", type=float, default=0.25, help="share of requests cancelled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the tally here")
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60 or not 1 <= args.concurrency <= 64:
        parser.error("--minutes must be in (0, 1440] and --concurrency in [1, 64]")
    if not 2 <= args.max_tokens <= 1024 or not 0 <= args.cancel <= 1:
        parser.error("--max-tokens must be in [2, 1024] and --cancel in [0, 1]")
    tally = asyncio.run(soak(args))
    print(f"\n{args.method}, {args.minutes:g} min, concurrency {args.concurrency}\n")
    print(
        "| waves | requests | exact | cancelled, prefix intact | mismatched | client errors "
        "| max slots held after a wave | RSS growth verifier / drafter / gateway |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    growth = " / ".join(f"{tally.growth(n):.3f}" for n in ("verifier", "drafter", "gateway"))
    print(
        f"| {tally.waves} | {tally.requests} | {tally.exact} | {tally.cancelled_prefix_intact} "
        f"| {tally.mismatched} | {tally.client_errors} | {tally.slots_leaked_max} | {growth} |"
    )
    if args.json:
        args.json.write_text(json.dumps(asdict(tally), indent=1))
    return 0 if tally.mismatched == tally.client_errors == tally.slots_leaked_max == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
