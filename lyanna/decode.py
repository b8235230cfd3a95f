"""Plain autoregressive decoding: the baseline every speculative method is compared with,
and must equal token for token at temperature 0.

It is the speculative engine's own loop (``lyanna.engine.SpecEngine``) with ``NoDrafter``,
method ``ar``: every step verifies a root-only tree, so plain decoding, serving (``--method
ar``) and self-distillation (``training.distill``) decode with one loop, and that loop is the
one every speculative method runs. Prefill runs each prompt alone (prompts differ in length;
one long matmul per prompt is what the CPU likes); decode steps run all unfinished sequences
together, one new token each. ``prefill`` (fill a KV slot with a prompt) is the target's
(``lyanna.target.prefill_prompt``), named here too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lyanna.drafters import TARGET_ONLY
from lyanna.drafters.base import NoDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.model.transformer import Transformer
from lyanna.scheduler import TREE_MARGIN
from lyanna.sequence import Sequence
from lyanna.target import prefill_prompt as prefill

__all__ = ["DecodeStats", "generate", "prefill"]


@dataclass(frozen=True, slots=True)
class DecodeStats:
    num_prompt_tokens: int
    num_output_tokens: int
    prefill_seconds: float
    decode_seconds: float


def generate(
    model: Transformer,
    sequences: list[Sequence],
    max_len: int | None = None,  # KV rows per sequence (default: the longest, plus a tree's)
) -> DecodeStats:
    """Decode every sequence to completion (greedy or sampled per its params), in place: all
    prompts are prefilled first, then every unfinished sequence decodes one token a step."""
    if len({s.seq_id for s in sequences}) != len(sequences):
        raise ValueError("the sequences need distinct seq_ids")
    longest = max(len(s.prompt_ids) + s.params.max_tokens for s in sequences)
    config = EngineConfig(max_running=len(sequences), max_len=max_len or longest + TREE_MARGIN)
    engine = SpecEngine(model, NoDrafter(), config, method=TARGET_ONLY)
    for sequence in sequences:
        engine.submit(sequence)
    start = time.perf_counter()
    engine.admit()
    prefill_done = time.perf_counter()
    engine.run()
    end = time.perf_counter()
    return DecodeStats(
        num_prompt_tokens=sum(len(s.prompt_ids) for s in sequences),
        num_output_tokens=sum(len(s.output_ids) for s in sequences),
        prefill_seconds=prefill_done - start,
        decode_seconds=end - prefill_done,
    )
