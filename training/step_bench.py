"""Training-step throughput of each drafter on the CPU, today's loss code against the
cross-entropy of an earlier git revision, side by side in one process (alternating, so both
see the same load on a shared machine):

    python -m training.step_bench --baseline-rev 1bcd3b9 --threads 1 --reps 2 \\
        [--drafters eagle,lyanna] [--amp none,bf16] [--batch-tokens 2048]

One step = forward, backward, gradient clipping and the AdamW update of ``training.train`` on
one fixed batch of ``distill-v3`` (the first cached shard), 512-token sequences. The baseline
swaps in ``training/hot_ce.py`` as it was at ``--baseline-rev`` (the rest of the step is
today's). Prints token-passes per CPU-second per (drafter, amp, version) and the speedup
(old / new) of the cheapest step of each: with one thread, CPU time is the step's own work,
which wall time on a CPU shared with other jobs is not (wall times are printed too).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lyanna.model import fetch_default_model, read_hf_dir
from training import losses as losses_module
from training import lyanna as lyanna_module
from training.config import TrainConfig
from training.data import iter_sequences
from training.losses import FrozenTarget
from training.models import get_model_class
from training.train import collate, hot_vocabulary, plan_batches

REPO = Path(__file__).resolve().parents[1]


def load_baseline(rev: str):
    """``training.hot_ce`` as it was at git revision ``rev`` (a module of its own)."""
    text = subprocess.run(["git", "show", f"{rev}:training/hot_ce.py"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "hot_ce_baseline.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("hot_ce_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["hot_ce_baseline"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", required=True)
    parser.add_argument("--drafters", default="eagle,lyanna")
    parser.add_argument("--amp", default="none,bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--data", default="distill-v3")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    baseline = load_baseline(args.baseline_rev)
    versions = {"new": (lyanna_module.fused_hot_ce, lyanna_module.TokenInfo),
                "old": (baseline.fused_hot_ce, baseline.TokenInfo)}  # fmt: skip
    config = TrainConfig(data=args.data, batch_tokens=args.batch_tokens, max_seq_len=512)
    target_config, state = read_hf_dir(fetch_default_model())
    sequences = list(iter_sequences(config.data_dirs))
    hot = hot_vocabulary(sequences, 8192, target_config.vocab_size, True)
    target = FrozenTarget.from_embedding(state["model.embed_tokens.weight"], hot)
    del state
    lengths = [min(s.tokens.shape[0], 512) for s in sequences]
    plan = plan_batches(lengths, config, 0)
    chosen = max(plan, key=lambda b: sum(lengths[i] for i in b))  # the fullest batch
    batch = collate([sequences[i] for i in chosen], config)
    tokens = int((batch.weight > 0).sum())
    times: dict[str, list[float]] = {}
    cpu_times: dict[str, list[float]] = {}  # CPU seconds: what the step costs on a shared CPU
    models = {}
    for kind in args.drafters.split(","):
        run = TrainConfig(model=kind, ce_weight=0.2 if kind == "eagle" else 1.0)
        torch.manual_seed(0)
        model = get_model_class(kind).build(target, target_config, run)
        params = [p for p in model.parameters() if p.requires_grad]
        models[kind] = (model, params, torch.optim.AdamW(params, lr=1e-5))
    for rep in range(args.reps + 1):  # the first round warms up and is not counted
        for kind, (model, params, optimizer) in models.items():
            for amp in args.amp.split(","):
                for version, (ce, info) in versions.items():
                    losses_module.fused_hot_ce = ce
                    lyanna_module.fused_hot_ce, lyanna_module.TokenInfo = ce, info
                    started, cpu = time.perf_counter(), time.process_time()
                    with torch.autocast("cpu", torch.bfloat16, enabled=amp == "bf16"):
                        loss, _ = model.loss(batch)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, 0.5)
                    optimizer.step()
                    if rep:
                        key = f"{kind} {amp} {version}"
                        times.setdefault(key, []).append(time.perf_counter() - started)
                        cpu_times.setdefault(key, []).append(time.process_time() - cpu)
    report: dict[str, dict] = {"batch": list(batch.tokens.shape), "tokens": tokens,
                               "threads": args.threads,
                               "baseline_rev": args.baseline_rev}  # fmt: skip
    for kind in models:
        for amp in args.amp.split(","):
            old, new = (min(cpu_times[f"{kind} {amp} {v}"]) for v in ("old", "new"))
            report[f"{kind} {amp}"] = {
                "old_tok_per_cpu_s": round(tokens / old, 1),
                "new_tok_per_cpu_s": round(tokens / new, 1), "speedup": round(old / new, 2),
                "old_cpu_s": [round(t, 2) for t in cpu_times[f"{kind} {amp} old"]],
                "new_cpu_s": [round(t, 2) for t in cpu_times[f"{kind} {amp} new"]],
                "old_wall_s": [round(t, 2) for t in times[f"{kind} {amp} old"]],
                "new_wall_s": [round(t, 2) for t in times[f"{kind} {amp} new"]],
            }  # fmt: skip
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
