"""docs/metrics.md lists every metric the gateway, verifier and drafter register."""

from __future__ import annotations

from pathlib import Path

from gateway.metrics import GatewayMetrics
from services.metrics import DrafterMetrics, VerifierMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def registered_names() -> set[str]:
    names = set()
    for registry in (
        GatewayMetrics("m", "s").registry,
        VerifierMetrics(4).registry,
        DrafterMetrics().registry,
    ):
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
