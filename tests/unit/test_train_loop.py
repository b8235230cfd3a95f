"""The whole ``training.train.train`` loop on a tiny target: data shards in the cache, periodic
evaluation, ``keep_best`` (the export is the best evaluated weights, re-scored here from the
files), the clock-driven decay, and the same loop on a CUDA device where one exists."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import training.train as train_module
from lyanna.model.loader import export_hf_dir
from tests.conftest import make_tiny_model
from tests.unit.test_distill import _model_sequences
from tests.unit.test_loader import hf_state_of
from training.config import TrainConfig
from training.data import build_shard, shard_path, write_shard
from training.losses import FrozenTarget
from training.models import get_model_class
from training.train import collate, evaluate, plan_batches

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def _write_run(cache: Path, name: str, sequences) -> None:
    run = cache / "data" / name
    run.mkdir(parents=True)
    write_shard(shard_path(run, 0), build_shard(sequences))
    (run / "manifest.json").write_text(json.dumps({"config": {"run_name": name}}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["eagle", "lyanna"])
def test_train_exports_its_best_evaluation(tmp_path, monkeypatch, kind: str, device: str) -> None:
    model = make_tiny_model(5, vocab_size=32)
    model_dir = tmp_path / "target"
    export_hf_dir(model.config, hf_state_of(model), model_dir)
    monkeypatch.setenv("LYANNA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(train_module, "fetch_default_model", lambda: model_dir)
    _write_run(tmp_path / "cache", "tiny-train", _model_sequences(model, 16, seed=1))
    held_out = _model_sequences(model, 6, seed=2)
    _write_run(tmp_path / "cache", "tiny-val", held_out)
    config = TrainConfig(model=kind, data="tiny-train", val_data="tiny-val", run_name="t",
                         hot_vocab_size=24, unroll_steps=2, batch_tokens=256, max_seq_len=32,
                         max_steps=12, warmup_steps=2, lr=3e-2, eval_every=3, ckpt_every=6,
                         log_every=3, keep_best=True, device=device)  # fmt: skip
    record = train_module.train(config)

    log = [json.loads(line) for line in (config.work_dir / "log.jsonl").read_text().splitlines()]
    evals = {e["step"]: e["val"] for e in log if "val" in e and "step" in e}
    assert sorted(evals) == [3, 6, 9, 12]
    best_step = max(evals, key=lambda s: train_module.selection_score(evals[s]))
    assert record["exported_step"] == best_step and record["val"] == evals[best_step]
    assert record["val_last_step"] == evals[12]

    # the exported file scores what the record says, re-evaluated from scratch on the CPU
    export_dir = config.work_dir / "export"
    weights = load_file(export_dir / "model.safetensors")
    assert all(t.device.type == "cpu" for t in weights.values())
    hot = weights["hot_vocab"] if "hot_vocab" in weights else weights["hot_ids"]
    cpu_config = dataclasses.replace(config, device="cpu")
    target = FrozenTarget.from_embedding(model.embed_tokens.weight, hot)
    fresh = get_model_class(kind).build(target, model.config, cpu_config)
    fresh.load_export(weights)
    lengths = [len(s.tokens) for s in held_out]
    batches = [collate([held_out[i] for i in b], cpu_config)
               for b in plan_batches(lengths, cpu_config, epoch=-1)]  # fmt: skip
    rescored = evaluate(fresh, batches)
    for key, value in record["val"].items():  # fp16 export: a hit or two may flip
        assert rescored[key] == pytest.approx(value, abs=0.02), key


def test_clock_ends_the_decay_before_max_steps() -> None:
    config = TrainConfig(lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, max_steps=1000)
    assert config.lr_at(5) == pytest.approx(6e-4)  # warmup ignores the clock
    assert config.lr_at(10, clock=0.0) == pytest.approx(1e-3)
    assert config.lr_at(10, clock=0.5) == pytest.approx(5.5e-4)
    assert config.lr_at(10, clock=1.5) == pytest.approx(1e-4)
    assert config.lr_at(505, clock=0.1) == pytest.approx(5.5e-4)  # steps ahead of the clock
