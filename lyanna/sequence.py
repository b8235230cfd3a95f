"""Per-request decoding state, the one record of a request: its committed tokens (the prompt
and the output, whose last token is the *next token*: decided, the root of the next tree, not
yet in the target's KV) and the stop conditions (EOS, stop strings, max tokens). Shared by
plain decoding, the speculative engine and the remote engine, so all of them finish requests
the same way; other per-request views (``remote_engine.seq.RemoteSeq``) keep only their
extras."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lyanna.sampling import SamplingParams
from lyanna.stop_strings import Detokenize, find_stop


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

    # While a sequence decodes, every output token but the last is in the target's KV and
    # the last is the next token (``append`` drops nothing until the sequence finishes).

    @property
    def next_token(self) -> int | None:
        """The root of the next tree (None before the prefill decided the first token)."""
        return self.output_ids[-1] if self.output_ids else None

    @property
    def num_committed(self) -> int:
        """Tokens in the target's KV: the prompt and the output before the next token."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    def history(self) -> list[int]:
        """The tokens in the target's KV (``num_committed`` of them): what a target or a
        drafter that lost the sequence is started again from."""
        return self.prompt_ids + self.output_ids[:-1]

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
        self.text_end = find_stop(text, self.params.stop, max(0, len(text) - longest - 16))
        return self.text_end is not None

    def output_text(self) -> str:
        text = self.detokenize(self.output_ids) if self.detokenize else ""
        return text if self.text_end is None else text[: self.text_end]
