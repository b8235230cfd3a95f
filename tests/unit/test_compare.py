"""``training.compare`` at a tiny budget on a tiny random-weight target: both drafters, three
learning rates, the same steps and hot vocabulary, the best learning rate picked on
validation, a markdown table and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

import training.compare as compare_module
import training.train as train_module
from lyanna.model.loader import export_hf_dir
from tests.conftest import make_tiny_model
from tests.unit.test_evaluate import _sequences
from tests.unit.test_loader import hf_state_of
from training.config import TrainConfig
from training.data import build_shard, shard_path, write_shard


def test_steps_for_budget_by_hand() -> None:
    config = TrainConfig(batch_tokens=64, max_seq_len=32)
    lengths = [10, 20, 30]  # batches of one epoch: [10, 20] (2 x 20 <= 64) and [30]
    # whichever comes first, two steps hold 60 tokens, a third 90
    assert compare_module.steps_for_budget(lengths, config, 50) == (2, 60)
    assert compare_module.steps_for_budget(lengths, config, 61) == (3, 90)


def _write_run(cache: Path, name: str, sequences) -> Path:
    run = cache / "data" / name
    run.mkdir(parents=True)
    write_shard(shard_path(run, 0), build_shard(sequences))
    (run / "manifest.json").write_text(json.dumps({"config": {"run_name": name}}))
    return run


def test_compare_runs_an_equal_budget_sweep_and_writes_table_and_plot(
    tmp_path, monkeypatch
) -> None:
    pytest.importorskip("matplotlib")
    model = make_tiny_model(5, vocab_size=32)
    model_dir = tmp_path / "target"
    export_hf_dir(model.config, hf_state_of(model), model_dir)
    cache = tmp_path / "cache"
    monkeypatch.setenv("LYANNA_CACHE", str(cache))
    for module in (train_module, compare_module):
        monkeypatch.setattr(module, "fetch_default_model", lambda: model_dir)
    runs = {
        "tiny-train": _write_run(cache, "tiny-train", _sequences(20, seed=1)),
        "tiny-heldout": _write_run(cache, "tiny-heldout", _sequences(6, seed=2)),
    }
    monkeypatch.setattr(compare_module, "ensure_hidden_states", lambda name, *a: runs[name])
    table, plot, out = tmp_path / "t.md", tmp_path / "img" / "p.png", tmp_path / "r.json"
    args = ["--data", "tiny-train", "--heldout", "tiny-heldout", "--token-passes", "900",
            "--lrs", "1e-3,5e-3,2e-2", "--unroll-steps", "2", "--hot-vocab-size", "24",
            "--batch-tokens", "128", "--max-seq-len", "32", "--val-sequences", "4",
            "--threads", "1", "--tag", "t", "--table", str(table), "--plot", str(plot),
            "--json", str(out)]  # fmt: skip
    compare_module.main(args)
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 6
    assert report["token_passes"] >= 900 and report["hot_vocab_size"] == 24
    for run in report["runs"]:
        manifest = json.loads((Path(run["export"]) / "manifest.json").read_text())
        # the same steps over the same training split for every run (equal budget)
        assert manifest["metrics"]["steps"] == report["steps"]
        assert manifest["train_config"]["unroll_steps"] == 2
        assert manifest["metrics"]["train_sequences"] == 16
        assert len(run["heldout_top1"]) == 5
        assert all(0.0 <= t <= 1.0 for t in run["heldout_top1"])
        weights = load_file(Path(run["export"]) / "model.safetensors")
        hot = weights["hot_vocab"] if "hot_vocab" in weights else weights["hot_ids"]
        assert hot.numel() == 24
        assert str(cache) in run["export"]  # never the repository's checkpoints/
    for kind in ("eagle", "lyanna"):
        mine = [r for r in report["runs"] if r["model"] == kind]
        assert report["best"][kind]["lr"] == max(mine, key=lambda r: r["selection"])["lr"]
    text = table.read_text()
    assert text.count("| EAGLE-2 |") == 3 and text.count("| Lyanna |") == 3
    assert text.count("| **") == 2  # one bold learning rate per drafter
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a rerun finds every export finished: evaluated again, never trained
    def no_training(config):
        raise AssertionError(f"{config.run_name} trained again")

    monkeypatch.setattr(train_module, "train", no_training)
    again = compare_module.main(args)
    assert [r["heldout_top1"] for r in again["runs"]] == [r["heldout_top1"] for r in report["runs"]]
    # ... unless a run would now train otherwise: then it stops instead of reusing it
    with pytest.raises(SystemExit, match="info_copy"):
        compare_module.main([*args, "--set", "lyanna:info_copy=true"])


def test_set_changes_one_drafter_typed_as_train_flags() -> None:
    items = ["lyanna:info_copy=true", "eagle:feature_noise=0.5", "seed=3"]
    assert compare_module.overrides(items, "lyanna") == {"info_copy": True, "seed": 3}
    assert compare_module.overrides(items, "eagle") == {"feature_noise": 0.5, "seed": 3}


def test_spec_bench_of_the_best_checkpoints_drafts_ungated_chains(tmp_path, monkeypatch) -> None:
    """``--spec-bench-per-category`` (and ``gate-off NAME=DIR``): each checkpoint, under any
    name, its kind read from its config, drafts a chain of the tree depth on every step (no
    gate), losslessly, with acceptance reported per depth."""
    import bench.spec_bench as spec_bench_module
    from bench.spec_bench import BenchSetup
    from tests.unit.test_evaluate import _checkpoint, _trained

    model = make_tiny_model(5, vocab_size=32)
    setup = BenchSetup(model, frozenset(), {"tiny": [[4, 4, 4, 4, 4], [3, 5, 3, 5, 3]]})
    monkeypatch.setattr(spec_bench_module.BenchSetup, "load",
                        classmethod(lambda cls, per_category: setup))  # fmt: skip

    runs = (("baseline", "eagle", 1), ("variant", "lyanna", 2))
    named = {name: _checkpoint(_trained(kind, model, seed), tmp_path / kind)
             for name, kind, seed in runs}  # fmt: skip
    assert compare_module.checkpoint_kind(named["baseline"]) == "eagle"
    assert compare_module.checkpoint_kind(named["variant"]) == "lyanna"
    out = compare_module.spec_bench(named, per_category=2, max_tokens=12, depth=3)
    assert set(out) == {"baseline", "variant"}
    for result in out.values():
        assert result["greedy_mismatches"] == 0 and result["prompts"] == 2
        assert len(result["cond_accept"]) == 3  # a node at every depth of the chain
        assert result["tau"] >= 1.0
