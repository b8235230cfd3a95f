"""Prometheus metrics of the verifier and drafter processes (prefix ``lyanna_verifier_`` /
``lyanna_drafter_``), served on their own port (``--metrics-port``; -1 = off, 0 = any free
port, written to ``--metrics-port-file``). The gateway's request and acceptance metrics live
in ``gateway.metrics``; ``docs/metrics.md`` lists every metric of the three processes (a test
keeps it complete). Each object owns its registry, so two services in one process (tests)
never collide.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from services.config import ServerConfig

FORWARD_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0)
TREE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


class VerifierMetrics:
    """Target forwards, tree sizes and KV slots of one verifier."""

    def __init__(self, total_slots: int) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.forward_seconds = Histogram(
            "lyanna_verifier_forward_seconds",
            "Seconds of one Prefill or Verify call's model work (forward + acceptance rules).",
            ("op",),
            buckets=FORWARD_BUCKETS,
            registry=r,
        )
        self.rule_seconds = Histogram(
            "lyanna_verifier_rule_seconds",
            "Seconds of one Verify call's acceptance rules (row softmax, rule, KV commit).",
            buckets=FORWARD_BUCKETS,
            registry=r,
        )
        self.tree_tokens = Histogram(
            "lyanna_verifier_tree_tokens",
            "Draft tokens in one sequence's verified tree (after fusion).",
            buckets=TREE_BUCKETS,
            registry=r,
        )
        self.sequences_verified = Counter(
            "lyanna_verifier_sequences_verified_total",
            "Sequence verifications (one per sequence per Verify call).",
            registry=r,
        )
        self.accepted_tokens = Counter(
            "lyanna_verifier_accepted_tokens_total", "Draft tokens accepted.", registry=r
        )
        self.prefill_tokens = Counter(
            "lyanna_verifier_prefill_tokens_total", "Prompt tokens prefilled.", registry=r
        )
        self.kv_slots = Gauge(
            "lyanna_verifier_kv_slots", "KV sequence slots by state.", ("state",), registry=r
        )
        self.total_slots = total_slots
        self.slots(total_slots)

    def slots(self, free: int) -> None:
        self.kv_slots.labels("free").set(free)
        self.kv_slots.labels("used").set(self.total_slots - free)


class DrafterMetrics:
    """Draft steps of one drafter."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.draft_seconds = Histogram(
            "lyanna_drafter_draft_seconds",
            "Seconds of one Step call's drafting (learning unseen steps + proposing).",
            buckets=FORWARD_BUCKETS,
            registry=r,
        )
        self.proposals = Counter(
            "lyanna_drafter_proposals_total", "Trees proposed (one per sequence).", registry=r
        )
        self.proposed_tokens = Counter(
            "lyanna_drafter_proposed_tokens_total", "Draft tokens proposed.", registry=r
        )
        self.starts = Counter(
            "lyanna_drafter_starts_total",
            "Sequences started (first start and every resync after a lost state).",
            registry=r,
        )
        self.sequences = Gauge(
            "lyanna_drafter_sequences", "Sequences the drafter holds state for.", registry=r
        )


def serve_metrics(registry: CollectorRegistry, config: ServerConfig) -> int | None:
    """Start the /metrics HTTP endpoint when ``config.metrics_port >= 0``; the bound port."""
    if config.metrics_port < 0:
        return None
    server, _ = start_http_server(config.metrics_port, addr=config.host, registry=registry)
    port = server.server_port
    if config.metrics_port_file:
        scratch = Path(config.metrics_port_file + ".tmp")
        scratch.write_text(str(port))
        scratch.replace(config.metrics_port_file)
    return port
