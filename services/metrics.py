"""Prometheus metrics of the verifier and drafter processes (prefix ``lyanna_verifier_`` /
``lyanna_drafter_``), served on their own port (``--metrics-port``; -1 = off, 0 = any free
port, written to ``--metrics-port-file``). Every name, type, label, help text and bucket comes
from ``services.metric_registry`` (the gateway's too); these classes only record events. Each
object owns its registry, so two services in one process (tests) never collide.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

from lyanna.drafters import Drafter, VerifiedStep
from lyanna.drafters.gate import DRAFT_SOURCES, step_source
from lyanna.tree import TokenTree
from services.config import ServerConfig
from services.metric_registry import DRAFTER, VERIFIER


class VerifierMetrics:
    """Target forwards, tree sizes and KV slots of one verifier."""

    def __init__(self, total_slots: int) -> None:
        built = VERIFIER.build()
        self.registry = built.registry
        self.forward_seconds = built.histogram("lyanna_verifier_forward_seconds")
        self.rule_seconds = built.histogram("lyanna_verifier_rule_seconds")
        self.tree_tokens = built.histogram("lyanna_verifier_tree_tokens")
        self.sequences_verified = built.counter("lyanna_verifier_sequences_verified_total")
        self.accepted_tokens = built.counter("lyanna_verifier_accepted_tokens_total")
        self.prefill_tokens = built.counter("lyanna_verifier_prefill_tokens_total")
        self.kv_slots = built.gauge("lyanna_verifier_kv_slots")
        self.total_slots = total_slots
        self.slots(total_slots)

    def slots(self, free: int) -> None:
        self.kv_slots.labels("free").set(free)
        self.kv_slots.labels("used").set(self.total_slots - free)

    def verified(self, trees: list[TokenTree], verified, seconds: float, rules: float) -> None:
        """One target forward over ``trees`` (``lyanna.multi_step.OnForward``): its seconds,
        the acceptance rules' share, the trees and the tokens accepted."""
        self.rule_seconds.observe(rules)
        self.forward_seconds.labels("verify").observe(seconds)
        self.sequences_verified.inc(len(trees))
        self.accepted_tokens.inc(sum(v.verdict.num_accepted for v in verified))
        for tree in trees:
            self.tree_tokens.observe(tree.num_drafted)


class DrafterMetrics:
    """Starts, resyncs, proposals and the source of each learned step of one drafter."""

    def __init__(self) -> None:
        built = DRAFTER.build()
        self.registry = built.registry
        self.draft_seconds = built.histogram("lyanna_drafter_draft_seconds")
        self.proposals = built.counter("lyanna_drafter_proposals_total")
        self.proposed_tokens = built.counter("lyanna_drafter_proposed_tokens_total")
        self.starts = built.counter("lyanna_drafter_starts_total")
        self.resyncs = built.counter("lyanna_drafter_resyncs_total")
        self.steps = built.counter("lyanna_drafter_steps_total")
        self.sequences = built.gauge("lyanna_drafter_sequences")
        for source in DRAFT_SOURCES:  # every share's series exists before the first step
            self.steps.labels(source)

    def started(self, resync: bool) -> None:
        """One Start item: a first start, or a resync after the drafter lost the state."""
        (self.resyncs if resync else self.starts).inc()

    def drafted(self, seconds: float, trees: list[TokenTree]) -> None:
        """One Step call's drafting: its seconds and the trees it proposed."""
        self.draft_seconds.observe(seconds)
        self.proposals.inc(len(trees))
        self.proposed_tokens.inc(sum(tree.num_drafted for tree in trees))

    def learned(self, drafter: Drafter, steps: list[VerifiedStep]) -> None:
        """Steps ``drafter`` just learned, by what drafted each (the gate's choice)."""
        for step in steps:
            self.steps.labels(step_source(drafter, step.seq_id)).inc()


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
