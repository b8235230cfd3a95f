"""Tree-shape sweep at batch 1: tau, tokens/s and speedup over AR for every (depth, top-k,
budget B) in a grid, per method; AR runs once and every setting is compared with it.

    python -m bench.tree_sweep [--methods eagle] [--depths 3,5,7] [--top-ks 2,4,8]
        [--budgets 8,16,32] [--configs 3x2x4,5x4x16] [--limit-per-category 1] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import itertools

from bench.common import print_table, set_threads
from bench.spec_bench import ArReference, BenchSetup, run_methods
from lyanna.drafters import DraftBudget
from lyanna.sampling import SamplingParams


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="eagle")
    parser.add_argument("--depths", default="3,5,7")
    parser.add_argument("--top-ks", default="2,4,8")
    parser.add_argument("--budgets", default="8,16,32")
    parser.add_argument(
        "--configs", help="explicit DEPTHxTOPKxBUDGET list instead of the grid, e.g. 3x2x4,5x4x16"
    )
    parser.add_argument("--limit-per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    set_threads(args.threads)
    setup = BenchSetup.load(per_category=args.limit_per_category)
    params = SamplingParams(max_tokens=args.max_tokens)
    reference = ArReference()
    rows = []
    if args.configs:
        grid = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    else:
        grid = itertools.product(ints(args.depths), ints(args.top_ks), ints(args.budgets))
    for depth, top_k, budget in grid:
        results = run_methods(
            setup,
            args.methods.split(","),
            1,
            params,
            DraftBudget(depth, top_k, budget),
            log=False,
            reference=reference,
        )
        for method, r in results.items():
            if method == "ar":
                rows.append(["ar", "-", "-", "-", r["tokens_per_s"], 1.0, 1.0, 0])
                continue
            rows.append(
                [
                    method,
                    depth,
                    top_k,
                    budget,
                    r["tokens_per_s"],
                    r["speedup_vs_ar"],
                    r["tau"],
                    r["greedy_mismatches"],
                ]
            )
            print(
                f"  {method} d{depth} k{top_k} B{budget}: {r['speedup_vs_ar']:.2f}x "
                f"tau {r['tau']:.2f}",
                flush=True,
            )
    print(
        f"\nTree sweep: {setup.num_prompts} Spec-Bench prompts, batch 1, greedy, "
        f"max {args.max_tokens} tokens\n"
    )
    print_table(
        ["method", "depth", "top-k", "budget B", "tok/s", "speedup", "tau", "greedy mismatches"],
        rows,
    )


if __name__ == "__main__":
    main()
