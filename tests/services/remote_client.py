"""Test helpers: drive a ``RemoteBackend`` against running services and compute the oracles
(plain greedy decoding and the in-process ``SpecEngine``) on the same weights."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from gateway.backend import GenerationRequest
from gateway.remote import RemoteBackend, RemoteConfig
from lyanna.decode import generate
from lyanna.drafters import DraftBudget, Drafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.step_facts import StepFacts

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [9], [4, 4, 4, 4, 4, 4]]


@dataclass(slots=True)
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    steps: list[StepFacts] = field(default_factory=list)


def single_threaded(fn, *args):
    """Run an oracle with one torch thread, as the services do (same matmul numerics)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def plain_greedy(model, prompts, max_tokens: int) -> list[list[int]]:
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    single_threaded(generate, model, seqs)
    return [s.output_ids for s in seqs]


def engine_outputs(
    model, drafter: Drafter | None, prompts, params: SamplingParams
) -> list[list[int]]:
    engine = SpecEngine(model, drafter, EngineConfig(max_running=len(prompts), max_len=512))
    seqs = [Sequence(i, p, params) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.submit(seq)
    single_threaded(engine.run)
    return [s.output_ids for s in seqs]


async def collect(backend: RemoteBackend, prompt: list[int], params: SamplingParams) -> Outcome:
    outcome = Outcome()
    async for delta in backend.generate(GenerationRequest("t", prompt, params)):
        outcome.tokens += delta.token_ids
        outcome.finish_reason = delta.finish_reason
        if delta.step is not None:
            outcome.steps.append(delta.step)
    return outcome


async def run_all(
    config: RemoteConfig, prompts, params: SamplingParams
) -> tuple[list[Outcome], RemoteBackend]:
    backend = RemoteBackend(config, frozenset(), lambda ids: "")
    await backend.start()
    try:
        outcomes = await asyncio.gather(*(collect(backend, p, params) for p in prompts))
    finally:
        await backend.stop()
    return list(outcomes), backend


def run_remote(config: RemoteConfig, prompts, params: SamplingParams):
    return asyncio.run(run_all(config, prompts, params))


BUDGET = DraftBudget(depth=4, top_k=2, max_tokens=6)
# --tree fixed: the in-process references draft with BUDGET as it is; a cost-sized tree would
# follow this machine's measured cost curve, which differs from run to run (a seeded sample
# then differed from the engine's whenever the curve pruned a node)
BUDGET_FLAGS = ("--depth", "4", "--top-k", "2", "--max-draft-tokens", "6", "--tree", "fixed")
LYANNA_FLAGS = (*BUDGET_FLAGS, "--factory", "tests.services.tiny_drafters:tiny_lyanna")
MAX_TOKENS = 24
METRICS_PORTS: dict[str, int] = {}  # the ngram deployment's /metrics ports


def config_for(deployment, **overrides) -> RemoteConfig:
    return RemoteConfig(deployment.verifier_addr, deployment.drafter_addr, **overrides)
