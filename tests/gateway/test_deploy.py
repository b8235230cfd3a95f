"""deploy/: the Kubernetes manifests are consistent (every kustomization resource exists,
selectors match pod labels, Services target declared container ports, the gateway reaches the
services by their Service names, every setting in the ConfigMap is accepted by the config
classes of the process that reads it) and every Grafana query names a metric of the
gateway's registry. The overlays are composed by ``kubectl kustomize`` (kustomize v5, what an
operator's ``kubectl apply -k`` runs; ``make test`` checks it is installed), never by a
re-implementation; docs/deploy.md and deploy/k8s/README.md name only paths, modules, flags,
settings and objects that exist."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from yamllint import linter as yamllint_linter
from yamllint.config import YamlLintConfig

from deploy.grafana import dashboard as grafana_dashboard
from deploy.prometheus import rules as prometheus_rules
from gateway import cli as gateway_cli
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from lyanna.model import huge_pages
from services.config import ServerConfig, parse_configs
from services.drafter.server import DrafterConfig
from services.metrics import DrafterMetrics, VerifierMetrics
from services.server import LIVENESS, READINESS
from services.verifier.config import VerifierConfig
from tests.gateway import crds

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


OVERLAYS = ("cpu", "a800", "h800")
GATEWAY_IMAGE_OBJECTS = ("lyanna-gateway", "lyanna-fetch-model")  # the rest: services image
OPERATOR_KINDS = ("ServiceMonitor", "PrometheusRule")  # CRDs: schemas in tests/gateway/crds
K8S_VERSION = "1.30.0"  # the oldest minor the manifests promise to validate against
YAMLLINT = """
extends: default
rules:
  line-length: {max: 120, level: warning}
  document-start: disable
  truthy: {check-keys: false}
  comments: {min-spaces-from-content: 1}
  braces: {max-spaces-inside: 1}
  indentation: {indent-sequences: whatever}
"""


def kubectl() -> str:
    """The kubectl binary (its built-in kustomize composes the overlays): missing, the test
    fails; ``make test`` refuses to start without it (``make kubectl``)."""
    binary = shutil.which("kubectl")
    assert binary is not None, "kubectl is not on PATH: see `make kubectl`"
    return binary


def kustomize_build(directory: Path) -> list[dict]:
    """The objects ``kubectl kustomize <directory>`` renders, in its order."""
    built = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


@functools.cache
def _overlay(overlay: str) -> str:
    return json.dumps(kustomize_build(DEPLOY / "k8s" / "overlays" / overlay))


def documents(overlay: str = "cpu") -> dict[tuple[str, str], dict]:
    """The objects ``kubectl apply -k deploy/k8s/overlays/<overlay>`` creates (a fresh copy
    each call; kubectl runs once per overlay)."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in json.loads(_overlay(overlay))}


def test_kubectl_ships_kustomize_v5() -> None:
    """The manifests use kustomize v5 fields (labels, patches with targets); kubectl 1.27+
    carries it."""
    version = subprocess.run(
        [kubectl(), "version", "--client"], capture_output=True, text=True, timeout=60
    )
    found = re.search(r"Kustomize Version: v(\d+)\.", version.stdout)
    assert found and int(found.group(1)) >= 5, version.stdout


def pod_of(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_render_and_validate_strictly(overlay: str) -> None:
    docs = documents(overlay)
    for (kind, name), doc in docs.items():
        if kind not in OPERATOR_KINDS:  # those: test_operator_objects_follow_the_upstream_crds
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any error
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == "lyanna", (kind, name)
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "lyanna"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_pools_and_placement(overlay: str) -> None:
    """GPU pools: the verifier and the drafter each on one GPU of the pool, both told the same
    device, dtype and weights (the drafter measures its cost curve on the target and takes
    its hidden rows), hidden states over NCCL; the CPU overlay: no GPU, no data plane."""
    docs = documents(overlay)
    config = docs[("ConfigMap", "lyanna-config")]["data"]
    planes = {config[f"LYANNA_{key}PLANE"] for key in ("VERIFIER_", "DRAFTER_", "DATA_")}
    assert planes == ({"grpc"} if overlay == "cpu" else {"nccl"})
    placements = []
    for role in ("verifier", "drafter"):
        pod = pod_of(docs[("Deployment", f"lyanna-{role}")])
        limits = pod["containers"][0]["resources"]["limits"]
        env = {e["name"]: e["value"] for e in pod["containers"][0].get("env", [])}
        if overlay == "cpu":
            assert "nvidia.com/gpu" not in limits and "nodeAffinity" not in pod.get("affinity", {})
            assert not any(k.endswith("_DEVICE") for k in env)
            continue
        assert limits["nvidia.com/gpu"] == 1
        assert pod["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == 1
        prefix = f"LYANNA_{role.upper()}_"
        assert env == {
            prefix + "DEVICE": "cuda",
            prefix + "DTYPE": "bfloat16",
            prefix + "WEIGHTS": "fp32",
        }
        placements.append({k.removeprefix(prefix): v for k, v in env.items()})
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        products = terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
        assert products and all(overlay.upper() in p for p in products)
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert "/dev/shm" in mounts
    if overlay != "cpu":
        assert placements[0] == placements[1]  # the drafter gets the verifier's placement
    drafter = pod_of(docs[("Deployment", "lyanna-drafter")])
    if overlay != "cpu":  # on the verifier's (tainted GPU) node
        assert any(t["key"] == "nvidia.com/gpu" for t in drafter["tolerations"])
        near = drafter["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert near[0]["podAffinityTerm"]["labelSelector"]["matchLabels"] == {
            "app.kubernetes.io/component": "verifier"
        }
    gateway = pod_of(docs[("Deployment", "lyanna-gateway")])
    assert "nvidia.com/gpu" not in gateway["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_volume_binds_where_the_overlay_runs(overlay: str) -> None:
    """One node (cpu: kind, a laptop) claims ReadWriteOnce, which kind's default local-path
    class offers (it refuses ReadWriteMany); the GPU pools' pods share it across nodes."""
    claim = documents(overlay)[("PersistentVolumeClaim", "lyanna-models")]
    mode = "ReadWriteOnce" if overlay == "cpu" else "ReadWriteMany"
    assert claim["spec"]["accessModes"] == [mode]


DIGEST = "sha256:" + "0" * 63 + "1"
PINNED = f"""apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [../h800]
images:
  - name: registry.example.com/lyanna/lyanna-services
    newName: localhost:5001/lyanna/lyanna-services
    digest: {DIGEST}
  - name: registry.example.com/lyanna/lyanna-gateway
    newName: localhost:5001/lyanna/lyanna-gateway
"""


def test_an_operators_overlay_pins_the_images(tmp_path) -> None:
    """An operator's own overlay over h800 that renames the images to a registry with a port
    and pins one by digest (docs/deploy.md) composes as documented."""
    shutil.copytree(DEPLOY / "k8s", tmp_path / "k8s")
    (tmp_path / "k8s" / "overlays" / "pinned").mkdir()
    (tmp_path / "k8s" / "overlays" / "pinned" / "kustomization.yaml").write_text(PINNED)
    docs = kustomize_build(tmp_path / "k8s" / "overlays" / "pinned")
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} == set(documents("h800"))
    images = {
        c["image"]
        for doc in docs
        if doc["kind"] in ("Deployment", "Job")
        for c in (*pod_of(doc).get("initContainers", []), *pod_of(doc)["containers"])
    }
    assert images == {
        f"localhost:5001/lyanna/lyanna-services@{DIGEST}",
        "localhost:5001/lyanna/lyanna-gateway:0.1.0",  # a new name only keeps the tag
    }


def test_pods_are_locked_down_bounded_and_read_the_model_volume() -> None:
    docs = documents("h800")
    pods = {name: pod_of(d) for (kind, name), d in docs.items() if kind in ("Deployment", "Job")}
    assert set(pods) == {
        "lyanna-verifier",
        "lyanna-drafter",
        "lyanna-gateway",
        "lyanna-fetch-model",
    }
    for name, pod in pods.items():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert claims == {"lyanna-models"}, name
        for container in (*pod.get("initContainers", []), *pod["containers"]):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
            assert context["capabilities"]["drop"] == ["ALL"]
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources[
                "limits"
            ]
            role = "gateway" if name in GATEWAY_IMAGE_OBJECTS else "services"
            assert container["image"] == f"registry.example.com/lyanna/lyanna-{role}:0.1.0"
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/models", "/tmp"} <= mounts, (name, container["name"])  # writable dirs


def test_probes_follow_what_each_process_can_answer() -> None:
    docs = documents()
    gateway = pod_of(docs[("Deployment", "lyanna-gateway")])["containers"][0]
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/livez"  # never its peers
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"  # target-only counts
    assert gateway["startupProbe"]["httpGet"]["path"] == "/livez"
    for role, port in (("verifier", 50051), ("drafter", 50052)):
        container = pod_of(docs[("Deployment", f"lyanna-{role}")])["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (role, probe)
        # the services' health names (services.server): liveness notices a hung compute
        # thread, readiness turns off at drain start
        assert container["livenessProbe"]["grpc"]["service"] == LIVENESS
        assert container["readinessProbe"]["grpc"]["service"] == READINESS


def test_every_pod_drains_before_it_is_killed() -> None:
    """A preStop sleep lets the endpoints drop each pod before SIGTERM, and the grace period
    covers that sleep plus the drain (the gateway's streams, the services' calls)."""
    docs = documents()
    env = docs[("ConfigMap", "lyanna-config")]["data"]
    drains = {
        "gateway": float(env["LYANNA_DRAIN_SECONDS"]) + 5,  # + uvicorn's final shutdown
        "verifier": float(env["LYANNA_VERIFIER_GRACE_SECONDS"]),
        "drafter": float(env["LYANNA_DRAFTER_GRACE_SECONDS"]),
    }
    assert drains["gateway"] > 30 + 5  # streams longer than 30 s are no longer cut
    for role, drain in drains.items():
        pod = pod_of(docs[("Deployment", f"lyanna-{role}")])
        command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        sleep = float(command[-1].split("sleep(")[1].rstrip(")"))
        assert sleep > 0
        assert pod["terminationGracePeriodSeconds"] > sleep + drain, role


def test_only_gateways_reach_the_services_and_the_gateway_scales() -> None:
    docs = documents()
    policy = docs[("NetworkPolicy", "lyanna-services")]
    grpc_rule = policy["spec"]["ingress"][0]
    assert grpc_rule["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}}}
    ]
    assert {p["port"] for p in grpc_rule["ports"]} == {50051, 50052}
    selected = policy["spec"]["podSelector"]["matchExpressions"][0]["values"]
    assert set(selected) == {"verifier", "drafter"}
    hpa = docs[("HorizontalPodAutoscaler", "lyanna-gateway")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "lyanna-gateway"
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in registered_samples()
    assert docs[("PodDisruptionBudget", "lyanna-gateway")]["spec"]["minAvailable"] == 1


def test_monitoring_objects_scrape_every_process_and_carry_the_generated_files() -> None:
    docs = documents()
    services = {name: d for (kind, name), d in docs.items() if kind == "Service"}
    scraped = set()
    for (kind, _), monitor in docs.items():
        if kind != "ServiceMonitor":
            continue
        for name, service in services.items():
            labels = service["metadata"]["labels"]
            selector = monitor["spec"]["selector"]
            match = selector.get("matchLabels", {}).items() <= labels.items()
            for expression in selector.get("matchExpressions", []):
                match &= labels.get(expression["key"]) in expression["values"]
            if match:
                ports = {p["name"] for p in service["spec"]["ports"]}
                assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
                scraped.add(name)
    assert scraped == {"lyanna-gateway", "lyanna-verifier", "lyanna-drafter"}
    board = docs[("ConfigMap", "lyanna-dashboard")]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["lyanna.json"]) == grafana_dashboard.dashboard()
    assert (DEPLOY / "k8s" / "base" / "grafana-dashboard.yaml").read_text() == (
        grafana_dashboard.config_map()
    )
    rule = docs[("PrometheusRule", "lyanna")]
    assert rule["spec"]["groups"]


def test_the_helm_values_wire_the_monitoring_objects() -> None:
    """The Helm values docs/deploy.md installs with: Prometheus takes the unlabelled
    ServiceMonitors and rules, Grafana's sidecar finds the dashboard ConfigMap by its label in
    any namespace, and prometheus-adapter serves the autoscaler's metric per pod."""
    docs = documents()
    values = {
        name: yaml.safe_load((DEPLOY / "prometheus" / f"{name}.values.yaml").read_text())
        for name in ("kube-prometheus-stack", "prometheus-adapter")
    }
    spec = values["kube-prometheus-stack"]["prometheus"]["prometheusSpec"]
    assert spec["serviceMonitorSelectorNilUsesHelmValues"] is False
    assert spec["ruleSelectorNilUsesHelmValues"] is False
    sidecar = values["kube-prometheus-stack"]["grafana"]["sidecar"]["dashboards"]
    labels = docs[("ConfigMap", "lyanna-dashboard")]["metadata"]["labels"]
    assert labels[sidecar["label"]] == sidecar["labelValue"] and sidecar["searchNamespace"] == "ALL"
    hpa = docs[("HorizontalPodAutoscaler", "lyanna-gateway")]["spec"]["metrics"][0]
    (rule,) = values["prometheus-adapter"]["rules"]["custom"]
    assert hpa["type"] == "Pods" and rule["name"]["as"] == hpa["pods"]["metric"]["name"]
    assert rule["seriesQuery"].startswith(hpa["pods"]["metric"]["name"] + "{")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


def test_every_manifest_passes_yamllint() -> None:
    config = YamlLintConfig(YAMLLINT)
    problems = [
        f"{path}:{p.line}: {p.desc}"
        for path in sorted(DEPLOY.rglob("*.yaml"))
        for p in yamllint_linter.run(path.read_text(), config, str(path))
        if p.level == "error"
    ]
    assert not problems, problems


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
    assert drafter.method == "lyanna"
    assert drafter.verifier == env["LYANNA_VERIFIER_ADDR"]  # each Step verifies through it
    assert (drafter.max_running, drafter.max_len) == (verifier.max_running, verifier.max_len)
    # a request at the advertised limits fits the KV with one tree on top (the verifier
    # reserves max_tree_nodes rows; the gateway refuses prompt + max_tokens beyond the rest)
    needed = gateway.max_prompt_tokens + gateway.max_output_tokens + verifier.max_tree_nodes
    assert needed <= verifier.max_len
    gateway_pod = pod_of(docs[("Deployment", "lyanna-gateway")])
    assert gateway_pod["containers"][0]["ports"][0]["containerPort"] == gateway.port
    assert "services" in gateway_pod["containers"][0]["command"]
    for role, server in (("verifier", verifier_server), ("drafter", drafter_server)):
        container = pod_of(docs[("Deployment", f"lyanna-{role}")])["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        expected = {"grpc": server.port, "metrics": server.metrics_port}
        if role == "verifier":  # rank 0 of the data plane listens for the drafter
            expected["plane"] = int(server.plane_addr.rsplit(":", 1)[1])
        assert ports == expected
    plane_port = int(verifier_server.plane_addr.rsplit(":", 1)[1])
    assert drafter_server.plane_addr == f"lyanna-verifier:{plane_port}"
    assert {"name": "plane", "port": plane_port, "targetPort": "plane"} in (
        services["lyanna-verifier"]["spec"]["ports"]
    )


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


def test_the_dashboard_and_the_rules_share_one_acceptance_length() -> None:
    """The acceptance-length panels and the recording rule are one formula over the draft
    counters (drafts only; root-only steps left out), with only the label filter, the window
    and the grouping differing; target-only decoding (ar) stays off the panels."""
    dashboard = json.loads((DEPLOY / "grafana" / "lyanna.json").read_text())

    def normalized(expr: str) -> str:
        expr = re.sub(r"\{[^}]*\}", "", expr)  # label filters
        expr = re.sub(r"\[[^]]*\]", "[w]", expr)  # windows
        return re.sub(r"sum( by \([^)]*\))? ", "sum ", expr)  # grouping

    (recorded,) = [
        r["expr"]
        for g in prometheus_rules.groups()
        for r in g["rules"]
        if r.get("record") == "lyanna:acceptance_length:rate5m"
    ]
    assert "lyanna_spec_draft_steps_total" in recorded and "root_only" not in recorded
    for title in ("Acceptance length", "Acceptance length per method"):
        panel = next(p for p in dashboard["panels"] if p["title"] == title)
        expr = panel["targets"][0]["expr"]
        assert 'method!="ar"' in expr, title
        assert normalized(expr) == normalized(recorded), title


def test_the_images_install_the_package_as_a_wheel_would(tmp_path) -> None:
    """The per-role images install the package non-editable (no repository beside it): the
    package must carry its generated stubs and the native decoder's sources, and find the
    drafter checkpoints through ``LYANNA_CHECKPOINTS`` (where services.Dockerfile copies
    them). Installed here as the images do, then imported from outside the repository."""
    repo = DEPLOY.parent
    for dockerfile in ("services", "gateway"):
        text = (DEPLOY / "images" / f"{dockerfile}.Dockerfile").read_text()
        assert "pip install --no-cache-dir ." in text and "-e ." not in text
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("lyanna", "gateway", "services"):
        shutil.copytree(repo / package, source / package, ignore=ignore)
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(target), str(source)], check=True, cwd=tmp_path)
    probe = (
        "import lyanna.engine, gateway.cli, services.pb.verifier_pb2\n"
        f"for module in (lyanna.engine, gateway.cli, services.pb.verifier_pb2):\n"
        f"    assert module.__file__.startswith({str(target)!r}), module.__file__\n"
        "from lyanna.model.native import SOURCE\n"
        "assert SOURCE.is_file() and SOURCE.with_name('block_matmul.h').is_file()\n"
        "from lyanna.drafters.eagle_head import DEFAULT_CHECKPOINT, load_eagle_head\n"
        "load_eagle_head(DEFAULT_CHECKPOINT)\n"
        "print(DEFAULT_CHECKPOINT)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LYANNA_CHECKPOINTS")}
    run = partial(subprocess.run, [sys.executable, "-c", probe], cwd=tmp_path, text=True)
    checkpoints = {"LYANNA_CHECKPOINTS": str(repo / "checkpoints")}
    found = run(env={**env, "PYTHONPATH": str(target), **checkpoints}, capture_output=True)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(repo / "checkpoints" / "eagle2-smollm2-135m")
    missing = run(env={**env, "PYTHONPATH": str(target)}, capture_output=True)
    assert "no EAGLE" in missing.stderr or "FileNotFoundError" in missing.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_operator_objects_follow_the_upstream_crds(overlay: str) -> None:
    """Every monitoring.coreos.com object passes its kind's CRD schema as the
    prometheus-operator project ships it (tests/gateway/crds/README.md), read as the API server
    reads it, with no field the API server would prune and only ObjectMeta fields in its
    metadata."""
    docs = [
        doc
        for doc in documents(overlay).values()
        if doc["apiVersion"].split("/")[0] == "monitoring.coreos.com"
    ]
    assert {d["kind"] for d in docs} == set(OPERATOR_KINDS)
    for doc in docs:
        assert crds.problems(doc, K8S_VERSION) == [], (doc["kind"], doc["metadata"]["name"])


def mutated(doc: dict, path: list, key: str, value: object) -> dict:
    """A copy of ``doc`` with ``key`` set to ``value`` in the node at ``path``."""
    copy = json.loads(json.dumps(doc))
    node = copy
    for step in path:
        node = node[step]
    node[key] = value
    return copy


ENDPOINT = ["spec", "endpoints", 0]
GROUP = ["spec", "groups", 0]
BROKEN = {
    "misspelt endpoint field": ("ServiceMonitor", ENDPOINT, "intreval", "15s", "'intreval' was"),
    "duration with a space": ("ServiceMonitor", ENDPOINT, "interval", "15 s", "does not match"),
    "string for a boolean": ("ServiceMonitor", ENDPOINT, "honorLabels", "yes", "of type 'bool"),
    "float for int-or-string": ("ServiceMonitor", ENDPOINT, "targetPort", 9101.5, "any of"),
    "null for a string": ("ServiceMonitor", ENDPOINT, "path", None, "(null): pruned"),
    "misspelt selector": ("ServiceMonitor", ["spec", "selector"], "matchLabel", {}, "pruned"),
    "misspelt metadata": ("ServiceMonitor", ["metadata"], "lables", {}, "'lables' was"),
    "group interval": ("PrometheusRule", GROUP, "interval", "half a minute", "does not match"),
    "strategy": ("PrometheusRule", GROUP, "partial_response_strategy", "never", "does not match"),
    "list of exprs": ("PrometheusRule", [*GROUP, "rules", 0], "expr", ["up"], "any of"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_the_crd_check_refuses_what_the_api_server_would_drop_or_reject(case: str) -> None:
    kind, path, key, value, why = BROKEN[case]
    name = "lyanna-gateway" if kind == "ServiceMonitor" else "lyanna"
    found = crds.problems(mutated(documents()[(kind, name)], path, key, value), K8S_VERSION)
    assert any(why in problem for problem in found), found


def test_the_crd_check_reads_the_schema_as_the_api_server_does() -> None:
    """Pruned fields are named by path; int-or-string takes either; RE2's ``^(?i)`` ignores
    case; a ``map`` list refuses two groups of one name; a kind with no vendored schema (a
    PodMonitor before its CRD is vendored) fails rather than passes unchecked."""
    docs = documents()
    monitor, rule = docs[("ServiceMonitor", "lyanna-gateway")], docs[("PrometheusRule", "lyanna")]
    assert crds.pruned(mutated(monitor, ENDPOINT, "intreval", "15s")) == [
        ".spec.endpoints[0].intreval"
    ]
    for port in (9101, "metrics"):
        assert crds.problems(mutated(monitor, ENDPOINT, "targetPort", port), K8S_VERSION) == []
    warn = mutated(rule, GROUP, "partial_response_strategy", "WARN")
    assert crds.problems(warn, K8S_VERSION) == []
    twice = mutated(rule, ["spec"], "groups", [rule["spec"]["groups"][0]] * 2)
    assert any("duplicate entry" in p for p in crds.problems(twice, K8S_VERSION))
    pod_monitor = {**monitor, "kind": "PodMonitor"}
    assert crds.problems(pod_monitor, K8S_VERSION) == [
        "no vendored CRD schema of monitoring.coreos.com/v1 PodMonitor"
    ]


DEPLOY_DOCS = (DEPLOY.parent / "docs" / "deploy.md", DEPLOY / "k8s" / "README.md")
KUBECTL_KINDS = {
    "job": "Job",
    "deployment": "Deployment",
    "svc": "Service",
    "hpa": "HorizontalPodAutoscaler",
    "pvc": "PersistentVolumeClaim",
}


def known_variables() -> set[str]:
    """Every ``LYANNA_*`` variable a process or image reads."""

    def names(prefix: str, *classes: type) -> set[str]:
        return {prefix + f.name.upper() for c in classes for f in dataclasses.fields(c)}

    return (
        names("LYANNA_", GatewayConfig)
        | names("LYANNA_VERIFIER_", ServerConfig, VerifierConfig)
        | names("LYANNA_DRAFTER_", ServerConfig, DrafterConfig)
        | set(documents()[("ConfigMap", "lyanna-config")]["data"])
        | {"LYANNA_CACHE", "LYANNA_CHECKPOINTS", "LYANNA_NATIVE_DIR", huge_pages.ENV}
    )


@pytest.mark.parametrize("doc", DEPLOY_DOCS, ids=lambda p: p.name)
def test_the_deploy_docs_name_only_what_exists(doc: Path) -> None:
    """The operator walk-through and the manifests' reference name only repository paths,
    ``python -m`` modules, ``lyanna`` flags, settings and objects that exist."""
    repo, text = DEPLOY.parent, doc.read_text()
    for path in re.findall(r"\b((?:deploy|docs|tests|bench)/[\w./-]*\w)", text):
        if not path.startswith("deploy/k8s/overlays/prod"):  # the operator's own overlay
            assert (repo / path).exists(), path
    for module in re.findall(r"python -m ([\w.]+)", text):
        assert importlib.util.find_spec(module) is not None, module
    subcommands = next(a for a in gateway_cli.build_parser()._actions if a.dest == "command")
    for command, rest in re.findall(r"\blyanna (fetch-model|generate|serve|chat)\b(.*)", text):
        accepted = subcommands.choices[command]._option_string_actions
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest.split("`")[0]):
            assert flag in accepted, (command, flag)
    known = known_variables()
    for variable in re.findall(r"\bLYANNA_[A-Z][A-Z_]*", text):
        assert any(name.startswith(variable) for name in known), variable
    objects = set(documents("h800"))
    for kind, name in re.findall(r"\b(job|deployment|svc|hpa|pvc)[/ ](lyanna-[\w-]+)", text):
        assert (KUBECTL_KINDS[kind], name) in objects, (kind, name)
    for name in re.findall(r"app\.kubernetes\.io/name=(lyanna-[\w-]+)", text):
        assert ("Deployment", name) in objects, name


GPU_POOLS = ("a800", "h800")
TLS_DIR = "/etc/lyanna/tls"
TLS_FILES = {f"{TLS_DIR}/{name}" for name in ("ca.crt", "tls.crt", "tls.key")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gpu_pools_require_the_api_key_secret(overlay: str) -> None:
    """A GPU pool's gateway does not start without lyanna-api-keys (no silent fallback to no
    authentication); kind or a laptop (cpu) may run without it."""
    gateway = pod_of(documents(overlay)[("Deployment", "lyanna-gateway")])["containers"][0]
    (keys,) = [e for e in gateway["env"] if e["name"] == "LYANNA_API_KEYS"]
    ref = keys["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("lyanna-api-keys", "keys")
    assert ref.get("optional", False) is (overlay == "cpu")


def admitted(docs: dict, pod_labels: dict, port: int) -> list[dict]:
    """The ``from`` peers of every NetworkPolicy ingress rule that admits ``port`` of a pod
    with ``pod_labels`` (``{}``: from anywhere)."""
    peers = []
    for (kind, _), policy in docs.items():
        if kind != "NetworkPolicy" or not selects(policy["spec"]["podSelector"], pod_labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
                continue
            peers.extend(rule.get("from", [{}]))
    return peers


def selects(selector: dict, labels: dict) -> bool:
    match = selector.get("matchLabels", {}).items() <= labels.items()
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        match &= labels.get(expression["key"]) in expression["values"]
    return match


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_metrics_are_reachable_from_the_monitoring_namespace_only(overlay: str) -> None:
    """Every process's metrics port admits the monitoring namespace and, for the services,
    their peer (the data plane needs every port between them); the gateway's API port, open
    to clients, serves no /metrics (LYANNA_METRICS_PORT moves it to the metrics port)."""
    docs = documents(overlay)
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    peer = {
        "podSelector": {
            "matchExpressions": [
                {
                    "key": "app.kubernetes.io/component",
                    "operator": "In",
                    "values": ["verifier", "drafter"],
                }
            ]
        }
    }
    for role in ("gateway", "verifier", "drafter"):
        template = docs[("Deployment", f"lyanna-{role}")]["spec"]["template"]
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        peers = admitted(docs, template["metadata"]["labels"], ports["metrics"])
        allowed = [monitoring] if role == "gateway" else [monitoring, peer]
        assert peers and all(p in allowed for p in peers), (role, peers)
        assert monitoring in peers, role
    env = docs[("ConfigMap", "lyanna-config")]["data"]
    gateway = GatewayConfig.from_env(env, mode="services")
    container = pod_of(docs[("Deployment", "lyanna-gateway")])["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert gateway.metrics_port == ports["metrics"] != ports["http"] == gateway.port
    assert admitted(docs, {"app.kubernetes.io/component": "gateway"}, ports["http"]) == [{}]
    monitor = docs[("ServiceMonitor", "lyanna-gateway")]
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]


def mounted_tls(pod: dict, container: dict) -> bool:
    secrets = {
        v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v
    }
    return any(
        m["mountPath"] == TLS_DIR and secrets.get(m["name"]) == "lyanna-tls"
        for m in container.get("volumeMounts", [])
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mutual_tls_is_wired_in_the_gpu_pools(overlay: str) -> None:
    """GPU pools: the certificate Secret lyanna-tls mounted in the three pods; the services
    serve mutual TLS, the drafter and the gateway present the client certificate (settings
    each process accepts); the services' probes are exec probes speaking mutual TLS to the
    health services the plaintext gRPC probes ask (cpu keeps those)."""
    from services.probe import build_parser

    docs, plain = documents(overlay), documents("cpu")
    env = docs[("ConfigMap", "lyanna-config")]["data"]
    tls_settings = {k: v for k, v in env.items() if "_TLS_" in k or "_VERIFIER_C" in k}
    tls_settings |= {k: v for k, v in env.items() if k.startswith("LYANNA_DRAFTER_VERIFIER_")}
    tls_settings.pop("LYANNA_DRAFTER_VERIFIER", None)  # the address
    if overlay == "cpu":
        assert not tls_settings
        assert GatewayConfig.from_env(env, mode="services").services_tls() is None
    else:
        assert set(tls_settings.values()) == TLS_FILES, tls_settings
        verifier_server, _ = parse_configs(
            (ServerConfig, VerifierConfig), [], "LYANNA_VERIFIER_", env=env
        )
        drafter_server, drafter = parse_configs(
            (ServerConfig, DrafterConfig), [], "LYANNA_DRAFTER_", env=env
        )
        for server in (verifier_server, drafter_server):  # mutual TLS: a client CA
            assert (server.tls_cert, server.tls_key) == (f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key")
            assert server.tls_client_ca == f"{TLS_DIR}/ca.crt"
        client = drafter.verifier_tls()
        assert client is not None and client.cert == f"{TLS_DIR}/tls.crt"
        gateway_tls = GatewayConfig.from_env(env, mode="services").services_tls()
        assert gateway_tls is not None and gateway_tls.key == f"{TLS_DIR}/tls.key"
    for role, port in (("gateway", None), ("verifier", 50051), ("drafter", 50052)):
        pod = pod_of(docs[("Deployment", f"lyanna-{role}")])
        container = pod["containers"][0]
        assert mounted_tls(pod, container) is (overlay != "cpu"), (overlay, role)
        if port is None:
            continue
        base = pod_of(plain[("Deployment", f"lyanna-{role}")])["containers"][0]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            if overlay == "cpu":
                assert "grpc" in probe and "exec" not in probe
                continue
            assert "grpc" not in probe, (role, kind)
            command = probe["exec"]["command"]
            assert command[:3] == ["python", "-m", "services.probe"], command
            args = build_parser().parse_args(command[3:])
            assert args.addr == f"127.0.0.1:{port}" and args.server_name == f"lyanna-{role}"
            assert {args.ca, args.cert, args.key} == TLS_FILES
            assert args.service == base[kind]["grpc"].get("service", ""), (role, kind)
            assert probe["timeoutSeconds"] > args.timeout
