"""What an operator sees, as a picture: the split deployment (verifier, drafter, gateway as
three processes) on the default model serves a short load of chat requests while a real
Prometheus scrapes all three; the key panels of the Grafana dashboard, with the dashboard's
own queries, are then drawn from Prometheus's range queries into one PNG.

    python -m bench.dashboard_snapshot [--method lyanna] [--requests 16] [--concurrency 4]
        [--out docs/img/dashboard.png]

Needs the ``prometheus`` binary (``make prometheus``). Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import openai  # noqa: E402

from deploy.grafana.dashboard import panel_targets  # noqa: E402
from deploy.prometheus.local import (  # noqa: E402
    poll,
    prometheus_binary,
    query,
    query_range,
    ready,
    start_prometheus,
)
from services.launch import free_port, launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "loadtests" / "scenarios" / "chat.jsonl"
PANELS = (  # (dashboard panel, how its y axis reads)
    ("Acceptance length per method", "tokens per draft"),
    ("Tokens/s", "tokens/s"),
    ("Time to first token", "seconds"),
    ("Inter-token latency", "seconds"),
    ("Draft vs verify latency per step (p50)", "seconds"),
    ("Verifier KV slots", "slots"),
)


def run_load(url: str, requests: int, concurrency: int, max_tokens: int) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    prompts = [json.loads(line)["prompt"] for line in SCENARIO.read_text().splitlines()]

    def one(i: int) -> None:
        messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        )
        for _ in stream:
            pass

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))


def draw(base: str, start: float, end: float, out: Path, title: str) -> None:
    targets = panel_targets(rate_interval="15s")
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (panel, unit) in zip(axes.flat, PANELS, strict=True):
        for expr, legend in targets[panel]:
            for series in query_range(base, expr, start, end, step=1.0):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                points = [(t, v) for t, v in points if v == v]  # NaN: no data yet
                if not points:
                    continue
                label = legend or panel
                for key, value in series["metric"].items():
                    label = label.replace("{{" + key + "}}", value)
                ax.plot(*zip(*points, strict=True), label=label)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("seconds into the load")
        ax.set_ylabel(unit)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--method", default="lyanna")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    args = parser.parse_args()
    binary = prometheus_binary()
    if binary is None:
        sys.exit("prometheus is not on PATH: make prometheus")
    ports = {"verifier": free_port(), "drafter": free_port()}
    gateway = [sys.executable, "-m", "gateway.cli", "serve", "--mode", "services"]
    gateway += ["--verifier-addr", "{verifier_addr}", "--drafter-addr", "{drafter_addr}"]
    gateway += ["--port", "{gateway_port}", "--method", "{method}"]
    with (
        tempfile.TemporaryDirectory() as workdir,
        launch(
            "",
            method=args.method,
            gateway_command=gateway,
            verifier_args=("--metrics-port", str(ports["verifier"])),
            drafter_args=("--metrics-port", str(ports["drafter"])),
        ) as deployment,
    ):
        url = f"http://127.0.0.1:{deployment.gateway_port}"
        targets = [url.removeprefix("http://"), *(f"127.0.0.1:{p}" for p in ports.values())]
        base, process = start_prometheus(binary, targets, Path(workdir))
        try:
            poll(lambda: ready(base))
            poll(lambda: len(query(base, 'up{job="lyanna"} == 1')) == len(targets))
            start = time.time()
            run_load(url, args.requests, args.concurrency, args.max_tokens)
            time.sleep(3)  # the last scrapes
            title = (
                f"{args.requests} chat requests, {args.concurrency} at a time, "
                f"method {args.method}, default model, split deployment"
            )
            draw(base, start - 2, time.time(), args.out, title)
        finally:
            process.terminate()
            process.wait(timeout=30)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
