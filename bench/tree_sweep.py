"""Tree-shape sweep at batch 1: tau, tokens/s and speedup over AR for every tree setting
(depth, top-k, budget B, fixed or cost-aware) per method. Every setting is its own entry of
one ``run_methods`` call, so all of them and AR take turns on each prompt and a burst of
load on a shared machine cannot favour one of them.

    python -m bench.tree_sweep [--methods eagle,lyanna] [--depths 3,5] [--top-ks 2,4]
        [--budgets 4,8,16] [--trees fixed,cost] [--configs 3x2x4,5x4x16c]
        [--limit-per-category 1] [--max-tokens 64] [--weights auto]

A config ``DEPTHxTOPKxBUDGET`` is a fixed tree; a trailing ``c`` makes it cost-aware (the
budget is then a cap, see ``lyanna.tree_cost``).
"""

from __future__ import annotations

import argparse
import itertools

from bench.common import print_table, set_threads
from bench.spec_bench import BenchSetup, run_methods
from lyanna.drafters import DraftBudget, default_budget, make_drafter
from lyanna.model.calibrate import verify_cost
from lyanna.model.loader import WEIGHT_FORMATS
from lyanna.sampling import SamplingParams


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_config(text: str) -> tuple[int, int, int, bool]:
    cost_aware = text.endswith("c")
    depth, top_k, budget = (int(v) for v in text.rstrip("c").split("x"))
    return depth, top_k, budget, cost_aware


def config_name(depth: int, top_k: int, budget: int, cost_aware: bool) -> str:
    return f"d{depth} k{top_k} B{budget}" + (" cost" if cost_aware else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="eagle")
    parser.add_argument("--depths", default="3,5")
    parser.add_argument("--top-ks", default="2,4")
    parser.add_argument("--budgets", default="4,16")
    parser.add_argument("--trees", default="fixed,cost", help="fixed and/or cost")
    parser.add_argument("--configs", help="explicit list instead of the grid, e.g. 3x2x4,5x4x16c")
    parser.add_argument("--limit-per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto")
    args = parser.parse_args()
    set_threads(args.threads)
    setup = BenchSetup.load(per_category=args.limit_per_category, weights=args.weights)
    if args.configs:
        grid = [parse_config(c) for c in args.configs.split(",")]
    else:
        trees = [t == "cost" for t in args.trees.split(",")]
        grid = list(
            itertools.product(ints(args.depths), ints(args.top_ks), ints(args.budgets), trees)
        )
    cost = verify_cost(setup.model) if any(c[3] for c in grid) else None
    settings: dict[str, tuple[str, tuple[int, int, int, bool]]] = {}
    for method in args.methods.split(","):
        for config in grid:
            settings[f"{method} {config_name(*config)}"] = (method, config)

    def factory(name: str):
        method, (depth, top_k, budget, cost_aware) = settings[name]
        shape = DraftBudget(depth, top_k, budget, cost=cost if cost_aware else None)
        return lambda: make_drafter(method, setup.model, shape)

    params = SamplingParams(max_tokens=args.max_tokens)
    factories = {name: factory(name) for name in settings}
    results = run_methods(setup, list(settings), 1, params, default_budget, False, factories)
    rows = []
    for name, r in results.items():
        method, config = settings.get(name, ("ar", None))
        rows.append(
            [
                method,
                config_name(*config) if config else "-",
                r["tokens_per_s"],
                r["decode_tokens_per_s"],
                r["speedup_vs_ar"],
                r["decode_speedup_vs_ar"],
                r["tau"],
                f"{r['draft_share']:.2f}",
                r["greedy_mismatches"] or 0,
            ]
        )
    print(
        f"\nTree sweep: {setup.num_prompts} Spec-Bench prompts, batch 1, greedy, "
        f"max {args.max_tokens} tokens, settings taking turns per prompt\n"
    )
    print_table(
        [
            "method",
            "tree",
            "tok/s e2e",
            "tok/s decode",
            "speedup",
            "decode speedup",
            "tau",
            "draft share",
            "greedy mismatches",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
