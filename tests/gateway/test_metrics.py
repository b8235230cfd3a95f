"""/metrics after real requests: every metric the registry lists for the gateway is exposed
with its registered labels (method, model and service on every lyanna_ series), and the
speculation counters add up (n-gram on repetitive output accepts tokens)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.metric_registry import GATEWAY, HISTOGRAM
from tests.gateway.conftest import MODEL_NAME, start_gateway


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """name -> {sorted label items -> value} (counters under their ``_total`` sample name)."""
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


@pytest.fixture(scope="module")
def scraped(loaded):
    server = start_gateway(loaded)
    try:
        completion_tokens = 0
        for i in range(3):
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "one two three " * 4 + str(i)}],
                "max_tokens": 48,
                "temperature": 0,
                "stream": i == 2,
            }
            response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200
            if i < 2:
                completion_tokens += response.json()["usage"]["completion_tokens"]
        yield scrape(server.url), completion_tokens
    finally:
        server.stop()


def only(samples: dict[tuple, float], **labels) -> float:
    matches = [v for k, v in samples.items() if set(labels.items()) <= set(k)]
    assert len(matches) == 1, (labels, samples)
    return matches[0]


def test_every_name_has_method_model_service_labels(scraped) -> None:
    samples, _ = scraped
    assert len(GATEWAY.metrics) >= 18
    for spec in GATEWAY.metrics:  # after three requests every registered series exists
        name = spec.name + ("_count" if spec.kind == HISTOGRAM else "")
        assert name in samples, name
        for labels in samples[name]:
            assert dict(labels).keys() == set(spec.labels), name
    for name, series in samples.items():
        if name.startswith("lyanna_"):
            for labels in series:
                assert {"method", "model", "service"} <= dict(labels).keys(), name
    labels = {"method": "ngram", "model": MODEL_NAME, "service": "embedded"}
    verifications = only(samples["lyanna_spec_draft_steps_total"], **labels)
    verifications += only(samples["lyanna_spec_root_only_steps_total"], **labels)
    assert verifications > 0  # drafts + root-only steps (the cost curve may prune every draft)


def test_speculation_counters_add_up(scraped) -> None:
    samples, _ = scraped
    steps = only(samples["lyanna_spec_draft_steps_total"], method="ngram")
    drafted = only(samples["lyanna_spec_draft_tokens_total"], method="ngram")
    accepted = only(samples["lyanna_spec_accepted_tokens_total"], method="ngram")
    assert 0 < accepted <= drafted  # repetitive output: the n-gram drafter must hit
    per_position = samples["lyanna_spec_accepted_tokens_per_position_total"]
    by_position = {int(dict(k)["position"]): v for k, v in per_position.items()}
    assert sum(by_position.values()) == accepted
    ordered = [by_position[p] for p in sorted(by_position)]
    assert ordered == sorted(ordered, reverse=True)  # depth d needs depth d - 1
    histogram_count = only(samples["lyanna_spec_acceptance_length_count"], method="ngram")
    histogram_sum = only(samples["lyanna_spec_acceptance_length_sum"], method="ngram")
    assert histogram_count == steps and histogram_sum == steps + accepted
    assert only(samples["lyanna_spec_resampled_accepted_tokens_total"], method="ngram") == 0


def test_request_metrics(scraped) -> None:
    samples, completion_tokens = scraped
    assert only(samples["lyanna_request_time_to_first_token_seconds_count"]) == 3
    assert only(samples["lyanna_request_e2e_latency_seconds_count"]) == 3
    assert only(samples["lyanna_request_success_total"], finish_reason="length") == 3
    assert only(samples["lyanna_generation_tokens_total"]) == completion_tokens + 48
    assert only(samples["lyanna_prompt_tokens_total"]) > 3 * 12
    assert only(samples["lyanna_num_requests_running"]) == 0
    assert only(samples["lyanna_num_requests_waiting"]) == 0
