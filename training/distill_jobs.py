"""What one self-distillation run asks for and makes (``training.distill``): its settings
(``DistillConfig``), one prompt to answer (``Job``) and its answer with the hidden state at
every token (``Answer``). Its own module so that the generators (``training.distill``'s
continuous batching, ``training.static_batch``) and the shard writer (``training.id_shards``)
share these types without importing each other."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from lyanna.model.default import cache_root
from lyanna.sampling import SamplingParams
from training.data import Sequence
from training.prepare import prompt_seed

REPO = Path(__file__).resolve().parents[1]


SPLITS = ("train", "heldout")
HELD_OUT_PERCENT = 2


def is_held_out(record_id: str) -> bool:
    """The held-out split: a fixed 2 % of prompt ids, whatever the run or its settings."""
    digest = hashlib.sha256(record_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


@dataclass(frozen=True, slots=True)
class DistillConfig:
    run_name: str = "distill-v1"
    split: str = "train"  # train | heldout
    weights: str = "auto"  # the target the drafters will serve with (q4 / fp32 / auto)
    device: str = "cpu"
    max_prompt_tokens: int = 384  # longer chat-formatted prompts are skipped
    max_answer_tokens: int = 512
    batch_size: int = 16  # sequences decoded together (KV slots; 32 was no faster)
    prompts_per_shard: int = 256
    sampled_fraction: float = 0.25  # share of prompts answered by sampling
    temperature_range: tuple[float, float] = (0.7, 1.0)
    token_budget: int = 2_000_000  # stop after the shard that reaches this many answer tokens
    start_shard: int = 0  # skip the split's first shards (another run answered those prompts)
    engine: str = "continuous"  # continuous (CPU: refill freed slots) | static (GPU: wide batches)
    max_minutes: float = 0.0  # start no new shard after this long (0 = no limit)
    seed: int = 20261123
    threads: int = 2
    ids_dir: str = ""  # default: data/distill/<run_name> in the repository

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise ValueError("sampled_fraction must be in [0, 1]")
        low, high = self.temperature_range
        if not 0.0 < low <= high:
            raise ValueError("temperature_range must be 0 < low <= high")
        if self.engine not in ("continuous", "static"):
            raise ValueError(f"engine must be continuous or static, got {self.engine!r}")
        for name in ("max_prompt_tokens", "max_answer_tokens", "batch_size", "prompts_per_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def id_dir(self) -> Path:
        return Path(self.ids_dir) if self.ids_dir else REPO / "data" / "distill" / self.run_name

    @property
    def hidden_dir(self) -> Path:
        return cache_root() / "data" / self.run_name


@dataclass(frozen=True, slots=True)
class Job:
    index: int  # line of the prompt file
    shard: int
    prompt_ids: list[int]
    temperature: float  # 0 = greedy

    def params(self, config: DistillConfig) -> SamplingParams:
        seed = prompt_seed(config.seed, self.index)
        return SamplingParams(self.temperature, max_tokens=config.max_answer_tokens, seed=seed)


@dataclass(frozen=True, slots=True, eq=False)
class Answer:
    job: Job
    answer: list[int]
    hidden: torch.Tensor  # [len(prompt) + len(answer), d] float16

    def sequence(self) -> Sequence:
        tokens = torch.tensor(self.job.prompt_ids + self.answer)
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[len(self.job.prompt_ids) :] = True
        return Sequence(tokens, self.hidden, mask)
