"""Helpers shared by the benchmark scripts: Spec-Bench prompts, medians, tables."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from lyanna.drafters import TREE_MODES, DraftBudget, default_budget, tree_budget
from lyanna.model.device import add_placement_args
from lyanna.model.loader import WEIGHT_FORMATS
from lyanna.tokenizer import chat_prompt_ids

SPEC_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "eval" / "spec_bench.jsonl"


HELD_OUT = Path("heldout")  # --questions heldout: the training prompts' held-out split


def _jsonl(path: Path) -> Iterator[dict]:
    with path.open() as f:
        yield from map(json.loads, f)


def held_out_rows() -> Iterator[dict]:
    """Held-out training prompts (``training.distill.is_held_out``: no drafter trains on
    them) as Spec-Bench-style rows of one category, in file order."""
    from training.distill import TRAIN_PROMPTS, is_held_out

    for record in _jsonl(TRAIN_PROMPTS):
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        if is_held_out(record["id"]) and users:
            yield {"category": "heldout", "turns": users[:1]}


def load_questions(path: Path = SPEC_BENCH, per_category: int | None = 1) -> list[dict]:
    """The first ``per_category`` questions of each category (all when None), in file order;
    ``HELD_OUT`` reads the held-out split of the training prompts instead."""
    counts: dict[str, int] = {}
    picked = []
    for row in held_out_rows() if path == HELD_OUT else _jsonl(path):
        seen = counts.get(row["category"], 0)
        if per_category is None or seen < per_category:
            counts[row["category"]] = seen + 1
            picked.append(row)
    return picked


def question_prompt(tokenizer, question: dict) -> list[int]:
    """A Spec-Bench question's first turn as chat-formatted prompt ids."""
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": question["turns"][0]}])


def median_seconds(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    """A GitHub-markdown table on stdout."""
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in row) + " |")


def add_run_args(parser: argparse.ArgumentParser, per_category: int, max_tokens: int) -> None:
    """The flags every Spec-Bench-driven script shares: prompts, tree budget, threads."""
    parser.add_argument("--limit-per-category", type=int, default=per_category)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    shape = "default: the method's measured default (lyanna.drafters.DEFAULT_BUDGETS)"
    parser.add_argument("--depth", type=int, help=shape)
    parser.add_argument("--top-k", type=int, help=shape)
    parser.add_argument("--budget", type=int, help="draft nodes per tree (a cap); " + shape)
    parser.add_argument(
        "--tree",
        choices=TREE_MODES,
        default="cost",
        help="cost: keep the nodes that pay for their verification (the target's measured "
        "cost curve); fixed: always --budget nodes",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto", help="target weights")
    add_placement_args(parser)  # --device / --dtype (e.g. --device cuda --dtype bf16)


def method_budget(args: argparse.Namespace, method: str, model) -> DraftBudget:
    """The tree budget of ``add_run_args``' flags for ``method``: its measured default with
    the flags given applied on top (and the target's cost curve for --tree cost)."""
    base = default_budget(method, model)
    given = {"depth": args.depth, "top_k": args.top_k, "max_tokens": args.budget}
    explicit = replace(base, **{k: v for k, v in given.items() if v is not None})
    return tree_budget(method, model, args.tree, explicit)


def describe_tree(args: argparse.Namespace) -> str:
    given = {"depth": args.depth, "top-k": args.top_k, "budget": args.budget}
    shape = ", ".join(f"{k} {v}" for k, v in given.items() if v is not None)
    return f"{args.tree} trees" + (f", {shape}" if shape else ", per-method default shapes")


def set_threads(threads: int) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)
