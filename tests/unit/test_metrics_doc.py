"""docs/metrics.md holds the one metric registry (``services.metric_registry``) table by table,
and the gateway, verifier and drafter register exactly the registry's metrics."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.metrics import GatewayMetrics
from services.metric_registry import BY_NAME, COUNTER, HISTOGRAM, PROCESSES, MetricSpec
from services.metrics import DrafterMetrics, VerifierMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def registries() -> dict[str, object]:
    return {
        "gateway": GatewayMetrics("m", "s").registry,
        "verifier": VerifierMetrics(4).registry,
        "drafter": DrafterMetrics().registry,
    }


def registered_names() -> set[str]:
    names = set()
    for registry in registries().values():
        for family in registry.collect():
            suffix = "_total" if family.type == "counter" else ""
            names.add(family.name + suffix)
    return names


def test_every_metric_is_documented() -> None:
    names = registered_names()
    assert len(names) > 25  # the three registries were read
    text = DOC.read_text()
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"add to docs/metrics.md: {missing}"


def test_the_doc_tables_are_the_registry() -> None:
    """Each process's table as the registry renders it (type, labels and help included), and
    no row for a metric the registry does not list."""
    text = DOC.read_text()
    for process in PROCESSES:
        assert process.doc_table() in text, f"paste {process.name}'s Process.doc_table()"
    rows = re.findall(r"^\| `(lyanna_[a-z0-9_]+)` \|", text, re.MULTILINE)
    assert sorted(rows) == sorted(BY_NAME)


def test_each_process_registers_exactly_its_registry_entries() -> None:
    built = registries()
    for process in PROCESSES:
        families = {f.name: f for f in built[process.name].collect()}
        assert len(families) == len(process.metrics), process.name
        for spec in process.metrics:
            family = families[spec.name.removesuffix("_total")]
            assert (family.type, family.documentation) == (spec.kind, spec.help), spec.name


@pytest.mark.parametrize(
    ("name", "kind", "buckets"),
    [
        ("lyanna_drafter_resyncs", COUNTER, None),  # a counter without _total
        ("lyanna_drafter_steps_total", HISTOGRAM, (1.0,)),  # _total on a histogram
        ("lyanna_drafter_seconds", HISTOGRAM, None),  # a histogram without buckets
        ("drafter_resyncs_total", COUNTER, None),  # no lyanna_ prefix
        ("lyanna_drafter_seconds_bucket", HISTOGRAM, (1.0,)),  # a sample suffix
    ],
)
def test_the_registry_refuses_names_promtool_would(name, kind, buckets) -> None:
    with pytest.raises(ValueError):
        MetricSpec(name, kind, "help", buckets=buckets)
