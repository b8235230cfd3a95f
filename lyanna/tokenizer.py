"""Tokenizer and chat template, loaded from the model directory through transformers
(no hub access: ``local_files_only``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

Message = dict[str, str]


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    path = Path(model_dir)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def chat_prompt_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """Token ids of a chat with the generation prompt appended (the model answers next)."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def make_detokenize(tokenizer: Any) -> Callable[[list[int]], str]:
    """The one decoding the gateway and the backends share (stop strings must agree)."""

    def detokenize(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    return detokenize
