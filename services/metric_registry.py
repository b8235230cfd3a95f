"""The one registry of every Prometheus metric Lyanna exports: name, type, labels, help and
buckets of each metric of the gateway, the verifier and the drafter.

The three processes build their ``prometheus_client`` objects from it (``Process.build``, a
fresh ``CollectorRegistry`` each, so several services in one process never collide);
``docs/metrics.md`` holds each process's ``doc_table`` (``tests/unit/test_metrics_doc.py``
compares them) and the Grafana generator (``deploy/grafana/dashboard.py``) refuses a query
naming a series not listed here. It lives in ``services`` because both upper layers may import
it: the gateway already imports ``services``, the services never import the gateway, and the
core package ``lyanna`` imports neither (``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
KINDS = {COUNTER: Counter, GAUGE: Gauge, HISTOGRAM: Histogram}
HISTOGRAM_SAMPLES = ("_bucket", "_count", "_sum")
_NAME = re.compile(r"lyanna_[a-z][a-z0-9_]*[a-z0-9]")
_LABEL = re.compile(r"[a-z][a-z0-9_]*")
_RESERVED_LABELS = {"le", "quantile", "job", "instance"}  # set by the client or Prometheus

GATEWAY_LABELS = ("method", "model", "service")
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
FORWARD_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0)
TREE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric as Prometheus exports it; checked against the naming conventions promtool
    enforces (counters end in ``_total``, histograms have buckets and no ``_total``)."""

    name: str  # the exported family name, with ``_total`` for a counter
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only

    def __post_init__(self) -> None:
        if self.kind not in KINDS or not _NAME.fullmatch(self.name):
            raise ValueError(f"{self.name}: a lyanna_ name and one of {sorted(KINDS)}")
        if (self.kind == COUNTER) != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")
        if (self.kind == HISTOGRAM) != bool(self.buckets):
            raise ValueError(f"{self.name}: histograms, and only histograms, have buckets")
        if self.name.endswith(HISTOGRAM_SAMPLES) or "|" in self.help or not self.help:
            raise ValueError(f"{self.name}: a sample suffix in the name, or no usable help")
        bad = [x for x in self.labels if not _LABEL.fullmatch(x) or x in _RESERVED_LABELS]
        if bad or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"{self.name}: bad or repeated labels {self.labels}")

    @property
    def samples(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this metric (PromQL reads these)."""
        if self.kind == HISTOGRAM:
            return tuple(self.name + suffix for suffix in HISTOGRAM_SAMPLES)
        return (self.name,)

    def build(self, registry: CollectorRegistry) -> MetricWrapperBase:
        extra = {"buckets": self.buckets} if self.kind == HISTOGRAM else {}
        return KINDS[self.kind](self.name, self.help, self.labels, registry=registry, **extra)

    def doc_row(self) -> str:
        labels = ", ".join(sorted(self.labels)) or "-"
        return f"| `{self.name}` | {self.kind} | {labels} | {self.help} |"


class BuiltMetrics:
    """One process's ``prometheus_client`` objects in its own registry, handed out by name
    with their kind checked (a misspelt or mistyped name fails at construction)."""

    def __init__(self, specs: tuple[MetricSpec, ...]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._built = {spec.name: (spec.kind, spec.build(self.registry)) for spec in specs}

    def _get(self, name: str, kind: str) -> MetricWrapperBase:
        built_kind, metric = self._built[name]
        if built_kind != kind:
            raise TypeError(f"{name} is a {built_kind}, not a {kind}")
        return metric

    def __getitem__(self, name: str) -> MetricWrapperBase:
        return self._built[name][1]

    def counter(self, name: str) -> Counter:
        return self._get(name, COUNTER)  # type: ignore[return-value]

    def gauge(self, name: str) -> Gauge:
        return self._get(name, GAUGE)  # type: ignore[return-value]

    def histogram(self, name: str) -> Histogram:
        return self._get(name, HISTOGRAM)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Process:
    """The metrics one process exports (every name starts with ``prefix``)."""

    name: str
    prefix: str
    metrics: tuple[MetricSpec, ...]

    def __post_init__(self) -> None:
        stray = [m.name for m in self.metrics if not m.name.startswith(self.prefix)]
        if stray:
            raise ValueError(f"{self.name} metrics without the {self.prefix} prefix: {stray}")

    def build(self) -> BuiltMetrics:
        return BuiltMetrics(self.metrics)

    def doc_table(self) -> str:
        """The markdown table docs/metrics.md carries for this process, rows sorted by name."""
        rows = [spec.doc_row() for spec in sorted(self.metrics, key=lambda m: m.name)]
        return "\n".join(["| metric | type | labels | meaning |", "|---|---|---|---|", *rows])


def _gateway(name: str, kind: str, help: str, *labels: str, buckets=None) -> MetricSpec:
    return MetricSpec(name, kind, help, (*GATEWAY_LABELS, *labels), buckets)


GATEWAY = Process(
    "gateway",
    "lyanna_",
    (
        _gateway(
            "lyanna_spec_draft_steps_total",
            COUNTER,
            "Drafts: verifications with at least one draft token, as vLLM counts them "
            "(whoever drafted the tree). Mean acceptance length = 1 + accepted / drafts.",
        ),
        _gateway(
            "lyanna_spec_fallback_draft_steps_total",
            COUNTER,
            "Drafts a gated learned drafter's free n-gram fallback drafted instead of the "
            "method (embedded: the drafter's fallback; services: the verifier's free drafts); "
            "a part of lyanna_spec_draft_steps_total.",
        ),
        _gateway(
            "lyanna_spec_root_only_steps_total",
            COUNTER,
            "Verifications without a draft token (a root-only tree: target-only decoding, "
            "gated-off and quiet steps, drafter fallbacks); not counted as drafts.",
        ),
        _gateway("lyanna_spec_draft_tokens_total", COUNTER, "Draft tokens verified."),
        _gateway("lyanna_spec_accepted_tokens_total", COUNTER, "Draft tokens accepted."),
        _gateway(
            "lyanna_spec_accepted_tokens_per_position_total",
            COUNTER,
            "Draft tokens accepted at each depth (position 0 = depth 1).",
            "position",
        ),
        _gateway(
            "lyanna_spec_resampled_accepted_tokens_total",
            COUNTER,
            "Accepted tokens only a re-sampled (fused) subtree proposed (Lyanna).",
        ),
        _gateway(
            "lyanna_spec_acceptance_length",
            HISTOGRAM,
            "Tokens emitted per draft (accepted + 1; root-only steps left out).",
            buckets=ACCEPTANCE_BUCKETS,
        ),
        _gateway(
            "lyanna_spec_draft_latency_seconds",
            HISTOGRAM,
            "Drafting time of the micro-batch holding a request, per verification.",
            buckets=LATENCY_BUCKETS,
        ),
        _gateway(
            "lyanna_spec_verify_latency_seconds",
            HISTOGRAM,
            "Verification forward time of the micro-batch holding a request.",
            buckets=LATENCY_BUCKETS,
        ),
        _gateway(
            "lyanna_spec_drafter_fallback_total",
            COUNTER,
            "Steps of a drafted request the gateway verified root-only straight against the "
            "verifier because the drafter service did not draft them (unreachable, late, "
            "failed or out of step with the sequence; services mode). Not counted: quiet "
            "steps the drafter announced, and steps the drafter's own n-gram fallback drafted "
            "(lyanna_drafter_steps_total).",
        ),
        _gateway(
            "lyanna_request_time_to_first_token_seconds",
            HISTOGRAM,
            "Time from request arrival to its first output token.",
            buckets=REQUEST_BUCKETS,
        ),
        _gateway(
            "lyanna_request_inter_token_latency_seconds",
            HISTOGRAM,
            "Time between consecutive output deltas of a request.",
            buckets=LATENCY_BUCKETS,
        ),
        _gateway(
            "lyanna_request_time_per_output_token_seconds",
            HISTOGRAM,
            "Per request: (e2e - ttft) / (output tokens - 1).",
            buckets=LATENCY_BUCKETS,
        ),
        _gateway(
            "lyanna_request_e2e_latency_seconds",
            HISTOGRAM,
            "Time from request arrival to its last token.",
            buckets=REQUEST_BUCKETS,
        ),
        _gateway("lyanna_num_requests_running", GAUGE, "Requests generating tokens."),
        _gateway("lyanna_num_requests_waiting", GAUGE, "Requests waiting for their first token."),
        _gateway("lyanna_prompt_tokens_total", COUNTER, "Prompt tokens of admitted requests."),
        _gateway("lyanna_generation_tokens_total", COUNTER, "Output tokens sent."),
        _gateway(
            "lyanna_request_success_total",
            COUNTER,
            "Finished requests by finish reason (stop, length, abort, error), as vLLM's. "
            "Requests refused with a 429 are not here (lyanna_request_rejected_total).",
            "finish_reason",
        ),
        _gateway(
            "lyanna_request_rejected_total",
            COUNTER,
            "Requests refused with a 429 by reason: queue_full (the backend is busy: full "
            "waiting queue or no slot in time), too_many_requests (a key's requests in "
            "flight), rate_limit_exceeded (a key's tokens per minute). method is none where "
            "the refusal came before the request was read.",
            "reason",
        ),
        _gateway(
            "lyanna_http_responses_total",
            COUNTER,
            "HTTP responses by path (the routes; other for any unknown path) and status code, "
            "4xx and 5xx included. method is none where no method was chosen (the request "
            "was refused before its intake, or is not a generation).",
            "path",
            "code",
        ),
    ),
)

VERIFIER = Process(
    "verifier",
    "lyanna_verifier_",
    (
        MetricSpec(
            "lyanna_verifier_forward_seconds",
            HISTOGRAM,
            "Seconds of one Prefill or Verify call's model work (forward + acceptance rules).",
            ("op",),
            FORWARD_BUCKETS,
        ),
        MetricSpec(
            "lyanna_verifier_rule_seconds",
            HISTOGRAM,
            "Seconds of one Verify call's acceptance rules (row softmax, rule, KV commit).",
            buckets=FORWARD_BUCKETS,
        ),
        MetricSpec(
            "lyanna_verifier_tree_tokens",
            HISTOGRAM,
            "Draft tokens in one sequence's verified tree (after fusion).",
            buckets=TREE_BUCKETS,
        ),
        MetricSpec(
            "lyanna_verifier_sequences_verified_total",
            COUNTER,
            "Sequence verifications (one per sequence per Verify call).",
        ),
        MetricSpec("lyanna_verifier_accepted_tokens_total", COUNTER, "Draft tokens accepted."),
        MetricSpec("lyanna_verifier_prefill_tokens_total", COUNTER, "Prompt tokens prefilled."),
        MetricSpec("lyanna_verifier_kv_slots", GAUGE, "KV sequence slots by state.", ("state",)),
    ),
)

DRAFTER = Process(
    "drafter",
    "lyanna_drafter_",
    (
        MetricSpec(
            "lyanna_drafter_draft_seconds",
            HISTOGRAM,
            "Seconds of one Step call's drafting (learning unseen steps + proposing).",
            buckets=FORWARD_BUCKETS,
        ),
        MetricSpec("lyanna_drafter_proposals_total", COUNTER, "Trees proposed (one per sequence)."),
        MetricSpec("lyanna_drafter_proposed_tokens_total", COUNTER, "Draft tokens proposed."),
        MetricSpec(
            "lyanna_drafter_starts_total",
            COUNTER,
            "First starts of a sequence (Start items without resync); starts again after a "
            "lost state count in lyanna_drafter_resyncs_total.",
        ),
        MetricSpec(
            "lyanna_drafter_resyncs_total",
            COUNTER,
            "Sequences started again from the caller's history because the drafter lost or "
            "dropped their state (drafter restart, a failed, late or missed step; Start items "
            "with resync).",
        ),
        MetricSpec(
            "lyanna_drafter_steps_total",
            COUNTER,
            "Verified sequence-steps the drafter learned, by what drafted the tree: method "
            "(the configured drafter; every step of an ungated one), fallback (gated off, the "
            "free n-gram fallback drafted it), plain (gated off without a fallback: a "
            "root-only step, quiet steps included).",
            ("source",),
        ),
        MetricSpec("lyanna_drafter_sequences", GAUGE, "Sequences the drafter holds state for."),
    ),
)

PROCESSES = (GATEWAY, VERIFIER, DRAFTER)
BY_NAME = {spec.name: spec for process in PROCESSES for spec in process.metrics}
if len(BY_NAME) != sum(len(process.metrics) for process in PROCESSES):
    raise ValueError("a metric name is registered twice")


def sample_names() -> set[str]:
    """Every sample name the three processes export (what a PromQL query may read)."""
    return {sample for spec in BY_NAME.values() for sample in spec.samples}
