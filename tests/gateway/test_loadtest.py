"""The load script (loadtests.load, used by bench.serving) against a live gateway: every
request completes and the report is consistent."""

from __future__ import annotations

import asyncio

from loadtests.load import HEADER, load_prompts, run_load


def test_run_load_reports_every_request(gateway) -> None:
    report = asyncio.run(run_load(gateway.url + "/v1", concurrency=3, num_requests=5, max_tokens=8))
    assert report.num_requests == 5 and report.output_tokens == 5 * 8
    assert report.tokens_per_second > 0 and 0 < report.ttft_p50 <= report.ttft_p99
    assert 0 < report.tpot_p50 <= report.tpot_p99
    assert report.acceptance_length >= 1.0
    assert report.row("tiny").count("|") == HEADER.splitlines()[0].count("|")
    assert len(load_prompts()) >= 16
