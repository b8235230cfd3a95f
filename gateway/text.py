"""One request as the routes see it (``Generation``): text deltas through
``lyanna.stop_strings.TextStream``, metrics recorded as they arrive, and the backend iterator
always closed, so a client that leaves aborts the sequence in the backend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request

from gateway.metrics import RequestTracker
from lyanna.async_engine import TokenDelta
from lyanna.stop_strings import TextStream

T = TypeVar("T")
DISCONNECT_POLL_SECONDS = 0.25


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class Generation:
    def __init__(
        self,
        deltas: AsyncIterator[TokenDelta],
        first: TokenDelta,
        text: TextStream,
        tracker: RequestTracker,
        on_finish: Callable[[int], None] | None = None,
    ) -> None:
        self._deltas, self._first = deltas, first
        self.text, self.tracker = text, tracker
        self.finish_reason: str | None = None
        self._on_finish = on_finish  # called once with the tokens used (prompt + output)
        self.logprobs: list = []  # TokenLogprob of each token consumed so far (when asked)
        self.logprobs_sent = 0  # how many of them a stream chunk already carried

    async def texts(self) -> AsyncIterator[str]:
        """Text deltas until the request finishes; ``finish_reason`` is set at the end."""
        delta = self._first
        try:
            while True:
                piece = self.text.push(delta.token_ids)
                self.tracker.on_delta(delta, len(delta.token_ids))
                if delta.logprobs:
                    self.logprobs.extend(delta.logprobs)
                if piece:
                    yield piece
                if self.text.stopped or delta.finish_reason is not None:
                    self.finish_reason = "stop" if self.text.stopped else delta.finish_reason
                    break
                delta = await anext(self._deltas)
            tail = self.text.flush()
            if tail:
                yield tail
        finally:
            await self.close()

    async def close(self) -> None:
        """Release the request (``texts`` does at its end, however it ends); idempotent."""
        with anyio.CancelScope(shield=True):
            await self._deltas.aclose()
        self.tracker.finish(self.finish_reason or "abort")
        if self._on_finish is not None:
            on_finish, self._on_finish = self._on_finish, None
            on_finish(self.tracker.num_prompt_tokens + self.tracker.num_output_tokens)

    def unsent_logprobs(self) -> list:  # those no stream chunk carried yet (marked sent)
        fresh, self.logprobs_sent = self.logprobs[self.logprobs_sent :], len(self.logprobs)
        return fresh

    async def collect(self) -> str:
        return "".join([piece async for piece in self.texts()])

    def usage(self) -> dict:
        """OpenAI's usage block, with the ``lyanna`` extra: method and speculation counts."""
        tracker = self.tracker
        prompt, output = tracker.num_prompt_tokens, tracker.num_output_tokens
        spec = {
            "method": tracker.method,
            "acceptance_length": round(tracker.acceptance_length, 4),
            "num_verifications": tracker.num_steps,
            "num_draft_tokens": tracker.num_drafted,
            "num_accepted_tokens": tracker.num_accepted,
        }
        tokens = {"prompt_tokens": prompt, "completion_tokens": output}
        return {**tokens, "total_tokens": prompt + output, "lyanna": spec}


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` but cancel it (raising ``ClientGone``) if the client disconnects."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
