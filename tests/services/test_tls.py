"""TLS between the gateway and the services: real verifier and drafter processes that require
mutual TLS serve a gateway holding a client certificate (greedy output equal to plain
decoding), and refuse plaintext clients, clients without a certificate and clients whose
certificate another CA signed."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.remote import RemoteConfig
from lyanna.sampling import SamplingParams
from services.config import ServerConfig
from services.launch import launch
from services.tls import ClientTls, sync_channel
from tests.services.remote_client import plain_greedy, run_remote
from tests.services.test_remote import BUDGET_FLAGS, PROMPTS


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, key, cert: x509.Certificate) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".pem")
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def _certificate(subject: str, issuer_key, issuer: x509.Name | None, key, ca: bool = False):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer or _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _authority(directory: Path, name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(name, key, None, key, ca=True)
    return key, cert, _write(directory / name, key, cert)[0]


def _leaf(directory: Path, name: str, ca_key, ca_cert) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    return _write(directory / name, key, _certificate(name, ca_key, ca_cert.subject, key))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert, ca = _authority(directory, "lyanna-ca")
    rogue_key, rogue_cert, _ = _authority(directory, "rogue-ca")
    server_cert, server_key = _leaf(directory, "services", ca_key, ca_cert)
    client_cert, client_key = _leaf(directory, "gateway", ca_key, ca_cert)
    rogue_client_cert, rogue_client_key = _leaf(directory, "intruder", rogue_key, rogue_cert)
    return {
        "ca": ca,
        "server_cert": server_cert,
        "server_key": server_key,
        "client_cert": client_cert,
        "client_key": client_key,
        "rogue_cert": rogue_client_cert,
        "rogue_key": rogue_client_key,
    }


def server_flags(pki: dict[str, str]) -> list[str]:
    return [
        "--tls-cert",
        pki["server_cert"],
        "--tls-key",
        pki["server_key"],
        "--tls-client-ca",
        pki["ca"],
    ]


def health_check(addr: str, tls: ClientTls | None) -> None:
    with sync_channel(addr, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)


def test_mutual_tls_serves_the_gateway_and_refuses_everyone_else(
    tiny_model_dir, tiny_loaded, pki
) -> None:
    gateway_tls = ClientTls(pki["ca"], pki["client_cert"], pki["client_key"])
    with launch(
        tiny_model_dir,
        "ngram",
        verifier_args=server_flags(pki),
        drafter_args=[*BUDGET_FLAGS, *server_flags(pki)],
        tls=gateway_tls,
    ) as deployment:
        config = RemoteConfig(deployment.verifier_addr, deployment.drafter_addr, tls=gateway_tls)
        params = SamplingParams(max_tokens=12)
        outcomes, _ = run_remote(config, PROMPTS, params)
        assert [o.tokens for o in outcomes] == plain_greedy(tiny_loaded, PROMPTS, 12)
        steps = [s for o in outcomes for s in o.steps]
        assert not any(s.drafter_fallback for s in steps)  # gateway -> drafter -> verifier: TLS

        strangers = {
            "plaintext": None,
            "no client certificate": ClientTls(pki["ca"]),
            "another CA's certificate": ClientTls(pki["ca"], pki["rogue_cert"], pki["rogue_key"]),
        }
        for addr in (deployment.verifier_addr, deployment.drafter_addr):
            health_check(addr, gateway_tls)
            for who, tls in strangers.items():
                with pytest.raises(grpc.RpcError) as refused:
                    health_check(addr, tls)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, who


def test_tls_settings_are_checked_together(pki) -> None:
    with pytest.raises(ValueError, match="go together"):
        ServerConfig(tls_cert=pki["server_cert"])
    with pytest.raises(ValueError, match="needs tls_cert"):
        ServerConfig(tls_client_ca=pki["ca"])
    with pytest.raises(ValueError, match="go together"):
        ClientTls(pki["ca"], cert=pki["client_cert"])
