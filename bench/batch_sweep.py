"""End-to-end tokens/s and speedup over AR at several batch sizes for several methods (the
Lyanna paper's Figures 8-11, here on a CPU), as a table, a JSON file and a PNG plot.

    python -m bench.batch_sweep [--methods ngram,sps,eagle,lyanna] [--batch-sizes 1,2,4,8,16]
        [--limit-per-category 2] [--max-tokens 64] [--png docs/img/batch_sweep.png]

Every batch size runs AR first, so each speedup is a ratio taken side by side in one run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import add_run_args, describe_tree, method_budget, print_table, set_threads
from bench.spec_bench import BenchSetup, run_methods
from lyanna.sampling import SamplingParams


def plot(results: dict[int, dict[str, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch_sizes = sorted(results)
    methods = list(results[batch_sizes[0]])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in methods:
        left.plot(
            batch_sizes,
            [results[b][method]["tokens_per_s"] for b in batch_sizes],
            "o-",
            label=method,
        )
        right.plot(
            batch_sizes,
            [results[b][method]["speedup_vs_ar"] for b in batch_sizes],
            "o-",
            label=method,
        )
    for ax, label in ((left, "tokens/s (end-to-end)"), (right, "speedup over AR")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    right.axhline(1.0, color="gray", lw=0.8)
    left.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="ngram,sps,eagle,lyanna")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    add_run_args(parser, per_category=2, max_tokens=64)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path, default=Path("docs/img/batch_sweep.png"))
    args = parser.parse_args()
    set_threads(args.threads)
    setup = BenchSetup.from_args(args)
    params = SamplingParams(max_tokens=args.max_tokens)
    methods = args.methods.split(",")
    results: dict[int, dict[str, dict]] = {}
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        print(f"batch {batch_size}", flush=True)
        results[batch_size] = run_methods(
            setup,
            methods,
            batch_size,
            params,
            lambda method: method_budget(args, method, setup.model),
            log=False,
        )
    names = list(results[next(iter(results))])
    print(
        f"\n{setup.num_prompts} Spec-Bench prompts, greedy, max {args.max_tokens} tokens, "
        f"{describe_tree(args)}\n"
    )
    print_table(
        [
            "batch",
            *[f"{m} tok/s" for m in names],
            *[f"{m} speedup" for m in names[1:]],
            *[f"{m} tau" for m in names[1:]],
        ],
        [
            [
                b,
                *[r[m]["tokens_per_s"] for m in names],
                *[r[m]["speedup_vs_ar"] for m in names[1:]],
                *[r[m]["tau"] for m in names[1:]],
            ]
            for b, r in results.items()
        ],
    )
    mismatches = {m: sum(r[m]["greedy_mismatches"] or 0 for r in results.values()) for m in names}
    print(f"\ngreedy mismatches vs AR (all batch sizes): {mismatches}")
    title = (
        f"SmolLM2-135M on 2 CPU cores, {setup.num_prompts} Spec-Bench prompts, "
        f"{args.max_tokens} tokens, {describe_tree(args)}"
    )
    plot(results, args.png, title)
    print(f"plot: {args.png}")
    if args.json:
        args.json.write_text(json.dumps({str(b): r for b, r in results.items()}, indent=2))


if __name__ == "__main__":
    main()
