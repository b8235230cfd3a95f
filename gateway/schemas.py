"""OpenAI request bodies (pydantic, strict types: a string where a number belongs is a 400,
never a silent coercion) and the response / stream-chunk builders.

No field is accepted and ignored: an unknown field is a 400 naming it (as OpenAI answers
"Unrecognized request argument"), and so is a known one Lyanna does not implement (tools,
``response_format``, ``suffix``, ``n`` > 1, ``best_of`` > 1): a client asking for JSON mode
or tool calls must not get free text with a 200. The logits processors (``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``top_k``), chat ``logprobs`` / ``top_logprobs`` and
completions ``logprobs`` (0-5 alternatives) are implemented (``lyanna.sampling``).
``lyanna_method`` picks the speculative method of one request (experiments); the usage block
carries a ``lyanna`` extra with the method and the request's mean acceptance length.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lyanna.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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
    # OpenAI allows negative seeds: mapped to the 64-bit unsigned range (seed mod 2^64) that
    # the services' wire format and torch's generator take
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)  # None = 1
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # token id (a decimal string, as JSON keys are) -> bias; ids checked against the vocab
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extension; -1 / 0 = off
    user: str | None = None  # the end user's id (abuse monitoring); never changes the answer
    lyanna_method: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# Known OpenAI fields Lyanna does not implement: typed here so the schema names them, and
# answered 400 by the intake unless they hold their no-op value (null, or the listed one).
UNSUPPORTED_NO_OP = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=5)  # alternatives per token
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

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


def chat_response(
    rid: str,
    model: str,
    text: str,
    finish_reason: str,
    usage_: dict,
    logprobs: dict | None = None,
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
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
    logprobs: dict | None = None,
) -> dict:
    """One ``chat.completion.chunk``; ``delta=None`` is the usage-only chunk (no choices)."""
    chunk: dict = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if with_usage_field or usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_logprobs(entries: list, token_text) -> dict:
    """OpenAI's chat ``logprobs`` object from ``lyanna.sampling.TokenLogprob`` entries;
    ``token_text`` decodes one token id."""

    def one(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list, token_text, offset: int) -> dict:
    """The legacy completions ``logprobs`` object (``tokens``, ``token_logprobs``,
    ``top_logprobs`` as token -> logprob maps, ``text_offset``: each token's character offset in
    the output, counted from ``offset``)."""
    tokens = [token_text(e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def completion_response(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict | None,
    logprobs: dict | None = None,
) -> dict:
    """A ``text_completion`` (also each streamed chunk: ``finish_reason`` None until the end,
    ``usage`` only where it belongs)."""
    body: dict = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body
