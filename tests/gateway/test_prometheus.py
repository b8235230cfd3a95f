"""A real Prometheus server scrapes the gateway and answers a PromQL query for
``lyanna_spec_accepted_tokens_total``; every query of the Grafana dashboard parses and, after
a request, the acceptance-length and tokens/s panels have data. Needs the ``prometheus``
binary (Debian's package; ``.ci/run`` installs it): missing, the test fails, unless
LYANNA_ALLOW_NO_PROMETHEUS=1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import httpx
import pytest

from gateway.server import free_port
from tests.gateway.conftest import MODEL_NAME
from tests.gateway.test_deploy import DEPLOY

pytestmark = pytest.mark.slow

SCRAPE_CONFIG = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: lyanna
    scrape_interval: 1s
    static_configs:
      - targets: ["{target}"]
"""


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("LYANNA_ALLOW_NO_PROMETHEUS") == "1":
            pytest.skip("prometheus is not installed (LYANNA_ALLOW_NO_PROMETHEUS=1)")
        pytest.fail("prometheus is not on PATH: apt-get install -y prometheus (see .ci/run)")
    return binary


def query(base: str, promql: str) -> list[dict]:
    response = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5)
    response.raise_for_status()
    return response.json()["data"]["result"]


def poll(fn, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = fn()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError("timed out")


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
    config = tmp_path / "prometheus.yml"
    config.write_text(SCRAPE_CONFIG.format(target=target))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        poll(lambda: _ready(base))
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
        # a second request between scrapes gives rate() two distinct samples to work with
        httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
        check_dashboard_queries(base)
    finally:
        process.terminate()
        process.wait(timeout=30)


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/-/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def check_dashboard_queries(base: str) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "lyanna.json").read_text())
    substitutions = {"$__rate_interval": "1m", "$model": ".*", "$method": ".*", "$service": ".*"}
    exprs: dict[str, str] = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in substitutions.items():
                expr = expr.replace(variable, value)
            response = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=5)
            assert response.status_code == 200, (panel["title"], response.text)
            exprs.setdefault(panel["title"], expr)

    def value_of(title: str) -> float | None:
        result = query(base, exprs[title])
        value = float(result[0]["value"][1]) if result else float("nan")
        return value if value == value and value > 0 else None  # NaN until rate() has data

    assert poll(lambda: value_of("Acceptance length")) > 1.0  # n-gram accepted tokens
    assert poll(lambda: value_of("Output tokens/s")) > 0
