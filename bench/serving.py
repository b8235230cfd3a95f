"""Serving benchmark: the same chat load against each deployment of the default model, at
several concurrencies, through real HTTP (``loadtests.load``; official ``openai`` client).

    python -m bench.serving [--deployments embedded services services-pipeline services-sync]
                            [--concurrency 1 4 16] [--requests 16] [--max-tokens 64]
                            [--serve-flags '--threads 2']

Deployments (each a fresh ``lyanna serve`` process tree, stopped after its runs):
``embedded`` (one process), ``services`` (verifier + drafter gRPC services + gateway, as
``lyanna serve --mode services`` runs them: one lane on the CPU, see
``remote_engine.config.use_pipeline``), ``services-pipeline`` (the asynchronous two-lane
pipeline), ``services-sync`` (one lane: draft, then verify). Prints one
markdown table: output tokens/s, TTFT and TPOT p50/p99, mean acceptance length; then, from
the gateway's own histograms, the mean draft and verify time per step of each run (in the
split deployments a round trip: set against embedded's, the RPC overhead per step).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.server import free_port
from loadtests.load import HEADER, load_prompts, run_load

DEPLOYMENTS = {
    "embedded": ("--mode", "embedded"),
    "services": ("--mode", "services"),
    "services-pipeline": ("--mode", "services", "--pipeline"),
    "services-sync": ("--mode", "services", "--no-pipeline"),
}


def start(flags: tuple[str, ...], port: int, extra: list[str], log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), *flags, *extra]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(1)
    process.kill()
    raise RuntimeError(f"the server did not become healthy; see {log}")


STEP_HISTOGRAMS = ("lyanna_spec_draft_latency_seconds", "lyanna_spec_verify_latency_seconds")


def step_sums(port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of the gateway's draft and verify latency histograms, over all methods."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    sums = {name: [0.0, 0.0] for name in STEP_HISTOGRAMS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name in STEP_HISTOGRAMS:
                if sample.name in (f"{name}_sum", f"{name}_count"):
                    sums[name][sample.name.endswith("_count")] += sample.value
    return {name: (total, count) for name, (total, count) in sums.items()}


def step_row(label: str, concurrency: int, before: dict, after: dict) -> str:
    """Mean ms per step (each request's step counted once) between two scrapes."""
    means = []
    for name in STEP_HISTOGRAMS:
        total = after[name][0] - before[name][0]
        count = after[name][1] - before[name][1]
        means.append(f"{1e3 * total / count:.2f}" if count else "-")
    return f"| {label} | {concurrency} | {means[0]} | {means[1]} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--deployments",
        nargs="+",
        choices=sorted(DEPLOYMENTS),
        default=["embedded", "services", "services-pipeline"],
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--method", default="lyanna")
    parser.add_argument("--model", help="HF directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument(
        "--serve-flags", default="", help="more `lyanna serve` flags, e.g. '--threads 2'"
    )
    args = parser.parse_args(argv)
    extra = ["--method", args.method, "--max-running", str(max(args.concurrency))]
    extra += shlex.split(args.serve_flags)
    if args.model:
        extra += ["--model", args.model]
    prompts = load_prompts()
    logs = Path(tempfile.mkdtemp(prefix="lyanna-bench-serving-"))
    print(f"method {args.method}, max_tokens {args.max_tokens}, temperature 0; logs in {logs}")
    print(HEADER)
    steps = []
    for name in args.deployments:
        port = free_port()
        process = start(DEPLOYMENTS[name], port, extra, logs / f"{name}.log")
        try:
            for concurrency in args.concurrency:
                before = step_sums(port)
                report = asyncio.run(
                    run_load(
                        f"http://127.0.0.1:{port}/v1",
                        concurrency,
                        max(args.requests, concurrency),
                        args.max_tokens,
                        prompts=prompts,
                    )
                )
                print(report.row(name), flush=True)
                steps.append(step_row(name, concurrency, before, step_sums(port)))
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=120)
    print("\n| deployment | concurrency | draft ms / step | verify ms / step |\n|---|---|---|---|")
    print("\n".join(steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
