"""Plain autoregressive decoding on the lean model: the baseline every speculative method is
compared with, and must equal token for token at temperature 0.

Prefill runs each prompt alone (prompts differ in length; one long matmul per prompt is what
the CPU likes); decode steps run all unfinished sequences together, one new token each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lyanna.model.native_layers import causal_mask
from lyanna.model.transformer import Transformer
from lyanna.sampling import greedy_or_sample
from lyanna.sequence import Sequence


@dataclass(frozen=True, slots=True)
class DecodeStats:
    num_prompt_tokens: int
    num_output_tokens: int
    prefill_seconds: float
    decode_seconds: float


def prefill(
    model: Transformer, prompt_ids: list[int], cache, slot: int, decoded: list[int] | None = None
) -> torch.Tensor:  # [prompt_len + len(decoded), hidden]
    """Fill the slot with the prompt and commit it; returns the prompt's hidden states.
    ``decoded``: tokens already decoded after the prompt (a resumed sequence), run as one
    causal chain after it, which computes them exactly as decoding did (a prompt's own
    attention may round differently, see ``Transformer._native_forward``)."""
    device = model.embed_tokens.weight.device
    slots = torch.tensor([slot])
    hidden = []
    for start, ids in ((0, prompt_ids), (len(prompt_ids), decoded or [])):
        if not ids:
            continue
        tokens = torch.tensor([ids], dtype=torch.int64, device=device)
        positions = (start + torch.arange(len(ids), device=device))[None]
        chain = None if start == 0 else causal_mask(1, len(ids)).to(device)
        hidden.append(model(tokens, positions, cache, slots, chain)[0])
        cache.commit(slot, torch.arange(len(ids)))
    return torch.cat(hidden)


def generate(
    model: Transformer,
    sequences: list[Sequence],
    max_len: int | None = None,
) -> DecodeStats:
    """Decode every sequence to completion (greedy or sampled per its params), in place."""
    longest = max(len(s.prompt_ids) + s.params.max_tokens for s in sequences)
    cache = model.new_cache(len(sequences), max_len or longest + 1)
    slots = [cache.allocate() for _ in sequences]
    start = time.perf_counter()
    pending: list[int] = []  # last decided token of each sequence, not yet in the cache
    for seq, slot in zip(sequences, slots, strict=True):
        hidden = prefill(model, seq.prompt_ids, cache, slot)
        token = greedy_or_sample(model.logits(hidden[-1:]), seq.params, seq.generator)
        pending.append(int(token))
        seq.append([pending[-1]])
    prefill_done = time.perf_counter()
    active = [i for i, s in enumerate(sequences) if not s.finished]
    while active:
        slot_ids = torch.tensor([slots[i] for i in active])
        tokens = torch.tensor([[pending[i]] for i in active])
        positions = cache.lengths[slot_ids][:, None].clone()
        logits = model.logits(model(tokens, positions, cache, slot_ids)[:, -1])
        for row, i in enumerate(active):
            cache.commit(slots[i], [0])
            seq = sequences[i]
            pending[i] = int(greedy_or_sample(logits[row : row + 1], seq.params, seq.generator))
            seq.append([pending[i]])
        active = [i for i in active if not sequences[i].finished]
    end = time.perf_counter()
    for slot in slots:
        cache.release(slot)
    return DecodeStats(
        num_prompt_tokens=sum(len(s.prompt_ids) for s in sequences),
        num_output_tokens=sum(len(s.output_ids) for s in sequences),
        prefill_seconds=prefill_done - start,
        decode_seconds=end - prefill_done,
    )
