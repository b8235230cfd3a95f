"""The Lyanna paper's Table 1 on this CPU: conditional acceptance rate at draft steps 1-3 (and
tau) of Lyanna, Lyanna without token info and Lyanna without first-token fusion, each a
separately trained checkpoint (same data, same steps), plus the full checkpoint with its token
info switched off at inference only.

    python -m bench.lyanna_ablations --checkpoint full=PATH --checkpoint no-info=PATH
        --checkpoint no-first-token=PATH [--limit-per-category 1] [--max-tokens 64]

Checkpoints come from ``python -m training.train --model lyanna`` (``--token-info false``,
``--fuse-first-token false``); their held-out top-1 per step (from the manifest) is printed
beside the measured acceptance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import add_run_args, describe_tree, method_budget, print_table, set_threads
from bench.spec_bench import BenchSetup, run_methods
from lyanna.drafters import default_budget
from lyanna.drafters.lyanna import LyannaDrafter
from lyanna.sampling import SamplingParams


def held_out_top1(path: Path) -> list[float]:
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return []
    val = json.loads(manifest.read_text()).get("metrics", {}).get("val", {})
    return [val[f"top1_{i}"] for i in range(1, 4) if f"top1_{i}" in val]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", action="append", required=True, help="name=PATH")
    add_run_args(parser, per_category=1, max_tokens=64)
    args = parser.parse_args()
    set_threads(args.threads)
    checkpoints = dict(item.split("=", 1) for item in args.checkpoint)
    setup = BenchSetup.from_args(args)
    budget = method_budget(args, "lyanna", setup.model)

    def factory(path: str, token_info: bool = True):
        def build() -> LyannaDrafter:
            drafter = LyannaDrafter.from_checkpoint(setup.model, Path(path), budget=budget)
            if not token_info:
                drafter.drop_token_info()
            return drafter

        return build

    factories = {name: factory(path) for name, path in checkpoints.items()}
    first_name, first_path = next(iter(checkpoints.items()))
    factories[f"{first_name} (token info off at inference)"] = factory(first_path, False)
    params = SamplingParams(max_tokens=args.max_tokens)
    results = run_methods(setup, list(factories), 1, params, default_budget, factories=factories)
    print(
        f"\nTable 1: {setup.num_prompts} Spec-Bench prompts, batch 1, greedy, "
        f"{describe_tree(args)}\n"
    )
    rows = []
    for name, r in results.items():
        if name == "ar":
            continue
        cond = (r["cond_accept"] + [0.0] * 3)[:3]
        top1 = held_out_top1(Path(checkpoints.get(name, ""))) if name in checkpoints else []
        rows.append(
            [
                name,
                *cond,
                r["tau"],
                " / ".join(f"{t:.3f}" for t in top1) or "-",
                r["greedy_mismatches"],
            ]
        )
    print_table(
        [
            "variant",
            "cond. accept d1",
            "d2",
            "d3",
            "tau",
            "held-out top-1 s1/s2/s3",
            "greedy mismatches",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
