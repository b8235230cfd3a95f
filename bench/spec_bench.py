"""Spec-Bench runner: every method through the same engine, side by side, on the same prompts.

    python -m bench.spec_bench --methods all --limit-per-category 4 [--batch-size 1]
        [--temperature 0] [--max-tokens 128] [--depth 5 --top-k 4 --budget 16]
        [--questions PATH] [--json results.json]

Prints, per method and per category: end-to-end tokens/s (prefill included), decode-only
tokens/s (prefill excluded), speedup over AR measured in this run, acceptance length tau,
conditional acceptance per depth, draft/verify time shares, and at temperature 0 how many
prompts differ from AR's output (must be 0).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import SPEC_BENCH, load_questions, print_table
from lyanna.drafters import DRAFTERS, DraftBudget, make_drafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.model import fetch_default_model, load_model
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.stats import SpecStats
from lyanna.tokenizer import chat_prompt_ids, load_tokenizer


@dataclass(slots=True)
class Tally:
    """Totals of one method over a set of prompts."""

    output_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)

    def add(self, other: Tally) -> None:
        self.output_tokens += other.output_tokens
        self.seconds += other.seconds
        self.prefill_seconds += other.prefill_seconds
        self.stats.merge(other.stats)

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
            "draft_share": self.stats.draft_seconds / spent,
            "verify_share": self.stats.verify_seconds / spent,
            "output_tokens": self.output_tokens,
        }


def run_batch(
    engine_factory, prompts: list[list[int]], params: SamplingParams, eos
) -> tuple[Tally, list[list[int]]]:
    engine = engine_factory()
    seqs = [Sequence(i, p, params, eos) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for seq in seqs:
        engine.submit(seq)
    stats = engine.run()
    seconds = time.perf_counter() - start
    tally = Tally(sum(len(s.output_ids) for s in seqs), seconds, stats.prefill_seconds, stats)
    return tally, [s.output_ids for s in seqs]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", action="append", dest="methods", help="repeatable")
    parser.add_argument("--methods", dest="methods_csv", help="comma list or 'all'")
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH)
    parser.add_argument("--limit-per-category", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    methods = list(args.methods or [])
    if args.methods_csv:
        methods += list(DRAFTERS) if args.methods_csv == "all" else args.methods_csv.split(",")
    methods = ["ar"] + [m for m in dict.fromkeys(methods or ["ngram"]) if m != "ar"]
    model_dir = fetch_default_model()
    model = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    eos = frozenset({tokenizer.eos_token_id})
    budget = DraftBudget(depth=args.depth, top_k=args.top_k, max_tokens=args.budget)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    questions = load_questions(args.questions, args.limit_per_category)
    by_category: dict[str, list[list[int]]] = defaultdict(list)
    for q in questions:
        by_category[q["category"]].append(
            chat_prompt_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}])
        )
    longest = max(len(p) for ps in by_category.values() for p in ps)
    config = EngineConfig(
        max_batch=args.batch_size, max_len=longest + args.max_tokens + 2 * args.budget + 64
    )

    results: dict[str, dict] = {}
    ar_outputs: dict[str, list[list[int]]] = {}
    ar_tallies: dict[str, Tally] = {}
    for method in methods:
        drafter = make_drafter(method, model, budget)
        factory = lambda d=drafter: SpecEngine(model, d, config)  # noqa: E731
        run_batch(
            factory, [by_category[next(iter(by_category))][0]], params.__class__(max_tokens=16), eos
        )  # warm-up
        overall, per_cat, mismatches = Tally(), {}, 0
        for category, prompts in by_category.items():
            tally = Tally()
            outputs: list[list[int]] = []
            for i in range(0, len(prompts), args.batch_size):
                part, outs = run_batch(factory, prompts[i : i + args.batch_size], params, eos)
                tally.add(part)
                outputs += outs
            if method == "ar":
                ar_outputs[category], ar_tallies[category] = outputs, tally
            elif params.greedy:
                mismatches += sum(
                    a != b for a, b in zip(outputs, ar_outputs[category], strict=True)
                )
            per_cat[category] = tally.summary(ar_tallies.get(category))
            overall.add(tally)
            print(
                f"  {method:8s} {category:24s} {tally.tokens_per_s:6.2f} tok/s"
                f"  tau {tally.stats.acceptance_length:.2f}",
                flush=True,
            )
        ar_overall = Tally()
        for t in ar_tallies.values():
            ar_overall.add(t)
        results[method] = {
            "overall": overall.summary(ar_overall),
            "categories": per_cat,
            "greedy_mismatches": mismatches if params.greedy else None,
        }
        results[method].update(results[method]["overall"])

    print(
        f"\nSpec-Bench: {len(questions)} prompts, batch {args.batch_size}, T={args.temperature}, "
        f"max {args.max_tokens} tokens, tree depth {args.depth} top-k {args.top_k} "
        f"budget {args.budget}\n"
    )
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
                r["greedy_mismatches"],
            ]
            for m, r in results.items()
        ],
    )
    categories = list(by_category)
    print("\nSpeedup (end-to-end) per category:\n")
    print_table(
        ["method", *categories],
        [
            [m, *[r["categories"][c]["speedup_vs_ar"] for c in categories]]
            for m, r in results.items()
        ],
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "methods": results}, indent=2
            )
        )


if __name__ == "__main__":
    main()
