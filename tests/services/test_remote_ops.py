"""What an operator sees of real services: each exports its own Prometheus metrics, and
serves gRPC health, with reflection only when asked."""

from __future__ import annotations

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from lyanna.sampling import SamplingParams
from tests.services.remote_client import (
    METRICS_PORTS,
    PROMPTS,
    config_for,
    run_remote,
)


def scrape(port: int) -> dict[str, float]:
    """Every sample of a /metrics page, keyed by name and labels."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_verifier_and_drafter_export_their_own_metrics(ngram_services) -> None:
    ports = METRICS_PORTS
    before = scrape(ports["verifier"]), scrape(ports["drafter"])
    outcomes, _ = run_remote(config_for(ngram_services), PROMPTS[:2], SamplingParams(max_tokens=12))
    verifier, drafter = scrape(ports["verifier"]), scrape(ports["drafter"])

    def grew(now, then, name):
        return now[name] - then.get(name, 0.0)

    verified = grew(verifier, before[0], "lyanna_verifier_sequences_verified_total")
    assert verified == sum(len(o.steps) for o in outcomes) > 0
    accepted = grew(verifier, before[0], "lyanna_verifier_accepted_tokens_total")
    assert accepted == sum(s.num_accepted for o in outcomes for s in o.steps)
    assert grew(verifier, before[0], "lyanna_verifier_tree_tokens_count") == verified
    verify_calls = grew(verifier, before[0], "lyanna_verifier_forward_seconds_count,op=verify")
    assert grew(verifier, before[0], "lyanna_verifier_rule_seconds_count") == verify_calls >= 1
    assert grew(verifier, before[0], "lyanna_verifier_rule_seconds_sum") > 0
    assert grew(verifier, before[0], "lyanna_verifier_forward_seconds_count,op=prefill") >= 1
    assert verifier["lyanna_verifier_kv_slots,state=free"] == 8  # released after the requests
    assert verifier["lyanna_verifier_kv_slots,state=used"] == 0
    drafted = sum(s.num_drafted for o in outcomes for s in o.steps)
    assert grew(drafter, before[1], "lyanna_drafter_proposed_tokens_total") >= drafted > 0
    assert grew(drafter, before[1], "lyanna_drafter_starts_total") == 2
    assert grew(drafter, before[1], "lyanna_drafter_resyncs_total") == 0  # none lost
    proposals = grew(drafter, before[1], "lyanna_drafter_proposals_total")
    # the n-gram method is ungated: every learned step is its own
    assert grew(drafter, before[1], "lyanna_drafter_steps_total,source=method") == proposals
    for source in ("fallback", "plain"):
        assert grew(drafter, before[1], f"lyanna_drafter_steps_total,source={source}") == 0
    assert grew(drafter, before[1], "lyanna_drafter_draft_seconds_count") >= 1


def test_reflection_is_off_unless_asked(lyanna_services) -> None:
    with grpc.insecure_channel(lyanna_services.verifier_addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="lyanna.v1.Verifier"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as refused:
            list(reflection.ServerReflectionInfo(iter([ask]), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_health_and_reflection(ngram_services) -> None:
    for addr, service in (
        (ngram_services.verifier_addr, "lyanna.v1.Verifier"),
        (ngram_services.drafter_addr, "lyanna.v1.Drafter"),
    ):
        with grpc.insecure_channel(addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            [answer] = list(reflection.ServerReflectionInfo(iter([ask]), timeout=5))
            names = {s.name for s in answer.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names
