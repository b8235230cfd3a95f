"""The gateway's drain (what SIGTERM starts): ``/readyz`` turns 503 at once, new API requests
get 503 with ``Retry-After``, a stream in flight runs to its end and the server then stops by
itself; a stream longer than the drain bound is cut. ``lyanna serve --data-plane`` reaches the
launcher (the services' ``--plane``, the remote backend's ``use_data_plane``), and with gloo on
the CPU the three processes form the plane and answer exactly."""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.cli import build_parser
from gateway.config import GatewayConfig
from gateway.server import ThreadedServer, free_port
from lyanna.tokenizer import chat_prompt_ids
from tests.gateway.conftest import MODEL_NAME, greedy_text
from tests.gateway.test_errors import CHAT, HoldingBackend, assert_error, chat_body


class HealthyHoldingBackend(HoldingBackend):
    async def health(self) -> dict[str, str]:
        return {"verifier": "ok"}


def draining_gateway(tokenizer, drain_seconds: float) -> tuple[ThreadedServer, HoldingBackend]:
    backend = HealthyHoldingBackend()
    app = create_app(backend, tokenizer, GatewayConfig(model_name=MODEL_NAME))
    return ThreadedServer(app, drain_seconds=drain_seconds).start(), backend


def test_a_drain_refuses_new_requests_and_lets_streams_finish(default_tokenizer) -> None:
    server, backend = draining_gateway(default_tokenizer, drain_seconds=120)
    body = chat_body(stream=True, model=MODEL_NAME)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.get("/readyz").status_code == 200
            with client.stream("POST", CHAT, json=body) as held:
                assert held.status_code == 200
                lines = held.iter_lines()
                next(lines)  # the first token arrived: one stream in flight
                server.drain()
                ready = client.get("/readyz")
                assert ready.status_code == 503 and ready.json()["status"] == "draining"
                assert client.get("/livez").status_code == 200  # alive: no restart
                refused = client.post(CHAT, json=chat_body(model=MODEL_NAME))
                assert assert_error(refused, 503)["code"] == "draining"
                assert refused.headers["Retry-After"] == "1"
                assert server.in_flight == 1 and not server.join(timeout=1.0)  # still serving
                backend.release.set()  # the stream ends normally
                rest = list(lines)
            assert any("[DONE]" in line for line in rest)
        assert server.join(timeout=60), "the drained server did not stop by itself"
    finally:
        backend.release.set()
        server.stop()


def test_a_stream_longer_than_the_drain_bound_is_cut(default_tokenizer) -> None:
    server, backend = draining_gateway(default_tokenizer, drain_seconds=1.0)
    rest: list[str] = []
    body = chat_body(stream=True, model=MODEL_NAME)
    try:
        with (
            httpx.Client(base_url=server.url, timeout=60) as client,
            client.stream("POST", CHAT, json=body) as held,
        ):
            lines = held.iter_lines()
            next(lines)
            server.drain()  # the backend never releases this stream
            with contextlib.suppress(httpx.HTTPError):  # cut mid-stream: a client of a
                rest = list(lines)  # stopped server may see an error or an early end
        assert server.join(timeout=60)
        assert not any("[DONE]" in line for line in rest)
    finally:
        backend.release.set()
        server.stop()


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--mode", "services", *flags])


def test_the_data_plane_flag_reaches_the_services_and_the_backend(monkeypatch) -> None:
    """``--data-plane gloo`` starts both services with ``--plane gloo`` and the remote
    backend with ``use_data_plane``; grpc (the default) with neither."""
    import gateway.launcher as launcher
    import gateway.remote as remote
    import services.launch as services_launch

    seen: dict[str, object] = {}

    class FakeDeployment:
        verifier_addr, drafter_addr, log_dir = "127.0.0.1:1", "127.0.0.1:2", Path("/tmp")

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

    def fake_launch(model, method="lyanna", **kwargs):
        seen["plane"] = kwargs.get("plane", "grpc")
        return FakeDeployment()

    class FakeBackend:
        default_method = "ngram"

        def __init__(self, config, eos, detokenize) -> None:
            seen["use_data_plane"] = config.use_data_plane

    monkeypatch.setattr(services_launch, "launch", fake_launch)
    monkeypatch.setattr(remote, "RemoteBackend", FakeBackend)
    monkeypatch.setattr(launcher, "create_app", lambda *args, **kwargs: None)
    monkeypatch.setattr(
        launcher,
        "serve",
        lambda app, config, level, drain_seconds: seen.update(drain=drain_seconds),
    )
    for flags, plane, on in ((("--data-plane", "gloo"), "gloo", True), ((), "grpc", False)):
        seen.clear()
        launcher.run_serve(serve_args("--method", "ngram", "--drain-seconds", "45", *flags))
        assert seen == {"plane": plane, "use_data_plane": on, "drain": 45.0}
    with pytest.raises(ValueError, match="CUDA"):
        launcher.run_serve(serve_args("--data-plane", "nccl"))
    with pytest.raises(ValueError, match="services"):
        launcher.run_serve(build_parser().parse_args(["serve", "--data-plane", "gloo"]))


@pytest.mark.slow
def test_lyanna_serve_with_gloo_forms_the_plane_and_answers_exactly(
    tiny_chat_dir, loaded, tmp_path
) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--mode", "services"]
    argv += ["--data-plane", "gloo", "--model", str(tiny_chat_dir), "--method", "ngram"]
    argv += ["--port", str(port), "--max-len", "512", "--drain-seconds", "30"]
    out = tmp_path / "gateway.log"
    with out.open("wb") as log:
        gateway = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert gateway.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            try:
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        prompt = "one two three one two three"
        messages = [{"role": "user", "content": prompt}]
        expected = greedy_text(loaded, chat_prompt_ids(loaded.tokenizer, messages), 24)
        body = {"model": "tiny-chat", "messages": messages, "max_tokens": 24, "temperature": 0}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == expected
        logs = Path(re.search(r"service logs in (\S+)", out.read_text()).group(1))
        for name in ("verifier", "drafter"):
            assert "data plane gloo ready" in (logs / f"{name}.log").read_text(), name
    finally:
        gateway.terminate()  # SIGTERM: drain (nothing in flight), then the services stop
        assert gateway.wait(120) == 0, out.read_text()
