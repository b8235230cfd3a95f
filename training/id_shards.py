"""The committed half of self-distilled data (``training.distill``): token-id shards and the
run manifest. A shard ``ids-NNNNN.safetensors`` holds ``tokens`` uint16 [N] (prompt + answer of
every sequence, concatenated), ``seq_starts`` int64 [S + 1], ``prompt_lens`` int32 [S],
``prompt_index`` int32 [S] (line of ``train_prompts.jsonl``) and ``temperature`` float32 [S]
(0 = greedy); ``manifest.json`` holds the settings, the target's and the prompts' sha256, the
per-shard counts and sha256 and the reproduce command. Files are written aside and renamed."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lyanna.model.default import sha256_of
from training.distill_jobs import Answer, DistillConfig

IDS_PATTERN = "ids-{:05d}.safetensors"


def shard_index(name: str) -> int:
    """``ids-00012.safetensors`` -> 12."""
    return int(name.split("-")[1].split(".")[0])


def write_ids_shard(path: Path, answers: list[Answer]) -> None:
    tokens = [a.job.prompt_ids + a.answer for a in answers]
    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
    save_file(
        {
            "tokens": torch.tensor([t for seq in tokens for t in seq]).to(torch.uint16),
            "seq_starts": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            "prompt_lens": torch.tensor([len(a.job.prompt_ids) for a in answers]).int(),
            "prompt_index": torch.tensor([a.job.index for a in answers]).int(),
            "temperature": torch.tensor([a.job.temperature for a in answers]).float(),
        },
        path.with_suffix(".partial"),
    )
    path.with_suffix(".partial").rename(path)


@dataclass(frozen=True, slots=True, eq=False)
class IdShard:
    tokens: torch.Tensor  # [N] int64
    seq_starts: torch.Tensor  # [S + 1] int64
    prompt_lens: torch.Tensor  # [S] int32
    prompt_index: torch.Tensor  # [S] int32
    temperature: torch.Tensor  # [S] float32

    def sequences(self) -> list[tuple[list[int], int]]:
        """(tokens, prompt length) of each sequence."""
        starts = self.seq_starts.tolist()
        return [
            (self.tokens[starts[s] : starts[s + 1]].tolist(), int(self.prompt_lens[s]))
            for s in range(len(starts) - 1)
        ]


def read_ids_shard(path: Path) -> IdShard:
    t = load_file(path)
    return IdShard(
        t["tokens"].long(), t["seq_starts"], t["prompt_lens"], t["prompt_index"], t["temperature"]
    )


@dataclass(slots=True)
class Manifest:
    """Both directories' manifest.json: settings, target, per-shard counts and checksums."""

    path: Path
    data: dict = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path, config: DistillConfig, model_dir: Path, prompts: Path) -> Manifest:
        data = json.loads(path.read_text()) if path.is_file() else {}
        settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "ids_dir"}
        settings = json.loads(json.dumps(settings))  # as stored: tuples become lists
        old = data.get("config")
        fixed = ("split", "weights", "max_prompt_tokens", "max_answer_tokens", "prompts_per_shard",
                 "sampled_fraction", "temperature_range", "seed")  # fmt: skip
        if old and any(old.get(k) != settings[k] and k in old for k in fixed):
            raise ValueError(f"{path.parent} was generated with other settings; use a new run")
        data["config"] = settings
        data["source"] = {"prompts": prompts.name, "sha256": sha256_of(prompts)}
        data["model"] = json.loads((model_dir / "lyanna-source.json").read_text())
        data["reproduce"] = "python -m training.distill generate " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list | tuple) else v}"
            for k, v in settings.items()
        )
        data.setdefault("shards", {})
        return cls(path, data)

    def add(self, name: str, summary: dict) -> None:
        self.data["shards"][name] = summary
        shards = self.data["shards"].values()
        keys = ("num_sequences", "num_tokens", "num_answer_tokens", "num_sampled", "seconds")
        self.data["totals"] = {k: round(sum(s.get(k, 0) for s in shards), 1) for k in keys}
        self.data["totals"]["num_shards"] = len(self.data["shards"])
        self.save()

    def save(self) -> None:  # written aside and renamed: a killed run never leaves half a file
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.data, indent=2) + "\n")
        partial.replace(self.path)

    @property
    def answer_tokens(self) -> int:
        return sum(s["num_answer_tokens"] for s in self.data["shards"].values())
