"""Where a draft step's time goes (the Lyanna paper's Figure 13): layer forward, LM head,
softmax, an info_copy drafter's read of the context, and the rest (sampling: top-k, tree
bookkeeping, pruning, fusion), per drafter.

    python -m bench.drafter_breakdown [--methods eagle,lyanna] [--limit-per-category 1]
        [--max-tokens 64] [--tree cost|fixed] [--depth D --top-k K --budget B] [--threads 1]

Each method first runs the prompts without a profiler (wall-clock draft ms per step), then
again under ``torch.profiler`` whose ``record_function`` scopes (``lyanna.drafters.scopes``)
split the draft time; the profiler's own overhead inflates the small-op share, so the split
is reported as shares of the profiled draft time and applied to the unprofiled wall clock.
Beside it: the weight bytes one draft depth reads (input projection, layer(s), hot LM head)
and the time that takes at the machine's measured streaming rate, the floor of a depth.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import add_run_args, describe_tree, method_budget, print_table, set_threads
from bench.engine_vs_peers import bandwidth
from bench.spec_bench import BenchSetup
from lyanna.drafters import DraftBudget, Drafter, make_drafter
from lyanna.drafters.scopes import COPY_SCOPE, LAYER_SCOPE, LM_HEAD_SCOPE, SOFTMAX_SCOPE
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.stats import SpecStats

SCOPES = (LAYER_SCOPE, LM_HEAD_SCOPE, SOFTMAX_SCOPE, COPY_SCOPE)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of every weight under ``module`` in its serving format (4-bit and Q8_0 packs
    with their scales, oneDNN-packed and plain weights)."""
    total = 0
    for sub in module.modules():
        for name in ("packed", "scales", "weight"):
            t = getattr(sub, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def depth_bytes(drafter: Drafter) -> int:
    """Weight bytes one draft depth reads: the drafter's network for one node (EAGLE-2's
    ``fc`` and layer, Lyanna's ``fc`` and layer, the SPS student's layers) and its hot head;
    0 for drafters without weights (n-gram)."""
    if hasattr(drafter, "head"):  # EAGLE-2
        parts = [drafter.head.fc, drafter.head.layer]
    elif hasattr(drafter, "draft"):  # Lyanna
        parts = [drafter.draft.fc, drafter.draft.layer]
    elif hasattr(drafter, "student"):  # SPS
        parts = list(drafter.student.layers)
    else:
        return 0
    return sum(module_bytes(m) for m in [*parts, drafter.lm_head])


def run(setup: BenchSetup, method: str, budget: DraftBudget, params: SamplingParams) -> SpecStats:
    # ungated: every step drafts, so the time per step is a draft step's (a gated step
    # drafts nothing and would dilute it)
    drafter = make_drafter(method, setup.model, budget, gate=False)
    stats = SpecStats()
    for i, prompt in enumerate(p for ps in setup.prompts.values() for p in ps):
        engine = SpecEngine(setup.model, drafter, EngineConfig(max_running=1, max_len=2048))
        engine.submit(Sequence(i, prompt, params, setup.eos))
        stats.merge(engine.run())
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="eagle,lyanna")
    add_run_args(parser, per_category=1, max_tokens=64)
    args = parser.parse_args()
    set_threads(args.threads)
    setup = BenchSetup.from_args(args)
    params = SamplingParams(max_tokens=args.max_tokens)
    rate = bandwidth()
    rows = []
    for method in args.methods.split(","):
        budget = method_budget(args, method, setup.model)
        run(setup, method, budget, SamplingParams(max_tokens=8))  # warm-up
        plain = run(setup, method, budget, params)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            profiled = run(setup, method, budget, params)
        by_name = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages()}
        scoped = [by_name.get(scope, 0.0) for scope in SCOPES]
        total = profiled.draft_seconds
        shares = [t / total for t in scoped] + [max(0.0, 1 - sum(scoped) / total)]
        per_step_ms = 1e3 * plain.draft_seconds / plain.num_steps
        nbytes = depth_bytes(make_drafter(method, setup.model, budget))
        rows.append(
            [
                method,
                per_step_ms,
                *[per_step_ms * s for s in shares],
                *[100 * s for s in shares],
                nbytes / 1e6,
                1e3 * nbytes / rate,
            ]
        )
    print(
        f"\nDraft step breakdown: {setup.num_prompts} prompts, batch 1, {describe_tree(args)}; "
        "ms per draft step (wall clock) split by profiler shares; weights one depth reads "
        f"and their floor at {rate / 1e9:.1f} GB/s\n"
    )
    print_table(
        [
            "method",
            "draft ms/step",
            "layer ms",
            "LM head ms",
            "softmax ms",
            "copy read ms",
            "sampling+tree ms",
            "layer %",
            "LM head %",
            "softmax %",
            "copy read %",
            "sampling+tree %",
            "weights MB/depth",
            "floor ms/depth",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
