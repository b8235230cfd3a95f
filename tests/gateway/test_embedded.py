"""The embedded backend on its own and behind HTTP: a consumer that stops early (client
disconnect) aborts its sequence and frees the KV slot; the default method falls back to one
that can run on the model; requests before start are refused with BackendUnavailable."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from gateway.backend import GenerationRequest
from gateway.embedded import EmbeddedBackend, EmbeddedConfig
from lyanna.async_engine import BackendBusy, BackendUnavailable, TokenDelta, settle
from lyanna.drafters.base import NoDrafter
from lyanna.sampling import SamplingParams
from lyanna.serving_model import load
from tests.gateway.conftest import MODEL_NAME, plain_greedy, start_gateway


def request(max_tokens: int, method: str | None = None) -> GenerationRequest:
    return GenerationRequest("r", [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens), method)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_closing_the_iterator_frees_the_sequence(loaded) -> None:
    backend = EmbeddedBackend(
        loaded.model, loaded.eos_token_ids, EmbeddedConfig(default_method="ar", max_len=512)
    )

    async def scenario() -> None:
        await backend.start()
        try:
            deltas = backend.generate(request(400))
            first = await anext(deltas)
            assert first.prompt_tokens == 4 and len(first.token_ids) == 1 and first.step is None
            second = await anext(deltas)
            assert second.step is not None and second.step.method == "ar"
            await deltas.aclose()
            engine = backend.engine
            await asyncio.to_thread(wait_until, lambda: not engine.has_work)
            assert engine.cache.num_free_slots == engine.cache.num_slots
            finished = [d async for d in backend.generate(request(3))]
            assert sum(len(d.token_ids) for d in finished) == 3
            assert finished[-1].finish_reason == "length"
        finally:
            await backend.stop()

    asyncio.run(scenario())


def test_refuses_before_start_and_falls_back_to_a_working_method(loaded) -> None:
    backend = EmbeddedBackend(loaded.model, loaded.eos_token_ids, EmbeddedConfig(max_len=512))

    async def scenario() -> None:
        with pytest.raises(BackendUnavailable):
            await anext(backend.generate(request(2)))
        await backend.start()  # the Lyanna checkpoint does not fit the tiny model
        try:
            assert backend.default_method == "ngram"
            health = await backend.health()
            assert health["engine"] == "ok" and health["method:lyanna"].startswith("degraded:")
            with pytest.raises(BackendUnavailable, match="eagle"):
                await anext(backend.generate(request(2, "eagle")))
        finally:
            await backend.stop()

    asyncio.run(scenario())


def test_a_request_the_core_rejects_fails_alone(loaded) -> None:
    """A Python caller past the HTTP intake (an empty prompt trips the scheduler's assertion)
    fails that request only; the engine serves the next one."""
    backend = EmbeddedBackend(
        loaded.model, loaded.eos_token_ids, EmbeddedConfig(default_method="ar", max_len=512)
    )

    async def scenario() -> None:
        await backend.start()
        try:
            empty = GenerationRequest("r", [], SamplingParams(max_tokens=2), None)
            with pytest.raises(BackendUnavailable, match="refused"):
                await anext(backend.generate(empty))
            finished = [d async for d in backend.generate(request(3))]
            assert sum(len(d.token_ids) for d in finished) == 3
            assert (await backend.health())["engine"] == "ok"
        finally:
            await backend.stop()

    asyncio.run(scenario())


def test_client_disconnect_cancels_the_stream(loaded) -> None:
    server = start_gateway(loaded)
    try:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "go on forever"}],
            "max_tokens": 400,
            "temperature": 0.7,
            "stream": True,
        }
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        engine = server.app.state.backend.engine
        wait_until(lambda: not engine.has_work)
        assert engine.cache.num_free_slots == engine.cache.num_slots
        metrics = httpx.get(server.url + "/metrics").text
        assert 'lyanna_request_success_total{finish_reason="abort"' in metrics
        assert "lyanna_num_requests_running{" in metrics
        running = [
            line for line in metrics.splitlines() if line.startswith("lyanna_num_requests_running{")
        ]
        assert running and running[0].endswith(" 0.0")
    finally:
        server.stop()


def test_full_waiting_queue_is_busy(loaded) -> None:
    config = EmbeddedConfig(default_method="ar", max_len=512, max_running=1, max_waiting=1)
    backend = EmbeddedBackend(loaded.model, loaded.eos_token_ids, config)

    async def scenario() -> None:
        await backend.start()
        engine = backend.engine
        step = engine.step
        engine.step = lambda: (time.sleep(0.005), step())[1]  # outlasts the timeout anywhere
        try:
            running = backend.generate(request(300))
            await anext(running)  # admitted: holds the only slot
            waiting = backend.generate(request(2))
            blocked = asyncio.ensure_future(anext(waiting))
            await asyncio.sleep(0.05)  # queued behind the running request
            with pytest.raises(BackendBusy):
                await anext(backend.generate(request(2)))
            await running.aclose()  # frees the slot: the waiting request proceeds
            assert (await blocked).prompt_tokens == 4
            await waiting.aclose()
        finally:
            await backend.stop()

    asyncio.run(scenario())


def test_a_request_that_finds_no_slot_in_time_is_busy_and_loses_nothing(loaded) -> None:
    """The only slot stays taken: the next request gets BackendBusy after queue_timeout
    (not a wait forever), and the running request goes on to its full length."""
    config = EmbeddedConfig(default_method="ar", max_len=512, max_running=1, queue_timeout=0.3)
    backend = EmbeddedBackend(loaded.model, loaded.eos_token_ids, config)

    async def scenario() -> None:
        await backend.start()
        engine = backend.engine
        step = engine.step
        engine.step = lambda: (time.sleep(0.005), step())[1]  # outlasts the timeout anywhere
        try:
            running = backend.generate(
                GenerationRequest(
                    "r", [5, 6, 7, 8], SamplingParams(max_tokens=200, ignore_eos=True)
                )
            )
            tokens = (await anext(running)).token_ids
            start = time.monotonic()
            with pytest.raises(BackendBusy, match="within 0.3 s"):
                await anext(backend.generate(request(2)))
            assert 0.25 < time.monotonic() - start < 5.0
            async for delta in running:
                tokens += delta.token_ids
            assert len(tokens) == 200
            assert backend._num_waiting == 0
            again = backend.generate(request(2))  # the slot is free again
            assert (await anext(again)).prompt_tokens == 4
            await again.aclose()
        finally:
            await backend.stop()

    asyncio.run(scenario())


class ExplodingDrafter(NoDrafter):
    """Drafts like AR until told to fail (the warm-up must pass)."""

    armed = False

    def propose(self, seq_ids):
        if self.armed:
            raise RuntimeError("drafter bug")
        return super().propose(seq_ids)


def test_a_failing_drafter_fails_its_step_and_stops_serving_its_method(loaded) -> None:
    """The step it broke fails (503 to the request in it), its method reports degraded and
    is refused from then on, and the other methods keep serving from the same engine."""
    config = EmbeddedConfig(default_method="ar", max_len=512)
    backend = EmbeddedBackend(loaded.model, loaded.eos_token_ids, config)

    async def scenario() -> None:
        await backend.start()
        try:
            drafter = ExplodingDrafter()
            await asyncio.to_thread(backend.engine.add_method, "ngram", drafter)
            drafter.armed = True
            deltas = backend.generate(request(8, "ngram"))
            assert len((await anext(deltas)).token_ids) == 1  # the prefill token
            with pytest.raises(BackendUnavailable, match="engine error"):
                await anext(deltas)
            assert (await backend.health())["method:ngram"].startswith("degraded:")
            with pytest.raises(BackendUnavailable, match="'ngram' is unavailable"):
                await anext(backend.generate(request(2, "ngram")))
            served = [d async for d in backend.generate(request(3, "ar"))]
            assert sum(len(d.token_ids) for d in served) == 3
            engine = backend.engine
            await asyncio.to_thread(wait_until, lambda: not engine.has_work)
            assert engine.cache.num_free_slots == engine.cache.num_slots
        finally:
            await backend.stop()

    asyncio.run(scenario())


def test_requests_of_different_methods_share_one_engine(loaded) -> None:
    config = EmbeddedConfig(default_method="ar", max_len=512)
    backend = EmbeddedBackend(loaded.model, loaded.eos_token_ids, config)

    async def collect(method: str) -> list[TokenDelta]:
        return [d async for d in backend.generate(request(6, method))]

    async def scenario() -> None:
        await backend.start()
        try:
            ar, ngram = await asyncio.gather(collect("ar"), collect("ngram"))
            assert sum(len(d.token_ids) for d in ar) == sum(len(d.token_ids) for d in ngram) == 6
            assert {d.step.method for d in ngram if d.step} == {"ngram"}
            assert {d.step.method for d in ar if d.step} == {"ar"}
            assert set(backend.engine.drafters) == {"ar", "ngram"}
            by_method = backend.engine.scheduler.stats_by_method
            assert by_method["ar"].num_steps > 0 and by_method["ngram"].num_steps > 0
        finally:
            await backend.stop()

    asyncio.run(scenario())


def test_bf16_embedded_backend_equals_bf16_plain_decoding(tiny_chat_dir) -> None:
    """``lyanna serve --dtype bf16`` in embedded mode: ``gateway.server.load`` loads the model
    in bf16 (its KV cache too), and the backend's greedy output, n-gram drafting and plain,
    is what plain bf16 decoding (``lyanna.decode.generate``) gives."""
    loaded = load(tiny_chat_dir, "auto", device="cpu", dtype=torch.bfloat16)
    assert loaded.model.dtype is torch.bfloat16
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9]]
    expected = [plain_greedy(loaded, prompt, 16) for prompt in prompts]
    config = EmbeddedConfig(default_method="ngram", max_len=512, tree="fixed")
    backend = EmbeddedBackend(loaded.model, loaded.eos_token_ids, config)

    async def tokens(prompt: list[int], method: str) -> list[int]:
        params = SamplingParams(max_tokens=16)
        stream = backend.generate(GenerationRequest("r", prompt, params, method))
        return [t async for delta in stream for t in delta.token_ids]

    async def scenario() -> None:
        await backend.start()
        try:
            assert backend.engine.cache.keys.dtype is torch.bfloat16
            for method in ("ngram", "ar"):
                got = await asyncio.gather(*(tokens(p, method) for p in prompts))
                assert list(got) == expected, method
        finally:
            await backend.stop()

    asyncio.run(scenario())


def test_settle_returns_once_the_loop_ran_the_woken_consumer() -> None:
    """The worker hands a delta over and waits for the event loop: when ``settle`` returns,
    a consumer that awaited the queue has taken the delta and gone past two more awaits (as
    a response formatting and sending a chunk does), so the next step's threads do not
    share a core with it."""
    import threading

    loop = asyncio.new_event_loop()
    handled: list[int] = []
    ready = threading.Event()
    items: asyncio.Queue = asyncio.Queue()

    async def consumer() -> None:
        ready.set()
        while True:
            item = await items.get()
            await asyncio.sleep(0)  # e.g. the response generator's own awaits
            await asyncio.sleep(0)
            handled.append(item)

    async def start() -> asyncio.Task:
        return asyncio.create_task(consumer())

    async def stop(task: asyncio.Task) -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    task = asyncio.run_coroutine_threadsafe(start(), loop).result(5)
    assert ready.wait(5)
    try:
        for i in range(20):
            loop.call_soon_threadsafe(items.put_nowait, i)
            settle(loop)
            assert handled == list(range(i + 1))
    finally:
        asyncio.run_coroutine_threadsafe(stop(task), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    settle(loop)  # a closed loop: returns at once
