"""Build drafter training data: chat-formatted prompts from ``shared/data/train_prompts.jsonl``
(never the evaluation sets), answered by the target itself (greedy self-distillation, batched
through ``lyanna.decode.generate``) or by the dataset's reference answer, then one target
forward per sequence to record the target's final hidden state at every token.

Output: ``$LYANNA_CACHE/data/<run-name>/`` with ``manifest.json`` and safetensors shards in the
format documented in ``training.data`` (``tokens`` int32 [N], ``hidden`` float16 [N, d],
``seq_starts`` int64 [S + 1], ``loss_mask`` uint8 [N], 1 on answer tokens). Shard k always
holds the k-th group of ``prompts_per_shard`` eligible prompts (file order; prompts longer than
``max_prompt_tokens`` are skipped), so a rerun skips finished shards and resumes. With
``--answers mix`` each prompt is answered by the target with probability ``self_fraction``
(seeded per prompt) and otherwise by its reference; prompts without a reference always get a
self answer.

    python -m training.prepare --run-name mix-v1 --answers mix --token-budget 150000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from lyanna.decode import generate
from lyanna.model import fetch_default_model, load_model
from lyanna.model.default import cache_root, sha256_of
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence as DecodeSequence
from lyanna.tokenizer import chat_prompt_ids, load_tokenizer
from training.data import MANIFEST, Sequence, build_shard, read_shard, shard_path, write_shard

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
TRAIN_PROMPTS = SHARED / "data" / "train_prompts.jsonl"
ANSWER_MODES = ("self", "reference", "mix")


@dataclass(frozen=True, slots=True)
class PrepareConfig:
    run_name: str = "default"
    answers: str = "mix"  # self | reference | mix
    self_fraction: float = 0.25  # mix: probability that a prompt gets a self-generated answer
    max_prompt_tokens: int = 384  # longer chat-formatted prompts are skipped
    max_answer_tokens: int = 128
    batch_size: int = 16  # generation batch
    prompts_per_shard: int = 64
    token_budget: int = 200_000  # stop after the shard that reaches this many tokens
    max_prompts: int = 0  # 0 = no limit on eligible prompts
    seed: int = 20240521
    threads: int = 2
    out_dir: str = ""  # default: $LYANNA_CACHE/data/<run_name>

    def __post_init__(self) -> None:
        if self.answers not in ANSWER_MODES:
            raise ValueError(f"answers must be one of {ANSWER_MODES}, got {self.answers!r}")
        if not 0.0 <= self.self_fraction <= 1.0:
            raise ValueError("self_fraction must be in [0, 1]")
        for name in ("max_prompt_tokens", "max_answer_tokens", "batch_size", "prompts_per_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else cache_root() / "data" / self.run_name


@dataclass(frozen=True, slots=True)
class Prompt:
    record_id: str
    prompt_ids: list[int]
    reference_ids: list[int] | None  # reference answer + end-of-turn, or None
    self_answer: bool


def prompt_seed(seed: int, index: int) -> int:
    """The seed of everything random about the prompt on line ``index`` of a run."""
    return seed * 1_000_003 + index


def chat_prompts(
    path: Path, tokenizer, max_prompt_tokens: int, keep=lambda record: True
) -> Iterator[tuple[int, dict, list[int]]]:
    """(line, record, chat-formatted prompt ids) of the records ``keep`` accepts, in file
    order; prompts longer than ``max_prompt_tokens`` are skipped."""
    with path.open() as f:
        for index, line in enumerate(f):
            record = json.loads(line)
            if not keep(record):
                continue
            ids = chat_prompt_ids(tokenizer, record["messages"])
            if len(ids) <= max_prompt_tokens:
                yield index, record, ids


def eligible_prompts(
    config: PrepareConfig, tokenizer, path: Path = TRAIN_PROMPTS
) -> Iterator[Prompt]:
    """Chat-formatted training prompts in file order, too-long ones skipped."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = chat_prompts(path, tokenizer, config.max_prompt_tokens)
    for count, (index, record, ids) in enumerate(prompts, start=1):
        reference = record.get("reference")
        reference_ids = None
        if reference:
            reference_ids = tokenizer.encode(reference, add_special_tokens=False)
            reference_ids = reference_ids[: config.max_answer_tokens - 1] + [eos]
        use_self = config.answers == "self" or reference_ids is None
        if config.answers == "mix" and reference_ids is not None:
            use_self = random.Random(prompt_seed(config.seed, index)).random() < (
                config.self_fraction
            )
        yield Prompt(record["id"], ids, reference_ids, use_self)
        if config.max_prompts and count >= config.max_prompts:
            return


def self_answers(
    model: Transformer, prompts: list[Prompt], config: PrepareConfig, eos_id: int
) -> list[list[int]]:
    """Greedy target answers (with the closing end-of-turn token when the target stopped)."""
    answers: list[list[int]] = []
    for start in range(0, len(prompts), config.batch_size):
        batch = prompts[start : start + config.batch_size]
        params = SamplingParams(max_tokens=config.max_answer_tokens)
        seqs = [
            DecodeSequence(i, p.prompt_ids, params, eos_token_ids=frozenset([eos_id]))
            for i, p in enumerate(batch)
        ]
        generate(model, seqs)
        answers += [s.output_ids + ([eos_id] if s.finish_reason == "stop" else []) for s in seqs]
    return answers


def target_hidden(model: Transformer, tokens: list[int]) -> torch.Tensor:  # [T, d]
    cache = model.new_cache(1, len(tokens))
    ids = torch.tensor([tokens], dtype=torch.int64)
    return model(ids, torch.arange(len(tokens))[None], cache, torch.tensor([0]))[0]


def build_sequences(model: Transformer, prompts: list[Prompt], config: PrepareConfig, eos_id: int):
    own = [p for p in prompts if p.self_answer]
    answers = self_answers(model, own, config, eos_id)
    generated = {id(p): a for p, a in zip(own, answers, strict=True)}
    sequences = []
    for p in prompts:
        answer = generated[id(p)] if p.self_answer else p.reference_ids
        tokens = p.prompt_ids + answer
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[len(p.prompt_ids) :] = True
        hidden = target_hidden(model, tokens).to(torch.float16)
        sequences.append(Sequence(torch.tensor(tokens), hidden, mask))
    return sequences


def shard_summary(shard, prompts: list[Prompt]) -> dict:
    return {
        "num_sequences": shard.num_sequences,
        "num_tokens": shard.num_tokens,
        "num_answer_tokens": int(shard.loss_mask.sum()),
        "num_self_answers": sum(p.self_answer for p in prompts),
        "first_id": prompts[0].record_id,
        "last_id": prompts[-1].record_id,
    }


def prepare(config: PrepareConfig, prompts_path: Path = TRAIN_PROMPTS) -> dict:
    torch.set_num_threads(config.threads)
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    manifest_file = run_dir / MANIFEST
    manifest = json.loads(manifest_file.read_text()) if manifest_file.is_file() else {}
    if manifest and manifest.get("config", {}).get("answers") != config.answers:
        raise ValueError(f"{run_dir} was prepared with different settings; use a new run name")
    manifest.update(
        config=dataclasses.asdict(config),
        source={"prompts": str(prompts_path.name), "sha256": sha256_of(prompts_path)},
        model=json.loads((model_dir / "lyanna-source.json").read_text()),
        format="training.data v1: tokens int32 [N], hidden float16 [N,d], seq_starts, loss_mask",
    )
    shards: dict[str, dict] = manifest.setdefault("shards", {})
    model = None
    total = sum(s["num_tokens"] for s in shards.values())
    bar = tqdm(total=config.token_budget, initial=min(total, config.token_budget), unit="tok")
    started = time.perf_counter()
    chunk: list[Prompt] = []
    index = 0
    for prompt in eligible_prompts(config, tokenizer, prompts_path):
        chunk.append(prompt)
        if len(chunk) < config.prompts_per_shard:
            continue
        if total >= config.token_budget:
            break
        path = shard_path(run_dir, index)
        if path.name not in shards:
            if path.is_file():
                shard = read_shard(path)
            else:
                if model is None:
                    model = load_model(model_dir)
                shard = build_shard(build_sequences(model, chunk, config, eos_id))
                write_shard(path, shard)
            shards[path.name] = shard_summary(shard, chunk)
            total += shards[path.name]["num_tokens"]
            bar.update(shards[path.name]["num_tokens"])
            manifest["totals"] = {
                key: sum(s[key] for s in shards.values())
                for key in ("num_sequences", "num_tokens", "num_answer_tokens", "num_self_answers")
            }
            manifest["totals"]["num_shards"] = len(shards)
            manifest["seconds_this_run"] = round(time.perf_counter() - started, 1)
            manifest_file.write_text(json.dumps(manifest, indent=2))
        chunk = []
        index += 1
    bar.close()
    manifest_file.write_text(json.dumps(manifest, indent=2))
    return manifest


def parse_args(argv: list[str] | None = None) -> PrepareConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(PrepareConfig):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(f.default), default=f.default)
    return PrepareConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    manifest = prepare(parse_args(argv))
    print(json.dumps(manifest.get("totals", {})))


if __name__ == "__main__":
    main()
