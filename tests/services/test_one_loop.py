"""Both backends drive one step loop: the embedded backend (``SpecEngine`` in this process)
and the remote one (``RemoteEngine`` over the drafter and verifier services) are the same
adapter over one engine object each, whose ``step`` is ``lyanna.engine.StepLoop.step``, and
the same requests make the same calls on their one scheduler, in the same order."""

from __future__ import annotations

import asyncio

from gateway.backend import GenerationRequest
from gateway.embedded import EmbeddedBackend, EmbeddedConfig
from gateway.remote import RemoteBackend
from lyanna.async_engine import AsyncEngine
from lyanna.engine import SpecEngine, StepLoop
from lyanna.sampling import SamplingParams
from lyanna.scheduler import Scheduler
from remote_engine import RemoteEngine
from tests.services.remote_client import PROMPTS, config_for, plain_greedy

MAX_TOKENS = 8
SPIED = (
    "add",
    "schedule_prefill",
    "postprocess_prefill",
    "decode_batch",
    "postprocess",
    "commit",
    "record_drafter_facts",
    "retire",
    "requeue",
    "abort",
)


def spy(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Record every call on ``scheduler``: its name and how many sequences it concerned."""
    calls: list[tuple[str, int]] = []

    def wrap(name: str):
        method = getattr(scheduler, name)

        def recorded(*args, **kwargs):
            at = len(calls)  # in the order the calls began (postprocess calls commit)
            calls.append((name, 0))
            result = method(*args, **kwargs)
            size = len(result) if isinstance(result, list) else 1
            if name in ("postprocess", "record_drafter_facts"):
                size = len(args[0])
            calls[at] = (name, size)
            return result

        return recorded

    for name in SPIED:
        setattr(scheduler, name, wrap(name))
    return calls


async def serve(backend: AsyncEngine) -> tuple[list[list[int]], list[tuple[str, int]], object]:
    """The prompts one after another (so no arrival races a step), greedy, target-only."""
    await backend.start()
    try:
        engine = backend.engine
        calls = spy(engine.scheduler)
        outputs = []
        for prompt in PROMPTS:
            request = GenerationRequest("s", prompt, SamplingParams(max_tokens=MAX_TOKENS), "ar")
            outputs.append([t async for d in backend.generate(request) for t in d.token_ids])
        while engine.has_work:  # the last retire runs after the last token streamed
            await asyncio.sleep(0.01)
        return outputs, calls, engine
    finally:
        await backend.stop()


def test_embedded_and_services_make_the_same_scheduler_calls(ngram_services, tiny_loaded):
    embedded = EmbeddedBackend(
        tiny_loaded,
        frozenset(),
        EmbeddedConfig(default_method="ar", fallback_methods=(), max_len=512),
    )
    remote = RemoteBackend(
        config_for(ngram_services, max_steps_per_call=1), frozenset(), lambda ids: ""
    )
    local_out, local_calls, local_engine = asyncio.run(serve(embedded))
    remote_out, remote_calls, remote_engine = asyncio.run(serve(remote))

    assert isinstance(local_engine, SpecEngine) and isinstance(remote_engine, RemoteEngine)
    for backend in (embedded, remote):  # one adapter: the backends add no step of their own
        assert isinstance(backend, AsyncEngine) and type(backend)._work is AsyncEngine._work
    for engine in (local_engine, remote_engine):  # one step loop, written once
        assert type(engine).step is StepLoop.step
    assert local_out == remote_out == plain_greedy(tiny_loaded, PROMPTS, MAX_TOKENS)
    per_request = [("add", 1), ("schedule_prefill", 1), ("postprocess_prefill", 1)]
    per_step = [("decode_batch", 1), ("postprocess", 1), ("commit", 1)]
    per_step += [("record_drafter_facts", 1), ("retire", 0)]
    assert local_calls[:3] == per_request and local_calls[3:8] == per_step
    assert local_calls.count(("retire", 1)) == len(PROMPTS)
    assert remote_calls == local_calls
