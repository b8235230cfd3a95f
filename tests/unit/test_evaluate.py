"""``training.evaluate``: the one scoring rule on a hand-computed case, each drafter's first
choices against what its training loss (Lyanna) or its unrolled forward (EAGLE) says, and the
entry point's JSON on tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import training.evaluate as evaluate_module
from lyanna.model.loader import export_hf_dir
from tests.conftest import make_tiny_model
from tests.unit.test_loader import hf_state_of
from training.config import TrainConfig
from training.data import Sequence, build_shard, shard_path, write_shard
from training.evaluate import (
    Drafter,
    eagle_first_choices,
    evaluate,
    full_vocab_argmax,
    lyanna_first_choices,
    step_hits,
)
from training.losses import FrozenTarget
from training.models import get_model_class
from training.train import collate

VOCAB, HOT = 32, 24


def test_step_hits_by_hand() -> None:
    first = torch.tensor([[-1, 5, 7, 7, 9, 3]])
    target = torch.tensor([[0, 5, 7, 8, 9, 3]])
    answer = torch.tensor([[False, False, True, True, True, True]])
    # step 1: states 1..4 decide answer tokens 2..5 (state 5's token does not exist):
    # hits at 1, 2, 4, a miss at 3
    assert step_hits(first, target, answer, 1) == (3, 4)
    # step 3: the anchor s - 3 must exist: states 3 and 4
    assert step_hits(first, target, answer, 3) == (1, 2)
    # a prompt token is never scored: state 1 decides token 2, now a prompt token
    answer[0, 2] = False
    assert step_hits(first, target, answer, 1) == (2, 3)


def test_full_vocab_argmax_sees_tokens_outside_any_hot_set() -> None:
    embedding = torch.eye(5)
    hidden = torch.eye(5)[[4, 0, 2]].view(1, 3, 5)
    assert full_vocab_argmax(hidden, embedding).tolist() == [[4, 0, 2]]


def _sequences(count: int, seed: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(9, 15, (1,), generator=gen))
        mask = torch.zeros(n, dtype=torch.bool)
        mask[3:] = True
        out.append(Sequence(torch.randint(0, VOCAB, (n,), generator=gen),
                            torch.randn(n, 32, generator=gen).half(), mask))  # fmt: skip
    return out


def _trained(kind: str, model, seed: int):
    torch.manual_seed(seed)
    hot = torch.randperm(VOCAB)[:HOT]  # some target argmaxes fall outside: full-vocab misses
    target = FrozenTarget.from_embedding(model.embed_tokens.weight, hot)
    config = TrainConfig(model=kind, hot_vocab_size=HOT, unroll_steps=3)
    trainer = get_model_class(kind).build(target, model.config, config)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if name.endswith("draft.w2"):
                p.normal_()
            if name.endswith("info_norm.weight"):
                p.fill_(3.0)  # a token-info bias large enough to change first choices
    return trainer.eval()


def _checkpoint(trainer, path: Path) -> Path:
    path.mkdir(parents=True)
    save_file(trainer.export(), path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(trainer.config_dict()))
    return path


def test_lyanna_first_choices_agree_with_its_training_metric() -> None:
    """One batch: evaluate's step-k top-1 equals ``draft_loss``'s full-vocabulary top-1."""
    model = make_tiny_model(5, vocab_size=VOCAB)
    trainer = _trained("lyanna", model, 0)
    batch = collate(_sequences(3, 1), TrainConfig(batch_tokens=512, max_seq_len=32))
    with torch.no_grad():
        _, metrics = trainer.loss(batch)
    target_argmax = full_vocab_argmax(batch.hidden, trainer.draft.embedding)
    for k, first in enumerate(lyanna_first_choices(trainer, batch, 3), start=1):
        hits, rows = step_hits(first, target_argmax, batch.answer, k)
        assert rows > 0
        assert hits / rows == pytest.approx(metrics[f"top1_full_{k}"])


def test_eagle_first_choices_follow_its_unrolled_positions() -> None:
    """Step k's choice at state s is the hot argmax of the step-k prediction at position
    s - 1 (``training.eagle``), mapped to its token id."""
    model = make_tiny_model(6, vocab_size=VOCAB)
    trainer = _trained("eagle", model, 1)
    batch = collate(_sequences(2, 2), TrainConfig(batch_tokens=512, max_seq_len=32))
    choices = eagle_first_choices(trainer, batch, 3)
    with torch.no_grad():
        preds = trainer.unroll(batch.tokens, batch.hidden, 3)
    head, hot = trainer.target.hot_head, trainer.target.hot_vocab
    for k in range(3):
        for s in (k + 1, 5, 8):
            expected = hot[(preds[k][0, s - 1] @ head.T).argmax()]
            assert int(choices[k][0, s]) == int(expected)


def test_entry_point_writes_top1_per_step_for_each_drafter(tmp_path, monkeypatch) -> None:
    model = make_tiny_model(5, vocab_size=VOCAB)
    model_dir = tmp_path / "target"
    export_hf_dir(model.config, hf_state_of(model), model_dir)
    monkeypatch.setattr(evaluate_module, "fetch_default_model", lambda: model_dir)
    run = tmp_path / "cache" / "data" / "tiny-heldout"
    run.mkdir(parents=True)
    write_shard(shard_path(run, 0), build_shard(_sequences(5, 3)))
    monkeypatch.setattr(evaluate_module, "ensure_hidden_states", lambda name, threads: run)
    eagle = _checkpoint(_trained("eagle", model, 2), tmp_path / "e")
    lyanna = _checkpoint(_trained("lyanna", model, 3), tmp_path / "l")
    out = tmp_path / "top1.json"
    evaluate_module.main(["--drafters", "eagle2,lyanna", "--checkpoint", f"eagle2={eagle}",
                          "--checkpoint", f"lyanna={lyanna}", "--data", "tiny-heldout",
                          "--json", str(out), "--threads", "1"])  # fmt: skip
    written = json.loads(out.read_text())
    assert set(written) == {"eagle2", "lyanna"}
    for name, kind in (("eagle2", "eagle"), ("lyanna", "lyanna")):
        assert len(written[name]["top1"]) == 5 and written[name]["kind"] == kind
        # deeper steps need an earlier anchor: never more rows than the step before
        rows = written[name]["rows"]
        assert rows == sorted(rows, reverse=True) and rows[-1] > 0
    # the same numbers from the library call on the same rows
    batches = evaluate_module.evaluation_batches([run])
    again = evaluate([Drafter("l", "lyanna", lyanna)], batches, model.embed_tokens.weight.float(),
                     model.config)  # fmt: skip
    assert again["l"]["top1"] == written["lyanna"]["top1"]


def test_drafted_parents_ablation_reads_the_step_before_first_choices() -> None:
    """``--info-parents drafted``: step 1 is unchanged; from step 2 on the token info reads
    the drafter's own first choice of the step before (``first_choices``, checked against
    the evaluator's independent ``lyanna_first_choices``), which changes the loss."""
    from training.lyanna import draft_loss, first_choices

    model = make_tiny_model(5, vocab_size=VOCAB)
    trainer = _trained("lyanna", model, 4)
    draft = trainer.draft
    batch = collate(_sequences(2, 5), TrainConfig(batch_tokens=512, max_seq_len=32))
    T = batch.tokens.shape[1]
    with torch.no_grad():
        y1 = draft.unrolled(batch.hidden, batch.tokens, 1)[0][:, : T - 2]
        mine = first_choices(draft, y1, batch.tokens[:, 1 : T - 1])
        theirs = lyanna_first_choices(trainer, batch, 1)[0][:, 1 : T - 1]
        assert torch.equal(mine, theirs)
        args = (draft, batch.hidden, batch.tokens, batch.weight)
        teacher = draft_loss(*args, steps=3)
        drafted = draft_loss(*args, steps=3, drafted_parents=True)
    assert drafted[1]["ce1"] == teacher[1]["ce1"] and drafted[1]["mse2"] == teacher[1]["mse2"]
    assert drafted[1]["ce2"] != teacher[1]["ce2"]
    with pytest.raises(ValueError):
        TrainConfig(info_parents="sampled")


def test_a_small_budget_rebuilds_only_the_first_shards(tmp_path, monkeypatch) -> None:
    """``ensure_hidden_states(run, max_shards=1)`` asks ``materialize`` for shard 0 of a
    committed three-shard run only, and nothing once it exists."""
    import training.distill as distill_module
    from training.id_shards import shard_index

    monkeypatch.setenv("LYANNA_CACHE", str(tmp_path))
    calls = []

    def fake_materialize(config):
        manifest = json.loads((config.id_dir / "manifest.json").read_text())
        calls.append((sorted(manifest["shards"]), [p.resolve() for p in config.id_dir.iterdir()]))
        config.hidden_dir.mkdir(parents=True, exist_ok=True)
        for name in manifest["shards"]:
            shard_path(config.hidden_dir, shard_index(name)).write_bytes(b"")
        return len(manifest["shards"])

    monkeypatch.setattr(distill_module, "materialize", fake_materialize)
    committed = Path(evaluate_module.__file__).parents[1] / "data" / "distill" / "distill-v3"
    names = sorted(json.loads((committed / "manifest.json").read_text())["shards"])
    assert len(names) == 3  # distill-v3 continues the numbering: ids-00090 ...
    hidden = evaluate_module.ensure_hidden_states("distill-v3", 1, max_shards=1)
    assert hidden == tmp_path / "data" / "distill-v3"
    assert len(calls) == 1 and calls[0][0] == names[:1]
    assert (committed / names[0]).resolve() in calls[0][1]
    assert [p.name for p in hidden.iterdir()] == [shard_path(hidden, shard_index(names[0])).name]
    evaluate_module.ensure_hidden_states("distill-v3", 1, max_shards=1)
    assert len(calls) == 1  # already there
