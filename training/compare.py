"""EAGLE-2 against Lyanna on an equal budget, on a CPU: the same data, the same batches in the
same order, the same token-passes, the same learning-rate sweep, the same unroll depth and the
same hot vocabulary; then held-out full-vocabulary top-1 for steps 1-5 of every run
(``training.evaluate``, one rule for both) and, optionally, Spec-Bench with the gate off.

    python -m training.compare --data distill-v1,distill-v2,distill-v3 \\
        --token-passes 2000000 --lrs 3e-4,6e-4,1.5e-3 [--unroll-steps 3] [--hot-vocab-size 8192]
        [--spec-bench-per-category 2] [--tag NAME] [--table docs/drafter_compare.md]
        [--plot docs/img/drafter_compare.png] [--json FILE]

Every run goes through ``training.train`` (the one loop). Equal budget: both drafters get the
same ``TrainConfig`` except the model and its loss weight (``--ce-weights``, each drafter's
committed recipe by default), so ``plan_batches`` gives them the same batches in the same
order; ``max_steps`` is the first step count whose batches hold ``--token-passes`` unpadded
tokens. The last ``--val-sequences`` training sequences are the validation set that picks each
drafter's best learning rate (never the reported held-out run); the hot vocabulary is counted
on the same training split, so it is the same for both (checked, and recorded).
Checkpoints and train state go to ``$LYANNA_CACHE/compare/<tag>/`` (not the repository's
``checkpoints/``); a rerun with the same tag resumes finished runs instead of training again,
and a run whose export is already there (e.g. a ``training.ablate`` run linked in) is
evaluated, not trained, when its manifest's training config is this run's (else it stops).
``--set lyanna:info_copy=true`` (repeatable; ``field=value`` for both) changes one drafter's
``TrainConfig`` in every run of the sweep.
Spec-Bench (evaluation only) runs each drafter's best checkpoint ungated, drafting a chain of
``--tree-depth`` tokens every step, and reports tau and conditional acceptance per depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from lyanna.model import fetch_default_model, read_hf_dir
from lyanna.model.default import cache_root
from training.config import TrainConfig, parse_overrides
from training.data import iter_sequences
from training.evaluate import Drafter, ensure_hidden_states, evaluate, evaluation_batches
from training.train import plan_batches, selection_score

REPO = Path(__file__).resolve().parents[1]
DRAFTERS = ("eagle", "lyanna")
LABELS = {"eagle": "EAGLE-2", "lyanna": "Lyanna"}
CE_WEIGHTS = {"eagle": 0.2, "lyanna": 1.0}  # the committed checkpoints' recipes


def steps_for_budget(lengths: list[int], config: TrainConfig, token_passes: int) -> tuple[int, int]:
    """(steps, token-passes): the fewest steps of ``plan_batches``' order (epoch after epoch)
    whose batches hold at least ``token_passes`` unpadded tokens, and how many they hold."""
    seen, steps, epoch = 0, 0, 0
    while seen < token_passes:
        plan = plan_batches(lengths, config, epoch)
        for batch in plan:
            seen += sum(lengths[i] for i in batch)
            steps += 1
            if seen >= token_passes:
                break
        epoch += 1
    return steps, seen


def run_config(base: TrainConfig, kind: str, lr: float, tag: str, ce_weight: float) -> TrainConfig:
    name = f"compare-{tag}-{kind}-lr{lr:g}"
    export = cache_root() / "compare" / tag / f"{kind}-lr{lr:g}"
    return dataclasses.replace(base, model=kind, lr=lr, ce_weight=ce_weight, run_name=name,
                               export_dir=str(export))  # fmt: skip


def hot_vocab_of(export_dir: Path) -> torch.Tensor:
    state = load_file(Path(export_dir) / "model.safetensors")
    return state["hot_vocab"] if "hot_vocab" in state else state["hot_ids"]


def checkpoint_kind(path: Path) -> str:
    """The drafter an exported checkpoint holds, from its ``config.json``: eagle or lyanna."""
    config = json.loads((path / "config.json").read_text())
    return "eagle" if config.get("kind") == "eagle" else "lyanna"


def spec_bench(checkpoints: dict[str, Path], per_category: int, max_tokens: int,
               depth: int) -> dict:  # fmt: skip
    """Each named checkpoint (EAGLE-2 or Lyanna, read from its config) on Spec-Bench, ungated,
    a chain of ``depth`` tokens every step; AR runs first as the reference."""
    from bench.spec_bench import BenchSetup, run_methods
    from lyanna.drafters.base import DraftBudget
    from lyanna.drafters.eagle import EagleDrafter
    from lyanna.drafters.eagle_head import load_eagle_head
    from lyanna.drafters.lyanna import LyannaDrafter
    from lyanna.sampling import SamplingParams

    setup = BenchSetup.load(per_category=per_category)
    budget = DraftBudget(depth=depth, top_k=1, max_tokens=depth)

    def factory(path: Path):
        if checkpoint_kind(path) == "eagle":
            return lambda: EagleDrafter(setup.model, load_eagle_head(path), budget)
        return lambda: LyannaDrafter.from_checkpoint(setup.model, path, budget=budget,
                                                     sample_drafts=False)  # fmt: skip

    factories = {name: factory(path) for name, path in checkpoints.items()}
    results = run_methods(setup, list(factories), 1, SamplingParams(max_tokens=max_tokens),
                          lambda m: budget, factories=factories)  # fmt: skip
    return {
        k: {"tau": r["tau"], "cond_accept": r["cond_accept"], "prompts": setup.num_prompts,
            "greedy_mismatches": r["greedy_mismatches"],
            "decode_speedup_vs_ar": r["decode_speedup_vs_ar"]}
        for k, r in results.items() if k != "ar"
    }  # fmt: skip


def gate_off_main(argv: list[str] | None = None) -> dict:
    """``python -m training.compare gate-off NAME=DIR ...``: Spec-Bench with the gate off for
    any exported checkpoints (e.g. ``training.ablate`` runs), printed as JSON."""
    parser = argparse.ArgumentParser(prog="python -m training.compare gate-off")
    parser.add_argument("checkpoints", nargs="+", help="NAME=DIR of an exported drafter")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    named = dict(item.split("=", 1) for item in args.checkpoints)
    result = spec_bench({k: Path(v) for k, v in named.items()}, args.per_category,
                        args.max_tokens, args.depth)  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return result


# fields that do not change the trained weights: a finished export may differ in them
BOOKKEEPING = ("run_name", "export_dir", "log_every", "eval_every", "ckpt_every", "threads",
               "device", "init_from")  # fmt: skip


def overrides(items: list[str], kind: str) -> dict:
    """``--set`` items (``[kind:]field=value``) for the runs of ``kind``, typed as
    ``training.train``'s flags type them."""
    changes = {}
    for item in items:
        scope, _, assignment = item.rpartition(":")
        if scope not in ("", kind):
            continue
        field, value = assignment.split("=", 1)
        parsed = parse_overrides(["--" + field.replace("_", "-"), value])
        changes[field] = getattr(parsed, field)
    return changes


def finished_run(config: TrainConfig) -> dict | None:
    """The metrics of the run's export when it exists (None when it does not), after checking
    that its manifest's training config is ``config`` in every field that shapes weights (a
    field newer than the manifest counts as its default, which kept the older behaviour)."""
    manifest = Path(config.export_dir) / "manifest.json"
    if not manifest.is_file():
        return None
    recorded = json.loads(manifest.read_text())
    mine, default = (json.loads(json.dumps(dataclasses.asdict(c))) for c in (config, TrainConfig()))
    theirs = {**default, **recorded["train_config"]}
    differs = sorted(k for k in mine if k not in BOOKKEEPING and theirs[k] != mine[k])
    if differs:
        raise SystemExit(f"{manifest.parent} was trained with other {', '.join(differs)}")
    return recorded["metrics"]


def markdown(report: dict) -> str:
    steps = len(next(iter(report["runs"]))["heldout_top1"])
    head = " | ".join(f"step {k}" for k in range(1, steps + 1))
    lines = [
        f"Equal budget: {report['token_passes']:,} token-passes ({report['steps']} steps of "
        f"{report['batch_tokens']} padded tokens) per run on `{report['data']}`, unroll depth "
        f"{report['unroll_steps']}, the same {report['hot_vocab_size']}-token hot vocabulary"
        f"{changed(report.get('overrides', {}))}. "
        f"Held-out (`{report['heldout']}`) top-1 over the full vocabulary; the learning rate "
        "of each drafter picked on validation sequences of the training split (**bold**).",
        "",
        f"| drafter | lr | validation top-1 (hot, mean) | {head} |",
        "|---|---|---|" + "---|" * steps,
    ]
    for run in report["runs"]:
        best = report["best"][run["model"]]["lr"] == run["lr"]
        cells = " | ".join(f"{t:.3f}" for t in run["heldout_top1"])
        lr = f"**{run['lr']:g}**" if best else f"{run['lr']:g}"
        lines.append(f"| {LABELS[run['model']]} | {lr} | {run['selection']:.3f} | {cells} |")
    bench = report.get("spec_bench")
    if bench:
        depth = max(len(r["cond_accept"]) for r in bench.values())
        lines += [
            "",
            f"Spec-Bench ({next(iter(bench.values()))['prompts']} prompts, T = 0, gate off, a "
            f"chain of {report['tree_depth']} every step), best learning rate of each:",
            "",
            "| drafter | tau | " + " | ".join(f"cond. accept d{d + 1}" for d in range(depth))
            + " |",
            "|---|---|" + "---|" * depth,
        ]  # fmt: skip
        for kind, r in bench.items():
            cond = " | ".join(f"{c:.3f}" for c in r["cond_accept"])
            lines.append(f"| {LABELS[kind]} | {r['tau']:.3f} | {cond} |")
    lines += ["", f"Command: `{report['command']}`"]
    return "\n".join(lines) + "\n"


def changed(overrides_by_kind: dict) -> str:
    """``; Lyanna with info_copy=True`` for the runs' ``--set`` changes ('' without)."""
    parts = [f"{LABELS[k]} with " + ", ".join(f"{f}={v}" for f, v in o.items())
             for k, o in overrides_by_kind.items() if o]  # fmt: skip
    return "; " + "; ".join(parts) if parts else ""


def plot(report: dict, path: Path) -> bool:
    """Top-1 per step (best learning rate solid, the others faint) and the sweep."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e .[dev])")
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"eagle": "tab:blue", "lyanna": "tab:orange"}
    for run in report["runs"]:
        kind = run["model"]
        best = report["best"][kind]["lr"] == run["lr"]
        steps = range(1, len(run["heldout_top1"]) + 1)
        label = f"{LABELS[kind]} lr {run['lr']:g}" + (" (best)" if best else "")
        left.plot(steps, run["heldout_top1"], marker="o", color=colors[kind],
                  alpha=1.0 if best else 0.3, label=label)  # fmt: skip
    left.set_xlabel("draft step")
    left.set_ylabel("held-out top-1 (full vocabulary)")
    left.legend(fontsize=7)
    for kind in DRAFTERS:
        runs = sorted((r for r in report["runs"] if r["model"] == kind), key=lambda r: r["lr"])
        if runs:
            right.plot([r["lr"] for r in runs], [sum(r["heldout_top1"]) / len(r["heldout_top1"])
                                                 for r in runs],
                       marker="o", color=colors[kind], label=LABELS[kind])  # fmt: skip
    right.set_xscale("log")
    right.set_xlabel("learning rate")
    right.set_ylabel("held-out top-1, mean of steps")
    right.legend(fontsize=7)
    fig.suptitle(f"Equal budget: {report['token_passes']:,} token-passes per run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def compare(args: argparse.Namespace, command: str) -> dict:
    from training.train import train

    kinds = args.drafters.split(",")
    lrs = [float(x) for x in args.lrs.split(",")]
    pairs = [item.split("=") for item in args.ce_weights.split(",") if item]
    ce_weights = dict(CE_WEIGHTS, **{k: float(v) for k, v in pairs})
    for run in args.data.split(","):
        hidden = ensure_hidden_states(run, args.threads, args.data_shards)
        held = len(list(hidden.glob("shard-*.safetensors")))
        if args.data_shards and held > args.data_shards:  # training.train reads every shard
            raise SystemExit(f"{hidden} holds {held} shards, not --data-shards {args.data_shards}")
    base = TrainConfig(data=args.data, unroll_steps=args.unroll_steps,
                       hot_vocab_size=args.hot_vocab_size, batch_tokens=args.batch_tokens,
                       max_seq_len=args.max_seq_len, val_sequences=args.val_sequences,
                       amp=args.amp, threads=args.threads, seed=args.seed, log_every=args.log_every,
                       ckpt_every=10**9)  # fmt: skip
    sequences = list(iter_sequences(base.data_dirs))[: -args.val_sequences]  # train's split
    lengths = [min(s.tokens.shape[0], base.max_seq_len) for s in sequences]
    steps, passes = steps_for_budget(lengths, base, args.token_passes)
    warmup = max(1, min(100, steps // 10))
    base = dataclasses.replace(base, max_steps=steps, warmup_steps=warmup, eval_every=steps)
    runs = []
    for kind in kinds:
        for lr in lrs:
            config = run_config(base, kind, lr, args.tag, ce_weights[kind])
            config = dataclasses.replace(config, **overrides(args.set, kind))
            started = time.perf_counter()
            record = finished_run(config) or train(config)
            runs.append({"model": kind, "lr": lr, "export": config.export_dir,
                         "selection": selection_score(record["val"]), "val": record["val"],
                         "train_seconds": round(time.perf_counter() - started, 1)})  # fmt: skip
    hot = [hot_vocab_of(Path(r["export"])) for r in runs]
    assert all(torch.equal(hot[0], h) for h in hot), "the runs' hot vocabularies differ"
    best = {}
    for kind in kinds:
        mine = [r for r in runs if r["model"] == kind]
        top = max(mine, key=lambda r: r["selection"])
        best[kind] = {"lr": top["lr"], "export": top["export"]}
    heldout_dirs = [ensure_hidden_states(r, args.threads) for r in args.heldout.split(",")]
    target_config, state = read_hf_dir(fetch_default_model())
    embedding = state["model.embed_tokens.weight"].float()
    del state
    batches = evaluation_batches(heldout_dirs, args.max_heldout_sequences)
    drafters = [Drafter(f"{r['model']}-{r['lr']:g}", r["model"], Path(r["export"])) for r in runs]
    scores = evaluate(drafters, batches, embedding, target_config, args.eval_steps)
    for run, drafter in zip(runs, drafters, strict=True):
        run["heldout_top1"] = scores[drafter.name]["top1"]
        run["heldout_rows"] = scores[drafter.name]["rows"]
    report = {
        "data": args.data + (f" (first {args.data_shards} shard(s) each)" if args.data_shards
                             else ""),
        "heldout": args.heldout, "token_passes": passes, "steps": steps,
        "batch_tokens": args.batch_tokens, "unroll_steps": args.unroll_steps,
        "hot_vocab_size": int(hot[0].numel()), "lrs": lrs, "ce_weights": ce_weights,
        "tree_depth": args.tree_depth or args.unroll_steps, "runs": runs, "best": best,
        "overrides": {kind: overrides(args.set, kind) for kind in kinds}, "command": command,
    }  # fmt: skip
    if args.spec_bench_per_category:
        report["spec_bench"] = spec_bench(
            {k: Path(v["export"]) for k, v in best.items()},
            args.spec_bench_per_category,
            args.spec_bench_max_tokens,
            report["tree_depth"],
        )
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="distill-v1,distill-v2,distill-v3")
    parser.add_argument("--data-shards", type=int, default=0,
                        help="train on the first N shards of each run only (0 = all)")  # fmt: skip
    parser.add_argument("--heldout", default="distill-heldout-v1")
    parser.add_argument("--drafters", default="eagle,lyanna")
    parser.add_argument("--token-passes", type=int, default=2_000_000)
    parser.add_argument("--lrs", default="3e-4,6e-4,1.5e-3")
    parser.add_argument("--ce-weights", default="", help="e.g. eagle=0.2,lyanna=1.0")
    parser.add_argument("--unroll-steps", type=int, default=3)
    parser.add_argument("--hot-vocab-size", type=int, default=8192)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--val-sequences", type=int, default=64)
    parser.add_argument("--max-heldout-sequences", type=int, default=0, help="0 = all")
    parser.add_argument("--eval-steps", type=int, default=5)
    parser.add_argument("--amp", choices=("none", "bf16"), default="none")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--tag", default="equal-budget")
    parser.add_argument("--set", action="append", default=[],
                        help="[eagle:|lyanna:]field=value, a TrainConfig change")  # fmt: skip
    parser.add_argument("--spec-bench-per-category", type=int, default=0, help="0 = skip")
    parser.add_argument("--spec-bench-max-tokens", type=int, default=128)
    parser.add_argument("--tree-depth", type=int, default=0, help="0 = --unroll-steps")
    parser.add_argument("--table", type=Path, default=REPO / "docs" / "drafter_compare.md")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "drafter_compare.png")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python -m training.compare " + " ".join(argv if argv is not None else sys.argv[1:])
    report = compare(args, command)
    text = markdown(report)
    print(text)
    args.table.parent.mkdir(parents=True, exist_ok=True)
    args.table.write_text(text)
    report["plot"] = str(args.plot) if plot(report, args.plot) else None
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    if sys.argv[1:2] == ["gate-off"]:
        gate_off_main(sys.argv[2:])
    else:
        main()
