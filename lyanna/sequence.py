"""Per-request decoding state: committed output tokens and the stop conditions (EOS, stop
strings, max tokens). Shared by plain decoding and the speculative engine so both finish
requests the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lyanna.sampling import SamplingParams

Detokenize = Callable[[list[int]], str]


@dataclass(slots=True)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    detokenize: Detokenize | None = None  # needed only when params.stop is set
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    text_end: int | None = None  # character cut of the output text when a stop string hit
    generator: torch.Generator | None = None
    method: str | None = None  # the drafter that serves it; None = the engine's default

    def __post_init__(self) -> None:
        if self.params.stop and self.detokenize is None:
            raise ValueError("stop strings need a detokenize function")
        if self.generator is None and not self.params.greedy:
            self.generator = self.params.make_generator()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def append(self, tokens: list[int]) -> list[int]:
        """Commit newly decided tokens; returns those that belong to the output (EOS and
        anything after a finish condition are dropped)."""
        emitted: list[int] = []
        for token in tokens:
            if self.finished:
                break
            if token in self.eos_token_ids and not self.params.ignore_eos:
                self.finish_reason = "stop"
                break
            self.output_ids.append(token)
            emitted.append(token)
            if self.params.stop and self._hit_stop_string():
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        return emitted

    def _hit_stop_string(self) -> bool:
        text = self.detokenize(self.output_ids)
        longest = max(len(s) for s in self.params.stop)
        window_start = max(0, len(text) - longest - 16)
        hits = [i for s in self.params.stop if (i := text.find(s, window_start)) >= 0]
        if hits:
            self.text_end = min(hits)
        return bool(hits)

    def output_text(self) -> str:
        text = self.detokenize(self.output_ids) if self.detokenize else ""
        return text if self.text_end is None else text[: self.text_end]
