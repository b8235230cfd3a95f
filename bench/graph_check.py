"""Proof on a CPU that the target's step is ready to be captured as CUDA graphs.

Runs two ``TargetRunner``s on one random-weight model side by side for ``--steps`` greedy
verifications of random token trees: one verifies through the eager forward, the other through
``lyanna.model.static_step`` with every bucket's step traced by
``torch.compile(backend="eager", fullgraph=True)``: any host sync, data-dependent shape or
Python branch on a tensor inside the step is a graph break, and fullgraph turns it into an
error. Sequences of random prompt lengths finish and are replaced, batches are random subsets
of the running ones and trees have random shapes, so the steps cross batch, row and context
(KV) buckets. Prints one line per bucket, then

    graph-ready: N buckets, 0 graph breaks, 0 recompiles
    traced = eager: S steps, V verdicts, 0 mismatches

and exits 1 on any break, recompile (a bucket compiled twice) or mismatch.

    python -m bench.graph_check [--steps 200] [--seed 0] [--shape tiny|default]
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from bench.common import print_table
from bench.random_weights import SHAPES, random_model
from lyanna.model.static_step import StaticStep, StepFunction
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.target import TargetConfig, TargetRunner
from lyanna.tree import DraftScheme, TokenTree


def traced(fn: StepFunction) -> StepFunction:
    return torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)


@dataclass(slots=True)
class CheckResult:
    buckets: list[tuple[int, int, int]]
    graph_breaks: int
    recompiles: int
    steps: int
    verdicts: int
    mismatches: int
    first_break: str | None = None

    @property
    def ok(self) -> bool:
        return self.graph_breaks == 0 and self.recompiles == 0 and self.mismatches == 0


def random_tree(rng: random.Random, root: int, vocab: int, max_nodes: int) -> TokenTree:
    """A random top-k-shaped tree under ``root``: up to ``max_nodes`` nodes, depth <= 6."""
    n = rng.choice([1, 1, 2, 3, 5, 8, 13, 24, max_nodes])
    tokens, parents, depths = [root], [-1], [0]
    while len(tokens) < n:
        parent = rng.randrange(len(tokens))
        if depths[parent] >= 6:
            continue
        tokens.append(rng.randrange(vocab))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return TokenTree.from_parents(tokens, parents, scheme=DraftScheme.TOPK)


def check(
    model: Transformer, steps: int = 200, seed: int = 0, max_running: int = 8, max_len: int = 600
) -> CheckResult:
    """Run both runners through ``steps`` verifications and compare every verdict."""
    import torch._dynamo

    torch._dynamo.reset()
    counters.clear()
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else None
    setattr(torch._dynamo.config, limit or "cache_size_limit", 1024)  # buckets share one code
    config = dict(max_running=max_running, max_len=max_len)
    eager = TargetRunner(model, TargetConfig(**config, static_step=False))
    static = TargetRunner(model, TargetConfig(**config, static_step=True))
    static.static_step = StaticStep(model, static.cache, capture=False, wrap=traced)
    runners = (eager, static)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_len)
    running: dict[int, int] = {}  # seq id -> tokens it may still take
    next_id = verdicts = mismatches = 0
    first_break = None
    for _ in range(steps):
        while not running or (len(running) < max_running and rng.random() < 0.7):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 160))]
            firsts = {r.prefill(next_id, prompt, params).first_token for r in runners}
            mismatches += len(firsts) - 1
            running[next_id] = max_len - len(prompt) - 1
            next_id += 1
        batch = rng.sample(sorted(running), rng.randint(1, len(running)))
        trees = [
            random_tree(rng, eager.next_token(s), vocab, min(48, running[s] - 1)) for s in batch
        ]
        try:
            results = [r.verify(batch, trees) for r in runners]
        except Exception as err:  # a graph break under fullgraph, named below
            first_break = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            break
        for seq, a, b in zip(batch, *results, strict=True):
            verdicts += 1
            same = a.verdict.tokens == b.verdict.tokens and a.num_committed == b.num_committed
            mismatches += not same
            running[seq] -= len(a.verdict.tokens)
            if running[seq] < 50 or rng.random() < 0.03:
                del running[seq]
                for r in runners:
                    r.release(seq)
    keys = static.static_step.keys_seen
    breaks = sum(counters["graph_break"].values()) + (first_break is not None)
    compiled = counters["stats"]["unique_graphs"]
    return CheckResult(
        buckets=[(k.batch, k.rows, k.kv_len) for k in keys],
        graph_breaks=breaks,
        recompiles=max(0, compiled - len(keys)),
        steps=steps,
        verdicts=verdicts,
        mismatches=mismatches,
        first_break=first_break,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = parser.parse_args(argv)
    model = random_model(args.shape, args.seed)
    result = check(model, args.steps, args.seed)
    rows = sorted(result.buckets)
    print_table(["batch", "rows", "kv_len"], [list(r) for r in rows])
    if result.first_break:
        print(f"first break: {result.first_break}")
    print(
        f"graph-ready: {len(rows)} buckets, {result.graph_breaks} graph breaks, "
        f"{result.recompiles} recompiles"
    )
    print(
        f"traced = eager: {result.steps} steps, {result.verdicts} verdicts, "
        f"{result.mismatches} mismatches"
    )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
