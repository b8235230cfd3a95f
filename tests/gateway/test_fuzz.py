"""Schemathesis against the gateway's own OpenAPI schema: requests generated from it, valid
(positive) and invalid (negative), never get a 5xx, and every 4xx carries an OpenAI error
body. The backend answers with a few fixed tokens, so what is fuzzed is the HTTP surface:
parsing, validation, bounds, tokenization, streaming and error mapping. Derandomized, so a
failure reproduces."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from gateway.app import create_app
from gateway.backend import GenerationRequest
from gateway.config import GatewayConfig
from gateway.schemas import UNSUPPORTED_NO_OP
from lyanna.async_engine import TokenDelta
from tests.gateway.conftest import MODEL_NAME
from tests.gateway.test_errors import RefusingBackend

EXAMPLES = 60  # per route and mode
ROUTES = ("/v1/chat/completions", "/v1/completions")


class FewTokensBackend(RefusingBackend):
    """Every request gets up to three tokens, then ``length``."""

    methods = ("ar", "ngram")

    def __init__(self) -> None:
        super().__init__(RuntimeError("unused"))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        count = max(1, min(request.params.max_tokens, 3))
        for i in range(count):
            yield TokenDelta(
                [42 + i],
                finish_reason="length" if i == count - 1 else None,
                prompt_tokens=len(request.prompt_ids) if i == 0 else None,
            )


@pytest.fixture(scope="module")
def schema(default_tokenizer):
    config = GatewayConfig(model_name=MODEL_NAME, openapi=True)  # off by default
    app = create_app(FewTokensBackend(), default_tokenizer, config)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def problems_of(response) -> str | None:
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{response.status_code} without an OpenAI error body: {response.text[:300]}"
        if not {"message", "type", "param", "code"} <= set(error) or not error["message"]:
            return f"{response.status_code} with an incomplete error body: {error}"
    return None


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("route", ROUTES)
def test_generated_requests_get_no_5xx_and_openai_errors(schema, route, mode) -> None:
    operation = schema[route]["POST"]
    statuses: set[int] = set()
    failures: list[str] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call()
        statuses.add(response.status_code)
        problem = problems_of(response)
        if problem is not None:
            failures.append(f"{case.body!r:.300} -> {problem}")

    run()
    assert not failures, failures[:5]
    # the fuzzing reached the handlers: valid requests answered, invalid ones refused
    if mode is GenerationMode.POSITIVE:
        assert 200 in statuses, statuses
    else:
        assert statuses and all(400 <= s < 500 for s in statuses), statuses


# every request field either changes the answer as OpenAI says (implemented) or is refused
# unless it holds its no-op value (gateway.schemas.UNSUPPORTED_NO_OP); nothing else is allowed
HONOURED = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "top_k",
    "logprobs",
    "top_logprobs",
    "user",
    "lyanna_method",
    "messages",
    "prompt",
    "echo",
}


def request_schema(schema, route: str) -> dict:
    raw = schema.raw_schema
    body = raw["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = body["$ref"].rsplit("/", 1)[-1]
    return raw["components"]["schemas"][name]


@pytest.mark.parametrize("route", ROUTES)
def test_the_schema_admits_no_field_that_would_be_ignored(schema, route) -> None:
    body = request_schema(schema, route)
    assert body.get("additionalProperties") is False  # unknown fields: 400, never ignored
    fields = set(body["properties"])
    assert fields <= HONOURED | set(UNSUPPORTED_NO_OP), fields - HONOURED - set(UNSUPPORTED_NO_OP)


@pytest.mark.parametrize("route", ROUTES)
def test_generated_requests_never_get_an_unimplemented_field_accepted(schema, route) -> None:
    """Schemathesis' valid requests: any that sets an unimplemented field to something other
    than its no-op value gets a 400 naming that field, never a 200."""
    operation = schema[route]["POST"]
    accepted_ignored: list[str] = []
    refused = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def run(case) -> None:
        nonlocal refused
        body = case.body if isinstance(case.body, dict) else {}
        live = [k for k, no_ops in UNSUPPORTED_NO_OP.items() if k in body and body[k] not in no_ops]
        if not live:
            return
        response = case.call()
        if response.status_code < 400:
            accepted_ignored.append(f"{live} -> {response.status_code}")
        elif response.status_code == 400:
            refused += 1
            assert response.json()["error"]["param"] is not None

    run()
    assert not accepted_ignored, accepted_ignored[:5]
    assert refused > 0  # the generator did set unimplemented fields
