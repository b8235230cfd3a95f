"""Self-distillation on the default model: an interrupted run resumes at shard granularity to
the same token ids as an uninterrupted one, and the hidden-state cache rebuilt from the ids by
batched prefill matches what generation kept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from training.data import read_shard, shard_path
from training.distill import DistillConfig, generate, materialize
from training.id_shards import read_ids_shard

pytestmark = pytest.mark.slow

PROMPTS = [
    "Name three primary colors.",
    "What is 2 + 2?",
    "Say hello in French.",
    "Write one word that rhymes with cat.",
    "What is the capital of Italy?",
    "Count from one to five.",
]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": text}]}
        for i, text in enumerate(PROMPTS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, name: str, budget: int) -> DistillConfig:
    return DistillConfig(
        run_name=f"pytest-distill-{name}",
        weights="q4",
        max_answer_tokens=12,
        batch_size=2,
        prompts_per_shard=2,
        sampled_fraction=0.5,
        token_budget=budget,
        threads=2,
        ids_dir=str(tmp_path / name),
    )


def test_resume_gives_the_same_ids_and_materialize_rebuilds_the_cache(
    tmp_path: Path, prompts_file: Path
) -> None:
    whole = _config(tmp_path, "whole", budget=10_000)
    first = _config(tmp_path, "resumed", budget=1)  # stops after the first shard
    resumed = _config(tmp_path, "resumed", budget=10_000)
    try:
        generate(whole, prompts_file)
        assert generate(first, prompts_file)["totals"]["num_shards"] == 1
        totals = generate(resumed, prompts_file)["totals"]
        assert totals["num_shards"] == 3 and totals["num_sequences"] == len(PROMPTS)
        for k in range(3):
            a = read_ids_shard(whole.id_dir / f"ids-{k:05d}.safetensors")
            b = read_ids_shard(resumed.id_dir / f"ids-{k:05d}.safetensors")
            assert a.sequences() == b.sequences()
            assert torch.equal(a.temperature, b.temperature)
        temps = [read_ids_shard(p).temperature for p in sorted(whole.id_dir.glob("ids-*"))]
        assert 0 < int((torch.cat(temps) > 0).sum()) < len(PROMPTS)  # sampled answers resume too
        kept = read_shard(shard_path(whole.hidden_dir, 1))
        shard_path(whole.hidden_dir, 1).unlink()
        assert materialize(whole) == 1
        rebuilt = read_shard(shard_path(whole.hidden_dir, 1))
        assert torch.equal(kept.tokens, rebuilt.tokens)
        assert torch.equal(kept.loss_mask, rebuilt.loss_mask)
        # not bitwise: generation batches other lengths beside each sequence, and on q4 the
        # bf16 rounding of every linear input magnifies attention's last-bit differences
        error = (rebuilt.hidden.float() - kept.hidden.float()).norm(dim=-1)
        relative = error / kept.hidden.float().norm(dim=-1)
        assert float(relative.mean()) < 0.01 and float(relative.max()) < 0.1  # 0.002, 0.013
    finally:
        for config in (whole, resumed):
            shutil.rmtree(config.hidden_dir, ignore_errors=True)
