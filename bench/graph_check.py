"""Proof on a CPU that the target's step and the learned drafters' steps are ready to be
captured as CUDA graphs.

Target: runs two ``TargetRunner``s on one random-weight model side by side for ``--steps``
greedy verifications of random token trees: one verifies through the eager forward, the other
through ``lyanna.model.static_step`` with every bucket's step traced by
``torch.compile(backend="eager", fullgraph=True)``: any host sync, data-dependent shape or
Python branch on a tensor inside the step is a graph break, and fullgraph turns it into an
error. Sequences of random prompt lengths finish and are replaced, batches are random subsets
of the running ones and trees have random shapes, so the steps cross batch, row and context
(KV) buckets.

Drafters: EAGLE-2 and Lyanna, random weights next to the same target, each as two drafters
in lockstep over ``--steps`` engine steps (random prompts, batches and releases as above; the
target verifies the first drafter's trees and both learn the same verifications): one runs
its device steps (``lyanna.drafters.static_draft``) eagerly, the other traced per bucket as
above. Their trees must be equal token for token. Each drafter runs twice: top-3 trees of
depth 4, and top-1 chains of depth 3 (the path a 4-bit CPU target's budgets take).

Prints one line per bucket (target, then each drafter's), then

    graph-ready: N buckets, 0 graph breaks, 0 recompiles
    traced = eager: S steps, V verdicts, 0 mismatches
    <drafter> top-<k> traced = eager: S steps, T trees, 0 mismatches

and exits 1 on any break (naming the first), recompile (a bucket compiled twice) or mismatch.

    python -m bench.graph_check [--steps 200] [--seed 0] [--shape tiny|default]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from bench.common import print_table
from bench.random_weights import SHAPES, random_model
from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.eagle_head import EagleConfig, EagleHead
from lyanna.drafters.lyanna import LyannaDrafter
from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
from lyanna.drafters.static_draft import eagle_steps, lyanna_steps
from lyanna.model.static_step import StaticStep, StepFunction
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.target import TargetConfig, TargetRunner
from lyanna.tree import DraftScheme, TokenTree


def traced(fn: StepFunction) -> StepFunction:
    return torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)


@dataclass(slots=True)
class CheckResult:
    buckets: list[tuple[int, ...]]
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
    with one_thread():
        return _check(model, steps, seed, max_running, max_len)


def _check(
    model: Transformer, steps: int, seed: int, max_running: int, max_len: int
) -> CheckResult:
    _fresh_dynamo()
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


@contextlib.contextmanager
def one_thread():
    """One intra-op thread for the check: its tiny steps gain nothing from more, and on a
    shared host whose cores are busy every product waits for the slowest thread (40x slower
    measured at a load of 8 on 2 cores). Both sides of every comparison run alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fresh_dynamo() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    counters.clear()
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else None
    setattr(torch._dynamo.config, limit or "cache_size_limit", 1024)  # buckets share one code


DRAFTERS = ("eagle", "lyanna")
DRAFT_BUDGET = DraftBudget(depth=4, top_k=3, max_tokens=16)  # trees
CHAIN_BUDGET = DraftBudget(depth=3, top_k=1, max_tokens=3)  # chains (a 4-bit CPU's top-1 path)


def random_drafter(
    method: str,
    model: Transformer,
    seed: int,
    budget: DraftBudget = DRAFT_BUDGET,
    max_running: int = 4,
    max_len: int = 400,
    feed_residual: bool = False,
    info_gate: bool = False,
    info_copy: bool = False,
    **flags,
):
    """An EAGLE-2 or Lyanna drafter with random weights (the same for the same seed) next to
    ``model``, on the device-generic path a GPU runs (``flags``: e.g. ``generic=False`` for
    the CPU fast paths, ``device_steps=False`` for the host-built trees; ``feed_residual``:
    Lyanna's chain feeds itself the layer's raw output; ``info_gate``, ``info_copy``: its
    per-chain token info, with weights off their start so that they change the trees)."""
    torch.manual_seed(seed)
    config = model.config
    hot = torch.randperm(config.vocab_size)[: max(16, config.vocab_size // 2)]
    flags = dict(generic=True) | flags
    kwargs = dict(budget=budget, max_running=max_running, max_len=max_len, **flags)
    if method == "eagle":
        head = EagleHead(EagleConfig.for_target(config, hot.numel()))
        head.hot_vocab.copy_(hot)
        return EagleDrafter(model, head, **kwargs)
    draft_config = LyannaDraftConfig(config, num_hot=hot.numel(), info_rank=16,
                                     feed_residual=feed_residual, info_gate=info_gate,
                                     info_copy=info_copy, copy_dim=16)  # fmt: skip
    draft = LyannaDraftModel(draft_config, model.embed_tokens.weight, hot)
    with torch.no_grad():
        draft.w2.normal_(0.0, 0.5)  # a token-info table that changes the trees
        if info_gate:
            draft.info_gate.weight.normal_(0.0, 0.3)
        if info_copy:
            draft.copy.state_query.normal_(0.0, 0.3)
            draft.copy.gate.weight.normal_(0.0, 0.3)
            draft.copy.scale.normal_(0.0, 0.5)
    return LyannaDrafter(model, draft, **kwargs)


@dataclass(slots=True)
class LockstepResult:
    steps: int  # engine steps run
    trees: int  # trees compared
    mismatches: int  # trees that differ from the first drafter's
    first_break: str | None = None
    first_mismatch: str | None = None


def lockstep(
    model: Transformer,
    drafters: list,
    steps: int,
    seed: int,
    max_running: int = 4,
    max_len: int = 400,
) -> LockstepResult:
    """Drive ``drafters`` (alike but for how they draft) through ``steps`` engine steps in
    lockstep: random prompts of 1-160 tokens start and finish, each step drafts for a random
    subset of the running sequences, the target verifies the first drafter's trees greedily
    and every drafter learns the same verifications. Counts the trees that differ (tokens or
    parents) from the first drafter's. An exception while drafting (a graph break under
    fullgraph) stops the run and is named."""
    runner = TargetRunner(model, TargetConfig(max_running, max_len, static_step=False))
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_len)
    running: dict[int, int] = {}  # seq id -> tokens it may still take
    result = LockstepResult(0, 0, 0)
    next_id = 0
    for _ in range(steps):
        while not running or (len(running) < max_running and rng.random() < 0.5):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 160))]
            first = runner.prefill(next_id, prompt, params)
            for drafter in drafters:
                drafter.start(next_id, prompt, first.hidden, first.first_token, params)
            running[next_id] = max_len - len(prompt) - 1
            next_id += 1
        batch = sorted(rng.sample(sorted(running), rng.randint(1, len(running))))
        try:
            proposals = [drafter.propose(batch) for drafter in drafters]
        except Exception as err:  # a graph break under fullgraph, named
            result.first_break = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            break
        result.steps += 1
        for i, seq in enumerate(batch):
            trees = [proposal[i] for proposal in proposals]
            result.trees += 1
            first = (trees[0].token_list, trees[0].parents.tolist())
            if any((t.token_list, t.parents.tolist()) != first for t in trees[1:]):
                result.mismatches += 1
                result.first_mismatch = result.first_mismatch or f"sequence {seq}: {trees}"
        verified = runner.verify(batch, proposals[0], return_hidden=True)
        learned = [VerifiedStep.of(seq, v) for seq, v in zip(batch, verified, strict=True)]
        for drafter in drafters:
            drafter.on_verified(learned)
        for seq, v in zip(batch, verified, strict=True):
            running[seq] -= len(v.verdict.tokens)
            if running[seq] < 40 or rng.random() < 0.03:
                del running[seq]
                runner.release(seq)
                for drafter in drafters:
                    drafter.release(seq)
    return result


def check_drafter(
    model: Transformer,
    method: str,
    steps: int = 200,
    seed: int = 0,
    budget: DraftBudget = DRAFT_BUDGET,
) -> tuple[CheckResult, int]:
    """One learned drafter's device steps traced per bucket against the same steps run
    eagerly, in lockstep (``lockstep``); returns the result and the trees compared."""
    _fresh_dynamo()
    eager = random_drafter(method, model, seed, budget)
    traced_drafter = random_drafter(method, model, seed, budget)
    make = eagle_steps if method == "eagle" else lyanna_steps
    traced_drafter.steps = make(traced_drafter, capture=False, wrap=traced)
    with one_thread():
        run = lockstep(model, [eager, traced_drafter], steps, seed)
    keys = traced_drafter.steps.keys_seen
    breaks = sum(counters["graph_break"].values()) + (run.first_break is not None)
    compiled = counters["stats"]["unique_graphs"]
    result = CheckResult(
        buckets=[_key_fields(k) for k in keys],
        graph_breaks=breaks,
        recompiles=max(0, compiled - len(keys)),
        steps=run.steps,
        verdicts=run.trees,
        mismatches=run.mismatches,
        first_break=run.first_break,
    )
    return result, run.trees


def _key_fields(key) -> tuple[int, ...]:
    return tuple(getattr(key, name) for name in key.__slots__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = parser.parse_args(argv)
    model = random_model(args.shape, args.seed)
    result = check(model, args.steps, args.seed)
    rows = sorted(result.buckets)
    print("target verify step")
    print_table(["batch", "rows", "kv_len"], [list(r) for r in rows])
    drafted = {
        (method, budget.top_k): check_drafter(model, method, args.steps, args.seed, budget)
        for budget in (DRAFT_BUDGET, CHAIN_BUDGET)
        for method in DRAFTERS
    }
    for (method, k), (drafter, _) in drafted.items():
        print(f"\n{method} draft steps, top-{k}")
        print_table(
            ["step", "batch", "shape", "kv_len"],
            [_bucket_row(method, fields) for fields in sorted(drafter.buckets)],
        )
    everything = [result] + [d for d, _ in drafted.values()]
    first_break = next((r.first_break for r in everything if r.first_break), None)
    if first_break:
        print(f"first break: {first_break}")
    print(
        f"graph-ready: {sum(len(r.buckets) for r in everything)} buckets, "
        f"{sum(r.graph_breaks for r in everything)} graph breaks, "
        f"{sum(r.recompiles for r in everything)} recompiles"
    )
    print(
        f"traced = eager: {result.steps} steps, {result.verdicts} verdicts, "
        f"{result.mismatches} mismatches"
    )
    for (method, k), (drafter, trees) in drafted.items():
        print(
            f"{method} top-{k} traced = eager: {drafter.steps} steps, {trees} trees, "
            f"{drafter.mismatches} mismatches"
        )
    return 0 if all(r.ok for r in everything) else 1


def _bucket_row(method: str, fields: tuple[int, ...]) -> list[object]:
    """A drafter bucket as (step, batch, shape, kv_len)."""
    if method == "lyanna":
        batch, steps, k, kv_len = fields
        return ["chain + tree", batch, f"{steps} steps, top-{k}", kv_len]
    if len(fields) == 2:
        return ["root", fields[0], f"top-{fields[1]}", "-"]
    batch, k, width, kv_len = fields
    return ["depth", batch, f"top-{k}, {width} tree rows", kv_len]


if __name__ == "__main__":
    sys.exit(main())
