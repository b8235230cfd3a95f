"""Sampling mode (temperature > 0), every drafting scheme and rule side by side: each learned
drafter drafts its children without replacement from the processed rows (verified by
traversal or RRS without replacement) or as top-k candidates (the deterministic rule), next to
n-gram, Lyanna and AR, all taking turns on each prompt (``run_methods``), at each temperature.

    python -m bench.sampling_modes [--temperatures 0.7,1.0] [--drafters eagle,sps,lyanna]

Decode-only speedups are against AR at the same temperature and seed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from bench.common import add_run_args, method_budget, print_table, set_threads
from bench.spec_bench import BenchSetup, run_methods
from lyanna.drafters import Drafter
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.lyanna import LyannaDrafter
from lyanna.drafters.sps import SpsDrafter
from lyanna.sampling import SamplingParams

# name -> (registry method whose budget it uses, sampled drafting?, rule at T > 0; None: the
# default of each tree's scheme, as Lyanna needs: a step that fuses a re-sampled subtree
# proposes a top-k union, verified by the deterministic rule)
VARIANTS = {
    "eagle wor/traversal": ("eagle", True, "traversal"),
    "eagle wor/rrs_wor": ("eagle", True, "rrs_wor"),
    "eagle topk/deterministic": ("eagle", False, "deterministic"),
    "sps wor/traversal": ("sps", True, "traversal"),
    "sps topk/deterministic": ("sps", False, "deterministic"),
    "lyanna wor/scheme default": ("lyanna", True, None),
    "lyanna topk/deterministic": ("lyanna", False, "deterministic"),
}
BUILDERS = {
    "eagle": EagleDrafter,
    "sps": SpsDrafter.from_checkpoint,
    "lyanna": LyannaDrafter.from_checkpoint,
}


def _scaled(drafter: Drafter, scale: float) -> Drafter:
    drafter.draft_temperature_scale = scale
    return drafter


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_args(parser, per_category=1, max_tokens=64)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--others", default="ngram", help="registry methods to add")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drafters", default="eagle,sps,lyanna", help="which VARIANTS to run")
    parser.add_argument(
        "--draft-temperature-scales",
        default="",
        help="also run each sampled variant with draft rows at these multiples of T: 0.8,1.25",
    )
    args = parser.parse_args()
    set_threads(args.threads)
    setup = BenchSetup.from_args(args)
    model = setup.model

    chosen = {n: v for n, v in VARIANTS.items() if v[0] in args.drafters.split(",")}
    factories: dict[str, Callable[[], Drafter]] = {}
    for name, (method, sampled, _) in chosen.items():
        budget = method_budget(args, method, model)
        build = BUILDERS[method]
        factories[name] = lambda b=build, budget=budget, s=sampled: b(
            model, budget=budget, sample_drafts=s
        )
    scales = [float(x) for x in args.draft_temperature_scales.split(",") if x]
    for name, (method, sampled, rule) in list(chosen.items()):
        for scale in scales if sampled else []:
            scaled = f"{name} x{scale:g}T"
            chosen[scaled] = (method, sampled, rule)
            factories[scaled] = lambda name=name, scale=scale: _scaled(factories[name](), scale)
    rules = {name: rule for name, (_, _, rule) in chosen.items() if rule is not None}
    others = [m for m in args.others.split(",") if m]
    rows = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        params = SamplingParams(temperature, max_tokens=args.max_tokens, seed=args.seed)
        results = run_methods(
            setup,
            [*chosen, *others],
            1,
            params,
            lambda method: method_budget(args, method, model),
            factories=factories,
            rules=rules,
        )
        for name, r in results.items():
            rows.append(
                [
                    temperature,
                    name,
                    r["tokens_per_s"],
                    r["decode_tokens_per_s"],
                    r["decode_speedup_vs_ar"],
                    r["tau"],
                    " / ".join(f"{c:.2f}" for c in r["cond_accept"][:3]),
                    f"{r['draft_share']:.2f}",
                ]
            )
    print(f"\nSpec-Bench: {setup.num_prompts} prompts, batch 1, max {args.max_tokens} tokens\n")
    print_table(
        [
            "T",
            "method",
            "tok/s e2e",
            "tok/s decode",
            "decode speedup",
            "tau",
            "cond. accept d1-d3",
            "draft share",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
