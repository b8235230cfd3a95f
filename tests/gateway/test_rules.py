"""Recording rules and alerts (deploy/prometheus): the committed files are what the generators
write, promtool accepts them, their unit tests pass (and fail on a broken rule), every alert
has a case where it fires on its fault and a normal load run at c = 16 where it stays silent,
and every metric they read is one the processes export."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.prometheus import alert_tests, rules
from tests.gateway.test_prometheus import prometheus_binary
from tests.unit.test_metrics_doc import registered_names

RULES_DIR = rules.HERE


def promtool() -> str:
    prometheus_binary()  # the same policy: missing fails unless LYANNA_ALLOW_NO_PROMETHEUS=1
    binary = shutil.which("promtool")
    assert binary is not None, "promtool ships with Debian's prometheus package"
    return binary


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_committed_rules_are_generated() -> None:
    assert rules.RULES.read_text() == rules.rule_file(), "run python -m deploy.prometheus.rules"
    assert rules.PROMETHEUS_RULE.read_text() == rules.prometheus_rule()
    assert alert_tests.OUTPUT.read_text() == alert_tests.test_file(), (
        "run python -m deploy.prometheus.alert_tests"
    )


def test_every_alert_fires_on_its_fault_and_stays_silent_at_c16() -> None:
    """Each alert: a unit-test case that expects it firing, and the normal c = 16 load run
    that expects it silent (before, at and after the evaluation time of the faults)."""
    document = yaml.safe_load(alert_tests.OUTPUT.read_text())
    names = {alert["alert"] for alert in rules.alerts()}
    assert len(names) == len(rules.alerts()) >= 8
    normal, *faults = document["tests"]
    assert "c = 16" in normal["name"]
    silent_at: dict[str, set[str]] = {}
    for case in normal["alert_rule_test"]:
        assert case["exp_alerts"] == []
        silent_at.setdefault(case["alertname"], set()).add(case["eval_time"])
    assert {name: len(times) for name, times in silent_at.items()} == dict.fromkeys(names, 3)
    firing = {
        case["alertname"]
        for fault in faults
        for case in fault["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert firing == names
    # the c = 16 run is the realistic one: drafting gated off, its few probes below the
    # collapse threshold, every KV slot taken
    series = {s["series"]: s["values"] for s in normal["input_series"]}
    root_only = next(
        v
        for k, v in series.items()
        if k.startswith('lyanna_spec_root_only_steps_total{method="lyanna"')
    )
    drafts = next(
        v
        for k, v in series.items()
        if k.startswith('lyanna_spec_draft_steps_total{method="lyanna"')
    )
    assert float(drafts.split("+")[1].split("x")[0]) < 0.01 * float(
        root_only.split("+")[1].split("x")[0]
    )


def test_rules_read_only_exported_metrics() -> None:
    exported = registered_names() | {"up"}
    exported |= {f"{n}_bucket" for n in exported}
    read = set(re.findall(r"\b(lyanna_[a-z_]+|up)\b", rules.RULES.read_text()))
    assert read and read <= exported, sorted(read - exported)


@pytest.mark.slow  # needs promtool (Debian's prometheus package; make test installs it)
def test_promtool_checks_and_unit_tests_pass(tmp_path: Path) -> None:
    tool = promtool()
    checked = run(tool, "check", "rules", "lyanna-rules.yaml", cwd=RULES_DIR)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run(tool, "test", "rules", "lyanna-rules.test.yaml", cwd=RULES_DIR)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # control: the same unit tests catch a wrong acceptance-length formula
    broken = rules.RULES.read_text().replace("expr: 1 + sum", "expr: 2 + sum")
    assert broken != rules.RULES.read_text()
    (tmp_path / "lyanna-rules.yaml").write_text(broken)
    shutil.copy(RULES_DIR / "lyanna-rules.test.yaml", tmp_path)
    failed = run(tool, "test", "rules", "lyanna-rules.test.yaml", cwd=tmp_path)
    assert failed.returncode != 0 and "acceptance_length" in failed.stdout + failed.stderr


OLD_ALERTS = {  # the rules issue 43 found wanting, and the case that catches each
    "LyannaAcceptanceCollapse": (
        'lyanna:acceptance_length:rate5m{method!="ar"} < 1.05',  # no drafting guard
        "normal load run at c = 16",
    ),
    "LyannaVerifierDown": ('up{job="lyanna-verifier"} == 0', "verifier absent"),  # no absent()
}


@pytest.mark.slow  # needs promtool
@pytest.mark.parametrize("alert", OLD_ALERTS)
def test_the_unit_tests_catch_the_old_alerts(alert: str, tmp_path: Path) -> None:
    """Controls: the collapse alert without its drafting guard fires on the normal c = 16 run,
    and the verifier alert without absent() misses a verifier with no target at all."""
    tool = promtool()
    expr, caught_by = OLD_ALERTS[alert]
    groups = rules.groups()
    (target,) = [r for g in groups for r in g["rules"] if r.get("alert") == alert]
    target["expr"] = expr
    (tmp_path / "lyanna-rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(RULES_DIR / "lyanna-rules.test.yaml", tmp_path)
    failed = run(tool, "test", "rules", "lyanna-rules.test.yaml", cwd=tmp_path)
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0 and alert in out and caught_by in out, out


@pytest.mark.slow  # needs promtool
def test_promtool_accepts_every_process_exposition() -> None:
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics
    from services.metrics import DrafterMetrics, VerifierMetrics

    tool = promtool()
    verifier, drafter = VerifierMetrics(4), DrafterMetrics()
    verifier.forward_seconds.labels("verify").observe(0.1)
    drafter.draft_seconds.observe(0.01)
    for registry in (GatewayMetrics("m", "s").registry, verifier.registry, drafter.registry):
        text = generate_latest(registry)
        checked = subprocess.run(
            [tool, "check", "metrics"], input=text, capture_output=True, timeout=60
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert b"lyanna_" in text
