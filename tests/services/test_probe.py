"""The exec probe the Kubernetes manifests run against the services under mutual TLS
(``python -m services.probe``): 0 only for a SERVING answer over a verified TLS connection with
the client certificate, 1 for a service not serving, a missing client certificate, another
CA's certificate, or plaintext against a TLS port. Run as the kubelet runs it (a process)."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.server import free_port
from services.tls import server_credentials
from tests.services.test_tls import _authority, _leaf


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    directory = tmp_path_factory.mktemp("probe-pki")
    ca_key, ca_cert, ca = _authority(directory, "lyanna-ca")
    rogue_key, rogue_cert, rogue = _authority(directory, "rogue-ca")
    cert, key = _leaf(directory, "services", ca_key, ca_cert)
    rogue_leaf, rogue_leaf_key = _leaf(directory, "intruder", rogue_key, rogue_cert)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = free_port()
    server.add_secure_port(f"127.0.0.1:{port}", server_credentials(cert, key, ca))
    server.start()
    files = {"ca": ca, "cert": cert, "key": key, "rogue": rogue}
    files |= {"rogue_cert": rogue_leaf, "rogue_key": rogue_leaf_key}
    yield f"127.0.0.1:{port}", servicer, files
    server.stop(None)


def probe(addr: str, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "services.probe", "--addr", addr, "--timeout", "3", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_the_probe_speaks_mutual_tls(service) -> None:
    addr, servicer, f = service
    mutual = ("--ca", f["ca"], "--cert", f["cert"], "--key", f["key"])
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    ok = probe(addr, *mutual, "--server-name", "localhost")
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stdout + ok.stderr
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    down = probe(addr, *mutual)
    assert down.returncode == 1 and down.stdout.strip() == "NOT_SERVING"
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    refused = {
        "no client certificate": ("--ca", f["ca"]),
        "another CA's client certificate": (
            "--ca",
            f["ca"],
            "--cert",
            f["rogue_cert"],
            "--key",
            f["rogue_key"],
        ),
        "another CA for the server": ("--ca", f["rogue"], "--cert", f["cert"], "--key", f["key"]),
        "plaintext": (),
    }
    for case, flags in refused.items():
        result = probe(addr, *flags)
        assert result.returncode == 1 and result.stdout.strip() != "SERVING", case


def test_the_probe_refuses_a_client_certificate_without_a_ca() -> None:
    result = probe("127.0.0.1:1", "--cert", "c.pem", "--key", "k.pem")
    assert result.returncode == 2 and "need --ca" in result.stderr
