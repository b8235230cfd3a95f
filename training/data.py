"""Training shards: the target's final hidden states over token sequences, as written by
``training.prepare`` and read by ``training.train`` (every drafter trains on the same format).

A run directory holds ``manifest.json`` and ``shard-00000.safetensors``, ``shard-00001...``.
Each shard is one safetensors file with four tensors for its S sequences and N tokens:

- ``tokens``     int32   [N]      token ids, sequences concatenated;
- ``hidden``     float16 [N, d]   target final (post-norm) hidden state at each token: row i
                                  is the state *at* token i, whose LM-head logits predict token
                                  i + 1 (so the last row of a sequence predicts nothing seen);
- ``seq_starts`` int64   [S + 1]  sequence s is rows ``seq_starts[s]:seq_starts[s + 1]``;
- ``loss_mask``  uint8   [N]      1 on answer tokens (the assistant's reply, including its
                                  closing end-of-turn token), 0 on the chat-formatted prompt.

A shard is written to a temporary name and renamed, so a shard file that exists is complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SHARD_PATTERN = "shard-{:05d}.safetensors"
MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True, eq=False)
class Shard:
    tokens: torch.Tensor  # [N] int32
    hidden: torch.Tensor  # [N, d] float16
    seq_starts: torch.Tensor  # [S + 1] int64
    loss_mask: torch.Tensor  # [N] uint8

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.hidden.shape[0] != n or self.loss_mask.shape != (n,):
            raise ValueError("tokens, hidden and loss_mask must have the same length")
        if int(self.seq_starts[0]) != 0 or int(self.seq_starts[-1]) != n:
            raise ValueError("seq_starts must run from 0 to the number of tokens")

    @property
    def num_sequences(self) -> int:
        return self.seq_starts.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def sequence(self, s: int) -> Sequence:
        start, end = int(self.seq_starts[s]), int(self.seq_starts[s + 1])
        return Sequence(
            tokens=self.tokens[start:end].long(),
            hidden=self.hidden[start:end],
            loss_mask=self.loss_mask[start:end].bool(),
        )


@dataclass(frozen=True, slots=True, eq=False)
class Sequence:
    tokens: torch.Tensor  # [T] int64
    hidden: torch.Tensor  # [T, d] float16
    loss_mask: torch.Tensor  # [T] bool


def build_shard(sequences: list[Sequence]) -> Shard:
    """Concatenate sequences into one shard (hidden stored as float16)."""
    lengths = torch.tensor([s.tokens.shape[0] for s in sequences], dtype=torch.int64)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return Shard(
        tokens=torch.cat([s.tokens for s in sequences]).to(torch.int32),
        hidden=torch.cat([s.hidden for s in sequences]).to(torch.float16),
        seq_starts=starts,
        loss_mask=torch.cat([s.loss_mask for s in sequences]).to(torch.uint8),
    )


def shard_path(run_dir: Path, index: int) -> Path:
    return run_dir / SHARD_PATTERN.format(index)


def write_shard(path: Path, shard: Shard) -> None:
    tensors = {
        "tokens": shard.tokens.contiguous(),
        "hidden": shard.hidden.contiguous(),
        "seq_starts": shard.seq_starts.contiguous(),
        "loss_mask": shard.loss_mask.contiguous(),
    }
    partial = path.with_suffix(".partial")
    save_file(tensors, partial)
    partial.replace(path)


def read_shard(path: Path) -> Shard:
    t = load_file(path)
    return Shard(t["tokens"], t["hidden"], t["seq_starts"], t["loss_mask"])


def shard_paths(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("shard-*.safetensors"))


def read_manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / MANIFEST).read_text())


def iter_sequences(run_dirs: list[Path]) -> Iterator[Sequence]:
    for run_dir in run_dirs:
        for path in shard_paths(run_dir):
            shard = read_shard(path)
            for s in range(shard.num_sequences):
                yield shard.sequence(s)
