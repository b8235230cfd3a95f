"""Start the verifier and drafter services (and optionally a gateway command) as local
subprocesses, wait until they are healthy, and stop them cleanly.

API::

    from services.launch import launch

    with launch(model_dir, method="lyanna") as deployment:     # -> Deployment
        deployment.verifier_addr        # "127.0.0.1:PORT"
        deployment.drafter_addr         # "127.0.0.1:PORT"
        deployment.gateway_port         # int, when a gateway command was given
        deployment.kill("drafter")      # SIGKILL one service (tests of fallback)
        deployment.restart("drafter")   # start it again on the same port, wait for health
    # leaving the block sends SIGTERM (in-flight calls drain), then SIGKILL after a timeout

    launch(
        model,                          # HF dir or .gguf of the target ("" = default model)
        method="lyanna",                # drafter registry name
        *,
        gateway_command=None,           # argv list; "{verifier_addr}", "{drafter_addr}",
                                        # "{gateway_port}", "{method}" are substituted, and the
                                        # same values are in LYANNA_VERIFIER_ADDR,
                                        # LYANNA_DRAFTER_ADDR, LYANNA_GATEWAY_PORT
        verifier_args=(), drafter_args=(),  # extra flags, e.g. ("--max-running", "16"); the
                                        # drafter is told where the verifier is (its port
                                        # file, --verifier-port-file) and gets ``tls``'s
                                        # client settings (--verifier-ca/-cert/-key)
        torch_threads=None,             # both services' --torch-threads; None: the verifier
                                        # keeps its default (every CPU) or its env variable,
                                        # the drafter gets 1 unless LYANNA_DRAFTER_TORCH_THREADS
        plane="grpc",                   # or "gloo" / "nccl": hidden states over torch.distributed
        startup_timeout=180.0,
        log_dir=None,                   # service logs (default: a temporary directory)
        env=None,                       # extra environment for every child
    ) -> Deployment

Services bind port 0 and report the bound port through ``--port-file``, so there is no race
for free ports; the gateway port is picked free just before the gateway starts. On Linux each
service gets SIGTERM when the thread that started it exits (``PR_SET_PDEATHSIG``, set by the
service itself from ``LYANNA_PARENT_PID``), so a crashed launcher leaves no orphaned services:
call ``launch``/``restart`` from a long-lived thread (the main thread, typically).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import PARENT_PID_ENV
from services.tls import ClientTls, sync_channel

SERVICES = ("verifier", "drafter")
log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A service exited or did not become healthy in time (the message holds its log tail)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(slots=True, eq=False)
class _Child:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    port: int = 0


@dataclass(slots=True, eq=False)
class Deployment:
    log_dir: Path
    env: dict[str, str]
    startup_timeout: float
    children: dict[str, _Child] = field(default_factory=dict)
    gateway_port: int | None = None
    tls: ClientTls | None = None  # how the health checks reach TLS services
    _scratch: tempfile.TemporaryDirectory | None = None

    @property
    def verifier_addr(self) -> str:
        return f"127.0.0.1:{self.children['verifier'].port}"

    @property
    def drafter_addr(self) -> str:
        return f"127.0.0.1:{self.children['drafter'].port}"

    def pid(self, name: str) -> int:
        return self.children[name].process.pid

    def kill(self, name: str) -> None:
        """SIGKILL one child (no draining): what a crash looks like to the others."""
        child = self.children[name]
        if child.process is not None and child.process.poll() is None:
            child.process.kill()
            child.process.wait()

    def restart(self, name: str) -> None:
        """Start a stopped or killed service again on its previous port."""
        child = self.children[name]
        self.kill(name)
        _start_service(child, self.env, fixed_port=child.port)
        _wait_service(child, self.startup_timeout, self.tls)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every child (gateway first), wait, then SIGKILL the stragglers."""
        order = [c for n, c in reversed(self.children.items()) if c.process is not None]
        for child in order:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in order:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _spawn(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _start_service(child: _Child, env: dict[str, str], fixed_port: int = 0) -> None:
    port_file = child.log_path.with_suffix(".port")
    port_file.unlink(missing_ok=True)
    argv = [*child.argv, "--port", str(fixed_port), "--port-file", str(port_file)]
    child.process = _spawn(argv, child.log_path, env)


def _wait_service(child: _Child, timeout: float, tls: ClientTls | None = None) -> None:
    port_file = child.log_path.with_suffix(".port")
    deadline = time.monotonic() + timeout
    while not port_file.is_file():
        if child.process.poll() is not None:
            raise LaunchError(f"{child.name} exited:\n{_log_tail(child.log_path)}")
        if time.monotonic() > deadline:
            raise LaunchError(f"{child.name} did not start in {timeout}s")
        time.sleep(0.1)
    child.port = int(port_file.read_text())
    with sync_channel(f"127.0.0.1:{child.port}", tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if child.process.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"{child.name} is not healthy:\n{_log_tail(child.log_path)}")
            time.sleep(0.1)


def _wait_http(url: str, child: _Child, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2.0):
                return
        except OSError:
            pass
        if child.process.poll() is not None or time.monotonic() > deadline:
            raise LaunchError(f"{child.name} is not healthy:\n{_log_tail(child.log_path)}")
        time.sleep(0.2)


def launch(
    model: str | Path,
    method: str = "lyanna",
    *,
    gateway_command: Sequence[str] | None = None,
    verifier_args: Sequence[str] = (),
    drafter_args: Sequence[str] = (),
    torch_threads: int | None = None,
    plane: str = "grpc",
    startup_timeout: float = 180.0,
    log_dir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    tls: ClientTls | None = None,
) -> Deployment:
    """Start drafter and verifier (and the gateway command), wait for health; see the module
    docstring. On any startup failure everything started so far is stopped. Services that
    serve TLS (``--tls-*`` in ``verifier_args`` / ``drafter_args``) are health-checked with
    ``tls``, and the drafter reaches the verifier with it."""
    scratch = tempfile.TemporaryDirectory(prefix="lyanna-services-") if log_dir is None else None
    logs = Path(scratch.name if scratch else log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    child_env = {**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())}
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[1]), child_env.get("PYTHONPATH")) if p
    )
    common = ["--model", str(model), "--plane", plane]
    threads = thread_flags(torch_threads, child_env)
    if plane != "grpc":
        common += ["--plane-addr", f"127.0.0.1:{free_port()}"]
    deployment = Deployment(logs, child_env, startup_timeout, tls=tls, _scratch=scratch)
    python = [sys.executable, "-m"]
    deployment.children["verifier"] = _Child(
        "verifier",
        [*python, "services.verifier", *common, *threads["verifier"], *verifier_args],
        logs / "verifier.log",
    )
    deployment.children["drafter"] = _Child(
        "drafter",
        [*python, "services.drafter", *common, *threads["drafter"], "--method", method]
        + _verifier_link(logs, tls)
        + list(drafter_args),
        logs / "drafter.log",
    )
    try:
        for name in SERVICES:
            _start_service(deployment.children[name], child_env)
        for name in SERVICES:
            _wait_service(deployment.children[name], startup_timeout, tls)
        if gateway_command is not None:
            _start_gateway(deployment, list(gateway_command), method)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def launch_first(model: str | Path, methods: Sequence[str], **kwargs) -> tuple[Deployment, str]:
    """``launch`` with the first of ``methods`` whose drafter starts (a missing checkpoint
    refuses one; each refusal is logged): the deployment and that method."""
    for method in dict.fromkeys(methods):
        try:
            return launch(model, method, **kwargs), method
        except LaunchError as err:
            log.warning("the drafter service cannot start with %r: %s", method, err)
    raise LaunchError(f"no method of {list(methods)} could start the drafter service")


def thread_flags(torch_threads: int | None, env: Mapping[str, str]) -> dict[str, list[str]]:
    """Each service's ``--torch-threads`` flags. A flag wins over its ``LYANNA_*`` variable,
    so none is passed where the variable should decide: given ``torch_threads``, both take it;
    else the verifier keeps its own default (every CPU: its forwards are the step) or
    ``LYANNA_VERIFIER_TORCH_THREADS``, and the drafter, whose steps are small and run beside
    the verifier's on this machine, takes one thread unless ``LYANNA_DRAFTER_TORCH_THREADS``
    says otherwise."""
    if torch_threads is not None:
        flag = ["--torch-threads", str(torch_threads)]
        return {"verifier": flag, "drafter": flag}
    drafter = [] if "LYANNA_DRAFTER_TORCH_THREADS" in env else ["--torch-threads", "1"]
    return {"verifier": [], "drafter": drafter}


def _verifier_link(logs: Path, tls: ClientTls | None) -> list[str]:
    """The drafter's flags to reach the verifier: the port file the verifier writes (read on
    the drafter's first Step, so both start at once) and the launcher's client TLS."""
    flags = ["--verifier-port-file", str((logs / "verifier.log").with_suffix(".port"))]
    if tls is not None:
        flags += ["--verifier-ca", tls.ca]
        if tls.cert and tls.key:
            flags += ["--verifier-cert", tls.cert, "--verifier-key", tls.key]
        if tls.server_name:
            flags += ["--verifier-server-name", tls.server_name]
    return flags


def _start_gateway(deployment: Deployment, command: list[str], method: str) -> None:
    port = free_port()
    values = {
        "verifier_addr": deployment.verifier_addr,
        "drafter_addr": deployment.drafter_addr,
        "gateway_port": str(port),
        "method": method,
    }
    argv = [part.format(**values) for part in command]
    env = {
        **deployment.env,
        "LYANNA_VERIFIER_ADDR": values["verifier_addr"],
        "LYANNA_DRAFTER_ADDR": values["drafter_addr"],
        "LYANNA_GATEWAY_PORT": str(port),
    }
    child = _Child("gateway", argv, deployment.log_dir / "gateway.log", port=port)
    child.process = _spawn(argv, child.log_path, env)
    deployment.children["gateway"] = child
    deployment.gateway_port = port
    _wait_http(f"http://127.0.0.1:{port}/health", child, deployment.startup_timeout)
