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

from lyanna.async_engine import TokenDelta
from lyanna.stats import acceptance_length
from lyanna.step_facts import StepFacts
from services.metric_registry import GATEWAY, GATEWAY_LABELS, HISTOGRAM

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
    """Every metric the gateway exports, looked up by name, with helpers that record one
    event each."""

    def __init__(self, model: str, service: str) -> None:
        self.model, self.service = model, service
        self._built = GATEWAY.build()
        self.registry = self._built.registry

    def labels(self, method: str) -> dict[str, str]:
        return {"method": method, "model": self.model, "service": self.service}

    def __call__(self, name: str, method: str, **extra: str):
        """``lyanna_<name>``'s series for ``method`` (and ``extra`` labels)."""
        return self._built[f"lyanna_{name}"].labels(**self.labels(method), **extra)

    def prime(self, method: str) -> None:
        """``method``'s counters and gauges at zero (those without a per-position or
        per-reason label), so scrapes and dashboards see the names before any request."""
        for spec in GATEWAY.metrics:
            if spec.kind != HISTOGRAM and spec.labels == GATEWAY_LABELS:
                self._built[spec.name].labels(**self.labels(method))
        self("request_rejected_total", method, reason="queue_full")

    def response(self, path: str, status: int, method: str | None) -> None:
        """One HTTP response (any status) on ``path``."""
        if path not in PATHS:
            path = "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        self("http_responses_total", method or NO_METHOD, path=path, code=str(status)).inc()

    def reject(self, reason: str, method: str | None = None) -> None:
        """A request refused with a 429 (a refusal, not an error)."""
        self("request_rejected_total", method or NO_METHOD, reason=reason).inc()

    def record_step(self, step: StepFacts) -> None:
        """One verification of one request: a draft step when it verified a draft token,
        a root-only step otherwise (which accepts nothing)."""
        method = step.method
        if step.num_drafted:
            self("spec_draft_steps_total", method).inc()
            if step.fallback_drafted:
                self("spec_fallback_draft_steps_total", method).inc()
            self("spec_draft_tokens_total", method).inc(step.num_drafted)
            self("spec_accepted_tokens_total", method).inc(step.num_accepted)
            for position in range(step.num_accepted):
                at = str(min(position, MAX_POSITIONS - 1))
                self("spec_accepted_tokens_per_position_total", method, position=at).inc()
            if step.num_resampled_accepted:
                self("spec_resampled_accepted_tokens_total", method).inc(
                    step.num_resampled_accepted
                )
            self("spec_acceptance_length", method).observe(step.num_accepted + 1)
        else:
            self("spec_root_only_steps_total", method).inc()
        self("spec_draft_latency_seconds", method).observe(step.draft_seconds)
        self("spec_verify_latency_seconds", method).observe(step.verify_seconds)
        if step.drafter_fallback:
            self("spec_drafter_fallback_total", method).inc()

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
        self.metrics("num_requests_waiting", self.method).inc()

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.num_accepted, self.num_steps)

    def on_delta(self, delta: TokenDelta, num_sent_tokens: int) -> None:
        """A delta from the backend; ``num_sent_tokens`` of its tokens reach the client."""
        m, method, now = self.metrics, self.method, time.perf_counter()
        if delta.prompt_tokens:
            self.num_prompt_tokens = delta.prompt_tokens
            m("prompt_tokens_total", method).inc(delta.prompt_tokens)
        if delta.step is not None:
            self.num_steps += 1
            self.num_drafted += delta.step.num_drafted
            self.num_accepted += delta.step.num_accepted
            m.record_step(delta.step)
        if num_sent_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                m("request_time_to_first_token_seconds", method).observe(now - self.arrival)
                m("num_requests_waiting", method).dec()
                m("num_requests_running", method).inc()
            elif self.last_delta_at is not None:
                gap = now - self.last_delta_at
                m("request_inter_token_latency_seconds", method).observe(gap)
            self.last_delta_at = now
            self.num_output_tokens += num_sent_tokens
            m("generation_tokens_total", method).inc(num_sent_tokens)

    def reject(self, reason: str) -> None:
        """A 429 before the first token: rejected, not finished; idempotent."""
        if self.finished:
            return
        self.finished = True
        self.metrics("num_requests_waiting", self.method).dec()
        self.metrics.reject(reason, self.method)

    def finish(self, finish_reason: str) -> None:
        """The request ended (normally, by error or by the client leaving); idempotent."""
        if self.finished:
            return
        self.finished = True
        m, method, now = self.metrics, self.method, time.perf_counter()
        started = self.first_token_at is not None
        m("num_requests_running" if started else "num_requests_waiting", method).dec()
        m("request_success_total", method, finish_reason=finish_reason).inc()
        m("request_e2e_latency_seconds", method).observe(now - self.arrival)
        if started and self.num_output_tokens > 1:
            per_token = (now - self.first_token_at) / (self.num_output_tokens - 1)
            m("request_time_per_output_token_seconds", method).observe(per_token)
