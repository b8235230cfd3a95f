"""Services mode honours the logits processors end to end: the gateway's remote backend sends
them with each sequence (common.SamplingParams 5-8), the verifier subprocess applies them to
every tree row, and greedy output over n-gram speculation equals a reference loop that
applies them to full-model logits step by step. Chat logprobs come back with every token."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from gateway.backend import GenerationRequest
from gateway.remote import RemoteBackend
from lyanna.sampling import SamplingParams
from tests.conftest import prompt_logits
from tests.services.remote_client import PROMPTS, config_for, run_remote, single_threaded

PARAMS = SamplingParams(
    max_tokens=16,
    presence_penalty=-0.6,  # favours repeats: the n-gram drafts still hit
    frequency_penalty=0.2,
    logit_bias=((3, 1.0), (5, -100.0)),
    top_k=6,
)


def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    output: list[int] = []
    bias = dict(params.logit_bias)
    while len(output) < params.max_tokens:
        raw = prompt_logits(model, torch.tensor([prompt + output]))[-1].double()
        counts = Counter(output)
        logits = [
            float(raw[v])
            - params.frequency_penalty * counts[v]
            - params.presence_penalty * (counts[v] > 0)
            + bias.get(v, 0.0)
            for v in range(raw.shape[0])
        ]
        kth = sorted(logits, reverse=True)[params.top_k - 1]
        logits = [x if x >= kth else float("-inf") for x in logits]
        output.append(logits.index(max(logits)))
    return output


def test_greedy_with_processors_over_services_equals_the_reference(
    ngram_services, tiny_loaded
) -> None:
    outcomes, _ = run_remote(config_for(ngram_services, pipeline=False), PROMPTS, PARAMS)
    expected = [single_threaded(reference_greedy, tiny_loaded, p, PARAMS) for p in PROMPTS]
    assert [o.tokens for o in outcomes] == expected
    plain = SamplingParams(max_tokens=PARAMS.max_tokens)
    unprocessed = [single_threaded(reference_greedy, tiny_loaded, p, plain) for p in PROMPTS]
    assert expected != unprocessed
    assert sum(s.num_accepted for o in outcomes for s in o.steps) > 0  # drafts were verified


async def logprobs_of(config, prompt: list[int], params: SamplingParams):
    backend = RemoteBackend(config, frozenset(), lambda ids: "")
    await backend.start()
    tokens, entries = [], []
    try:
        async for delta in backend.generate(GenerationRequest("lp", prompt, params)):
            tokens += delta.token_ids
            assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids)
            entries += delta.logprobs
    finally:
        await backend.stop()
    return tokens, entries


@pytest.mark.parametrize("pipeline", [True, False], ids=["async", "sync"])
def test_logprobs_cross_the_wire(ngram_services, tiny_loaded, pipeline) -> None:
    """Chat logprobs in services mode: each emitted token's (first token from Prefill, the rest
    from Verify, drafted, relayed by the drafter or direct) is the model's log-softmax."""
    params = SamplingParams(max_tokens=10, logprobs=2)
    config = config_for(ngram_services, pipeline=pipeline)
    tokens, entries = asyncio.run(logprobs_of(config, PROMPTS[0], params))
    assert [e.token for e in entries] == tokens and len(tokens) == 10
    for i, entry in enumerate(entries):
        raw = prompt_logits(tiny_loaded, torch.tensor([PROMPTS[0] + tokens[:i]]))[-1]
        logp = torch.log_softmax(raw.double(), -1)
        assert abs(entry.logprob - float(logp[entry.token])) < 1e-4
        assert [t for t, _ in entry.top] == logp.topk(2).indices.tolist()
