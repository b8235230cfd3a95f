"""A serving benchmark in the conventions of vLLM's ``benchmark_serving`` and sglang's
``bench_serving``, on the official ``openai`` client against a running gateway: requests
arrive at a fixed ``--request-rate`` (Poisson) or a fixed ``--concurrency``; each streams a
chat completion; the report gives request and output-token throughput, TTFT, TPOT, ITL and
E2E (mean, median, p99), goodput under an SLO, failures (counted, never fatal) and the mean
acceptance length, both from the responses' ``usage.lyanna`` and from ``/metrics`` deltas.

    python -m loadtests.load --url http://127.0.0.1:8000/v1 --concurrency 1 4 16
    python -m loadtests.load --request-rate 0.5 1 2 inf --dataset spec-bench --json out.json \
        --plot load.png

TTFT = time to the first content chunk; TPOT = (end - first chunk) / (output tokens - 1) per
request; ITL = time between consecutive content chunks; goodput = completed requests per
second whose TTFT and TPOT meet ``--slo-ttft-ms`` / ``--slo-tpot-ms``. Every run is bounded
in requests and in time (``--time-limit``: requests still running then count as failed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from openai import AsyncOpenAI

SCENARIO = Path(__file__).with_name("scenarios") / "chat.jsonl"
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "eval" / "spec_bench.jsonl"
MAX_REQUESTS = 10_000


@dataclass(frozen=True, slots=True)
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    tpot: float | None = None
    itls: tuple[float, ...] = ()
    num_verifications: int = 0
    num_accepted: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Latency:
    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Latency:
        if not values:
            return cls(0.0, 0.0, 0.0)
        return cls(statistics.fmean(values), statistics.median(values), percentile(values, 99))


@dataclass(frozen=True, slots=True)
class RunReport:
    concurrency: int | None  # None: arrivals at request_rate
    request_rate: float | None  # requests/s (inf: all at once); None: fixed concurrency
    num_requests: int
    completed: int
    failed: int
    seconds: float
    output_tokens: int
    ttft: Latency
    tpot: Latency
    itl: Latency
    e2e: Latency
    goodput: float  # completed requests/s meeting the SLO
    acceptance_length: float  # from the responses' usage
    metrics_acceptance_length: float | None  # from the gateway's /metrics deltas
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def request_throughput(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0

    @property
    def load(self) -> str:
        return (
            f"{self.request_rate:g} req/s"
            if self.request_rate is not None
            else str(self.concurrency)
        )

    def row(self, label: str = "") -> str:
        ms = 1e3
        return (
            f"| {label} | {self.load} | {self.completed}/{self.num_requests} | "
            f"{self.request_throughput:.2f} | {self.tokens_per_second:.1f} | "
            f"{self.ttft.median * ms:.0f} / {self.ttft.p99 * ms:.0f} | "
            f"{self.tpot.median * ms:.0f} / {self.tpot.p99 * ms:.0f} | "
            f"{self.itl.median * ms:.0f} / {self.itl.p99 * ms:.0f} | "
            f"{self.e2e.median * ms:.0f} / {self.e2e.p99 * ms:.0f} | "
            f"{self.goodput:.2f} | {self.acceptance_length:.2f} |"
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            tokens_per_second=self.tokens_per_second, request_throughput=self.request_throughput
        )
        return out


HEADER = (
    "| deployment | load | completed | req/s | output tokens/s | TTFT p50 / p99 ms "
    "| TPOT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms | goodput req/s "
    "| acceptance length |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def load_prompts(path: Path | str = SCENARIO) -> list[str]:
    """Prompts of a JSONL file (``prompt``, or Spec-Bench's first ``turns``), or ``spec-bench``."""
    path = SPEC_BENCH if str(path) == "spec-bench" else Path(path)
    prompts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(row["prompt"] if "prompt" in row else row["turns"][0])
    return prompts


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


async def one_request(
    client: AsyncOpenAI,
    model: str,
    prompt: str,
    max_tokens: int,
    method: str | None,
    temperature: float = 0.0,
) -> RequestResult:
    start = time.perf_counter()
    chunks: list[float] = []
    usage = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"lyanna_method": method} if method else None,
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                chunks.append(time.perf_counter())
    except Exception as error:  # counted, never fatal: the run goes on
        return RequestResult(ok=False, error=type(error).__name__)
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else 0
    spec = (usage.model_extra or {}).get("lyanna", {}) if usage is not None else {}
    first = chunks[0] if chunks else end
    return RequestResult(
        ok=True,
        output_tokens=tokens,
        ttft=first - start,
        e2e=end - start,
        tpot=(end - first) / (tokens - 1) if tokens > 1 else None,
        itls=tuple(b - a for a, b in zip(chunks, chunks[1:], strict=False)),
        num_verifications=spec.get("num_verifications", 0),
        num_accepted=spec.get("num_accepted_tokens", 0),
    )


async def spec_counters(client: httpx.AsyncClient, metrics_url: str) -> tuple[float, float] | None:
    """(accepted tokens, verifications) summed over every series of the gateway's /metrics:
    verifications are drafts plus root-only steps, as the responses' usage counts them."""
    try:
        text = (await client.get(metrics_url, timeout=10)).text
    except httpx.HTTPError:
        return None
    steps = ("lyanna_spec_draft_steps_total", "lyanna_spec_root_only_steps_total")
    totals = dict.fromkeys(("lyanna_spec_accepted_tokens_total", *steps), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["lyanna_spec_accepted_tokens_total"], sum(totals[name] for name in steps)


async def run_load(
    url: str,
    concurrency: int | None = 4,
    num_requests: int = 16,
    max_tokens: int = 64,
    method: str | None = None,
    api_key: str = "none",
    prompts: list[str] | None = None,
    *,
    request_rate: float | None = None,
    temperature: float = 0.0,
    slo_ttft: float = 1.0,
    slo_tpot: float = 0.1,
    time_limit: float = 600.0,
    seed: int = 0,
) -> RunReport:
    """One run: ``num_requests`` requests at ``request_rate`` (Poisson arrivals; inf = all at
    once) or, when it is None, ``concurrency`` at a time."""
    if not 1 <= num_requests <= MAX_REQUESTS:
        raise ValueError(f"num_requests must be in [1, {MAX_REQUESTS}]")
    if request_rate is None and not (concurrency and concurrency >= 1):
        raise ValueError("give a concurrency >= 1 or a request rate")
    prompts = prompts or load_prompts()
    rng = random.Random(seed)
    metrics_url = url.rstrip("/").removesuffix("/v1") + "/metrics"
    headers = {"Authorization": f"Bearer {api_key}"}
    async with (
        AsyncOpenAI(
            base_url=url, api_key=api_key, max_retries=0, timeout=max(time_limit, 30.0)
        ) as client,
        httpx.AsyncClient(headers=headers) as http,
    ):
        model = (await client.models.list()).data[0].id
        before = await spec_counters(http, metrics_url)
        chosen = [prompts[i % len(prompts)] for i in range(num_requests)]

        async def request(prompt: str) -> RequestResult:
            return await one_request(client, model, prompt, max_tokens, method, temperature)

        start = time.perf_counter()
        if request_rate is None:
            queue = list(reversed(chosen))

            async def worker() -> list[RequestResult]:
                done = []
                while queue:
                    done.append(await request(queue.pop()))
                return done

            tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        else:

            async def arrival(delay: float, prompt: str) -> list[RequestResult]:
                await asyncio.sleep(delay)
                return [await request(prompt)]

            at, tasks = 0.0, []
            for prompt in chosen:
                tasks.append(asyncio.ensure_future(arrival(at, prompt)))
                at += rng.expovariate(request_rate) if math.isfinite(request_rate) else 0.0
        finished, late = await asyncio.wait(tasks, timeout=time_limit)
        for task in late:
            task.cancel()
        seconds = time.perf_counter() - start
        after = await spec_counters(http, metrics_url)
    results = [r for task in finished for r in task.result()]
    results += [RequestResult(ok=False, error="time_limit")] * (num_requests - len(results))
    return summarize(results, seconds, concurrency, request_rate, slo_ttft, slo_tpot, before, after)


def summarize(
    results: list[RequestResult],
    seconds: float,
    concurrency: int | None,
    request_rate: float | None,
    slo_ttft: float,
    slo_tpot: float,
    before: tuple[float, float] | None,
    after: tuple[float, float] | None,
) -> RunReport:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    verifications = sum(r.num_verifications for r in ok)
    accepted = sum(r.num_accepted for r in ok)
    from_metrics = None
    if before is not None and after is not None and after[1] > before[1]:
        from_metrics = 1 + (after[0] - before[0]) / (after[1] - before[1])
    return RunReport(
        concurrency=None if request_rate is not None else concurrency,
        request_rate=request_rate,
        num_requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        seconds=seconds,
        output_tokens=sum(r.output_tokens for r in ok),
        ttft=Latency.of([r.ttft for r in ok]),
        tpot=Latency.of([r.tpot for r in ok if r.tpot is not None]),
        itl=Latency.of([x for r in ok for x in r.itls]),
        e2e=Latency.of([r.e2e for r in ok]),
        goodput=len(good) / seconds if seconds else 0.0,
        acceptance_length=1 + accepted / verifications if verifications else 1.0,
        metrics_acceptance_length=from_metrics,
        errors=errors,
    )


def plot(reports: list[RunReport], path: Path, label: str) -> None:
    """Output tokens/s and p99 latencies against the offered load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [r.request_rate if r.request_rate is not None else r.concurrency for r in reports]
    finite = [x for x in loads if x is not None and math.isfinite(x)]
    xs = [x if x in finite else 2 * max(finite or [1.0]) for x in loads]  # inf: drawn at 2x
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(xs, [r.tokens_per_second for r in reports], marker="o", label=label or "run")
    left.set(xlabel="load (req/s or concurrency)", ylabel="output tokens/s", title="throughput")
    for name in ("ttft", "tpot", "e2e"):
        right.plot(xs, [getattr(r, name).p99 * 1e3 for r in reports], marker="o", label=name)
    right.set(xlabel="load (req/s or concurrency)", ylabel="p99 ms", title="p99 latency")
    right.legend()
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    loads = parser.add_mutually_exclusive_group()
    loads.add_argument("--concurrency", type=int, nargs="+", help="default: 1 4 16")
    loads.add_argument("--request-rate", type=float, nargs="+", help="req/s (Poisson); inf")
    parser.add_argument("--requests", type=int, default=16, help="requests per load level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--method", help="speculative method (default: the server's)")
    parser.add_argument(
        "--dataset", default=str(SCENARIO), help="JSONL ('prompt' or 'turns'), or spec-bench"
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per level")
    parser.add_argument("--seed", type=int, default=0, help="arrival times")
    parser.add_argument("--label", default="", help="deployment name for the table")
    parser.add_argument("--json", type=Path, help="write every report here")
    parser.add_argument("--plot", type=Path, help="PNG of throughput and p99 vs load")
    args = parser.parse_args(argv)
    prompts = load_prompts(args.dataset)
    levels: list[tuple[int | None, float | None]] = (
        [(None, rate) for rate in args.request_rate]
        if args.request_rate
        else [(c, None) for c in (args.concurrency or [1, 4, 16])]
    )
    print(HEADER)
    reports = []
    for concurrency, rate in levels:
        report = asyncio.run(
            run_load(
                args.url,
                concurrency,
                max(args.requests, concurrency or 1),
                args.max_tokens,
                args.method,
                args.api_key,
                prompts,
                request_rate=rate,
                temperature=args.temperature,
                slo_ttft=args.slo_ttft_ms / 1e3,
                slo_tpot=args.slo_tpot_ms / 1e3,
                time_limit=args.time_limit,
                seed=args.seed,
            )
        )
        reports.append(report)
        print(report.row(args.label), flush=True)
        if report.errors:
            print(f"  failures: {report.errors}", flush=True)
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r in reports], indent=2))
    if args.plot:
        plot(reports, args.plot, args.label)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
