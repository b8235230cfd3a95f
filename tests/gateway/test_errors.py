"""Bad requests get the right 4xx/5xx status and an OpenAI error body
``{"error": {"message", "type", "param", "code"}}``: malformed JSON, wrong types, unknown
model or method, n > 1, max_tokens out of range, prompts over the context, oversized bodies,
missing or wrong API keys, a full queue (429) and a dead backend (503)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.auth import TokenRateLimiter
from gateway.backend import GenerationRequest
from gateway.config import GatewayConfig
from gateway.server import ThreadedServer
from lyanna.async_engine import BackendBusy, BackendUnavailable, TokenDelta
from tests.gateway.conftest import MODEL_NAME, start_gateway

CHAT = "/v1/chat/completions"


def chat_body(**overrides) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(overrides)
    return body


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.fixture
def http(gateway) -> httpx.Client:
    with httpx.Client(base_url=gateway.url) as client:
        yield client


def test_malformed_json_is_400(http) -> None:
    response = http.post(
        CHAT, content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    error = assert_error(response, 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "json_invalid"
    assert_error(http.post(CHAT, content=b""), 400)


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"stop": [1, 2]}, None),
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0}, "top_p"),
    ],
)
def test_wrong_types_and_ranges_are_400(http, overrides, param) -> None:
    assert_error(http.post(CHAT, json=chat_body(**overrides)), 400, param)


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 2}, "n"),
        ({"lyanna_method": "telepathy"}, "lyanna_method"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 200}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"seed": -(2**63) - 1}, "seed"),  # negative seeds map to [0, 2^64); int64 is the bound
        ({"seed": 2**64}, "seed"),
    ],
)
def test_invalid_parameters_are_400(http, overrides, param) -> None:
    assert_error(http.post(CHAT, json=chat_body(**overrides)), 400, param)


def test_unknown_method_header_is_400(http) -> None:
    response = http.post(CHAT, json=chat_body(), headers={"X-Lyanna-Method": "telepathy"})
    assert_error(response, 400, "lyanna_method")


def test_prompt_over_context_is_400(http, client) -> None:
    long_prompt = "speculative decoding " * 400  # > 448 tokens: the tiny model's context
    error = assert_error(
        http.post(CHAT, json=chat_body(messages=[{"role": "user", "content": long_prompt}])),
        400,
        "messages",
    )
    assert error["code"] == "context_length_exceeded"
    error = assert_error(
        http.post(
            CHAT,
            json=chat_body(messages=[{"role": "user", "content": "hi " * 100}], max_tokens=400),
        ),
        400,
        "max_tokens",
    )
    assert error["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=4)


def test_unknown_model_and_route_are_404(http, client) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(
            model="gpt-17", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert err.value.body["code"] == "model_not_found"
    assert_error(http.get("/v1/models/gpt-17"), 404, "model")
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get(CHAT), 405)


def test_oversized_body_is_413(http) -> None:
    body = chat_body(messages=[{"role": "user", "content": "x" * (1 << 20)}])
    assert_error(http.post(CHAT, json=body), 413)


def test_api_keys(loaded) -> None:
    server = start_gateway(loaded, GatewayConfig(model_name=MODEL_NAME, api_keys=("k1", "k2")))
    try:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
            response = httpx.post(server.url + CHAT, json=chat_body(), headers=headers)
            assert assert_error(response, 401)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope").models.list()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k2", max_retries=0)
        assert client.models.list().data[0].id == MODEL_NAME
        assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    finally:
        server.stop()


class RefusingBackend:
    """A backend that refuses every request with ``error``."""

    max_context = 1024
    default_method = "ar"
    methods = ("ar",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def health(self) -> dict[str, str]:
        return {"verifier": "connection refused"}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        raise self.error
        yield  # an async generator, like real backends


@pytest.mark.parametrize(
    ("error", "status", "client_error"),
    [
        (BackendBusy("queue full"), 429, openai.RateLimitError),
        (BackendUnavailable("verifier down"), 503, openai.InternalServerError),
    ],
)
def test_busy_is_429_and_down_is_503(default_tokenizer, error, status, client_error) -> None:
    config = GatewayConfig(model_name=MODEL_NAME)
    server = ThreadedServer(create_app(RefusingBackend(error), default_tokenizer, config)).start()
    try:
        for stream in (False, True):
            response = httpx.post(server.url + CHAT, json=chat_body(stream=stream))
            assert_error(response, status)
            if status == 429:  # every 429 says when to come back
                assert response.headers["Retry-After"] == "1"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(client_error):
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
    finally:
        server.stop()


def test_completion_token_ids_out_of_vocabulary_are_400(http) -> None:
    body = {"model": MODEL_NAME, "prompt": [1, 2, 10**7], "max_tokens": 2}
    assert_error(http.post("/v1/completions", json=body), 400, "prompt")
    body["prompt"] = []
    assert_error(http.post("/v1/completions", json=body), 400, "prompt")


def test_api_keys_from_a_file_rotate_without_a_restart(loaded, tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("alpha  # the first key\n\n")
    config = GatewayConfig(model_name=MODEL_NAME, api_keys_file=str(key_file))
    server = start_gateway(loaded, config)

    def status(key: str) -> int:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.get(server.url + "/v1/models", headers=headers).status_code

    try:
        assert (status("alpha"), status("beta")) == (200, 401)
        key_file.write_text("beta\n")
        os.utime(key_file, (time.time() + 5, time.time() + 5))  # a visibly newer file
        time.sleep(1.1)  # the file is looked at once a second
        assert (status("alpha"), status("beta")) == (401, 200)
        key_file.write_text("")  # an emptied file keeps the last keys, never opens the door
        os.utime(key_file, (time.time() + 10, time.time() + 10))
        time.sleep(1.1)
        assert (status("beta"), status("gamma")) == (200, 401)
    finally:
        server.stop()


def test_metrics_can_require_a_key(loaded) -> None:
    config = GatewayConfig(model_name=MODEL_NAME, api_keys=("k1",), metrics_need_key=True)
    server = start_gateway(loaded, config)
    try:
        assert assert_error(httpx.get(server.url + "/metrics"), 401)["code"] == "invalid_api_key"
        good = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer k1"})
        assert good.status_code == 200 and "lyanna_spec_draft_steps_total" in good.text
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


class HoldingBackend(RefusingBackend):
    """Streams one token, then holds the request open until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(RuntimeError("unused"))
        self.release = threading.Event()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        yield TokenDelta([5], prompt_tokens=len(request.prompt_ids))
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        yield TokenDelta([6], finish_reason="length")


def test_each_key_has_a_bounded_number_of_requests_in_flight(default_tokenizer) -> None:
    config = GatewayConfig(model_name=MODEL_NAME, api_keys=("k1", "k2"), max_streams_per_key=1)
    backend = HoldingBackend()
    server = ThreadedServer(create_app(backend, default_tokenizer, config)).start()
    k1, k2 = ({"Authorization": f"Bearer {k}"} for k in ("k1", "k2"))
    body = chat_body(stream=True, model=MODEL_NAME)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            with client.stream("POST", CHAT, json=body, headers=k1) as held:
                assert held.status_code == 200
                lines = held.iter_lines()  # kept: a dropped iterator closes the stream
                next(lines)  # the first token arrived: k1 has one request open
                refused = client.post(CHAT, json=body, headers=k1)
                assert assert_error(refused, 429)["code"] == "too_many_requests"
                assert refused.headers["Retry-After"] == "1"
                assert client.get("/v1/models", headers=k2).status_code == 200  # other keys
                backend.release.set()
                rest = list(lines)
            assert any("[DONE]" in line for line in rest)
            backend.release.clear()
            backend.release.set()
            again = client.post(CHAT, json=chat_body(model=MODEL_NAME), headers=k1)
            assert again.status_code == 200  # the finished stream gave its place back
    finally:
        server.stop()


def test_token_rate_limiter_ages_charges_out_over_a_minute() -> None:
    now = [100.0]
    limiter = TokenRateLimiter(50, clock=lambda: now[0])
    assert limiter.retry_after(b"k") == 0
    limiter.charge(b"k", 30)
    now[0] += 10
    limiter.charge(b"k", 30)  # 60 >= 50: over, until the first charge ages out
    assert limiter.retry_after(b"other") == 0  # per key
    assert limiter.retry_after(b"k") == 50  # the first charge leaves at t = 160
    now[0] = 159.5
    assert limiter.retry_after(b"k") == 1
    now[0] = 160.0
    assert limiter.retry_after(b"k") == 0  # 30 left in the window
    now[0] = 170.0
    assert limiter.retry_after(b"k") == 0 and limiter._used == {}  # nothing kept
    assert TokenRateLimiter(0).retry_after(b"k") == 0  # 0 = unbounded


def test_each_key_has_a_bounded_number_of_tokens_per_minute(default_tokenizer) -> None:
    config = GatewayConfig(
        model_name=MODEL_NAME, api_keys=("k1", "k2"), max_tokens_per_minute_per_key=3
    )
    backend = HoldingBackend()
    backend.release.set()
    server = ThreadedServer(create_app(backend, default_tokenizer, config)).start()
    k1, k2 = ({"Authorization": f"Bearer {k}"} for k in ("k1", "k2"))
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            first = client.post(CHAT, json=chat_body(), headers=k1)
            assert first.status_code == 200  # under the limit when it started
            used = first.json()["usage"]["total_tokens"]
            assert used > 3  # the prompt alone is more than 3 tokens: k1 is over now
            refused = client.post(CHAT, json=chat_body(stream=True), headers=k1)
            assert assert_error(refused, 429)["code"] == "rate_limit_exceeded"
            assert 1 <= int(refused.headers["Retry-After"]) <= 60
            assert client.post(CHAT, json=chat_body(), headers=k2).status_code == 200
            assert client.get("/v1/models", headers=k1).status_code == 429  # every /v1 route
    finally:
        server.stop()


class StatusBackend(RefusingBackend):
    """Reports whatever component states the test sets."""

    def __init__(self) -> None:
        super().__init__(RuntimeError("unused"))
        self.states: dict[str, str] = {}

    async def health(self) -> dict[str, str]:
        return dict(self.states)


def test_probes_liveness_is_independent_and_readiness_survives_drafter_fallback(
    default_tokenizer,
) -> None:
    backend = StatusBackend()
    config = GatewayConfig(model_name=MODEL_NAME, api_keys=("k",))
    server = ThreadedServer(create_app(backend, default_tokenizer, config)).start()
    try:
        cases = [  # (components, ready, /health)
            ({"verifier": "ok", "drafter": "ok"}, 200, 200),
            ({"verifier": "ok", "drafter": "fallback: UNAVAILABLE"}, 200, 503),
            ({"verifier": "UNAVAILABLE", "drafter": "ok"}, 503, 503),
        ]
        for states, ready, health in cases:
            backend.states = states
            assert httpx.get(server.url + "/livez").status_code == 200  # no key, no peers
            assert httpx.get(server.url + "/readyz").status_code == ready, states
            assert httpx.get(server.url + "/health").status_code == health, states
    finally:
        server.stop()


class FailingMidStreamBackend(RefusingBackend):
    """Streams one token, then fails with ``error``."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        yield TokenDelta([5], prompt_tokens=len(request.prompt_ids))
        raise self.error


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (BackendUnavailable("engine error (logged)"), "engine error (logged)"),
        (RuntimeError("/srv/secret/path: tensor a (3) must match b (4)"), "internal error"),
    ],
)
def test_a_stream_that_fails_names_no_internals(default_tokenizer, error, message) -> None:
    """A failure after the headers went out ends the stream with an error event: errors meant
    for clients keep their message, anything else becomes a generic one (the log keeps it)."""
    config = GatewayConfig(model_name=MODEL_NAME)
    app = create_app(FailingMidStreamBackend(error), default_tokenizer, config)
    server = ThreadedServer(app).start()
    try:
        for route in (CHAT, "/v1/completions"):
            body = chat_body(stream=True)
            if route != CHAT:
                body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "stream": True}
            events = [
                json.loads(line.removeprefix("data: "))
                for line in httpx.post(server.url + route, json=body).text.splitlines()
                if line.startswith("data: {")
            ]
            errors = [e["error"] for e in events if "error" in e]
            assert len(errors) == 1 and message in errors[0]["message"]
            assert "secret" not in errors[0]["message"]
    finally:
        server.stop()
