"""OpenAI request bodies (pydantic, strict types: a string where a number belongs is a 400,
never a silent coercion) and the response / stream-chunk builders.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do; fields that would
change the answer and that Lyanna does not implement (``n`` > 1, ``logprobs``, tools) are
rejected by the routes with a clear message. ``lyanna_method`` picks the speculative method
of one request (experiments); the usage block carries a ``lyanna`` extra with the method and
the request's mean acceptance length.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # null is accepted wherever OpenAI accepts it and means the default
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # None = 1.0
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # None = 1.0
    # a 64-bit unsigned seed, as the services' wire format and torch's generator take it
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)  # None = 1
    logprobs: bool | int | None = None
    user: str | None = None
    lyanna_method: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool | None = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, spec: dict) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "lyanna": spec,
    }


def chat_response(rid: str, model: str, text: str, finish_reason: str, usage_: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_,
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict | None,
    finish_reason: str | None = None,
    usage_: dict | None = None,
    with_usage_field: bool = False,
) -> dict:
    """One ``chat.completion.chunk``; ``delta=None`` is the usage-only chunk (no choices)."""
    chunk: dict = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage_field or usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def completion_response(
    rid: str, model: str, text: str, finish_reason: str | None, usage_: dict | None
) -> dict:
    """A ``text_completion`` (also each streamed chunk: ``finish_reason`` None until the end,
    ``usage`` only where it belongs)."""
    body: dict = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body
