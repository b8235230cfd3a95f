"""A real Prometheus server scrapes the embedded gateway and answers a PromQL query for
``lyanna_spec_accepted_tokens_total``; every query of the Grafana dashboard parses and, after
a request, the acceptance-length and tokens/s panels have data. A second test scrapes the
three processes of a split deployment (gateway, verifier, drafter) through a short load and a
drafter outage: every dashboard panel then shows data, and the acceptance length Prometheus
computes equals what the requests' ``usage`` reported (within 2 %). Needs the ``prometheus``
binary (Debian's package; ``.ci/run`` installs it): missing, the test fails, unless
LYANNA_ALLOW_NO_PROMETHEUS=1."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from deploy.grafana.dashboard import panel_queries
from deploy.prometheus import local, rules
from deploy.prometheus.local import poll, query, ready, start_prometheus
from gateway.server import free_port
from services.launch import launch
from tests.gateway.conftest import MODEL_NAME
from tests.gateway.test_services_deployment import DRAFTER_NGRAM

pytestmark = pytest.mark.slow


def prometheus_binary() -> str:
    binary = local.prometheus_binary()
    if binary is None:
        if os.environ.get("LYANNA_ALLOW_NO_PROMETHEUS") == "1":
            pytest.skip("prometheus is not installed (LYANNA_ALLOW_NO_PROMETHEUS=1)")
        pytest.fail("prometheus is not on PATH: apt-get install -y prometheus (see .ci/run)")
    return binary


def test_prometheus_scrapes_spec_metrics(gateway, tmp_path) -> None:
    binary = prometheus_binary()
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "one two three one two three"}],
        "max_tokens": 48,
        "temperature": 0,
    }
    response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.json()["usage"]["lyanna"]["num_accepted_tokens"] > 0
    target = gateway.url.removeprefix("http://")
    base, process = start_prometheus(binary, [target], tmp_path)
    try:
        poll(lambda: ready(base))
        up = poll(lambda: query(base, 'up{job="lyanna"} == 1'))
        assert up[0]["metric"]["instance"] == target
        series = poll(lambda: query(base, "lyanna_spec_accepted_tokens_total > 0"))
        labels = series[0]["metric"]
        assert labels["method"] == "ngram" and labels["model"] == MODEL_NAME
        assert labels["service"] == "embedded"
        assert (
            float(series[0]["value"][1])
            >= response.json()["usage"]["lyanna"]["num_accepted_tokens"]
        )
        # a request between scrapes that accepts draft tokens gives rate() two distinct
        # samples to work with; the n-gram drafter's calibration, updated by the first
        # request, may prune a later one's drafts to nothing (a fresh-clone CI run read no
        # accepted token in the window once), so this asks until one accepts (at most 5)
        for _ in range(5):
            again = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
            if again.json()["usage"]["lyanna"]["num_accepted_tokens"] > 0:
                break
        else:
            raise AssertionError("5 requests after the first accepted no draft token")
        check_panel_queries(base)
    finally:
        process.terminate()
        process.wait(timeout=30)


def check_panel_queries(base: str) -> None:
    exprs: dict[str, str] = {}
    for title, queries in panel_queries().items():
        for expr in queries:
            response = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=5)
            assert response.status_code == 200, (title, response.text)
        exprs[title] = queries[0]

    def value_above(title: str, floor: float) -> float | None:
        """The panel's value once it exceeds ``floor`` (NaN until rate() has two samples;
        a window whose two samples straddle no accepted token reads exactly 1.0)."""
        result = query(base, exprs[title])
        value = float(result[0]["value"][1]) if result else float("nan")
        return value if value == value and value > floor else None

    assert poll(lambda: value_above("Acceptance length", 1.0))  # n-gram accepted tokens
    assert poll(lambda: value_above("Output tokens/s", 0.0))


def test_every_panel_shows_the_three_processes(tiny_chat_dir, tmp_path) -> None:
    """Gateway, verifier and drafter as separate processes, each scraped; a short load (plain,
    streamed and concurrent requests), then the drafter killed and one more request (the
    fallback panels). Every panel returns data, and Prometheus's acceptance length (from the
    counters) matches the requests' own ``usage`` within 2 %."""
    binary = prometheus_binary()
    ports = {"verifier": free_port(), "drafter": free_port()}
    gateway = [sys.executable, "-m", "gateway.cli", "serve", "--mode", "services"]
    gateway += ["--verifier-addr", "{verifier_addr}", "--drafter-addr", "{drafter_addr}"]
    gateway += ["--port", "{gateway_port}", "--model", str(tiny_chat_dir), "--method", "{method}"]
    with launch(
        tiny_chat_dir,
        method="ngram",
        gateway_command=gateway,
        verifier_args=("--max-len", "512", "--metrics-port", str(ports["verifier"])),
        drafter_args=("--metrics-port", str(ports["drafter"]), *DRAFTER_NGRAM),
    ) as deployment:
        url = f"http://127.0.0.1:{deployment.gateway_port}"
        targets = [url.removeprefix("http://"), *(f"127.0.0.1:{p}" for p in ports.values())]
        base, process = start_prometheus(binary, targets, tmp_path, (rules.RULES,))
        try:
            poll(lambda: ready(base))
            poll(lambda: len(query(base, 'up{job="lyanna"} == 1')) == len(targets))
            usages = run_load(url)
            poll(lambda: scraped_steps(base) >= sum(u["num_verifications"] for u in usages))
            # every panel once: those of a dead drafter go stale after it is killed, the
            # fallback panels only fill after it
            panels = panel_queries(rate_interval="5m")
            empty = [t for t, queries in panels.items() if not any(query(base, q) for q in queries)]
            deployment.kill("drafter")
            usages += run_load(url, requests=1)
            accepted = sum(u["num_accepted_tokens"] for u in usages)
            steps = sum(u["num_verifications"] for u in usages)
            assert accepted > 0
            poll(lambda: scraped_steps(base) >= steps)
            # per verification (drafts + root-only steps) as the usage counts it; per draft
            # (vLLM's, the recording rule's) at least as high, over no more steps
            scraped_accepted = float(query(base, f"sum({NGRAM_ACCEPTED})")[0]["value"][1])
            drafts = float(query(base, f"sum({NGRAM_DRAFTS})")[0]["value"][1])
            assert 1 + scraped_accepted / scraped_steps(base) == pytest.approx(
                1 + accepted / steps, rel=0.02
            )
            assert 0 < drafts <= scraped_steps(base)
            assert 1 + scraped_accepted / drafts >= 1 + accepted / steps

            def still_empty() -> list[str]:
                return [t for t in empty if not any(query(base, q) for q in panels[t])]

            try:
                poll(lambda: not still_empty(), timeout=30)
            except AssertionError:
                pytest.fail(f"panels without data: {still_empty()}")
            check_recording_rules(base)
        finally:
            process.terminate()
            process.wait(timeout=30)


NGRAM_ACCEPTED = 'lyanna_spec_accepted_tokens_total{method="ngram"}'
NGRAM_DRAFTS = 'lyanna_spec_draft_steps_total{method="ngram"}'
NGRAM_ROOT_ONLY = 'lyanna_spec_root_only_steps_total{method="ngram"}'


def check_recording_rules(base: str) -> None:
    """The recording rules (deploy/prometheus/lyanna-rules.yaml) evaluated on the three
    processes' real series: each of those the load feeds has a value, with the labels the
    alerts join on; the acceptance length is the rule's over the same counters."""

    def recorded(name: str) -> list[dict]:
        return query(base, f'{name}{{method="ngram"}}') or query(base, name)

    for name in (
        "lyanna:acceptance_length:rate5m",
        "lyanna:draft_steps:rate5m",
        "lyanna:drafted_share:rate5m",
        "lyanna:acceptance_rate:rate5m",
        "lyanna:drafter_fallback_share:rate5m",
        "lyanna:time_to_first_token_seconds:p99_5m",
        "lyanna:rejected_share:rate5m",
    ):
        series = poll(lambda name=name: recorded(name), timeout=90)
        labels = series[0]["metric"]
        assert "model" in labels, (name, labels)
        if name != "lyanna:rejected_share:rate5m":
            assert labels["method"] == "ngram", (name, labels)
    share = float(recorded("lyanna:drafted_share:rate5m")[0]["value"][1])
    assert 0 < share <= 1
    tau = float(recorded("lyanna:acceptance_length:rate5m")[0]["value"][1])
    assert tau >= 1


def scraped_steps(base: str) -> float:
    """Verifications of the n-gram requests Prometheus has: drafts + root-only steps."""
    total = query(base, f"sum({NGRAM_DRAFTS}) + sum({NGRAM_ROOT_ONLY})")
    return float(total[0]["value"][1]) if total else 0.0


def run_load(url: str, requests: int = 4) -> list[dict]:
    """``requests`` chat requests, two at a time, one of each pair streamed; their usage."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "one two three one two three"}]

    def one(i: int) -> dict:
        if i % 2:
            stream = client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=32,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [c.usage for c in stream if c.usage is not None][-1]
        else:
            usage = client.chat.completions.create(
                model=model, messages=messages, max_tokens=32, temperature=0
            ).usage
        return usage.model_extra["lyanna"]

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(requests)))
