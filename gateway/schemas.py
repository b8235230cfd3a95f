"""OpenAI request bodies (pydantic, strict: a string where a number belongs is a 400, never
a silent coercion) and the response builders.

No field is accepted and ignored: an unknown field is a 400 naming it, and so is a known one
Lyanna does not implement (tools, ``response_format``, ...): a client asking for JSON mode or
tool calls must not get free text with a 200. ``lyanna_method`` picks one request's method;
the usage block carries a ``lyanna`` extra (method, mean acceptance length)."""

from __future__ import annotations

import time
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


def response(rid: str, model: str, kind: str, choice: dict | None, **usage_: dict | None) -> dict:
    """A response or stream chunk of object ``kind`` with one choice (None: no choices, the
    usage-only chunk); a ``usage`` field only where one is passed."""
    choices = [] if choice is None else [{"index": 0, **choice}]
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model}
    return {**body, "choices": choices, **usage_}


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
