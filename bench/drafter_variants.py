"""One drafter setting on and off, side by side: every variant and AR take turns on each
prompt (``run_methods``), at each method's default cost-aware tree.

    python -m bench.drafter_variants --variant weights [--methods eagle,lyanna]
    python -m bench.drafter_variants --variant calibration [--methods ngram,eagle,lyanna]

``weights``: draft layers and head in fp32 vs bf16 (``heads.draft_weight_dtype``).
``calibration``: cost-aware widths from raw draft probabilities vs calibrated ones
(``tree_cost.GainCalibration``; "raw" holds its scale at 1).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.common import print_table, set_threads
from bench.spec_bench import BenchSetup, run_methods
from lyanna.drafters import Drafter, default_budget, make_drafter, tree_budget
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.lyanna import LyannaDrafter
from lyanna.sampling import SamplingParams

WEIGHT_DRAFTERS = {"eagle": EagleDrafter, "lyanna": LyannaDrafter.from_checkpoint}


def variants(
    setup: BenchSetup, variant: str, methods: list[str]
) -> dict[str, Callable[[], Drafter]]:
    model = setup.model
    built: dict[str, Callable[[], Drafter]] = {}
    for method in methods:
        budget = tree_budget(method, model)
        if variant == "weights":
            make = WEIGHT_DRAFTERS[method]
            for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
                built[f"{method} {name} weights"] = lambda make=make, budget=budget, dtype=dtype: (
                    make(model, budget=budget, weight_dtype=dtype)
                )
        else:
            for calibrated in (False, True):

                def build(method=method, budget=budget, calibrated=calibrated) -> Drafter:
                    drafter = make_drafter(method, model, budget)
                    if not calibrated:
                        drafter.calibration.prior = 1e12  # the scale stays 1
                    return drafter

                built[f"{method} {'calibrated' if calibrated else 'raw'}"] = build
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=("weights", "calibration"), required=True)
    parser.add_argument("--methods", default="eagle,lyanna")
    parser.add_argument("--limit-per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    set_threads(args.threads)
    setup = BenchSetup.load(per_category=args.limit_per_category)
    factories = variants(setup, args.variant, args.methods.split(","))
    params = SamplingParams(max_tokens=args.max_tokens)
    results = run_methods(setup, list(factories), 1, params, default_budget, False, factories)
    print(f"\n{setup.num_prompts} Spec-Bench prompts, batch 1, greedy, {args.max_tokens} tokens\n")
    print_table(
        [
            "drafter",
            "tok/s e2e",
            "tok/s decode",
            "decode speedup",
            "tau",
            "draft share",
            "mismatches",
        ],
        [
            [
                name,
                r["tokens_per_s"],
                r["decode_tokens_per_s"],
                r["decode_speedup_vs_ar"],
                r["tau"],
                r["draft_share"],
                r["greedy_mismatches"],
            ]
            for name, r in results.items()
        ],
    )


if __name__ == "__main__":
    main()
