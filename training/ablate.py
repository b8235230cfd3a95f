"""One equal-budget ablation run (issue 41): ``training.train`` on the same data, batches,
order and token-pass budget as ``training.compare`` (its ``steps_for_budget`` and base
config), with any ``TrainConfig`` field overridden, then held-out full-vocabulary top-1 for
draft steps 1-5 by ``training.evaluate``'s one rule on the first ``--heldout-sequences``
sequences of the held-out run. One JSON line per run is appended to ``--results``.

    python -m training.ablate --name lyanna-base --model lyanna --lr 1e-3 \\
        --token-passes 200000 [--set init_from_target=false --set ce_weight=0.2]

Checkpoints and train state go to ``$LYANNA_CACHE/ablate/<name>/`` (never ``checkpoints/``);
rerunning a name whose export exists only evaluates it again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from lyanna.model import fetch_default_model, read_hf_dir
from lyanna.model.default import cache_root
from training.compare import CE_WEIGHTS, steps_for_budget
from training.config import TrainConfig, parse_overrides
from training.data import iter_sequences
from training.evaluate import Drafter, evaluate, evaluation_batches


def run_config(args: argparse.Namespace) -> tuple[TrainConfig, int]:
    """The run's config (compare's base, the overrides applied) and its token-passes."""
    base = TrainConfig(data=args.data, unroll_steps=3, hot_vocab_size=8192,
                       batch_tokens=args.batch_tokens, max_seq_len=512,
                       val_sequences=args.val_sequences, amp=args.amp, threads=args.threads,
                       seed=0, log_every=args.log_every, ckpt_every=10**9)  # fmt: skip
    sequences = list(iter_sequences(base.data_dirs))[: -args.val_sequences]
    lengths = [min(s.tokens.shape[0], base.max_seq_len) for s in sequences]
    steps, passes = steps_for_budget(lengths, base, args.token_passes)
    export = cache_root() / "ablate" / args.name
    overrides = ["--model", args.model, "--lr", str(args.lr),
                 "--ce-weight", str(CE_WEIGHTS[args.model])]  # fmt: skip
    for item in args.set:
        key, value = item.split("=", 1)
        overrides += ["--" + key.replace("_", "-"), value]
    config = parse_overrides(overrides)
    own = (
        "model",
        "lr",
        "ce_weight",
        "max_steps",
        "warmup_steps",
        "eval_every",
        "run_name",
        "export_dir",
    )
    fixed = {f.name: getattr(base, f.name) for f in dataclasses.fields(TrainConfig)
             if f.name not in own
             and getattr(config, f.name) == getattr(TrainConfig(), f.name)}  # fmt: skip
    config = dataclasses.replace(config, **fixed, max_steps=steps,
                                 warmup_steps=max(1, min(100, steps // 10)), eval_every=steps,
                                 run_name=f"ablate-{args.name}",
                                 export_dir=str(export))  # fmt: skip
    return config, passes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--name", required=True)
    parser.add_argument("--model", choices=("eagle", "lyanna"), required=True)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--token-passes", type=int, default=200_000)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--data", default="distill-v3")
    parser.add_argument("--val-sequences", type=int, default=32)
    parser.add_argument("--heldout", default="distill-heldout-v1")
    parser.add_argument("--heldout-sequences", type=int, default=48)
    parser.add_argument("--amp", choices=("none", "bf16"), default="bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], help="TrainConfig field=value")
    parser.add_argument("--results", type=Path, default=cache_root() / "ablate" / "results.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config, passes = run_config(args)
    started = time.perf_counter()
    if not (Path(config.export_dir) / "model.safetensors").is_file():
        from training.train import train

        train(config)
    train_seconds = time.perf_counter() - started
    target_config, state = read_hf_dir(fetch_default_model())
    embedding = state["model.embed_tokens.weight"].float()
    del state
    batches = evaluation_batches([cache_root() / "data" / args.heldout], args.heldout_sequences)
    drafter = Drafter(args.name, args.model, Path(config.export_dir))
    score = evaluate([drafter], batches, embedding, target_config, 5)[args.name]
    result = {"name": args.name, "model": args.model, "lr": args.lr, "set": args.set,
              "token_passes": passes, "steps": config.max_steps,
              "batch_tokens": args.batch_tokens, "top1": score["top1"],
              "rows": score["rows"][0], "train_seconds": round(train_seconds, 1),
              "eval_seconds": score["seconds"], "threads": args.threads,
              "heldout_sequences": args.heldout_sequences}  # fmt: skip
    print(json.dumps(result), flush=True)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a") as f:
        f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
