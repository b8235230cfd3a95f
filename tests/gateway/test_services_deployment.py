"""Three processes, wired the way a cluster wires them: ``services.launch`` starts the verifier
and drafter and a ``lyanna serve --mode services --verifier-addr ... --drafter-addr ...``
gateway that only connects. Through the official client, greedy answers (streamed or not)
equal plain greedy decoding and /metrics reports the drafter's steps; with the drafter killed
the answer is unchanged (target-only fallback) and /metrics counts the fallback steps."""

from __future__ import annotations

import sys

import httpx
import openai
import pytest

from lyanna.tokenizer import chat_prompt_ids
from services.launch import launch
from tests.gateway.conftest import greedy_text

pytestmark = pytest.mark.slow


# an explicit shape (the default's depth) keeps n-gram drafting in the drafter service, whose
# path (and its loss) these tests watch; the default shape is drafted in the verifier
DRAFTER_NGRAM = ("--depth", "3")


def test_gateway_connects_to_running_services(tiny_chat_dir, loaded) -> None:
    gateway = [sys.executable, "-m", "gateway.cli", "serve", "--mode", "services"]
    gateway += ["--verifier-addr", "{verifier_addr}", "--drafter-addr", "{drafter_addr}"]
    gateway += ["--port", "{gateway_port}", "--model", str(tiny_chat_dir), "--method", "{method}"]
    with launch(
        tiny_chat_dir,
        method="ngram",
        gateway_command=gateway,
        verifier_args=("--max-len", "512"),
        drafter_args=DRAFTER_NGRAM,
    ) as deployment:
        url = f"http://127.0.0.1:{deployment.gateway_port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        prompt = "one two three one two three"
        expected = greedy_text(
            loaded, chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": prompt}]), 32
        )
        messages = [{"role": "user", "content": prompt}]
        response = client.chat.completions.create(
            model=model, messages=messages, max_tokens=32, temperature=0
        )
        assert response.choices[0].message.content == expected
        assert response.usage.model_extra["lyanna"]["method"] == "ngram"
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=32, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
        metrics = httpx.get(url + "/metrics").text
        assert 'lyanna_spec_draft_steps_total{method="ngram"' in metrics
        assert 'service="services"' in metrics
        deployment.kill("drafter")  # target-only fallback: same answer, counted in /metrics
        response = client.chat.completions.create(
            model=model, messages=messages, max_tokens=32, temperature=0
        )
        assert response.choices[0].message.content == expected
        fallbacks = [
            line
            for line in httpx.get(url + "/metrics").text.splitlines()
            if line.startswith("lyanna_spec_drafter_fallback_total{")
        ]
        assert fallbacks and float(fallbacks[0].rsplit(" ", 1)[1]) > 0
