"""The OpenAI surface over real HTTP (tiny model, embedded backend): nothing is accepted and
ignored (unknown and unimplemented parameters are a 400 naming them), the logits processors
change greedy output exactly as a reference loop over full-model logits says, chat logprobs
are the model's log-softmax, negative seeds map to the unsigned range, ``X-Request-Id`` is
honoured and echoed, and the status-code and rejection counters count."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import torch

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.server import ThreadedServer
from lyanna.async_engine import BackendBusy
from lyanna.tokenizer import chat_prompt_ids
from tests.conftest import prompt_logits
from tests.gateway.conftest import MODEL_NAME, start_gateway
from tests.gateway.test_errors import RefusingBackend, assert_error, chat_body

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PROMPT = "Count: one two three"


def completion_body(**overrides) -> dict:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
    body.update(overrides)
    return body


@pytest.fixture
def http(gateway) -> httpx.Client:
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        yield client


UNSUPPORTED_CHAT = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("parallel_tool_calls", True),
    ("response_format", {"type": "json_object"}),
]
UNSUPPORTED_COMPLETIONS = [("suffix", "tail"), ("best_of", 2), ("echo", True)]
UNKNOWN = ["metadata", "store", "service_tier", "frobnicate"]


@pytest.mark.parametrize(("param", "value"), UNSUPPORTED_CHAT)
def test_unimplemented_chat_parameters_are_400_naming_them(http, param, value) -> None:
    assert_error(http.post(CHAT, json=chat_body(**{param: value})), 400, param)


@pytest.mark.parametrize(("param", "value"), UNSUPPORTED_COMPLETIONS)
def test_unimplemented_completion_parameters_are_400_naming_them(http, param, value) -> None:
    assert_error(http.post(COMPLETIONS, json=completion_body(**{param: value})), 400, param)


@pytest.mark.parametrize("param", UNKNOWN)
@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_unknown_parameters_are_400_naming_them(http, route, param) -> None:
    body = chat_body() if route == CHAT else completion_body()
    error = assert_error(http.post(route, json={**body, param: {"x": 1}}), 400, param)
    assert error["message"] == f"Unrecognized request argument supplied: {param}"


def test_unknown_message_fields_are_400(http) -> None:
    body = chat_body(messages=[{"role": "user", "content": "hi", "tool_calls": []}])
    assert_error(http.post(CHAT, json=body), 400, "messages.0.tool_calls")


def test_no_op_values_of_unimplemented_parameters_are_accepted(http) -> None:
    body = chat_body(tools=None, tool_choice="none", response_format={"type": "text"}, user="u")
    assert http.post(CHAT, json=body).status_code == 200
    body = completion_body(best_of=1, suffix=None, logprobs=None)
    assert http.post(COMPLETIONS, json=body).status_code == 200


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # the vocabulary has 49152 tokens
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {"5": "high"}}, "logit_bias.5"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_processor_bounds_are_400_naming_the_parameter(http, overrides, param) -> None:
    assert_error(http.post(CHAT, json=chat_body(**overrides)), 400, param)


def reference_greedy(loaded, prompt_ids: list[int], steps: int, **processors) -> list[int]:
    """Greedy over full-model logits with the processors applied here, step by step."""
    model, output = loaded.model, []
    bias = {int(k): v for k, v in processors.get("logit_bias", {}).items()}
    presence = processors.get("presence_penalty", 0.0)
    frequency = processors.get("frequency_penalty", 0.0)
    for _ in range(steps):
        logits = prompt_logits(model, torch.tensor([prompt_ids + output]))[-1].double()
        for token, count in Counter(output).items():
            logits[token] -= frequency * count + presence
        for token, value in bias.items():
            logits[token] += value
        output.append(int(logits.argmax()))
    return output


def test_greedy_with_processors_equals_the_reference_loop(http, loaded) -> None:
    prompt_ids = chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": PROMPT}])
    plain = reference_greedy(loaded, prompt_ids, 12)
    processors = {
        "logit_bias": {str(plain[1]): -100, "1000": 4.0},
        "presence_penalty": 1.5,
        "frequency_penalty": 0.5,
    }
    expected = reference_greedy(loaded, prompt_ids, 12, **processors)
    assert expected != plain
    for method in ("ar", "ngram"):
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 12,
            "temperature": 0,
            "lyanna_method": method,
            **processors,
        }
        answer = http.post(CHAT, json=body).json()
        text = answer["choices"][0]["message"]["content"]
        assert text == loaded.tokenizer.decode(expected, skip_special_tokens=True), method


def test_top_k_one_is_greedy_at_any_temperature(http, loaded) -> None:
    prompt_ids = chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": PROMPT}])
    greedy = loaded.tokenizer.decode(reference_greedy(loaded, prompt_ids, 10))
    body = chat_body(messages=[{"role": "user", "content": PROMPT}], max_tokens=10)
    answer = http.post(CHAT, json={**body, "temperature": 1.5, "top_k": 1}).json()
    assert answer["choices"][0]["message"]["content"] == greedy


def test_chat_logprobs_are_the_models_log_softmax(http, loaded) -> None:
    prompt_ids = chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": PROMPT}])
    body = chat_body(
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    answer = http.post(CHAT, json=body).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"] == 6
    output = reference_greedy(loaded, prompt_ids, 6)
    for i, entry in enumerate(content):
        raw = prompt_logits(loaded.model, torch.tensor([prompt_ids + output[:i]]))[-1]
        logp = torch.log_softmax(raw.double(), -1)
        assert entry["token"] == loaded.tokenizer.decode([output[i]])
        assert entry["bytes"] == list(entry["token"].encode())
        assert abs(entry["logprob"] - float(logp[output[i]])) < 1e-3
        top = entry["top_logprobs"]
        assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"]
        assert abs(top[0]["logprob"] - float(logp.max())) < 1e-3  # greedy: the best is chosen
    streamed = []
    with http.stream("POST", CHAT, json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                for choice in chunk["choices"]:
                    if choice["logprobs"] is not None:
                        streamed += choice["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]


def test_completion_logprobs_in_the_legacy_format(http, loaded) -> None:
    prompt_ids = loaded.tokenizer.encode(PROMPT)
    body = completion_body(prompt=prompt_ids, max_tokens=6, temperature=0, logprobs=2)
    choice = http.post(COMPLETIONS, json=body).json()["choices"][0]
    lp = choice["logprobs"]
    output = reference_greedy(loaded, prompt_ids, 6)
    assert lp["tokens"] == [loaded.tokenizer.decode([t]) for t in output]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(6)]
    for i, (value, top) in enumerate(zip(lp["token_logprobs"], lp["top_logprobs"], strict=True)):
        raw = prompt_logits(loaded.model, torch.tensor([prompt_ids + output[:i]]))[-1]
        logp = torch.log_softmax(raw.double(), -1)
        assert abs(value - float(logp[output[i]])) < 1e-3
        assert 1 <= len(top) <= 2 and abs(max(top.values()) - float(logp.max())) < 1e-3
    streamed: dict[str, list] = {"tokens": [], "text_offset": []}
    with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for c in httpx.Response(200, content=line[6:]).json()["choices"]:
                    if c["logprobs"] is not None:
                        streamed["tokens"] += c["logprobs"]["tokens"]
                        streamed["text_offset"] += c["logprobs"]["text_offset"]
    assert streamed == {"tokens": lp["tokens"], "text_offset": lp["text_offset"]}
    assert_error(http.post(COMPLETIONS, json={**body, "logprobs": 6}), 400, "logprobs")


def test_logprobs_without_backend_support_are_400(default_tokenizer) -> None:
    """Services mode (a backend without ``supports_logprobs``) refuses them, never ignores."""
    app = create_app(
        RefusingBackend(RuntimeError("unused")),
        default_tokenizer,
        GatewayConfig(model_name=MODEL_NAME),
    )
    server = ThreadedServer(app).start()
    try:
        response = httpx.post(server.url + CHAT, json=chat_body(logprobs=True))
        assert_error(response, 400, "logprobs")
        response = httpx.post(server.url + COMPLETIONS, json=completion_body(logprobs=0))
        assert_error(response, 400, "logprobs")
    finally:
        server.stop()


def test_negative_seeds_map_to_the_unsigned_range(http) -> None:
    def sampled(seed: int) -> str:
        body = chat_body(max_tokens=12, temperature=1.0, seed=seed, lyanna_method="ar")
        response = http.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    assert sampled(-1) == sampled(2**64 - 1)
    assert sampled(-(2**63)) == sampled(2**63)
    assert sampled(-1) != sampled(-2)


def test_x_request_id_is_honoured_and_echoed(http) -> None:
    response = http.post(CHAT, json=chat_body(), headers={"X-Request-Id": "req-42.a:b_c"})
    assert response.headers["x-request-id"] == "req-42.a:b_c"
    assert response.json()["id"] == "chatcmpl-req-42.a:b_c"
    response = http.post(COMPLETIONS, json=completion_body(), headers={"X-Request-Id": "r7"})
    assert response.headers["x-request-id"] == "r7" and response.json()["id"] == "cmpl-r7"
    own = http.post(CHAT, json=chat_body())
    assert own.json()["id"] == "chatcmpl-" + own.headers["x-request-id"]
    with http.stream(
        "POST", CHAT, json=chat_body(stream=True), headers={"X-Request-Id": "s1"}
    ) as stream:
        assert stream.headers["x-request-id"] == "s1"
        ids = {
            httpx.Response(200, content=line[6:]).json()["id"]
            for line in stream.iter_lines()
            if line.startswith("data: {")
        }
    assert ids == {"chatcmpl-s1"}
    for bad in ("has space", "x" * 129, "semi;colon"):
        refused = http.post(CHAT, json=chat_body(), headers={"X-Request-Id": bad})
        assert_error(refused, 400, "X-Request-Id")


def scrape(url: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            out[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return out


def find(samples: dict[tuple, float], name: str, **labels) -> float:
    return sum(v for k, v in samples.items() if k[0] == name and set(labels.items()) <= set(k[1:]))


def test_responses_are_counted_by_status_code(loaded) -> None:
    server = start_gateway(loaded)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.post(CHAT, json=chat_body()).status_code == 200
            assert http.post(CHAT, json=chat_body(tools=[{}])).status_code == 400
            assert http.post(CHAT, json=chat_body(max_tokens=0)).status_code == 400
            assert http.get("/v1/models/nope").status_code == 404
            assert http.get("/no/such/path").status_code == 404
        samples = scrape(server.url)
        name = "lyanna_http_responses_total"
        assert find(samples, name, path=CHAT, code="200", method="ngram") == 1
        assert find(samples, name, path=CHAT, code="400", method="none") == 2
        assert find(samples, name, path="/v1/models/{model}", code="404") == 1
        assert find(samples, name, path="other", code="404") == 1
        assert find(samples, "lyanna_request_success_total", finish_reason="error") == 0
    finally:
        server.stop()


def test_busy_429s_are_counted_apart_from_errors(default_tokenizer) -> None:
    app = create_app(
        RefusingBackend(BackendBusy("queue full")),
        default_tokenizer,
        GatewayConfig(model_name=MODEL_NAME),
    )
    server = ThreadedServer(app).start()
    try:
        for stream in (False, True):
            response = httpx.post(server.url + CHAT, json=chat_body(stream=stream))
            assert_error(response, 429)
            assert response.headers["Retry-After"] == "1"
        samples = scrape(server.url)
        assert find(samples, "lyanna_request_rejected_total", reason="queue_full") == 2
        assert find(samples, "lyanna_request_success_total") == 0  # not errors
        assert find(samples, "lyanna_num_requests_waiting") == 0
        assert find(samples, "lyanna_http_responses_total", code="429", path=CHAT) == 2
    finally:
        server.stop()
