"""deploy/: the Kubernetes manifests are consistent (every kustomization resource exists,
selectors match pod labels, Services target declared container ports, the gateway reaches the
services by their Service names, every setting in the ConfigMap is accepted by the config
classes of the process that reads it) and every Grafana query names a metric of the
gateway's registry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from deploy.grafana import dashboard as grafana_dashboard
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from services.config import ServerConfig, parse_configs
from services.drafter.server import DrafterConfig
from services.metrics import DrafterMetrics, VerifierMetrics
from services.verifier.server import VerifierConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def documents() -> dict[tuple[str, str], dict]:
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    docs = {}
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / "k8s" / resource).read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def test_deployments_services_and_gpus() -> None:
    docs = documents()
    deployments = {name: d for (kind, name), d in docs.items() if kind == "Deployment"}
    assert set(deployments) == {"lyanna-verifier", "lyanna-drafter", "lyanna-gateway"}
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        service = docs[("Service", name)]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        if name == "lyanna-gateway":
            assert "nvidia.com/gpu" not in limits
            continue
        assert limits["nvidia.com/gpu"] == 1
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["spec"]["tolerations"])
        terms = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        products = terms[0]["matchExpressions"][0]["values"]
        assert any("A800" in p for p in products) and any("H800" in p for p in products)


def test_configmap_is_valid_for_every_process() -> None:
    docs = documents()
    env = docs[("ConfigMap", "lyanna-config")]["data"]
    assert all(isinstance(v, str) for v in env.values())
    verifier_server, verifier = parse_configs(
        (ServerConfig, VerifierConfig), [], "LYANNA_VERIFIER_", env=env
    )
    drafter_server, drafter = parse_configs(
        (ServerConfig, DrafterConfig), [], "LYANNA_DRAFTER_", env=env
    )
    gateway = GatewayConfig.from_env(env, mode="services")
    services = {name: d for (kind, name), d in docs.items() if kind == "Service"}
    for server, name, key in (
        (verifier_server, "lyanna-verifier", "LYANNA_VERIFIER_ADDR"),
        (drafter_server, "lyanna-drafter", "LYANNA_DRAFTER_ADDR"),
    ):
        assert env[key] == f"{name}:{server.port}"
        assert services[name]["spec"]["ports"][0]["port"] == server.port
        assert server.host == "0.0.0.0"
    assert drafter.method == "lyanna" and verifier.max_len >= gateway.max_prompt_tokens
    gateway_pod = docs[("Deployment", "lyanna-gateway")]["spec"]["template"]
    assert gateway_pod["metadata"]["annotations"]["prometheus.io/port"] == str(gateway.port)
    assert "services" in gateway_pod["spec"]["containers"][0]["command"]


def registered_samples() -> set[str]:
    """Every sample name the gateway, verifier and drafter registries export."""
    registries = [
        GatewayMetrics("m", "s").registry,
        VerifierMetrics(1).registry,
        DrafterMetrics().registry,
    ]
    return {
        sample
        for registry in registries
        for family in registry.collect()
        for sample in (
            family.name,
            f"{family.name}_total",
            f"{family.name}_bucket",
            f"{family.name}_count",
            f"{family.name}_sum",
        )
    }


def test_dashboard_is_generated_and_current() -> None:
    committed = (DEPLOY / "grafana" / "lyanna.json").read_text()
    assert committed == grafana_dashboard.render(), "run: python -m deploy.grafana.dashboard"


def test_dashboard_queries_use_registered_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "lyanna.json").read_text())
    registered = registered_samples()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 20
    for expr in exprs:
        names = set(re.findall(r"\blyanna_[a-z0-9_]+", expr))
        assert names and names <= registered, expr
    used = {n for expr in exprs for n in re.findall(r"\blyanna_[a-z]+_[a-z0-9_]+", expr)}
    # the verifier's and drafter's own metrics have panels too
    assert any(n.startswith("lyanna_verifier_") for n in used)
    assert any(n.startswith("lyanna_drafter_") for n in used)
    titles = " ".join(panel["title"] for panel in dashboard["panels"])
    for needed in (
        "Acceptance length",
        "Acceptance length distribution",
        "Conditional acceptance per depth",
        "Re-sampled share",
        "Tokens/s",
        "Time to first token",
        "Inter-token latency",
        "End-to-end latency",
        "KV slots",
        "fallback",
    ):
        assert needed in titles, needed
    kinds = {panel["type"] for panel in dashboard["panels"]}
    assert {"stat", "timeseries", "heatmap"} <= kinds
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "method"} <= variables


def test_acceptance_panels_leave_out_target_only_and_fallback_steps() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "lyanna.json").read_text())
    panel = next(p for p in dashboard["panels"] if p["title"] == "Acceptance length")
    expr = panel["targets"][0]["expr"]
    assert 'method!="ar"' in expr and "lyanna_spec_drafter_fallback_total" in expr
