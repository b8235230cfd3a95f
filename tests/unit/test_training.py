"""Training pipeline: the data never includes a Spec-Bench prompt, shards round-trip, batches
cover the data, and training steps reduce the loss on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_model
from training.config import TrainConfig
from training.data import Sequence, build_shard, read_shard, shard_path, write_shard
from training.eagle import EagleTrainModel
from training.losses import FrozenTarget
from training.prepare import TRAIN_PROMPTS, PrepareConfig, Prompt, build_sequences
from training.train import collate, hot_vocabulary, load_state, plan_batches, save_state

SPEC_BENCH = TRAIN_PROMPTS.parents[1] / "eval" / "spec_bench.jsonl"


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def _ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="shared eval data not present")
def test_no_spec_bench_prompt_in_training_prompts() -> None:
    assert TRAIN_PROMPTS.name == "train_prompts.jsonl" and TRAIN_PROMPTS.parent.name == "data"
    turns = [t for line in SPEC_BENCH.open() for t in json.loads(line)["turns"]]
    normalized = {" ".join(_words(t)) for t in turns}
    grams = set().union(*(_ngrams(_words(t), 13) for t in turns))
    for line in TRAIN_PROMPTS.open():
        record = json.loads(line)
        text = " ".join(m["content"] for m in record["messages"])
        words = _words(text)
        assert " ".join(words) not in normalized, record["id"]
        assert not _ngrams(words, 13) & grams, record["id"]


def _tiny_sequences(model, lengths=(9, 5, 12)) -> list[Sequence]:
    torch.manual_seed(0)
    out = []
    for n in lengths:
        tokens = torch.randint(0, model.config.vocab_size - 1, (n,))
        hidden = model(
            tokens[None], torch.arange(n)[None], model.new_cache(1, n), torch.tensor([0])
        )
        mask = torch.arange(n) >= n // 2
        out.append(Sequence(tokens, hidden[0].half(), mask))
    return out


def test_shard_round_trip_on_tiny_model(tmp_path: Path) -> None:
    model = make_tiny_model(0, vocab_size=32)
    eos = model.config.eos_token_id
    prompts = [
        Prompt("a", [1, 2, 3, 4], [5, 6, eos], self_answer=False),
        Prompt("b", [7, 8], None, self_answer=True),
        Prompt("c", [9, 10, 11], [12, eos], self_answer=True),
    ]
    config = PrepareConfig(max_answer_tokens=6, batch_size=2)
    sequences = build_sequences(model, prompts, config, eos)
    path = shard_path(tmp_path, 0)
    write_shard(path, build_shard(sequences))
    shard = read_shard(path)
    assert shard.num_sequences == 3 and shard.tokens.dtype == torch.int32
    assert shard.hidden.dtype == torch.float16 and shard.loss_mask.dtype == torch.uint8
    for s, (prompt, original) in enumerate(zip(prompts, sequences, strict=True)):
        seq = shard.sequence(s)
        assert seq.tokens.tolist()[: len(prompt.prompt_ids)] == prompt.prompt_ids
        assert seq.loss_mask.tolist() == [
            i >= len(prompt.prompt_ids) for i in range(len(seq.tokens))
        ]
        full = model(
            seq.tokens[None],
            torch.arange(len(seq.tokens))[None],
            model.new_cache(1, 64),
            torch.tensor([0]),
        )[0]
        torch.testing.assert_close(seq.hidden.float(), full, atol=2e-2, rtol=1e-2)
        assert torch.equal(seq.tokens, original.tokens)
    assert shard.sequence(0).tokens.tolist() == [1, 2, 3, 4, 5, 6, eos]  # the reference answer
    assert shard.sequence(1).tokens.shape[0] <= 2 + 6  # a self answer of at most 6 tokens


def test_plan_batches_covers_every_sequence_once() -> None:
    lengths = [5, 40, 17, 64, 3, 33, 64, 8, 21] * 7
    config = TrainConfig(batch_tokens=128, max_seq_len=64)
    batches = plan_batches(lengths, config, epoch=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 128 for b in batches)
    assert batches == plan_batches(lengths, config, epoch=3)


def _tiny_trainer(model, config: TrainConfig, sequences) -> EagleTrainModel:
    hot = hot_vocabulary(sequences, config.hot_vocab_size, model.config.vocab_size)
    target = FrozenTarget.from_embedding(model.embed_tokens.weight, hot)
    torch.manual_seed(1)
    return EagleTrainModel.build(target, model.config, config)


def test_train_steps_reduce_loss_and_resume(tmp_path: Path) -> None:
    model = make_tiny_model(0, vocab_size=32)
    config = TrainConfig(hot_vocab_size=24, unroll_steps=3, lr=3e-3, batch_tokens=512)
    sequences = _tiny_sequences(model)
    trainer = _tiny_trainer(model, config, sequences)
    batch = collate(sequences, config)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=config.lr)
    losses = []
    for _ in range(8):
        loss, metrics = trainer.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert {"step1_top1", "step3_top3", "step2_ce", "step1_reg"} <= set(metrics)
    save_state(tmp_path / "state.safetensors", trainer, optimizer, 8, config)
    other = _tiny_trainer(model, config, sequences)
    other_opt = torch.optim.AdamW(other.parameters(), lr=config.lr)
    assert load_state(tmp_path / "state.safetensors", other, other_opt) == 8
    with torch.no_grad():
        assert float(other.loss(batch)[0]) == pytest.approx(float(trainer.loss(batch)[0]))
    exported = trainer.export()
    assert exported["fc.weight"].dtype == torch.float16
    assert exported["hot_vocab"].dtype == torch.int64
    assert not any("embed" in name for name in exported)


def test_step_weights_weigh_each_unrolled_step() -> None:
    """``step_weights`` (issue 41): the loss is the mean over steps of each step's loss times
    its multiplier (scaled to mean 1), the per-step losses read back from the metrics."""
    model = make_tiny_model(0, vocab_size=32)
    sequences = _tiny_sequences(model)
    base = TrainConfig(hot_vocab_size=24, unroll_steps=3, regression_weight=0.3, ce_weight=0.2)
    batch = collate(sequences, base)
    trainer = _tiny_trainer(model, base, sequences).eval()
    with torch.no_grad():
        plain, metrics = trainer.loss(batch)
        weighted = dataclasses.replace(base, step_weights="1,2,5")
        trainer.train_config = weighted
        loss, _ = trainer.loss(batch)
    steps = [0.3 * metrics[f"step{k}_reg"] + 0.2 * metrics[f"step{k}_ce"] for k in (1, 2, 3)]
    assert float(plain) == pytest.approx(sum(steps) / 3, rel=1e-5)
    assert weighted.step_weight_list() == pytest.approx([0.375, 0.75, 1.875])
    expected = sum(w * s for w, s in zip([0.375, 0.75, 1.875], steps, strict=True)) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="step_weights"):
        TrainConfig(unroll_steps=3, step_weights="1,2")
