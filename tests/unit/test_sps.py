"""The SPS drafter (a small standalone LM on EAGLE-2's dynamic tree) on tiny random models:
greedy speculative decoding equals plain greedy decoding, the runtime student computes what the
training forward computes, distillation lowers the loss, and export -> checkpoint -> drafter
round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lyanna.decode import generate
from lyanna.drafters.base import DraftBudget
from lyanna.drafters.sps import SpsDrafter, build_student
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from tests.conftest import make_tiny_model
from training.config import TrainConfig
from training.losses import FrozenTarget, TrainBatch
from training.sps import SpsTrainModel

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [9], [4, 4, 4, 4, 4, 4]]


def tiny_trainer(model, num_layers: int = 1, hot: int | None = None) -> SpsTrainModel:
    vocab = model.config.vocab_size
    hot_vocab = torch.arange(vocab) if hot is None else torch.randperm(vocab)[:hot]
    target = FrozenTarget.from_embedding(model.embed_tokens.weight, hot_vocab)
    config = TrainConfig(student_layers=num_layers, hot_vocab_size=hot_vocab.numel(), lr=3e-3)
    trainer = SpsTrainModel(model.config, target, config)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in trainer.parameters():
            p.normal_(0.0, 0.3)
    return trainer


def drafter_from(model, trainer: SpsTrainModel, budget: DraftBudget, **kwargs) -> SpsDrafter:
    """The trainer's fp32 weights as a drafter (export() rounds to fp16)."""
    state = {f"layers.{k}": v.detach() for k, v in trainer.layers.state_dict().items()}
    state["norm.weight"] = trainer.norm.weight.detach()
    student = build_student(model, len(trainer.layers), state)
    return SpsDrafter(student, trainer.target.hot_vocab, budget, **kwargs)


@pytest.mark.parametrize("max_running", [1, 3])
def test_greedy_equals_plain_decoding(max_running: int) -> None:
    model = make_tiny_model(2, vocab_size=16)
    drafter = drafter_from(
        model, tiny_trainer(model, 2), DraftBudget(4, 3, 10), max_running=max_running
    )
    engine = SpecEngine(model, drafter, EngineConfig(max_running=max_running, max_len=256))
    seqs = [Sequence(i, p, SamplingParams(max_tokens=24)) for i, p in enumerate(PROMPTS)]
    for s in seqs:
        engine.submit(s)
    while engine.has_work:
        engine.step()
        for seq_id, slot in engine.slots.items():  # student KV (+ queue) == target KV + root
            state = drafter._seqs[seq_id]
            num_rows = int(drafter.cache.lengths[state.slot]) + len(state.pending_tokens)
            assert num_rows == int(engine.cache.lengths[slot]) + 1
    expected = [Sequence(i, p, SamplingParams(max_tokens=24)) for i, p in enumerate(PROMPTS)]
    generate(model, expected)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in expected]
    assert drafter.cache.num_free_slots == max_running and not drafter._seqs
    assert engine.stats.num_drafted > 0


def test_runtime_student_matches_training_forward() -> None:
    """Root state = the training forward at the root token; a tree node's state = the training
    forward at that token when the tree path follows the sequence."""
    model = make_tiny_model(4, vocab_size=32)
    trainer = tiny_trainer(model, 2)
    tokens = torch.tensor([[3, 9, 4, 1, 8, 2, 6, 5, 7, 11, 12]])
    with torch.no_grad():
        reference = trainer(tokens)[:, 1:]  # [0, i]: output at tokens[i + 1]
    drafter = drafter_from(model, trainer, DraftBudget(3, 2, 8), max_running=1, max_len=64)
    P = 6  # prompt length; the root (first token) is tokens[P]
    drafter.start(0, tokens[0, :P].tolist(), None, int(tokens[0, P]))
    drafter.propose([0])
    state = drafter._seqs[0]
    torch.testing.assert_close(state.root_state, reference[0, P - 1], atol=1e-4, rtol=1e-4)
    lengths, slots = drafter.cache.lengths[[state.slot]].clone(), torch.tensor([state.slot])
    seen = torch.ones(1, 1, 2, dtype=torch.bool)  # tree rows: the depth-1 node, then its child
    with torch.inference_mode():
        depth1 = drafter._tree_forward(
            lengths, slots, 1, state.root_state[None, None], tokens[:, P + 1 : P + 2], seen[..., :1]
        )
        depth2 = drafter._tree_forward(lengths, slots, 2, depth1, tokens[:, P + 2 : P + 3], seen)
    torch.testing.assert_close(depth1[0, 0], reference[0, P], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(depth2[0, 0], reference[0, P + 1], atol=1e-4, rtol=1e-4)


def test_distillation_lowers_loss_and_checkpoint_round_trips(tmp_path: Path) -> None:
    model = make_tiny_model(0, vocab_size=32)
    trainer = tiny_trainer(model, 1, hot=24)
    torch.manual_seed(0)
    tokens = torch.randint(0, 31, (2, 12))
    hidden = model(
        tokens, torch.arange(12)[None].expand(2, 12), model.new_cache(2, 12), torch.arange(2)
    )
    batch = TrainBatch(tokens, hidden.clone(), torch.ones(2, 12), torch.ones(2, 12, dtype=bool))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss, metrics = trainer.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert {"step1_top1", "step1_ce", "step1_reg"} <= set(metrics)
    exported = trainer.export()
    assert not any("embed" in name for name in exported)
    assert exported["hot_vocab"].dtype == torch.int64
    save_file(exported, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(trainer.config_dict()))
    drafter = SpsDrafter.from_checkpoint(model, tmp_path, budget=DraftBudget(2, 2, 4))
    assert torch.equal(drafter.hot_vocab, exported["hot_vocab"])
    with torch.no_grad():
        reference = trainer(tokens[:1])[:, 1:].float()
    drafter.start(0, tokens[0, :5].tolist(), None, int(tokens[0, 5]))
    drafter.propose([0])
    torch.testing.assert_close(drafter._seqs[0].root_state, reference[0, 4], atol=5e-3, rtol=5e-3)
