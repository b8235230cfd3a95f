"""A throwaway local Prometheus (Debian's ``prometheus`` binary) scraping given targets every
second: what the Prometheus tests and ``bench.dashboard_snapshot`` run against."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")

SCRAPE_CONFIG = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: lyanna
    scrape_interval: 1s
    static_configs:
      - targets: [{targets}]
"""


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_prometheus(
    binary: str, targets: list[str], workdir: Path, rule_files: tuple[Path, ...] = ()
) -> tuple[str, subprocess.Popen]:
    """Start scraping ``targets`` (host:port), evaluating ``rule_files`` (recording rules and
    alerts); returns its base URL and the process."""
    config = workdir / "prometheus.yml"
    text = SCRAPE_CONFIG.format(targets=", ".join(f'"{t}"' for t in targets))
    if rule_files:
        text += "rule_files:\n" + "".join(f'  - "{path}"\n' for path in rule_files)
    config.write_text(text)
    port = _free_port()
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return f"http://127.0.0.1:{port}", process


def ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/-/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def query(base: str, promql: str) -> list[dict]:
    """An instant query's result vector."""
    response = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5)
    response.raise_for_status()
    return response.json()["data"]["result"]


def query_range(base: str, promql: str, start: float, end: float, step: float) -> list[dict]:
    """A range query's result matrix (each series' ``values``: [timestamp, "value"] pairs)."""
    params = {"query": promql, "start": start, "end": end, "step": step}
    response = httpx.get(f"{base}/api/v1/query_range", params=params, timeout=10)
    response.raise_for_status()
    return response.json()["data"]["result"]


def poll(fn: Callable[[], T], timeout: float = 90.0) -> T:
    """``fn()`` until it returns something truthy (AssertionError after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = fn()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError("timed out")
