"""The gateway on the real default model with the Lyanna drafter (the server default): at
temperature 0 the answer over HTTP, streamed or not, equals plain greedy decoding."""

from __future__ import annotations

import openai
import pytest

from gateway.config import GatewayConfig
from gateway.embedded import EmbeddedConfig
from gateway.server import ThreadedServer, embedded_app
from lyanna.decode import generate
from lyanna.model import DEFAULT_MODEL
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.serving_model import LoadedModel, eos_ids
from lyanna.tokenizer import chat_prompt_ids, make_detokenize

pytestmark = pytest.mark.slow

PROMPTS = ["Explain speculative decoding in two sentences.", "Name three primary colors."]


@pytest.fixture(scope="module")
def served(default_model, default_tokenizer):
    loaded = LoadedModel(
        default_model, default_tokenizer, eos_ids(default_tokenizer, default_model)
    )
    app = embedded_app(loaded, GatewayConfig(), EmbeddedConfig(default_method="lyanna"))
    server = ThreadedServer(app).start()
    yield loaded, server
    server.stop()


def test_lyanna_method_equals_plain_greedy(served) -> None:
    loaded, server = served
    assert server.app.state.backend.default_method == "lyanna"  # the checkpoint loads
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    detokenize = make_detokenize(loaded.tokenizer)
    for i, prompt in enumerate(PROMPTS):
        messages = [{"role": "user", "content": prompt}]
        seq = Sequence(
            0,
            chat_prompt_ids(loaded.tokenizer, messages),
            SamplingParams(max_tokens=48),
            loaded.eos_token_ids,
        )
        generate(loaded.model, [seq])
        expected = detokenize(seq.output_ids)
        kwargs = {"model": DEFAULT_MODEL.name, "messages": messages, "max_tokens": 48}
        if i == 0:
            response = client.chat.completions.create(**kwargs, temperature=0)
            assert response.choices[0].message.content == expected
            spec = response.usage.model_extra["lyanna"]
            assert spec["method"] == "lyanna" and spec["num_draft_tokens"] > 0  # it drafts
            # tokens per verification: plain steps of the draft gate count (1 token each)
            assert spec["acceptance_length"] >= 1.0
            assert response.usage.completion_tokens == len(seq.output_ids)
        else:
            stream = client.chat.completions.create(**kwargs, temperature=0, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == expected
