"""Recording rules and alerts (deploy/prometheus): the committed files are what the generator
writes, promtool accepts them, their unit tests pass (and fail on a broken rule), and every
metric they read is one the processes export."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.prometheus import rules
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
