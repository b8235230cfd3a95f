"""Statistical losslessness on the real model: at temperature 1, the law of the first few
emitted tokens under each speculative method against plain sampling (AR), from many seeded
runs of the same prompt. A two-sample chi-square test (cells with fewer than 5 expected draws
pooled) per method; a small p-value would mean the method changed the distribution.

    python -m bench.sampling_law [--runs 600] [--tokens 3] [--methods eagle,sps,lyanna,ngram]

The first token comes from the prefill (the same code for every method); the rest from
verifications of the methods' sampled trees. CI does not run this (minutes on a CPU).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from scipy.stats import chi2_contingency

from bench.common import print_table, set_threads
from lyanna.drafters import make_drafter, tree_budget
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.model.default import fetch_default_model
from lyanna.model.loader import load_model
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.tokenizer import chat_prompt_ids, load_tokenizer

PROMPT = "Count from 1 to 20, separated by commas."


def sample_prefixes(model, method: str, prompt: list[int], runs: int, tokens: int, batch: int):
    drafter = make_drafter(method, model, tree_budget(method, model))
    engine = SpecEngine(model, drafter, EngineConfig(max_running=batch, max_len=len(prompt) + 300))
    seqs = [
        Sequence(i, prompt, SamplingParams(1.0, max_tokens=tokens, seed=10_000 * i + 7))
        for i in range(runs)
    ]
    for seq in seqs:
        engine.submit(seq)
    start = time.perf_counter()
    stats = engine.run()
    seconds = time.perf_counter() - start
    return [tuple(s.output_ids) for s in seqs], stats, seconds


def laws(outputs: list[tuple[int, ...]]) -> dict[str, Counter]:
    """The joint law of the emitted tokens and the marginal law of each position after the
    first (positions decided by verifications), as counts."""
    found = {"joint": Counter(outputs)}
    for position in range(1, max(len(o) for o in outputs)):
        found[f"token {position + 1}"] = Counter(o[position] for o in outputs if len(o) > position)
    return found


def two_sample_pvalue(a: Counter, b: Counter) -> tuple[float, int]:
    """Chi-square test of homogeneity; cells with < 5 expected draws in either row pooled."""
    total_a, total_b = sum(a.values()), sum(b.values())
    keep, pooled_a, pooled_b = [], 0, 0
    for key in set(a) | set(b):
        both = a[key] + b[key]
        if min(both * total_a, both * total_b) / (total_a + total_b) >= 5:
            keep.append(key)
        else:
            pooled_a, pooled_b = pooled_a + a[key], pooled_b + b[key]
    table = [[a[k] for k in keep] + [pooled_a], [b[k] for k in keep] + [pooled_b]]
    if pooled_a + pooled_b == 0:
        table = [row[:-1] for row in table]
    return float(chi2_contingency(table).pvalue), len(table[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", default="eagle,sps,lyanna,ngram")
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--tokens", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="(at 16 trees may cost too much)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    set_threads(args.threads)
    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    outputs, _, ar_seconds = sample_prefixes(
        model, "ar", prompt, args.runs, args.tokens, args.batch
    )
    reference = laws(outputs)
    tests = list(reference)
    rows = [["ar", *["-"] * len(tests), 1.0, "-", "-", f"{ar_seconds:.0f}"]]
    for method in args.methods.split(","):
        outputs, stats, seconds = sample_prefixes(
            model, method, prompt, args.runs, args.tokens, args.batch
        )
        found = laws(outputs)
        results = [two_sample_pvalue(reference[t], found[t]) for t in tests]
        rows.append(
            [
                method,
                *[f"{p:.3f} ({cells})" for p, cells in results],
                stats.acceptance_length,
                stats.num_drafted,
                stats.num_accepted,
                f"{seconds:.0f}",
            ]
        )
        print(f"  {method}: p = {[round(p, 3) for p, _ in results]}", flush=True)
    print(
        f"\nT = 1, {args.runs} seeded runs per method, first {args.tokens} tokens of "
        f"{args.prompt!r}\n"
    )
    headers = [f"p vs AR: {t} (cells)" for t in tests]
    print_table(["method", *headers, "tau", "drafted", "accepted", "seconds"], rows)


if __name__ == "__main__":
    main()
