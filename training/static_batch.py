"""Static-batch answer generation for an accelerator (``training.distill generate --engine
static``): a GPU decodes a 135M model at the same speed for one sequence or a thousand, so
throughput comes from the width of the batch, not from refilling slots. Each group of
``batch_size`` prompts is prefilled in chunks of similar length, then decoded one token per
row per step with the choice made on the device (argmax, or a sample at the row's
temperature) until every row has its closing token and that token's hidden state. The answers
are ``training.distill_jobs.Answer`` objects, as the continuous-batching path makes them; sampled
rows draw from one device generator per group (seeded), so they are not the CPU path's draws.

This is the one decode loop besides the engine's (``lyanna.decode``, method ``ar``, which
``generate`` and the continuous path drive), and it stays because a wide batch is bound by the
host's work per row: the engine prefills each prompt alone and runs the acceptance rule, the KV
commit and the bookkeeping of every row in Python at every step, where this loop prefills
chunks and decides every row's token in one device op. Measured on the tiny test model (its
forward costs little, so what is left is the host's share, the bound on a GPU; 2-core CPU,
greedy, 32 answer tokens, one run on a loaded host): 328 us per answer token through the
engine against 27 us here at 512 rows, 398 against 47 at 128 rows. At 768 rows that is about
0.25 s of host time per step through the engine (``training/README.md``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch

from lyanna.model.kv_cache import KVCache
from lyanna.model.transformer import Transformer
from training.distill_jobs import Answer, DistillConfig, Job

PREFILL_ROWS = 64  # prompts per prefill forward (the causal mask is rows x width x width)


def choose_tokens(
    logits: torch.Tensor,  # [B, vocab] float32
    temperature: torch.Tensor,  # [B] float32, 0 = greedy
    generator: torch.Generator | None,
) -> torch.Tensor:  # [B] int64
    """Argmax where the temperature is 0, else one draw from softmax(logits / T)."""
    greedy = logits.argmax(-1)
    scaled = logits / temperature.clamp(min=1e-6)[:, None]
    sampled = torch.multinomial(scaled.softmax(-1), 1, generator=generator)[:, 0]
    return torch.where(temperature > 0, sampled, greedy)


def generate_static(
    model: Transformer, jobs: Iterable[Job], config: DistillConfig, eos_id: int, seed: int = 0
) -> Iterator[Answer]:
    """Answers to ``jobs`` (``training.distill_jobs.Job``), ``config.batch_size`` at a time."""
    jobs = iter(jobs)
    for group_index in itertools.count():
        group = list(itertools.islice(jobs, config.batch_size))
        if not group:
            return
        yield from _answer_group(model, group, config, eos_id, seed + group_index)


@torch.inference_mode()
def _answer_group(
    model: Transformer, group: list[Job], config: DistillConfig, eos_id: int, seed: int
) -> list[Answer]:
    device = model.embed_tokens.weight.device
    group = sorted(group, key=lambda job: len(job.prompt_ids))  # similar widths per chunk
    B = len(group)
    cache = model.new_cache(B, config.max_prompt_tokens + config.max_answer_tokens)
    slots = torch.tensor([cache.allocate() for _ in range(B)])
    prompt_hidden, last = _prefill(model, group, cache, slots)
    generator = torch.Generator(device=device).manual_seed(seed)
    temperature = torch.tensor([job.temperature for job in group], device=device)
    token = choose_tokens(model.logits(last), temperature, generator)  # [B]
    decided = torch.ones(B, dtype=torch.int64, device=device)  # answer tokens chosen per row
    closed = (token == eos_id) | (decided >= config.max_answer_tokens)  # last token chosen
    done = torch.zeros(B, dtype=torch.bool, device=device)  # last token's hidden state kept
    tokens, hidden = [token], []
    while not bool(done.all()):
        positions = cache.lengths[slots][:, None]
        h = model(token[:, None], positions, cache, slots)[:, 0]  # [B, d]
        hidden.append(h.half().cpu())
        cache.advance(slots, (~done).cpu())  # a finished row rewrites its spare row
        done = done | closed
        if bool(done.all()):
            break
        chosen = choose_tokens(model.logits(h), temperature, generator)
        token = torch.where(closed, token, chosen)
        decided = decided + (~closed).long()
        closed = closed | (token == eos_id) | (decided >= config.max_answer_tokens)
        tokens.append(token)
    steps_tokens = torch.stack(tokens).cpu()  # [S, B]
    steps_hidden = torch.stack(hidden)  # [S', B, d] float16
    lengths = decided.cpu().tolist()
    answers = []
    for row, job in enumerate(group):
        n = lengths[row]
        answer = steps_tokens[:n, row].tolist()
        states = torch.cat([prompt_hidden[row], steps_hidden[:n, row]])
        answers.append(Answer(job, answer, states))
    return answers


def _prefill(
    model: Transformer, group: list[Job], cache: KVCache, slots: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every prompt into its slot, ``PREFILL_ROWS`` at a time (right-padded, causal): the
    prompts' hidden states (float16, CPU) and each prompt's last state (device)."""
    device = model.embed_tokens.weight.device
    prompt_hidden: list[torch.Tensor] = []
    last = []
    for start in range(0, len(group), PREFILL_ROWS):
        chunk = group[start : start + PREFILL_ROWS]
        width = max(len(job.prompt_ids) for job in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.int64)
        for row, job in enumerate(chunk):
            ids[row, : len(job.prompt_ids)] = torch.tensor(job.prompt_ids)
        positions = torch.arange(width)[None].expand(len(chunk), width)
        chunk_slots = slots[start : start + len(chunk)]
        out = model(ids.to(device), positions.to(device), cache, chunk_slots)  # [n, W, d]
        lengths = torch.tensor([len(job.prompt_ids) for job in chunk])
        cache.advance(chunk_slots, lengths)
        rows = out.half().cpu()
        for row, n in enumerate(lengths.tolist()):
            prompt_hidden.append(rows[row, :n])
        last.append(out[torch.arange(len(chunk), device=device), lengths.to(device) - 1])
    return prompt_hidden, torch.cat(last)
