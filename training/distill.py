"""Self-distilled drafter data: the target answers the training prompts itself, batched, and the
hidden states that generation computes are kept (no second forward over the same tokens).

Two outputs per run, one job each:

- **token-id shards, in git** (``data/distill/<run>/ids-00000.safetensors`` + ``manifest.json``,
  the format of ``training.id_shards``): a few MB for millions of tokens, so nobody
  regenerates them.
- **hidden-state shards, a cache** (``$LYANNA_CACHE/data/<run>/shard-00000.safetensors``, the
  ``training.data`` format every trainer reads): written by generation; ``materialize`` rebuilds
  missing ones from the ids by batched prefill.

Generation is continuous batching on the engine's plain-decoding loop (``lyanna.engine``,
method ``ar``, as ``lyanna.decode.generate``) on a CPU: a finished sequence's slot takes the
next prompt at once, so the batch stays full until the queue runs dry (``--engine static``,
for a GPU: ``training.static_batch``, which says why it has a loop of its own). Shard k holds
the k-th group of ``prompts_per_shard`` prompts of the split (file order), so a rerun skips
finished shards.
A share of prompts (``sampled_fraction``, chosen per prompt from the seed) is answered by
sampling at a temperature drawn from ``temperature_range``, so sampling-mode drafting sees
the target's sampled continuations too. ``heldout`` prompts (2 % of ids, by hash) never enter
the ``train`` split.

    python -m training.distill generate --run-name distill-v1 --token-budget 2000000
    python -m training.distill materialize --run-name distill-v1
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from lyanna.drafters import TARGET_ONLY
from lyanna.drafters.base import NoDrafter, VerifiedStep
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.model import fetch_default_model, load_model
from lyanna.model.default import sha256_of
from lyanna.model.transformer import Transformer
from lyanna.scheduler import TREE_MARGIN
from lyanna.sequence import Sequence as DecodeSequence
from lyanna.tokenizer import load_tokenizer
from training.data import MANIFEST, Sequence, build_shard, shard_path, write_shard
from training.distill_jobs import Answer, DistillConfig, Job, is_held_out
from training.id_shards import IDS_PATTERN, Manifest, read_ids_shard, shard_index, write_ids_shard
from training.prepare import TRAIN_PROMPTS, chat_prompts, prompt_seed
from training.static_batch import generate_static


def plan_jobs(config: DistillConfig, tokenizer, path: Path = TRAIN_PROMPTS) -> Iterator[Job]:
    """The split's eligible prompts in file order, each with its shard and temperature."""
    low, high = config.temperature_range
    in_split = lambda record: is_held_out(record["id"]) == (config.split == "heldout")  # noqa: E731
    prompts = chat_prompts(path, tokenizer, config.max_prompt_tokens, in_split)
    for count, (index, _, ids) in enumerate(prompts):
        rng = random.Random(prompt_seed(config.seed, index))
        temperature = 0.0
        if rng.random() < config.sampled_fraction:
            temperature = round(rng.uniform(low, high), 2)
        yield Job(index, count // config.prompts_per_shard, ids, temperature)


@dataclass(slots=True, eq=False)
class _Answering(DecodeSequence):
    """A prompt answered through the engine. The answer closes at end-of-turn or at
    ``limit`` tokens; the sequence decodes two tokens past that closing token, so the engine
    has taught the recorder the step that committed it (its hidden state is the one a drafter
    regresses last; the engine teaches no step that finishes a sequence), then stops: two
    extra rows per answer, one more than a loop of its own would run. ``output_ids[:closed]``
    is the answer, end-of-turn kept."""

    job: Job | None = None
    eos_id: int = -1
    limit: int = 0
    closed: int = 0  # answer tokens once the closing token is decided (0: still open)

    def append(self, tokens: list[int]) -> list[int]:
        for token in tokens:
            if self.finished:
                break
            self.output_ids.append(token)
            if self.closed and len(self.output_ids) > self.closed + 1:
                self.finish_reason = "stop"  # the step that committed the closing token ran
            elif not self.closed and (token == self.eos_id or len(self.output_ids) >= self.limit):
                self.closed = len(self.output_ids)
        return tokens


class _HiddenRecorder(NoDrafter):
    """Plain decoding (root-only trees) that keeps the hidden states the engine's forwards
    computed: the prompt's at start, then the committed root's at every step."""

    needs_hidden = True

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, list[torch.Tensor]] = {}  # seq id -> float16 CPU rows

    def start(self, seq_id, prompt_ids, prompt_hidden, first_token, params=None) -> None:
        super().start(seq_id, prompt_ids, prompt_hidden, first_token, params)
        self.rows[seq_id] = [prompt_hidden.half().cpu()]

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        for step in steps:
            self.rows[step.seq_id].append(step.hidden.half().cpu())
        return super().on_verified(steps)


def generate_answers(
    model: Transformer, jobs: Iterator[Job], config: DistillConfig, eos_id: int
) -> Iterator[Answer]:
    """Continuous batching on the engine's plain-decoding loop (``lyanna.decode``'s; method
    ``ar``): every live sequence decodes one token per step and a queued prompt takes each
    freed slot before the next step. Each answer ends with end-of-turn (when the target
    stopped) and carries the hidden state at every one of its tokens."""
    recorder = _HiddenRecorder()
    longest = config.max_prompt_tokens + config.max_answer_tokens + 2
    engine_config = EngineConfig(config.batch_size, longest + TREE_MARGIN)
    engine = SpecEngine(model, recorder, engine_config, method=TARGET_ONLY)
    live: dict[int, _Answering] = {}  # seq id -> sequence (running or waiting)
    jobs = iter(jobs)
    ids = itertools.count()
    while True:
        while len(live) < config.batch_size and (job := next(jobs, None)) is not None:
            params = job.params(config)
            sequence = _Answering(
                next(ids),
                job.prompt_ids,
                dataclasses.replace(params, max_tokens=config.max_answer_tokens + 2),
                job=job,
                eos_id=eos_id,
                limit=config.max_answer_tokens,
            )
            live[sequence.seq_id] = sequence
            engine.submit(sequence)
        if not live:
            return
        engine.step()
        for seq_id in [s for s, sequence in live.items() if sequence.finished]:
            sequence = live.pop(seq_id)
            rows = torch.cat(recorder.rows.pop(seq_id))
            answer = sequence.output_ids[: sequence.closed]
            yield Answer(sequence.job, answer, rows[: len(sequence.prompt_ids) + len(answer)])


def fast_attention(model: Transformer) -> None:
    """float32 attention for the eager q4 layers: serving on them keeps float64 attention so
    that a token's hidden state does not depend on what shares its forward; training data does
    not need that, and float32 attention doubles generation throughput at batch 16 (measured,
    docs/benchmarks.md). The native decoder is batch invariant in float32 already (no-op)."""
    model.attention_dtype = None


def generate(config: DistillConfig, prompts: Path = TRAIN_PROMPTS) -> dict:
    """Generate the split's shards until the answer-token budget is met (resumable)."""
    torch.set_num_threads(config.threads)
    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for d in (config.id_dir, config.hidden_dir):
        d.mkdir(parents=True, exist_ok=True)
    ids_manifest = Manifest.open(config.id_dir / MANIFEST, config, model_dir, prompts)
    hidden_manifest = Manifest.open(config.hidden_dir / MANIFEST, config, model_dir, prompts)
    done = {shard_index(n) for n in ids_manifest.data["shards"]}
    budget_shards = None  # the shard index at which the budget is met, once known
    if ids_manifest.answer_tokens >= config.token_budget:
        return ids_manifest.data
    model = load_model(model_dir, weights=config.weights, device=config.device)
    fast_attention(model)

    plan = list(plan_jobs(config, tokenizer, prompts))
    expected: dict[int, int] = {}  # shard -> number of its prompts
    for job in plan:
        expected[job.shard] = expected.get(job.shard, 0) + 1

    deadline = time.perf_counter() + 60 * config.max_minutes if config.max_minutes else None

    def todo() -> Iterator[Job]:
        current = None
        for job in plan:
            if budget_shards is not None and job.shard >= budget_shards:
                return
            if job.shard != current and deadline and time.perf_counter() > deadline:
                return  # at a shard boundary: every shard started gets all its prompts
            current = job.shard
            if job.shard not in done and job.shard >= config.start_shard:
                yield job

    bar = tqdm(total=config.token_budget, initial=ids_manifest.answer_tokens, unit="tok")
    pending: dict[int, list[Answer]] = {}
    started = time.perf_counter()
    if config.engine == "static":
        answers = generate_static(model, todo(), config, eos_id, seed=config.seed)
    else:
        answers = generate_answers(model, todo(), config, eos_id)
    for answer in answers:
        shard = answer.job.shard
        pending.setdefault(shard, []).append(answer)
        bar.update(len(answer.answer))
        if len(pending[shard]) < expected[shard]:
            continue
        answers = sorted(pending.pop(shard), key=lambda a: a.job.index)
        name = IDS_PATTERN.format(shard)
        write_ids_shard(config.id_dir / name, answers)
        hidden = build_shard([a.sequence() for a in answers])
        write_shard(shard_path(config.hidden_dir, shard), hidden)
        summary = {
            "num_sequences": len(answers),
            "num_tokens": hidden.num_tokens,
            "num_answer_tokens": int(hidden.loss_mask.sum()),
            "num_sampled": sum(a.job.temperature > 0 for a in answers),
            "first_index": answers[0].job.index,
            "last_index": answers[-1].job.index,
            "seconds": round(time.perf_counter() - started, 1),
        }
        started = time.perf_counter()
        ids_manifest.add(name, summary | {"sha256": sha256_of(config.id_dir / name)})
        hidden_manifest.add(shard_path(config.hidden_dir, shard).name, summary)
        done.add(shard)
        if ids_manifest.answer_tokens >= config.token_budget and budget_shards is None:
            budget_shards = max(done) + 1  # finish the shards already started, start no more
    bar.close()
    return ids_manifest.data


def materialize(config: DistillConfig, batch: int = 8) -> int:
    """Rebuild missing hidden-state shards from the committed ids (batched prefill, progress
    bar); returns how many were built."""
    torch.set_num_threads(config.threads)
    model_dir = fetch_default_model()
    ids_manifest = json.loads((config.id_dir / MANIFEST).read_text())
    config.hidden_dir.mkdir(parents=True, exist_ok=True)
    missing = [
        n for n in sorted(ids_manifest["shards"])
        if not shard_path(config.hidden_dir, shard_index(n)).is_file()
    ]  # fmt: skip
    if not missing:
        return 0
    weights = ids_manifest["config"]["weights"]
    if torch.device(config.device).type != "cpu":
        weights = "fp32"  # the 4-bit kernels are CPU-only; fp32 holds the same dequantized weights
    model = load_model(model_dir, weights=weights, device=config.device)
    fast_attention(model)
    total = sum(ids_manifest["shards"][n]["num_tokens"] for n in missing)
    bar = tqdm(total=total, unit="tok", desc="hidden states")
    for name in missing:
        path = config.id_dir / name
        if sha256_of(path) != ids_manifest["shards"][name]["sha256"]:
            raise ValueError(f"{path} does not match its manifest checksum")
        seqs = read_ids_shard(path).sequences()
        hidden = prefill_hidden(model, [tokens for tokens, _ in seqs], batch)
        out = []
        for (tokens, prompt_len), h in zip(seqs, hidden, strict=True):
            mask = torch.zeros(len(tokens), dtype=torch.bool)
            mask[prompt_len:] = True
            out.append(Sequence(torch.tensor(tokens), h, mask))
            bar.update(len(tokens))
        write_shard(shard_path(config.hidden_dir, shard_index(name)), build_shard(out))
    bar.close()
    manifest = dict(ids_manifest, rebuilt_by="prefill")
    (config.hidden_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return len(missing)


@torch.inference_mode()
def prefill_hidden(model: Transformer, sequences: list[list[int]], batch: int) -> list:
    """Final hidden states of each sequence, ``batch`` similar lengths per padded forward."""
    device = model.embed_tokens.weight.device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor | None] = [None] * len(sequences)
    for start in range(0, len(order), batch):
        group = order[start : start + batch]
        width = max(len(sequences[i]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.int64)
        for row, i in enumerate(group):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
        cache = model.new_cache(len(group), width)
        slots = torch.tensor([cache.allocate() for _ in group])
        positions = torch.arange(width)[None].expand(len(group), width)
        hidden = model(ids.to(device), positions.to(device), cache, slots).half().cpu()
        for row, i in enumerate(group):
            out[i] = hidden[row, : len(sequences[i])]
    return out


def parse_args(argv: list[str] | None = None) -> tuple[str, DistillConfig]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("generate", "materialize"))
    for f in dataclasses.fields(DistillConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, tuple):
            parser.add_argument(flag, type=float, nargs=2, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    args["temperature_range"] = tuple(args["temperature_range"])
    return command, DistillConfig(**args)


def main(argv: list[str] | None = None) -> None:
    command, config = parse_args(argv)
    if command == "generate":
        print(json.dumps(generate(config).get("totals", {})))
    else:
        print(f"built {materialize(config)} hidden-state shards")


if __name__ == "__main__":
    main()
