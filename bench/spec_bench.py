"""Spec-Bench runner: every method through the same engine, side by side, on the same prompts.

    python -m bench.spec_bench --methods all --limit-per-category 4 [--batch-size 1]
        [--temperature 0] [--max-tokens 128] [--tree cost|fixed] [--depth D --top-k K --budget B]
        [--gate on|off|both]
        [--questions PATH] [--json results.json]

Prints, per method and per category: end-to-end tokens/s (prefill included), decode-only
tokens/s (prefill excluded), speedup over AR measured in this run, acceptance length tau,
conditional acceptance per depth, draft/verify time shares, and at temperature 0 how many
prompts differ from AR's output (must be 0).

The JSON also has, per method, ``learned_step_share``: of the steps that drafted anything
(a gated learned drafter's own steps and its free fallback's), the share the method itself
proposed (1.0 for a method without a gate; None for AR), and ``cond_accept_by_source``: the
conditional acceptance per depth of the method's own steps (``method``) and its fallback's
(``fallback``) apart (``lyanna.drafters.gate.DRAFT_SOURCES``; ``plain`` steps draft nothing).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from bench.common import (
    SPEC_BENCH,
    add_run_args,
    describe_tree,
    load_questions,
    method_budget,
    print_table,
    question_prompt,
    set_threads,
)
from lyanna.drafters import (
    DRAFTERS,
    MODEL_FREE_METHODS,
    TARGET_ONLY,
    DraftBudget,
    Drafter,
    make_drafter,
)
from lyanna.drafters.gate import DRAFT_SOURCES
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.model.device import placement
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.serving_model import load
from lyanna.stats import SpecStats


@dataclass(slots=True)
class Tally:
    """Totals of one method over a set of prompts."""

    output_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    resampled_accepted: int = 0  # tokens accepted from re-sampled subtrees (Lyanna)
    stats: SpecStats = field(default_factory=SpecStats)
    # the verifications of each step source (``DRAFT_SOURCES``: method, fallback, plain)
    by_source: dict[str, SpecStats] = field(default_factory=dict)

    def add(self, other: Tally) -> None:
        self.output_tokens += other.output_tokens
        self.resampled_accepted += other.resampled_accepted
        self.seconds += other.seconds
        self.prefill_seconds += other.prefill_seconds
        self.stats.merge(other.stats)
        for source, stats in other.by_source.items():
            self.by_source.setdefault(source, SpecStats()).merge(stats)

    def steps_of(self, source: str) -> int:
        stats = self.by_source.get(source)
        return stats.num_steps if stats else 0

    @property
    def learned_step_share(self) -> float:
        """Of the drafted steps (the method's own and its fallback's), the method's share."""
        own, fallback = self.steps_of("method"), self.steps_of("fallback")
        return own / (own + fallback) if own + fallback else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return self.output_tokens / decode if decode > 0 else 0.0

    def summary(self, ar: Tally | None) -> dict:
        spent = max(self.stats.draft_seconds + self.stats.verify_seconds, 1e-9)
        return {
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "speedup_vs_ar": self.tokens_per_s / ar.tokens_per_s if ar else None,
            "decode_speedup_vs_ar": self.decode_tokens_per_s / ar.decode_tokens_per_s
            if ar
            else None,
            "tau": self.stats.acceptance_length,
            "cond_accept": self.stats.conditional_acceptance,
            "learned_step_share": self.learned_step_share,
            "steps_by_source": {src: self.steps_of(src) for src in DRAFT_SOURCES},
            "cond_accept_by_source": {
                src: self.by_source[src].conditional_acceptance
                for src in ("method", "fallback")
                if src in self.by_source
            },
            "resampled_share": self.resampled_accepted / self.output_tokens
            if self.output_tokens
            else 0.0,
            "draft_share": self.stats.draft_seconds / spent,
            "verify_share": self.stats.verify_seconds / spent,
            "output_tokens": self.output_tokens,
        }


def run_batch(
    engine_factory, prompts: list[list[int]], params: SamplingParams, eos
) -> tuple[Tally, list[list[int]]]:
    engine = engine_factory()
    seqs = [Sequence(i, p, params, eos) for i, p in enumerate(prompts)]
    by_source: dict[str, SpecStats] = {}
    start = time.perf_counter()
    for seq in seqs:
        engine.submit(seq)
    while engine.has_work:  # engine.run(), keeping what drafted each verified step
        for item in engine.step():
            if item.verdict is not None:
                by_source.setdefault(item.source, SpecStats()).record(item.verdict)
    stats = engine.stats
    seconds = time.perf_counter() - start
    tally = Tally(sum(len(s.output_ids) for s in seqs), seconds, stats.prefill_seconds)
    tally.stats = stats
    tally.by_source = by_source
    tally.resampled_accepted = stats.num_resampled_accepted
    return tally, [s.output_ids for s in seqs]


@dataclass(frozen=True, slots=True)
class BenchSetup:
    """The target, its tokenizer and the chat-formatted prompts by Spec-Bench category."""

    model: Transformer
    eos: frozenset[int]
    prompts: dict[str, list[list[int]]]

    @classmethod
    def load(
        cls,
        questions: Path = SPEC_BENCH,
        per_category: int | None = 4,
        weights: str = "auto",
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> BenchSetup:
        loaded = load(None, weights, device, dtype)
        by_category: dict[str, list[list[int]]] = defaultdict(list)
        for q in load_questions(questions, per_category):
            by_category[q["category"]].append(question_prompt(loaded.tokenizer, q))
        return cls(loaded.model, loaded.eos_token_ids, dict(by_category))

    @classmethod
    def from_args(cls, args: argparse.Namespace, questions: Path = SPEC_BENCH) -> BenchSetup:
        """The setup ``bench.common.add_run_args``' flags ask for (prompts, weights, device)."""
        device, dtype = placement(args)
        return cls.load(questions, args.limit_per_category, args.weights, device, dtype)

    @property
    def num_prompts(self) -> int:
        return sum(len(p) for p in self.prompts.values())


MIXED = "all (mixed categories)"
TREE_ROWS = 256  # KV rows beyond prompt + output: the largest tree, a fused subtree, margin


@dataclass(slots=True)
class ArReference:
    """AR's outputs and tallies per category: what speedups and mismatches compare against."""

    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    tallies: dict[str, Tally] = field(default_factory=dict)


def run_methods(
    setup: BenchSetup,
    methods: list[str],
    batch_size: int,
    params: SamplingParams,
    budget_of: Callable[[str], DraftBudget],
    log: bool = True,
    factories: Mapping[str, Callable[[], Drafter]] | None = None,
    reference: ArReference | None = None,
    rules: Mapping[str, str] | None = None,
) -> dict[str, dict]:
    """Every method over every prompt, the methods taking turns on each batch. AR runs
    first on each (speedups and mismatches are against it) unless a filled ``reference``
    from an earlier run with the same batch size is given; an empty ``reference`` is filled.
    ``budget_of(method)`` gives a registry method's tree budget; ``factories`` builds
    drafters the registry does not name (e.g. ablation checkpoints); ``rules`` a method's
    acceptance rule at temperature > 0 (default: its trees' scheme default)."""
    factories = factories or {}
    reference = reference if reference is not None else ArReference()
    methods = [m for m in dict.fromkeys(methods) if m != TARGET_ONLY]
    if not reference.tallies:
        methods = [TARGET_ONLY, *methods]
    ar_outputs, ar_tallies = reference.outputs, reference.tallies
    longest = max(len(p) for ps in setup.prompts.values() for p in ps)
    config = EngineConfig(max_running=batch_size, max_len=longest + params.max_tokens + TREE_ROWS)
    warmup_prompt = next(iter(setup.prompts.values()))[0]
    groups = setup.prompts  # batches form within a category, unless one is too small to fill
    if any(len(prompts) < batch_size for prompts in groups.values()):
        groups = {MIXED: [p for prompts in setup.prompts.values() for p in prompts]}
    engines = {}
    for method in methods:
        drafter = (
            factories[method]()
            if method in factories
            else make_drafter(method, setup.model, budget_of(method))
        )
        method_config = replace(config, rule=(rules or {}).get(method))
        engines[method] = lambda d=drafter, c=method_config: SpecEngine(setup.model, d, c)
        run_batch(engines[method], [warmup_prompt], SamplingParams(max_tokens=16), setup.eos)
    overall = {m: Tally() for m in methods}
    per_cat: dict[str, dict] = {m: {} for m in methods}
    mismatches = dict.fromkeys(methods, 0)
    for category, prompts in groups.items():
        tallies = {m: Tally() for m in methods}
        outputs: dict[str, list[list[int]]] = {m: [] for m in methods}
        for i in range(0, len(prompts), batch_size):
            # the methods take turns on every batch, so a burst of load on a shared machine
            # slows them alike and the ratios hold
            for method in methods:
                part, outs = run_batch(
                    engines[method], prompts[i : i + batch_size], params, setup.eos
                )
                tallies[method].add(part)
                outputs[method] += outs
        if TARGET_ONLY in methods:
            ar_outputs[category], ar_tallies[category] = outputs[TARGET_ONLY], tallies[TARGET_ONLY]
        for method in methods:
            tally = tallies[method]
            if method != TARGET_ONLY and params.greedy:
                mismatches[method] += sum(
                    a != b for a, b in zip(outputs[method], ar_outputs[category], strict=True)
                )
            per_cat[method][category] = tally.summary(ar_tallies.get(category))
            overall[method].add(tally)
            if log:
                print(
                    f"  {method:8s} {category:24s} {tally.tokens_per_s:6.2f} tok/s"
                    f"  tau {tally.stats.acceptance_length:.2f}",
                    flush=True,
                )
    ar_overall = Tally()
    for t in ar_tallies.values():
        ar_overall.add(t)
    results: dict[str, dict] = {}
    for method in methods:
        results[method] = {
            "overall": overall[method].summary(ar_overall),
            "categories": per_cat[method],
            "greedy_mismatches": mismatches[method] if params.greedy else None,
        }
        results[method].update(results[method]["overall"])
        if method == TARGET_ONLY:  # plain decoding drafts nothing: no share to speak of
            for summary in (results[method], results[method]["overall"], *per_cat[method].values()):
                summary["learned_step_share"] = None
    return results


def print_results(results: dict[str, dict]) -> None:
    print_table(
        [
            "method",
            "tok/s e2e",
            "speedup",
            "tok/s decode",
            "decode speedup",
            "tau",
            "cond. accept d1-d3",
            "draft/verify share",
            "learned share",
            "greedy mismatches",
        ],
        [
            [
                m,
                r["tokens_per_s"],
                r["speedup_vs_ar"],
                r["decode_tokens_per_s"],
                r["decode_speedup_vs_ar"],
                r["tau"],
                " / ".join(f"{c:.2f}" for c in r["cond_accept"][:3]),
                f"{r['draft_share']:.2f} / {r['verify_share']:.2f}",
                r["learned_step_share"],
                r["greedy_mismatches"],
            ]
            for m, r in results.items()
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", action="append", dest="methods", help="repeatable")
    parser.add_argument("--methods", dest="methods_csv", help="comma list or 'all'")
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH)
    add_run_args(parser, per_category=4, max_tokens=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gate",
        choices=("on", "off", "both"),
        default="on",
        help="per-sequence draft gate (cost trees only); both: each method also as <m>-ungated",
    )
    parser.add_argument(
        "--fallback",
        choices=("on", "off", "both"),
        default="on",
        help="gated-off steps of learned drafters draft n-gram (on) or nothing (off); "
        "both: each learned method also as <m>-nofallback",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    set_threads(args.threads)

    methods = list(args.methods or [])
    if args.methods_csv:
        methods += list(DRAFTERS) if args.methods_csv == "all" else args.methods_csv.split(",")
    setup = BenchSetup.from_args(args, args.questions)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    methods = methods or ["ngram"]

    def budget_of(method: str) -> DraftBudget:
        return method_budget(args, method, setup.model)

    factories: dict[str, Callable[[], Drafter]] = {}
    if args.fallback != "on":
        for m in [m for m in methods if m not in MODEL_FREE_METHODS]:
            name = m if args.fallback == "off" else f"{m}-nofallback"
            factories[name] = lambda m=m: make_drafter(
                m, setup.model, budget_of(m), free_fallback=False
            )
            if args.fallback == "both":
                methods.insert(methods.index(m) + 1, name)
    if args.gate != "on":
        for m in [m for m in methods if m != TARGET_ONLY]:
            name = m if args.gate == "off" else f"{m}-ungated"
            factories[name] = lambda m=m: make_drafter(m, setup.model, budget_of(m), gate=False)
            if args.gate == "both":
                methods.insert(methods.index(m) + 1, name)
    results = run_methods(setup, methods, args.batch_size, params, budget_of, factories=factories)
    print(
        f"\nSpec-Bench: {setup.num_prompts} prompts, batch {args.batch_size}, "
        f"T={args.temperature}, max {args.max_tokens} tokens, {describe_tree(args)}\n"
    )
    print_results(results)
    categories = list(next(iter(results.values()))["categories"])
    print("\nSpeedup (end-to-end) per category:\n")
    print_table(
        ["method", *categories],
        [
            [m, *[r["categories"][c]["speedup_vs_ar"] for c in categories]]
            for m, r in results.items()
        ],
    )
    if any(r["resampled_share"] for r in results.values()):
        print("\nShare of emitted tokens accepted from re-sampled subtrees:\n")
        print_table(
            ["method", "resampled share"],
            [[m, r["resampled_share"]] for m, r in results.items() if m.startswith("lyanna")],
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "methods": results}, indent=2
            )
        )


if __name__ == "__main__":
    main()
