"""Generate the Grafana dashboard ``deploy/grafana/lyanna.json`` from the metric registries.

    python -m deploy.grafana.dashboard      # rewrite lyanna.json and its ConfigMap

``deploy/k8s/base/grafana-dashboard.yaml`` carries the same JSON in a ConfigMap labelled
``grafana_dashboard: "1"`` (the Grafana sidecar of kube-prometheus-stack loads it).

Every query names series of the one metric registry (``services.metric_registry``): the
generator refuses any other, and ``tests/gateway/test_deploy.py`` fails when the committed JSON
differs from what this script writes or names a metric no process exports. Gateway series
carry the ``model`` / ``method`` / ``service`` labels (dashboard variables); the verifier's and
drafter's carry only what Prometheus adds (``job``, ``instance``).

Acceptance panels leave out target-only decoding (method ``ar``) and read the draft counters,
which count drafts only (vLLM's meaning: root-only steps, drafter fallbacks among them, are
counted apart): they measure the drafter, and a drafter outage or a gate that keeps drafting
off shows on its own panels instead of dragging the acceptance length down. The acceptance
length, drafted share and fallback share are the definitions the recording rules use
(``deploy.prometheus.promql``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from deploy.grafana import configmap
from deploy.grafana.configmap import CONFIG_MAP
from deploy.prometheus import promql
from services.metric_registry import sample_names

OUTPUT = Path(__file__).resolve().parent / "lyanna.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GATEWAY = 'model=~"$model", method=~"$method", service=~"$service"'
SPECULATIVE = GATEWAY + ', method!="ar"'
RATE = "[$__rate_interval]"
DEPTHS = 6  # conditional acceptance plotted for depths 1..DEPTHS
QUANTILES = (0.5, 0.95, 0.99)


def rate(metric: str, labels: str = GATEWAY, by: str = "") -> str:
    grouping = f"sum by ({by}) " if by else "sum "
    return f"{grouping}(rate({metric}{{{labels}}}{RATE}))"


def quantile(q: float, metric: str, labels: str = GATEWAY, by: str = "") -> str:
    groups = "le" + (f", {by}" if by else "")
    return f"histogram_quantile({q}, {rate(metric + '_bucket', labels, groups)})"


def speculative(by: str = "") -> promql.Rate:
    """Summed rates of the speculative methods' series, grouped ``by``."""
    return lambda metric: rate(metric, SPECULATIVE, by)


def acceptance_length(by: str = "") -> str:
    """1 + accepted / drafts, as ``lyanna:acceptance_length:rate5m`` records it."""
    return promql.acceptance_length(speculative(by))


def accepted_at(position: int) -> str:
    labels = f'{SPECULATIVE}, position="{position}"'
    return rate("lyanna_spec_accepted_tokens_per_position_total", labels)


@dataclass
class Panel:
    kind: str  # stat | timeseries | heatmap
    title: str
    targets: list[tuple[str, str]]  # (expr, legend)
    unit: str = "none"
    description: str = ""
    width: int = 8
    height: int = 8
    extra: dict = field(default_factory=dict)

    def to_json(self, panel_id: int, x: int, y: int) -> dict:
        panel = {
            "type": self.kind,
            "title": self.title,
            "datasource": DATASOURCE,
            "gridPos": {"x": x, "y": y, "w": self.width, "h": self.height},
            "fieldConfig": {"defaults": {"unit": self.unit}, "overrides": []},
            "targets": [
                {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                for i, (expr, legend) in enumerate(self.targets)
            ],
            "id": panel_id,
        }
        if self.description:
            panel["description"] = self.description
        if self.kind == "timeseries":
            panel["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}}
        panel.update(self.extra)
        return panel


def latency_panel(title: str, metric: str, by: str = "method", labels: str = GATEWAY) -> Panel:
    targets = [
        (quantile(q, metric, labels, by), f"p{round(q * 100)}" + (f" {{{{{by}}}}}" if by else ""))
        for q in QUANTILES
    ]
    return Panel("timeseries", title, targets, unit="s")


def panels() -> list[Panel]:
    drafts = rate(promql.DRAFTS, SPECULATIVE)
    conditional = [(f"{accepted_at(0)} / {drafts}", "depth 1")] + [
        (f"{accepted_at(p)} / {accepted_at(p - 1)}", f"depth {p + 1}") for p in range(1, DEPTHS)
    ]
    steps_by_source = rate("lyanna_drafter_steps_total", "", "source")
    all_steps = rate("lyanna_drafter_steps_total", "")
    return [
        # -- acceptance (the paper's tau and Table 1, live) --
        Panel(
            "stat",
            "Acceptance length",
            [(acceptance_length(), "")],
            description="vLLM's mean acceptance length: 1 + accepted tokens / drafts "
            "(verifications with a draft token; root-only steps left out).",
            width=6,
            height=4,
            extra={"options": {"reduceOptions": {"calcs": ["lastNotNull"]}}},
        ),
        Panel(
            "stat",
            "Output tokens/s",
            [(rate("lyanna_generation_tokens_total"), "")],
            width=6,
            height=4,
        ),
        Panel(
            "stat",
            "Drafter fallback share",
            [(promql.fallback_share(speculative()), "")],
            unit="percentunit",
            description="Verifications of drafted requests the drafter service did not draft "
            "(unreachable, late, failed): the gateway verified them without it.",
            width=6,
            height=4,
        ),
        Panel(
            "stat",
            "Requests running",
            [("sum (lyanna_num_requests_running{" + GATEWAY + "})", "")],
            width=6,
            height=4,
        ),
        Panel(
            "timeseries",
            "Acceptance length per method",
            [(acceptance_length("method"), "{{method}}")],
            description="1.0 = every draft rejected; root-only steps excluded (no value while "
            "nothing drafts).",
            width=12,
        ),
        Panel(
            "timeseries",
            "Drafted share of verifications",
            [(promql.drafted_share(speculative("method")), "{{method}}")],
            unit="percentunit",
            description="Drafts / (drafts + root-only steps): how often a tree with a draft "
            "token was verified (the draft gate turns drafting off where it does not pay).",
            width=12,
        ),
        Panel(
            "heatmap",
            "Acceptance length distribution",
            [
                (
                    "sum by (le) (increase(lyanna_spec_acceptance_length_bucket{"
                    + SPECULATIVE
                    + "}"
                    + RATE
                    + "))",
                    "{{le}}",
                )
            ],
            description="Tokens emitted per draft (histogram buckets).",
            width=12,
            extra={
                "options": {"calculate": False, "yAxis": {"unit": "none"}},
                "targets_format": "heatmap",
            },
        ),
        Panel(
            "timeseries",
            "Acceptance rate (accepted / drafted tokens)",
            [
                (
                    f"{rate('lyanna_spec_accepted_tokens_total', SPECULATIVE, 'method')}"
                    f" / {rate('lyanna_spec_draft_tokens_total', SPECULATIVE, 'method')}",
                    "{{method}}",
                )
            ],
            unit="percentunit",
        ),
        Panel(
            "timeseries",
            "Conditional acceptance per depth",
            conditional,
            unit="percentunit",
            description="Accepted at depth d / accepted at depth d - 1 (the paper's Table 1).",
        ),
        Panel(
            "timeseries",
            "Re-sampled share of output tokens",
            [
                (
                    f"{rate('lyanna_spec_resampled_accepted_tokens_total', SPECULATIVE, 'method')}"
                    f" / {rate('lyanna_generation_tokens_total', SPECULATIVE, 'method')}",
                    "{{method}}",
                )
            ],
            unit="percentunit",
            description="Accepted tokens that only a re-sampled (fused) subtree proposed.",
        ),
        # -- throughput and latency --
        Panel(
            "timeseries",
            "Tokens/s",
            [
                (rate("lyanna_generation_tokens_total", by="method"), "output {{method}}"),
                (rate("lyanna_prompt_tokens_total", by="method"), "prompt {{method}}"),
            ],
        ),
        latency_panel("Time to first token", "lyanna_request_time_to_first_token_seconds"),
        latency_panel("Inter-token latency", "lyanna_request_inter_token_latency_seconds"),
        latency_panel("Time per output token", "lyanna_request_time_per_output_token_seconds"),
        latency_panel("End-to-end latency", "lyanna_request_e2e_latency_seconds"),
        Panel(
            "timeseries",
            "Requests running / waiting",
            [
                ("sum by (method) (lyanna_num_requests_running{" + GATEWAY + "})", "running"),
                ("sum by (method) (lyanna_num_requests_waiting{" + GATEWAY + "})", "waiting"),
            ],
        ),
        # -- the pipeline: drafter and verifier --
        Panel(
            "timeseries",
            "Draft vs verify latency per step (p50)",
            [
                (quantile(0.5, "lyanna_spec_draft_latency_seconds", by="method"), "draft"),
                (quantile(0.5, "lyanna_spec_verify_latency_seconds", by="method"), "verify"),
            ],
            unit="s",
        ),
        latency_panel("Verifier forward", "lyanna_verifier_forward_seconds", "op", labels=""),
        latency_panel(
            "Verifier acceptance rules", "lyanna_verifier_rule_seconds", by="", labels=""
        ),
        latency_panel("Drafter Step drafting", "lyanna_drafter_draft_seconds", by="", labels=""),
        Panel(
            "timeseries",
            "Verifier KV slots",
            [("sum by (state) (lyanna_verifier_kv_slots)", "{{state}}")],
        ),
        Panel(
            "timeseries",
            "Draft tokens per verified tree (p50 / p99)",
            [
                (quantile(0.5, "lyanna_verifier_tree_tokens", ""), "p50"),
                (quantile(0.99, "lyanna_verifier_tree_tokens", ""), "p99"),
            ],
        ),
        # -- failures --
        Panel(
            "timeseries",
            "Finished requests by reason",
            [(rate("lyanna_request_success_total", by="finish_reason"), "{{finish_reason}}")],
            unit="reqps",
        ),
        Panel(
            "timeseries",
            "Drafter fallbacks and resyncs",
            [
                (rate("lyanna_spec_drafter_fallback_total", by="method"), "fallback steps"),
                (rate("lyanna_drafter_starts_total", ""), "drafter first starts"),
                (rate("lyanna_drafter_resyncs_total", ""), "drafter resyncs"),
            ],
            unit="ops",
            description="Steps the drafter service missed (the gateway's fallback), and "
            "sequences the drafter started for the first time or again after losing them.",
        ),
        Panel(
            "timeseries",
            "Drafter steps by source",
            [(f"{steps_by_source} / ignoring(source) group_left {all_steps}", "{{source}}")],
            unit="percentunit",
            description="Share of the drafter's learned steps its configured method drafted, "
            "its free n-gram fallback drafted (gated off) or it left plain (gated off).",
        ),
    ]


def checked(items: list[Panel]) -> list[Panel]:
    """The panels, once every series their queries read is one the metric registry lists."""
    known = sample_names()
    for panel in items:
        for expr, _ in panel.targets:
            unknown = set(re.findall(r"\blyanna_[a-z0-9_]+", expr)) - known
            if unknown:
                raise ValueError(f"{panel.title}: {sorted(unknown)} not in the metric registry")
    return items


def layout(items: list[Panel]) -> list[dict]:
    """Left to right, wrapping at Grafana's 24 columns."""
    out, x, y, row_height = [], 0, 0, 0
    for panel_id, panel in enumerate(items, start=1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        doc = panel.to_json(panel_id, x, y)
        if doc.pop("targets_format", None):
            for target in doc["targets"]:
                target["format"] = "heatmap"
        out.append(doc)
        x += panel.width
        row_height = max(row_height, panel.height)
    return out


def variable(name: str) -> dict:
    query = f"label_values(lyanna_spec_draft_steps_total, {name})"
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
    }


def dashboard() -> dict:
    return {
        "title": "Lyanna speculative serving",
        "uid": "lyanna-serving",
        "description": "Generated by deploy/grafana/dashboard.py from the metric registries "
        "of the gateway, verifier and drafter (docs/metrics.md).",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "tags": ["lyanna", "llm", "speculative-decoding"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                },
                variable("model"),
                variable("method"),
                variable("service"),
            ]
        },
        "panels": layout(checked(panels())),
    }


def panel_targets(rate_interval: str = "1m") -> dict[str, list[tuple[str, str]]]:
    """Panel title -> its (PromQL query, legend format) pairs as the committed dashboard
    holds them, the variables filled in (every model, method and service): what a Grafana
    shows, for tests and ``bench.dashboard_snapshot``."""
    values = {"$__rate_interval": rate_interval, "$model": ".*", "$method": ".*"}
    values["$service"] = ".*"
    targets: dict[str, list[tuple[str, str]]] = {}
    for panel in json.loads(OUTPUT.read_text())["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable_name, value in values.items():
                expr = expr.replace(variable_name, value)
            targets.setdefault(panel["title"], []).append((expr, target.get("legendFormat", "")))
    return targets


def panel_queries(rate_interval: str = "1m") -> dict[str, list[str]]:
    """Panel title -> its PromQL queries (see ``panel_targets``)."""
    return {
        title: [expr for expr, _ in pairs] for title, pairs in panel_targets(rate_interval).items()
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def config_map() -> str:
    """The dashboard as a ConfigMap for Grafana's dashboard sidecar."""
    return configmap.config_map(render())


def main() -> None:
    OUTPUT.write_text(render())
    CONFIG_MAP.write_text(config_map())
    print(f"wrote {OUTPUT} and {CONFIG_MAP}")


if __name__ == "__main__":
    main()
