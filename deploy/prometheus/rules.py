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

HERE = Path(__file__).resolve().parent
RULES = HERE / "lyanna-rules.yaml"
PROMETHEUS_RULE = HERE.parents[0] / "k8s" / "base" / "prometheusrule.yaml"
WINDOW = "5m"
POSITIONS = 8  # conditional acceptance recorded for depths 1..POSITIONS
BY = "method, model"


def _rate(metric: str, by: str = BY) -> str:
    return f"sum by ({by}) (rate({metric}[{WINDOW}]))"


def recording_rules() -> list[dict]:
    steps = _rate("lyanna_spec_draft_steps_total")
    per_position = "lyanna_spec_accepted_tokens_per_position_total"
    rules = [
        {  # the paper's tau: tokens per verification
            "record": "lyanna:acceptance_length:rate5m",
            "expr": f"1 + {_rate('lyanna_spec_accepted_tokens_total')} / {steps}",
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
            "expr": f"{_rate('lyanna_spec_drafter_fallback_total')} / {steps}",
        },
        {
            "record": "lyanna:time_to_first_token_seconds:p99_5m",
            "expr": "histogram_quantile(0.99, "
            f"{_rate('lyanna_request_time_to_first_token_seconds_bucket', 'le, ' + BY)})",
        },
    ]
    # conditional acceptance at depth p + 1: accepted at p / accepted at p - 1 (the paper's
    # Table 1, live); depth 1 is conditioned on a verification having happened
    for position in range(POSITIONS):
        accepted = f'sum by ({BY}) (rate({per_position}{{position="{position}"}}[{WINDOW}]))'
        before = (
            steps
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


def alerts() -> list[dict]:
    return [
        {
            "alert": "LyannaAcceptanceCollapse",
            "expr": 'lyanna:acceptance_length:rate5m{method!="ar"} < 1.05',
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "{{ $labels.method }} accepts almost no draft tokens",
                "description": 'Mean acceptance length {{ $value | printf "%.2f" }} over 5m: '
                "speculation costs more than it saves (drafter checkpoint, sampling mode, "
                "or a drafter in fallback).",
            },
        },
        {
            "alert": "LyannaDrafterFallback",
            "expr": "lyanna:drafter_fallback_share:rate5m > 0.5",
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "most steps of {{ $labels.method }} run target-only",
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
            "alert": "LyannaVerifierDown",
            "expr": 'up{job=~".*verifier.*"} == 0',
            "for": "2m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "the verifier {{ $labels.instance }} is not scraped",
                "description": "No verifier: the gateway answers 503.",
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
