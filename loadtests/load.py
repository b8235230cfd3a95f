"""An async load generator on the official ``openai`` client: streams chat completions at a
fixed concurrency against a running gateway and reports output tokens/s, TTFT and TPOT
percentiles and the mean acceptance length (from the ``usage.lyanna`` extra).

    python -m loadtests.load --url http://127.0.0.1:8000/v1 --concurrency 1 4 16 --requests 16

TTFT = time to the first content chunk; TPOT = (end - first chunk) / (output tokens - 1) per
request; tokens/s = all output tokens / wall time of the run; acceptance length = 1 +
accepted / verifications over all requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from openai import AsyncOpenAI

SCENARIO = Path(__file__).with_name("scenarios") / "chat.jsonl"


@dataclass(frozen=True, slots=True)
class RequestResult:
    output_tokens: int
    ttft: float
    tpot: float | None
    num_verifications: int
    num_accepted: int


@dataclass(frozen=True, slots=True)
class RunReport:
    concurrency: int
    num_requests: int
    seconds: float
    output_tokens: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    acceptance_length: float

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def row(self, label: str = "") -> str:
        return (
            f"| {label} | {self.concurrency} | {self.num_requests} | "
            f"{self.tokens_per_second:.1f} | {self.ttft_p50 * 1e3:.0f} / {self.ttft_p99 * 1e3:.0f} "
            f"| {self.tpot_p50 * 1e3:.0f} / {self.tpot_p99 * 1e3:.0f} | "
            f"{self.acceptance_length:.2f} |"
        )


HEADER = (
    "| deployment | concurrency | requests | output tokens/s | TTFT p50 / p99 ms "
    "| TPOT p50 / p99 ms | acceptance length |\n|---|---|---|---|---|---|---|"
)


def load_prompts(path: Path = SCENARIO) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


async def one_request(
    client: AsyncOpenAI, model: str, prompt: str, max_tokens: int, method: str | None
) -> RequestResult:
    start = time.perf_counter()
    first: float | None = None
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"lyanna_method": method} if method else None,
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else 0
    spec = (usage.model_extra or {}).get("lyanna", {}) if usage is not None else {}
    first = first or end
    return RequestResult(
        output_tokens=tokens,
        ttft=first - start,
        tpot=(end - first) / (tokens - 1) if tokens > 1 else None,
        num_verifications=spec.get("num_verifications", 0),
        num_accepted=spec.get("num_accepted_tokens", 0),
    )


async def run_load(
    url: str,
    concurrency: int,
    num_requests: int,
    max_tokens: int = 64,
    method: str | None = None,
    api_key: str = "none",
    prompts: list[str] | None = None,
) -> RunReport:
    prompts = prompts or load_prompts()
    async with AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        queue: asyncio.Queue[str] = asyncio.Queue()
        for i in range(num_requests):
            queue.put_nowait(prompts[i % len(prompts)])
        results: list[RequestResult] = []

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                results.append(await one_request(client, model, prompt, max_tokens, method))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    ttfts = [r.ttft for r in results]
    tpots = [r.tpot for r in results if r.tpot is not None]
    verifications = sum(r.num_verifications for r in results)
    accepted = sum(r.num_accepted for r in results)
    return RunReport(
        concurrency=concurrency,
        num_requests=len(results),
        seconds=seconds,
        output_tokens=sum(r.output_tokens for r in results),
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        acceptance_length=1 + accepted / verifications if verifications else 1.0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--method", help="speculative method (default: the server's)")
    parser.add_argument("--prompts", type=Path, default=SCENARIO, help="JSONL with 'prompt'")
    parser.add_argument("--label", default="", help="deployment name for the table")
    args = parser.parse_args(argv)
    prompts = load_prompts(args.prompts)
    print(HEADER)
    for concurrency in args.concurrency:
        report = asyncio.run(
            run_load(
                args.url,
                concurrency,
                max(args.requests, concurrency),
                args.max_tokens,
                args.method,
                args.api_key,
                prompts,
            )
        )
        print(report.row(args.label), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
