"""A gRPC health probe that speaks TLS and mutual TLS, for Kubernetes exec probes: the kubelet's
native gRPC probe cannot present a client certificate, and the services image ships no
``grpc_health_probe``. Exit 0 when the service answers SERVING, 1 otherwise (not serving, an
error, a refused certificate, a timeout).

    python -m services.probe --addr 127.0.0.1:50051 --ca ca.crt --cert tls.crt --key tls.key \\
        --server-name lyanna-verifier

Without ``--ca`` it checks over plaintext. Imports grpc and the health stubs only (no torch), so
a probe costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.tls import ClientTls, sync_channel


def check(addr: str, tls: ClientTls | None, service: str = "", timeout: float = 4.0) -> str:
    """The service's health status name (``SERVING``, ...), or the gRPC error's code name."""
    with sync_channel(addr, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.probe", description=__doc__)
    parser.add_argument("--addr", required=True, help="host:port of the gRPC service")
    parser.add_argument("--service", default="", help="health service name ('' = the server)")
    parser.add_argument("--ca", help="PEM of the CA that signed the service's certificate")
    parser.add_argument("--cert", help="this client's certificate (mutual TLS)")
    parser.add_argument("--key", help="its private key")
    parser.add_argument("--server-name", help="the name in the service's certificate")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds (default 4)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.cert or args.key or args.server_name) and not args.ca:
        parser.error("--cert, --key and --server-name need --ca")
    tls = ClientTls(args.ca, args.cert, args.key, args.server_name) if args.ca else None
    status = check(args.addr, tls, args.service, args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
