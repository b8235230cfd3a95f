"""Gateway fixtures: a real uvicorn server on a free port in a background thread, serving a
tiny random-weight model (vocab 49152, so the default model's tokenizer fits it) through the
embedded backend, and the official ``openai`` client pointed at it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway.config import GatewayConfig
from gateway.embedded import EmbeddedConfig
from gateway.server import ThreadedServer, embedded_app
from lyanna.decode import generate
from lyanna.model.loader import export_hf_dir
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.serving_model import LoadedModel, eos_ids
from lyanna.tokenizer import make_detokenize
from tests.conftest import make_tiny_model
from tests.unit.test_loader import hf_state_of

TINY_VOCAB = 49152
MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def chat_model():
    return make_tiny_model(0, vocab_size=TINY_VOCAB)


@pytest.fixture(scope="session")
def loaded(chat_model, default_tokenizer) -> LoadedModel:
    eos = eos_ids(default_tokenizer, chat_model.config.eos_token_id)
    return LoadedModel(chat_model, default_tokenizer, eos)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory, chat_model, default_model_dir) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-chat"
    export_hf_dir(chat_model.config, hf_state_of(chat_model), out)
    for name in TOKENIZER_FILES:
        if (Path(default_model_dir) / name).exists():
            shutil.copy(Path(default_model_dir) / name, out / name)
    return out


def start_gateway(
    loaded: LoadedModel,
    config: GatewayConfig | None = None,
    embedded: EmbeddedConfig | None = None,
) -> ThreadedServer:
    config = config or GatewayConfig(model_name=MODEL_NAME)
    embedded = embedded or EmbeddedConfig(default_method="ngram", max_len=512)
    return ThreadedServer(embedded_app(loaded, config, embedded)).start()


@pytest.fixture(scope="module")
def gateway(loaded) -> Iterator[ThreadedServer]:
    server = start_gateway(loaded)
    yield server
    server.stop()


@pytest.fixture
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)


def plain_greedy(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The oracle: plain autoregressive greedy decoding (lyanna.decode.generate)."""
    seq = Sequence(0, prompt_ids, SamplingParams(max_tokens=max_tokens), loaded.eos_token_ids)
    generate(loaded.model, [seq])
    return seq.output_ids


def greedy_text(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int) -> str:
    return make_detokenize(loaded.tokenizer)(plain_greedy(loaded, prompt_ids, max_tokens))
