"""Generate ``lyanna-rules.test.yaml``, the promtool unit tests of the recording rules and
alerts (``promtool test rules deploy/prometheus/lyanna-rules.test.yaml``):

- one *normal load run at c = 16*: the series one gateway of the split deployment exports
  while 16 clients stream chat answers (about 300 output tokens/s, 280 requests a minute, as
  ``docs/benchmarks.md`` measured on the 2-core host; the draft gate keeps drafting off there,
  so nearly every verification is root-only and its few probe drafts accept almost nothing;
  every verifier KV slot taken, a few requests in prefill). Every alert stays silent on it,
  and the recording rules' values on it are checked;
- for each alert, the same run with its fault injected, on which it fires with the labels and
  annotations written out below.

    python -m deploy.prometheus.alert_tests     # rewrite lyanna-rules.test.yaml

The expected values are literals computed by hand from the series (the comments show how), not
from the rules. ``tests/gateway/test_rules.py`` checks the committed file is current, runs
promtool on it, checks every alert has a firing and a silent case, and that the silent case
catches the old rules (collapse without the drafting guard, verifier down without absent()).
"""

from __future__ import annotations

import yaml

from deploy.prometheus import rules

OUTPUT = rules.HERE / "lyanna-rules.test.yaml"
MINUTES = 40  # each series runs this long, one sample a minute
EVAL = "30m"  # where the alerts are evaluated (every window full, every `for` elapsed)
SPEC = 'method="lyanna", model="m", service="services"'
AR = 'method="ar", model="m", service="services"'
NONE = 'method="none", model="m", service="services"'  # responses before a method is chosen
GATEWAYS = ("10.0.0.1:8000", "10.0.0.2:8000")
WAITING = (3, 6, 4, 8, 5, 2, 7, 5)  # requests in prefill at each scrape, cycled
ALERTS = [alert["alert"] for alert in rules.alerts()]


def counter(per_minute: float) -> str:
    return f"0+{per_minute:g}x{MINUTES}"


def gauge(value: float) -> str:
    return f"{value:g}x{MINUTES}"


def cycled(values: tuple[int, ...]) -> str:
    return " ".join(str(values[i % len(values)]) for i in range(MINUTES + 1))


def normal_c16() -> dict[str, str]:
    """Series -> values (promtool's expanding notation), a minute apart."""
    ttft = "lyanna_request_time_to_first_token_seconds_bucket"
    series = {
        # 17,600 root-only verifications a minute (drafting gated off), 60 probe drafts of one
        # token each accepting 2: vLLM's acceptance length 1 + 2/60 = 1.033 (under 1.05)
        f"lyanna_spec_draft_steps_total{{{SPEC}}}": counter(60),
        f"lyanna_spec_root_only_steps_total{{{SPEC}}}": counter(17600),
        f"lyanna_spec_draft_tokens_total{{{SPEC}}}": counter(60),
        f"lyanna_spec_accepted_tokens_total{{{SPEC}}}": counter(2),
        f'lyanna_spec_accepted_tokens_per_position_total{{{SPEC}, position="0"}}': counter(2),
        f"lyanna_spec_resampled_accepted_tokens_total{{{SPEC}}}": counter(0),
        f"lyanna_spec_drafter_fallback_total{{{SPEC}}}": counter(3),  # a late Step now and then
        # output: one token per verification + accepted + each request's first token (prefill)
        f"lyanna_generation_tokens_total{{{SPEC}}}": counter(17660 + 2 + 280),
        # method ar beside it: never drafts, must never look like a collapse
        f"lyanna_spec_draft_steps_total{{{AR}}}": counter(0),
        f"lyanna_spec_root_only_steps_total{{{AR}}}": counter(600),
        f"lyanna_spec_accepted_tokens_total{{{AR}}}": counter(0),
        # 280 requests a minute: 250 stop at max_tokens, 30 at EOS; none fails, none refused
        f'lyanna_request_success_total{{{SPEC}, finish_reason="length"}}': counter(250),
        f'lyanna_request_success_total{{{SPEC}, finish_reason="stop"}}': counter(30),
        f'lyanna_request_success_total{{{SPEC}, finish_reason="error"}}': counter(0),
        f'{rules.REJECTED}{{{SPEC}, reason="queue_full"}}': counter(0),
        # every request answered 200; the probes' /readyz (two gateways, every 5 s) beside it
        f'{rules.RESPONSES}{{{SPEC}, path="/v1/chat/completions", code="200"}}': counter(280),
        f'{rules.RESPONSES}{{{NONE}, path="/readyz", code="200"}}': counter(24),
        # time to first token: 30 % under 0.5 s, 60 % under 1 s, 274 of 280 under 2.5 s, all
        # under 5 s: p99 = 2.5 + (277.2 - 274) / 6 * 2.5 = 3.83 s
        f'{ttft}{{{SPEC}, le="0.5"}}': counter(84),
        f'{ttft}{{{SPEC}, le="1"}}': counter(168),
        f'{ttft}{{{SPEC}, le="2.5"}}': counter(274),
        f'{ttft}{{{SPEC}, le="5"}}': counter(280),
        f'{ttft}{{{SPEC}, le="10"}}': counter(280),
        f'{ttft}{{{SPEC}, le="+Inf"}}': counter(280),
        # 16 clients on 16 verifier slots: every slot taken at every scrape, a few waiting
        f"lyanna_num_requests_waiting{{{SPEC}}}": cycled(WAITING),
        'lyanna_verifier_kv_slots{job="lyanna-verifier", instance="10.0.1.1:9101", '
        'state="free"}': gauge(0),
        'lyanna_verifier_kv_slots{job="lyanna-verifier", instance="10.0.1.1:9101", '
        'state="used"}': gauge(16),
        'up{job="lyanna-verifier", instance="10.0.1.1:9101"}': gauge(1),
        'up{job="lyanna-drafter", instance="10.0.1.1:9102"}': gauge(1),
    }
    for instance in GATEWAYS:
        series[f'up{{job="lyanna-gateway", instance="{instance}"}}'] = gauge(1)
    return series


def with_fault(changes: dict[str, str | None]) -> list[dict]:
    """The c = 16 run with ``changes`` applied (None removes a series)."""
    series = normal_c16()
    for name, values in changes.items():
        if values is None:
            del series[name]
        else:
            series[name] = values
    return [{"series": name, "values": values} for name, values in series.items()]


def silent(eval_time: str = EVAL) -> list[dict]:
    return [{"eval_time": eval_time, "alertname": name, "exp_alerts": []} for name in ALERTS]


def fires(alertname: str, labels: dict, annotations: dict) -> dict:
    return {
        "eval_time": EVAL,
        "alertname": alertname,
        "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}],
    }


def normal_case() -> dict:
    lyanna = {"method": "lyanna", "model": "m"}

    def sample(record: str, value: float, **labels: str) -> dict:
        """``record`` in millionths (round() makes the comparison exact on any promtool)."""
        return {
            "expr": f"round({record} * 1e6)",
            "eval_time": EVAL,
            "exp_samples": [{"labels": label_set(labels), "value": round(value * 1e6)}],
        }

    return {
        "name": "normal load run at c = 16: every alert silent",
        "interval": "1m",
        "input_series": with_fault({}),
        "promql_expr_test": [
            # 1 + 2 / 60 over the 60 drafts; ar has no draft, so no value (not 1.0)
            sample("lyanna:acceptance_length:rate5m", 1 + 2 / 60, **lyanna),
            sample('lyanna:drafted_share:rate5m{method="lyanna"}', 60 / 17660, **lyanna),
            sample('lyanna:draft_steps:rate5m{method="lyanna"}', 1.0, **lyanna),
            sample('lyanna:acceptance_rate:rate5m{method="lyanna"}', 2 / 60, **lyanna),
            sample('lyanna:drafter_fallback_share:rate5m{method="lyanna"}', 3 / 17660, **lyanna),
            sample('lyanna:conditional_acceptance:rate5m{depth="1"}', 2 / 60, depth="1", **lyanna),
            sample("lyanna:resampled_share:rate5m", 0.0, **lyanna),
            sample("lyanna:time_to_first_token_seconds:p99_5m", 2.5 + 3.2 / 6 * 2.5, **lyanna),
            # no 5xx series exists before the first 5xx: no value, so nothing to alert on
            {"expr": "lyanna:request_error_share:rate5m", "eval_time": EVAL, "exp_samples": []},
            sample("lyanna:rejected_share:rate5m", 0.0, model="m"),
        ],
        "alert_rule_test": silent("10m") + silent(EVAL) + silent(f"{MINUTES}m"),
    }


def label_set(labels: dict) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


VERIFIER = {"job": "lyanna-verifier", "instance": "10.0.1.1:9101"}
VERIFIER_UP = 'up{job="lyanna-verifier", instance="10.0.1.1:9101"}'


def fault_cases() -> list[dict]:
    lyanna = {"method": "lyanna", "model": "m"}
    verifier_down = {
        "summary": "no verifier target is up",
        "description": "No verifier: the gateway answers 503.",
    }
    gateway_down = {
        "summary": "no gateway target is up",
        "description": "No gateway answers: clients get connection errors.",
    }
    gateways_up = [f'up{{job="lyanna-gateway", instance="{i}"}}' for i in GATEWAYS]
    cases = [
        (  # the drafter drafts every step (600 a minute) and 6 of its tokens are accepted
            "acceptance collapse while drafting",
            {
                f"lyanna_spec_draft_steps_total{{{SPEC}}}": counter(600),
                f"lyanna_spec_root_only_steps_total{{{SPEC}}}": counter(0),
                f"lyanna_spec_draft_tokens_total{{{SPEC}}}": counter(600),
                f"lyanna_spec_accepted_tokens_total{{{SPEC}}}": counter(6),
            },
            fires(
                "LyannaAcceptanceCollapse",
                {"severity": "warning", **lyanna},
                {
                    "summary": "lyanna accepts almost no draft tokens",
                    "description": "Mean acceptance length 1.01 over 5m while it drafts: "
                    "speculation costs more than it saves (drafter checkpoint, sampling "
                    "mode, tree shape).",
                },
            ),
        ),
        (  # the drafter service gone: every step verified without it
            "drafter down",
            {
                f"lyanna_spec_draft_steps_total{{{SPEC}}}": counter(0),
                f"lyanna_spec_accepted_tokens_total{{{SPEC}}}": counter(0),
                f"lyanna_spec_drafter_fallback_total{{{SPEC}}}": counter(17600),
                'up{job="lyanna-drafter", instance="10.0.1.1:9102"}': gauge(0),
            },
            fires(
                "LyannaDrafterFallback",
                {"severity": "warning", **lyanna},
                {
                    "summary": "most steps of lyanna run without the drafter",
                    "description": "The drafter is down or late; output stays correct, speed "
                    "drops.",
                },
            ),
        ),
        (  # every first token between 5 and 10 s
            "slow first tokens",
            {
                f'lyanna_request_time_to_first_token_seconds_bucket{{{SPEC}, le="{le}"}}': counter(
                    0
                )
                for le in ("0.5", "1", "2.5", "5")
            },
            fires(
                "LyannaTimeToFirstTokenHigh",
                {"severity": "warning", **lyanna},
                {
                    "summary": "p99 time to first token above 5 s",
                    "description": "Requests wait for slots or prefill is slow: scale the "
                    "gateway or the verifier.",
                },
            ),
        ),
        (  # 40 of 320 API responses a minute are 503s: 12.5 % (the probes' not counted)
            "errors",
            {
                f'{rules.RESPONSES}{{{SPEC}, path="/v1/chat/completions", code="503"}}': (
                    counter(40)
                ),
                f'{rules.RESPONSES}{{{NONE}, path="/readyz", code="503"}}': counter(24),
            },
            fires(
                "LyannaErrors",
                {"severity": "critical", "model": "m"},
                {
                    "summary": "12.5% of API responses are 5xx",
                    "description": "Requests fail (503: the verifier or a drafter that breaks "
                    "mid-step; 500: a bug): the gateway's and services' logs say which.",
                },
            ),
        ),
        (  # 120 refused a minute against 280 served: 30 %
            "429s",
            {f'{rules.REJECTED}{{{SPEC}, reason="queue_full"}}': counter(120)},
            fires(
                "LyannaRateLimited",
                {"severity": "warning", "model": "m"},
                {
                    "summary": "30% of requests refused with 429",
                    "description": "The waiting queue is full, no slot frees in time or keys "
                    "hit their limits: add verifier capacity, or raise the per-key limits.",
                },
            ),
        ),
        (  # 48 clients on 16 slots: 40 requests wait at every scrape
            "KV exhaustion",
            {f"lyanna_num_requests_waiting{{{SPEC}}}": gauge(40)},
            fires(
                "LyannaKVExhausted",
                {"severity": "warning"},
                {
                    "summary": "no free KV slot and 40 requests waiting",
                    "description": "Every verifier KV slot is taken and more requests wait "
                    "than the verifier holds: requests queue until 429. Raise "
                    "LYANNA_VERIFIER_MAX_RUNNING (memory allowing) or add a verifier.",
                },
            ),
        ),
        (
            "verifier down",
            {VERIFIER_UP: gauge(0)},
            fires("LyannaVerifierDown", {"severity": "critical", **VERIFIER}, verifier_down),
        ),
        (  # no verifier target at all (scaled to zero, its ServiceMonitor gone)
            "verifier absent",
            {VERIFIER_UP: None},
            fires(
                "LyannaVerifierDown",
                {"severity": "critical", "job": "lyanna-verifier"},
                verifier_down,
            ),
        ),
        (
            "gateways down",
            {name: gauge(0) for name in gateways_up},
            fires("LyannaGatewayDown", {"severity": "critical"}, gateway_down),
        ),
        (
            "gateways absent",
            dict.fromkeys(gateways_up),
            fires("LyannaGatewayDown", {"severity": "critical"}, gateway_down),
        ),
    ]
    return [
        {
            "name": f"c = 16 with a fault: {name}",
            "interval": "1m",
            "input_series": with_fault(changes),
            "alert_rule_test": [expected],
        }
        for name, changes, expected in cases
    ]


HEADER = (
    "# Generated by `python -m deploy.prometheus.alert_tests`; edit that script, not this file.\n"
    "# promtool test rules deploy/prometheus/lyanna-rules.test.yaml\n"
)


def test_file() -> str:
    document = {
        "rule_files": [rules.RULES.name],
        "evaluation_interval": "1m",
        "tests": [normal_case(), *fault_cases()],
    }
    return HEADER + yaml.safe_dump(document, sort_keys=False, width=100)


def main() -> None:
    OUTPUT.write_text(test_file())
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
