"""The OpenAI API over real HTTP with the official client: non-streaming and streaming chat,
text completions, stop strings, per-request method choice, seeded sampling, and eight
concurrent streams; at temperature 0 every answer equals plain greedy decoding."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from lyanna.tokenizer import chat_prompt_ids
from tests.gateway.conftest import MODEL_NAME, greedy_text

PROMPT = "Write a haiku about speculative decoding."


def chat_ids(loaded, content: str) -> list[int]:
    return chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": content}])


@pytest.mark.parametrize("method", ["ngram", "ar"])
def test_chat_temperature_zero_equals_plain_greedy(client, loaded, method) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=40,
        temperature=0,
        extra_body={"lyanna_method": method},
    )
    assert response.choices[0].message.content == greedy_text(loaded, chat_ids(loaded, PROMPT), 40)
    assert response.choices[0].finish_reason == "length"
    usage = response.usage
    assert usage.completion_tokens == 40
    assert usage.prompt_tokens == len(chat_ids(loaded, PROMPT))
    spec = usage.model_extra["lyanna"]
    assert spec["method"] == method
    assert spec["acceptance_length"] >= 1.0
    if method == "ar":
        assert spec["acceptance_length"] == 1.0 and spec["num_draft_tokens"] == 0


def test_streaming_equals_non_streaming_and_reports_usage(client, loaded) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_text(loaded, chat_ids(loaded, PROMPT), 32)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    assert chunks[-1].usage.model_extra["lyanna"]["method"] == "ngram"


def test_sse_wire_format_ends_with_done(gateway) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-lyanna-method"] == "ngram"
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in events[:-1]]
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert all("usage" not in p for p in payloads)  # include_usage was not asked for


def test_text_completion_equals_plain_greedy(client, loaded) -> None:
    prompt = "The quick brown fox"
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0
    )
    expected = greedy_text(loaded, loaded.tokenizer.encode(prompt), 24)
    assert response.choices[0].text == expected
    stream = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_stop_string_cuts_the_answer(client, loaded) -> None:
    full = greedy_text(loaded, chat_ids(loaded, PROMPT), 40)
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=40,
            temperature=0,
            stop=[stop],
            stream=stream,
        )
        if stream:
            chunks = list(response)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, finish = response.choices[0].message.content, response.choices[0].finish_reason
        assert text == full[: full.find(stop)]
        assert finish == "stop"


def test_method_header_and_seeded_sampling(client, gateway) -> None:
    def sampled(seed: int) -> str:
        response = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=16,
            temperature=0.8,
            seed=seed,
            extra_headers={"X-Lyanna-Method": "ar"},
        )
        assert response.headers["x-lyanna-method"] == "ar"
        return response.parse().choices[0].message.content

    assert sampled(7) == sampled(7)
    assert sampled(2**64 - 1) == sampled(2**64 - 1)  # the largest seed the schema admits


def test_models_and_health(client, gateway) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert "lyanna" in models[0].model_extra["lyanna_methods"]
    assert models[0].model_extra["lyanna_default_method"] == "ngram"
    health = httpx.get(gateway.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_eight_concurrent_streams_complete_correctly(gateway, loaded) -> None:
    prompts = [f"Tell me fact number {i} about the sea." for i in range(8)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=gateway.url + "/v1", api_key="none", max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    answers = asyncio.run(all_of_them())
    assert answers == [greedy_text(loaded, chat_ids(loaded, p), 24) for p in prompts]


def test_null_means_default(gateway) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": None,
        "top_p": None,
        "n": None,
        "stream": None,
        "seed": None,
        "stop": None,
    }
    response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 4
