"""The load harness (loadtests.load, used by bench.serving) against a live gateway: every
request is accounted for at a fixed concurrency and at Poisson arrivals, the acceptance length
from /metrics deltas equals the one the responses report, failures and the time limit are
counted without aborting the run, and the CLI writes JSON and a plot."""

from __future__ import annotations

import asyncio
import json

import pytest

from loadtests.load import HEADER, load_prompts, main, run_load


def test_fixed_concurrency_reports_every_request(gateway) -> None:
    report = asyncio.run(run_load(gateway.url + "/v1", concurrency=3, num_requests=5, max_tokens=8))
    assert report.completed == report.num_requests == 5 and report.failed == 0
    assert report.output_tokens == 5 * 8 and report.tokens_per_second > 0
    assert 0 < report.ttft.median <= report.ttft.p99 <= report.e2e.p99
    assert 0 < report.tpot.median <= report.tpot.p99 and report.itl.p99 > 0
    assert report.acceptance_length >= 1.0
    assert report.metrics_acceptance_length == pytest.approx(report.acceptance_length, rel=0.02)
    assert 0 < report.goodput <= report.request_throughput
    assert report.row("tiny").count("|") == HEADER.splitlines()[0].count("|")
    assert len(load_prompts()) >= 16 and len(load_prompts("spec-bench")) == 480


def test_poisson_arrivals_complete(gateway) -> None:
    report = asyncio.run(
        run_load(gateway.url + "/v1", None, num_requests=6, max_tokens=4, request_rate=40.0)
    )
    assert report.concurrency is None and report.request_rate == 40.0
    assert report.completed == 6 and report.output_tokens == 6 * 4


def test_failures_and_the_time_limit_are_counted_not_fatal(gateway) -> None:
    refused = asyncio.run(run_load(gateway.url + "/v1", 2, num_requests=3, max_tokens=10**7))
    assert refused.completed == 0 and refused.errors == {"BadRequestError": 3}
    late = asyncio.run(
        run_load(gateway.url + "/v1", 1, num_requests=8, max_tokens=64, time_limit=0.05)
    )
    assert late.completed + late.failed == 8 and late.errors.get("time_limit", 0) >= 1


def test_cli_writes_json_and_a_plot(gateway, tmp_path) -> None:
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    argv = ["--url", gateway.url + "/v1", "--request-rate", "20", "inf", "--requests", "3"]
    assert main([*argv, "--max-tokens", "4", "--json", str(out), "--plot", str(png)]) == 0
    reports = json.loads(out.read_text())
    assert [r["request_rate"] for r in reports] == [20.0, float("inf")]
    assert all(r["completed"] == 3 for r in reports)
    assert png.stat().st_size > 1000


def test_fault_and_soak_runs_refuse_bad_arguments_before_starting_anything(capsys) -> None:
    """The scripted runs start three processes and load a model: a typo in a fault name or an
    unbounded soak must be refused first, with a message naming what is allowed."""
    from loadtests import faults, soak

    with pytest.raises(SystemExit) as exit_info:
        faults.main(["--faults", "drafter-kill,verifier-explode"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "verifier-explode" in err and "drafter-restart" in err
    for argv in (["--minutes", "0"], ["--minutes", "2000"], ["--cancel", "1.5"]):
        with pytest.raises(SystemExit) as exit_info:
            soak.main(argv)
        assert exit_info.value.code == 2, argv


def test_soak_growth_compares_the_last_quarter_with_the_first() -> None:
    from loadtests.soak import SoakTally

    tally = SoakTally(rss_mb={"flat": [100.0] * 8, "leak": [100.0 + 10 * i for i in range(8)]})
    assert tally.growth("flat") == 1.0
    assert tally.growth("leak") == pytest.approx(165.0 / 105.0)
