"""``lyanna chat``: a terminal client on the official ``openai`` package. It streams each
answer, keeps the conversation and prints tokens/s, time to first token and the acceptance
length the gateway reports in the final usage chunk."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from openai import APIConnectionError, APIError, OpenAI


@dataclass(frozen=True, slots=True)
class ChatOptions:
    url: str = "http://127.0.0.1:8000/v1"
    api_key: str = "none"
    model: str | None = None  # None = the first model the server lists
    method: str | None = None  # speculative method (X-Lyanna-Method); None = server default
    max_tokens: int = 256
    temperature: float = 0.0
    system: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or not 0.0 <= self.temperature <= 2.0:
            raise ValueError("max_tokens must be >= 1 and temperature in [0, 2]")


@dataclass(frozen=True, slots=True)
class TurnStats:
    completion_tokens: int
    seconds: float
    ttft_seconds: float
    acceptance_length: float | None
    method: str | None

    def line(self) -> str:
        rate = self.completion_tokens / max(self.seconds, 1e-9)
        accept = "n/a" if self.acceptance_length is None else f"{self.acceptance_length:.2f}"
        return (
            f"[{self.completion_tokens} tokens in {self.seconds:.2f} s: {rate:.1f} tokens/s, "
            f"TTFT {self.ttft_seconds:.2f} s, acceptance length {accept} "
            f"({self.method or 'default'})]"
        )


class ChatSession:
    def __init__(self, options: ChatOptions) -> None:
        self.options = options
        headers = {"X-Lyanna-Method": options.method} if options.method else None
        self.client = OpenAI(
            base_url=options.url, api_key=options.api_key, default_headers=headers, max_retries=0
        )
        self.model = options.model or self.client.models.list().data[0].id
        self.messages = [{"role": "system", "content": options.system}] if options.system else []

    def ask(self, prompt: str, out: TextIO | None = None) -> TurnStats:
        """Stream one answer to ``out`` (default stdout); the conversation keeps both turns."""
        out = out or sys.stdout
        self.messages.append({"role": "user", "content": prompt})
        start, first, parts, usage = time.perf_counter(), None, [], None
        stream = self.client.chat.completions.create(
            model=self.model,
            messages=self.messages,
            max_tokens=self.options.max_tokens,
            temperature=self.options.temperature,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    parts.append(choice.delta.content)
                    out.write(choice.delta.content)
                    out.flush()
        end = time.perf_counter()
        out.write("\n")
        out.flush()
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        spec = (usage.model_extra or {}).get("lyanna", {}) if usage is not None else {}
        tokens = usage.completion_tokens if usage is not None else len(parts)
        accept, method = spec.get("acceptance_length"), spec.get("method")
        return TurnStats(tokens, end - start, (first or end) - start, accept, method)


def run_chat(options: ChatOptions, prompt: str | None = None) -> int:
    """One turn when ``prompt`` is given, else a conversation read line by line from stdin
    (an empty line or EOF ends it)."""
    try:
        session = ChatSession(options)
        if prompt is not None:
            print(session.ask(prompt).line(), file=sys.stderr)
            return 0
        print(f"chatting with {session.model} at {options.url} (empty line or Ctrl-D quits)")
        while line := _read("> "):
            print(session.ask(line).line(), file=sys.stderr)
        return 0
    except (APIConnectionError, APIError) as err:
        print(f"lyanna chat: {err}", file=sys.stderr)
        return 1


def _read(prompt: str) -> str:
    try:
        return input(prompt).strip()
    except EOFError:
        return ""
