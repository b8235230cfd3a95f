"""The gateway's Prometheus metrics (prefix ``lyanna_``), recorded per request.

Names, types, labels, help texts and buckets come from ``services.metric_registry`` (the one
registry of the three processes' metrics; docs/metrics.md says what each means). Semantics
follow vLLM: a *draft step* verified at least one draft token, so ``1 + accepted_tokens_total
/ draft_steps_total`` is vLLM's mean acceptance length; a root-only verification counts in
``lyanna_spec_root_only_steps_total`` instead. Labels: ``method``, ``model`` and ``service``
(the deployment mode). Each ``GatewayMetrics`` owns its registry (two gateways in a test)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest, start_http_server

from gateway.backend import TokenDelta
from lyanna.stats import acceptance_length
from lyanna.step_facts import StepFacts
from services.metric_registry import GATEWAY

MAX_POSITIONS = 32  # per-position series beyond this depth are folded into the last one
NO_METHOD = "none"  # the method label of responses sent before a method was chosen
PATHS = (  # the path label's values (bounded: any other path is "other")
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/livez",
    "/readyz",
    "/metrics",
)


class GatewayMetrics:
    """Every metric the gateway exports, with helpers that record one event each."""

    def __init__(self, model: str, service: str) -> None:
        self.model, self.service = model, service
        built = GATEWAY.build()
        self.registry = built.registry
        self.draft_steps = built.counter("lyanna_spec_draft_steps_total")
        self.root_only_steps = built.counter("lyanna_spec_root_only_steps_total")
        self.fallback_draft_steps = built.counter("lyanna_spec_fallback_draft_steps_total")
        self.draft_tokens = built.counter("lyanna_spec_draft_tokens_total")
        self.accepted_tokens = built.counter("lyanna_spec_accepted_tokens_total")
        self.accepted_per_position = built.counter("lyanna_spec_accepted_tokens_per_position_total")
        self.resampled_accepted = built.counter("lyanna_spec_resampled_accepted_tokens_total")
        self.acceptance_length = built.histogram("lyanna_spec_acceptance_length")
        self.draft_latency = built.histogram("lyanna_spec_draft_latency_seconds")
        self.verify_latency = built.histogram("lyanna_spec_verify_latency_seconds")
        self.drafter_fallbacks = built.counter("lyanna_spec_drafter_fallback_total")
        self.ttft = built.histogram("lyanna_request_time_to_first_token_seconds")
        self.inter_token_latency = built.histogram("lyanna_request_inter_token_latency_seconds")
        self.time_per_output_token = built.histogram("lyanna_request_time_per_output_token_seconds")
        self.e2e_latency = built.histogram("lyanna_request_e2e_latency_seconds")
        self.running = built.gauge("lyanna_num_requests_running")
        self.waiting = built.gauge("lyanna_num_requests_waiting")
        self.prompt_tokens = built.counter("lyanna_prompt_tokens_total")
        self.generation_tokens = built.counter("lyanna_generation_tokens_total")
        self.requests = built.counter("lyanna_request_success_total")
        self.rejected = built.counter("lyanna_request_rejected_total")
        self.responses = built.counter("lyanna_http_responses_total")

    def labels(self, method: str) -> dict[str, str]:
        return {"method": method, "model": self.model, "service": self.service}

    def prime(self, method: str) -> None:
        """``method``'s counters and gauges at zero (those without a per-position or
        per-reason label), so scrapes and dashboards see the names before any request."""
        labels = self.labels(method)
        for metric in (
            self.draft_steps,
            self.root_only_steps,
            self.fallback_draft_steps,
            self.draft_tokens,
            self.accepted_tokens,
            self.resampled_accepted,
            self.drafter_fallbacks,
            self.running,
            self.waiting,
            self.prompt_tokens,
            self.generation_tokens,
        ):
            metric.labels(**labels)
        self.rejected.labels(**labels, reason="queue_full")

    def response(self, path: str, status: int, method: str | None) -> None:
        """One HTTP response (any status) on ``path``."""
        if path not in PATHS:
            path = "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        labels = self.labels(method or NO_METHOD)
        self.responses.labels(**labels, path=path, code=str(status)).inc()

    def reject(self, reason: str, method: str | None = None) -> None:
        """A request refused with a 429 (a refusal, not an error)."""
        self.rejected.labels(**self.labels(method or NO_METHOD), reason=reason).inc()

    def record_step(self, step: StepFacts) -> None:
        """One verification of one request: a draft step when it verified a draft token,
        a root-only step otherwise (which accepts nothing)."""
        labels = self.labels(step.method)
        if step.num_drafted:
            self.draft_steps.labels(**labels).inc()
            if step.fallback_drafted:
                self.fallback_draft_steps.labels(**labels).inc()
            self.draft_tokens.labels(**labels).inc(step.num_drafted)
            self.accepted_tokens.labels(**labels).inc(step.num_accepted)
            for position in range(step.num_accepted):
                position_label = str(min(position, MAX_POSITIONS - 1))
                self.accepted_per_position.labels(**labels, position=position_label).inc()
            if step.num_resampled_accepted:
                self.resampled_accepted.labels(**labels).inc(step.num_resampled_accepted)
            self.acceptance_length.labels(**labels).observe(step.num_accepted + 1)
        else:
            self.root_only_steps.labels(**labels).inc()
        self.draft_latency.labels(**labels).observe(step.draft_seconds)
        self.verify_latency.labels(**labels).observe(step.verify_seconds)
        if step.drafter_fallback:
            self.drafter_fallbacks.labels(**labels).inc()

    def serve(self, host: str, port: int):
        """The HTTP server exporting on a port of its own when ``port >= 0`` (0: a free one;
        a NetworkPolicy can keep it to Prometheus), else None."""
        if port < 0:
            return None
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@dataclass(slots=True)
class RequestTracker:
    """One request in the metrics (waiting -> running -> finished), and its speculation
    summary for the usage block."""

    metrics: GatewayMetrics
    method: str
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_delta_at: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    finished: bool = False

    def __post_init__(self) -> None:
        self.metrics.waiting.labels(**self.metrics.labels(self.method)).inc()

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.num_accepted, self.num_steps)

    def on_delta(self, delta: TokenDelta, num_sent_tokens: int) -> None:
        """A delta from the backend; ``num_sent_tokens`` of its tokens reach the client."""
        m, labels, now = self.metrics, self.metrics.labels(self.method), time.perf_counter()
        if delta.prompt_tokens:
            self.num_prompt_tokens = delta.prompt_tokens
            m.prompt_tokens.labels(**labels).inc(delta.prompt_tokens)
        if delta.step is not None:
            self.num_steps += 1
            self.num_drafted += delta.step.num_drafted
            self.num_accepted += delta.step.num_accepted
            m.record_step(delta.step)
        if num_sent_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                m.ttft.labels(**labels).observe(now - self.arrival)
                m.waiting.labels(**labels).dec()
                m.running.labels(**labels).inc()
            elif self.last_delta_at is not None:
                m.inter_token_latency.labels(**labels).observe(now - self.last_delta_at)
            self.last_delta_at = now
            self.num_output_tokens += num_sent_tokens
            m.generation_tokens.labels(**labels).inc(num_sent_tokens)

    def reject(self, reason: str) -> None:
        """A 429 before the first token: rejected, not finished; idempotent."""
        if self.finished:
            return
        self.finished = True
        self.metrics.waiting.labels(**self.metrics.labels(self.method)).dec()
        self.metrics.reject(reason, self.method)

    def finish(self, finish_reason: str) -> None:
        """The request ended (normally, by error or by the client leaving); idempotent."""
        if self.finished:
            return
        self.finished = True
        m, labels, now = self.metrics, self.metrics.labels(self.method), time.perf_counter()
        (m.running if self.first_token_at is not None else m.waiting).labels(**labels).dec()
        m.requests.labels(**labels, finish_reason=finish_reason).inc()
        m.e2e_latency.labels(**labels).observe(now - self.arrival)
        if self.first_token_at is not None and self.num_output_tokens > 1:
            decode_seconds = now - self.first_token_at
            per_token = decode_seconds / (self.num_output_tokens - 1)
            m.time_per_output_token.labels(**labels).observe(per_token)
