"""Generate the Prometheus recording rules and alerts of Lyanna (``lyanna-rules.yaml``, the
``groups`` of a rule file; ``deploy/k8s/base/prometheusrule.yaml`` wraps the same groups in a
PrometheusRule for the Prometheus operator).

    python -m deploy.prometheus.rules          # rewrite both files
    promtool check rules deploy/prometheus/lyanna-rules.yaml
    promtool test rules deploy/prometheus/lyanna-rules.test.yaml

A test fails when the committed files differ from what this script writes, and runs both
promtool commands (``tests/gateway/test_rules.py``).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from deploy.prometheus import promql

HERE = Path(__file__).resolve().parent
RULES = HERE / "lyanna-rules.yaml"
PROMETHEUS_RULE = HERE.parents[0] / "k8s" / "base" / "prometheusrule.yaml"
WINDOW = "5m"
POSITIONS = 8  # conditional acceptance recorded for depths 1..POSITIONS
BY = "method, model"
FINISHED = "lyanna_request_success_total"  # every finished request, by finish_reason
REJECTED = "lyanna_request_rejected_total"  # every 429, by reason
RESPONSES = "lyanna_http_responses_total"  # every HTTP response, by path and code
API_RESPONSES = RESPONSES + '{path=~"/v1/.*"}'  # the API's own (not the probes' /readyz)
SERVER_ERRORS = RESPONSES + '{path=~"/v1/.*", code=~"5.."}'


def _rate(metric: str, by: str = BY) -> str:
    return f"sum by ({by}) (rate({metric}[{WINDOW}]))"


# the jobs the ServiceMonitors give each process's targets (the Service's name)
GATEWAY_JOB, VERIFIER_JOB = "lyanna-gateway", "lyanna-verifier"
COLLAPSE_BELOW = 1.05  # mean acceptance length under which speculation costs more than it saves
# collapse is judged only while drafting happens: at least this share of verifications drafted
# and this many drafts a second (a gate that keeps drafting off, as at c = 16 on a CPU, or a
# handful of probes, is not a collapse)
DRAFTING_SHARE, DRAFTING_RATE = 0.2, 0.1
KV_WAITING_FACTOR = 1  # KV exhaustion: waiting requests >= this many times the verifier's slots


def recording_rules() -> list[dict]:
    per_position = "lyanna_spec_accepted_tokens_per_position_total"
    rules = [
        {  # vLLM's mean acceptance length: tokens per draft (deploy/prometheus/promql.py)
            "record": "lyanna:acceptance_length:rate5m",
            "expr": promql.acceptance_length(_rate),
        },
        {  # drafts a second
            "record": "lyanna:draft_steps:rate5m",
            "expr": _rate(promql.DRAFTS),
        },
        {  # how much drafting happens: drafts / verifications
            "record": "lyanna:drafted_share:rate5m",
            "expr": promql.drafted_share(_rate),
        },
        {
            "record": "lyanna:acceptance_rate:rate5m",
            "expr": f"{_rate('lyanna_spec_accepted_tokens_total')}"
            f" / {_rate('lyanna_spec_draft_tokens_total')}",
        },
        {  # share of emitted tokens only a re-sampled (fused) subtree proposed
            "record": "lyanna:resampled_share:rate5m",
            "expr": f"{_rate('lyanna_spec_resampled_accepted_tokens_total')}"
            f" / {_rate('lyanna_generation_tokens_total')}",
        },
        {
            "record": "lyanna:drafter_fallback_share:rate5m",
            "expr": promql.fallback_share(_rate),
        },
        {
            "record": "lyanna:time_to_first_token_seconds:p99_5m",
            "expr": "histogram_quantile(0.99, "
            f"{_rate('lyanna_request_time_to_first_token_seconds_bucket', 'le, ' + BY)})",
        },
        {  # API responses with a 5xx status, of all API responses
            "record": "lyanna:request_error_share:rate5m",
            "expr": f"{_rate(SERVER_ERRORS, 'model')} / {_rate(API_RESPONSES, 'model')}",
        },
        {  # requests refused with 429, of all requests answered
            "record": "lyanna:rejected_share:rate5m",
            "expr": f"{_rate(REJECTED, 'model')}"
            f" / ({_rate(REJECTED, 'model')} + {_rate(FINISHED, 'model')})",
        },
    ]
    # conditional acceptance at depth p + 1: accepted at p / accepted at p - 1 (the paper's
    # Table 1, live); depth 1 is conditioned on a draft having been verified
    for position in range(POSITIONS):
        accepted = f'sum by ({BY}) (rate({per_position}{{position="{position}"}}[{WINDOW}]))'
        before = (
            _rate(promql.DRAFTS)
            if position == 0
            else f'sum by ({BY}) (rate({per_position}{{position="{position - 1}"}}[{WINDOW}]))'
        )
        rules.append(
            {
                "record": "lyanna:conditional_acceptance:rate5m",
                "expr": f"{accepted} / {before}",
                "labels": {"depth": str(position + 1)},
            }
        )
    return rules


def _down(job: str) -> str:
    """A job's targets down, or no target of it at all (absent: the Deployment deleted or
    scaled to zero, its ServiceMonitor gone)."""
    return f'up{{job="{job}"}} == 0 or absent(up{{job="{job}"}})'


def alerts() -> list[dict]:
    return [
        {
            "alert": "LyannaAcceptanceCollapse",
            "expr": f'lyanna:acceptance_length:rate5m{{method!="ar"}} < {COLLAPSE_BELOW}'
            f" and on (method, model) lyanna:drafted_share:rate5m > {DRAFTING_SHARE}"
            f" and on (method, model) lyanna:draft_steps:rate5m > {DRAFTING_RATE}",
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "{{ $labels.method }} accepts almost no draft tokens",
                "description": 'Mean acceptance length {{ $value | printf "%.2f" }} over 5m '
                "while it drafts: speculation costs more than it saves (drafter checkpoint, "
                "sampling mode, tree shape).",
            },
        },
        {
            "alert": "LyannaDrafterFallback",
            "expr": "lyanna:drafter_fallback_share:rate5m > 0.5",
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "most steps of {{ $labels.method }} run without the drafter",
                "description": "The drafter is down or late; output stays correct, speed drops.",
            },
        },
        {
            "alert": "LyannaTimeToFirstTokenHigh",
            "expr": "lyanna:time_to_first_token_seconds:p99_5m > 5",
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "p99 time to first token above 5 s",
                "description": "Requests wait for slots or prefill is slow: scale the gateway "
                "or the verifier.",
            },
        },
        {
            "alert": "LyannaErrors",
            "expr": "lyanna:request_error_share:rate5m > 0.05",
            "for": "5m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "{{ $value | humanizePercentage }} of API responses are 5xx",
                "description": "Requests fail (503: the verifier or a drafter that breaks "
                "mid-step; 500: a bug): the gateway's and services' logs say which.",
            },
        },
        {
            "alert": "LyannaRateLimited",
            "expr": "lyanna:rejected_share:rate5m > 0.1",
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "{{ $value | humanizePercentage }} of requests refused with 429",
                "description": "The waiting queue is full, no slot frees in time or keys hit "
                "their limits: add verifier capacity, or raise the per-key limits.",
            },
        },
        {
            "alert": "LyannaKVExhausted",
            "expr": "sum(lyanna_num_requests_waiting)"
            f" >= {KV_WAITING_FACTOR} * sum(lyanna_verifier_kv_slots)"
            ' and on () sum(lyanna_verifier_kv_slots{state="free"}) == 0',
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "no free KV slot and {{ $value }} requests waiting",
                "description": "Every verifier KV slot is taken and more requests wait than "
                "the verifier holds: requests queue until 429. Raise "
                "LYANNA_VERIFIER_MAX_RUNNING (memory allowing) or add a verifier.",
            },
        },
        {
            "alert": "LyannaVerifierDown",
            "expr": _down(VERIFIER_JOB),
            "for": "2m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "no verifier target is up",
                "description": "No verifier: the gateway answers 503.",
            },
        },
        {
            "alert": "LyannaGatewayDown",
            "expr": f'absent(up{{job="{GATEWAY_JOB}"}} == 1)',
            "for": "2m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "no gateway target is up",
                "description": "No gateway answers: clients get connection errors.",
            },
        },
    ]


def groups() -> list[dict]:
    return [
        {"name": "lyanna.recording", "interval": "30s", "rules": recording_rules()},
        {"name": "lyanna.alerts", "rules": alerts()},
    ]


HEADER = "# Generated by `python -m deploy.prometheus.rules`; edit that script, not this file.\n"


def rule_file() -> str:
    return HEADER + yaml.safe_dump({"groups": groups()}, sort_keys=False, width=100)


def prometheus_rule() -> str:
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "lyanna", "labels": {"app.kubernetes.io/name": "lyanna"}},
        "spec": {"groups": groups()},
    }
    return HEADER + yaml.safe_dump(manifest, sort_keys=False, width=100)


def main() -> None:
    RULES.write_text(rule_file())
    PROMETHEUS_RULE.write_text(prometheus_rule())
    print(f"wrote {RULES} and {PROMETHEUS_RULE}")


if __name__ == "__main__":
    main()
