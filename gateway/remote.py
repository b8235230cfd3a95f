"""The remote backend: drafter and verifier gRPC services behind ``GenerationBackend``.

Scheduling (all on the event loop, async gRPC clients, a deadline on every call; the
queues, admission, commits, acceptance counts and retirement are ``lyanna.scheduler``'s):

- *Admission* (``gateway.remote_admission``): waiting requests are prefilled in batches
  bounded by ``max_running`` and by the free KV slots the verifier reports; the first token
  streams right away.
- *Lanes*: running sequences live in micro-batches ("lanes"). Each lane loops: one drafter
  ``Step`` (the drafter drafts every tree, verifies them in one ``Verify`` to the verifier
  itself, learns the outcome and relays the verifier's results) -> stream tokens, release
  finished sequences. One round trip per step on the critical path; the gateway stays the
  source of truth of every sequence's tokens (it learns each step from the verifier's
  results). With ``pipeline=True`` two lanes run concurrently, so while the verifier
  verifies one micro-batch the drafter drafts the other (the asynchronous pipeline);
  ``pipeline=False`` runs one lane, for comparison.
- *Verification fusion*: the Lyanna drafter merges the subtree re-sampled after the last
  verification into its fresh tree under the budget, in the drafter process, which owns the
  chain logits (the engine runs the same code). The fused tree is a deterministic candidate
  set, so the acceptance rule stays lossless.
- *Plain steps together*: when no sequence of a micro-batch drafts this step and the next
  ones are known to be plain (target-only methods, and a gated drafter's quiet steps), the
  lane calls the verifier directly, and one ``Verify`` runs up to ``max_steps_per_call``
  decode steps (``VerifyItem.steps``): one round trip for several tokens, each still
  streamed and counted as its own step.
- *Fallback*: when the drafter fails or misses ``draft_deadline``, the lane verifies
  root-only trees directly (plain target decoding, still exact) and retries the drafter after
  ``drafter_retry_seconds``. A drafter may fail after the verifier committed its step: the
  direct retry names the same committed length, and the verifier answers it with the result
  it committed (``Verify`` is idempotent per step), so no token is lost or doubled. A
  sequence whose drafter state is in doubt is started again from its full committed history
  (tokens + hidden states kept here), so speculation recovers when the drafter returns, even
  as a new process.
- *Cancellation*: closing a request's iterator marks it; its lane releases it in both
  services between steps (never while a batched call that includes it is in flight).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import torch

from gateway.backend import (
    BackendBusy,
    BackendUnavailable,
    GenerationRequest,
    StepFacts,
    TokenDelta,
)
from gateway.remote_admission import RESUMABLE, Admission, verifier_failure
from gateway.remote_config import RemoteConfig
from gateway.remote_drafter import DrafterLink
from gateway.remote_seq import RemoteSeq, split_steps
from lyanna.scheduler import Scheduler, SchedulerConfig
from lyanna.sequence import Sequence
from services import codec
from services.codec import TARGET_ONLY
from services.pb import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from services.tls import aio_channel

logger = logging.getLogger(__name__)

__all__ = ["RemoteBackend", "RemoteConfig"]


@dataclass(slots=True, eq=False)
class _Lane:
    seqs: list[RemoteSeq] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class RemoteBackend(Admission):
    """``GenerationBackend`` over the gRPC services (see the module docstring)."""

    supports_logprobs = True  # the verifier returns them (VerifyResult.logprobs)

    def __init__(
        self,
        config: RemoteConfig,
        eos_token_ids: frozenset[int],
        detokenize: Callable[[list[int]], str],
    ) -> None:
        self.config = config
        self._eos, self._detokenize = eos_token_ids, detokenize
        self.default_method = config.method if config.drafter_addr else TARGET_ONLY
        self.methods = tuple(dict.fromkeys((self.default_method, TARGET_ONLY)))
        self.max_context = 0
        self.vocab_size = 0
        self.hidden_row_bytes = 0  # one hidden state on the wire (from the verifier's Capacity)
        self.num_fallback_steps = 0
        self.num_verify_calls = 0
        self.num_resumed = 0  # sequences re-prefilled after the verifier lost them
        self.scheduler = Scheduler(SchedulerConfig(config.max_running))  # context: start()
        self._seqs: dict[int, RemoteSeq] = {}  # the remote state of each scheduled sequence
        self._lanes = [_Lane() for _ in range(2 if config.pipeline else 1)]
        self._admit = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._drafter_releases: set[asyncio.Task] = set()  # best effort, off the lanes
        self._closing = False
        self._channels: list[grpc.aio.Channel] = []
        self._verifier: verifier_pb2_grpc.VerifierStub | None = None
        self.drafter: DrafterLink | None = None  # None: target-only decoding
        self.verifier_drafted_method: str | None = None  # a method the verifier drafts itself

    # -- GenerationBackend ------------------------------------------------------------------

    async def start(self) -> None:
        options = self.config.channel_options()
        channel = aio_channel(self.config.verifier_addr, self.config.tls, options)
        self._channels.append(channel)
        self._verifier = verifier_pb2_grpc.VerifierStub(channel)
        if self.config.drafter_addr:
            channel = aio_channel(self.config.drafter_addr, self.config.tls, options)
            self._channels.append(channel)
            self.drafter = DrafterLink(drafter_pb2_grpc.DrafterStub(channel), self.config)
        try:
            capacity = await self._verifier.Capacity(
                verifier_pb2.CapacityRequest(), timeout=self.config.control_deadline
            )
        except grpc.aio.AioRpcError as error:
            where = self.config.verifier_addr
            raise BackendUnavailable(f"verifier at {where}: {error.details()}") from None
        limits = SchedulerConfig(self.config.max_running, capacity.max_len, capacity.reserved_rows)
        self.scheduler, self.max_context = Scheduler(limits), limits.max_context
        self.vocab_size = capacity.vocab_size
        hidden_dtype = codec.DTYPES.get(capacity.hidden_dtype, torch.float32)
        self.hidden_row_bytes = capacity.hidden_size * hidden_dtype.itemsize
        if self.drafter is not None and await self.drafter.describe():
            self.default_method = self.drafter.method
            self.methods = tuple(dict.fromkeys((self.drafter.method, TARGET_ONLY)))
            if not self.drafter.linked:
                logger.error("the drafter has no verifier to verify through: target-only")
                self.drafter, self.default_method, self.methods = None, TARGET_ONLY, (TARGET_ONLY,)
        if self.drafter is not None and self.drafter.drafts_in_verifier and capacity.free_drafts:
            # n-gram trees need no model: the verifier drafts them where the tokens are, in
            # calls of several steps, instead of a round trip through the drafter per step
            self.verifier_drafted_method = self.drafter.method
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._admit_loop(), name="remote-admit")]
        self._tasks += [loop.create_task(self._lane_loop(lane)) for lane in self._lanes]

    @property
    def num_verified_steps(self) -> int:
        """Sequence-steps verified."""
        return self.scheduler.stats.num_steps

    async def stop(self) -> None:
        self._closing = True
        self._drop(self._waiting, BackendUnavailable("the backend is shutting down"))
        self._admit.set()
        for lane in self._lanes:
            lane.wake.set()
        done, pending = await asyncio.wait(self._tasks, timeout=self.config.drain_seconds)
        for task in pending:
            task.cancel()
        leftovers = [s for lane in self._lanes for s in lane.seqs]
        for seq in leftovers:
            seq.deliver(TokenDelta([], finish_reason="abort"))
        if leftovers:
            await self._release(leftovers)
        if self._drafter_releases:  # a second's grace; a stuck drafter's go with its channel
            await asyncio.wait(self._drafter_releases, timeout=1.0)
        for channel in self._channels:
            await channel.close()

    async def health(self) -> dict[str, str]:
        status = {}
        try:
            await self._verifier.Capacity(verifier_pb2.CapacityRequest(), timeout=2.0)
            status["verifier"] = "ok"
        except grpc.aio.AioRpcError as error:
            status["verifier"] = error.code().name  # details name peers: the log only
            logger.debug("verifier health: %s", error.details())
        if self.drafter is not None:
            status["drafter"] = self.drafter.status()
        return status

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if self._closing or not self._tasks:
            raise BackendUnavailable("the remote backend is not running")
        method = request.method or self.default_method
        if method not in self.methods:
            raise ValueError(f"unknown method {method!r}; known: {list(self.methods)}")
        if not request.prompt_ids or any(not 0 <= t < self.vocab_size for t in request.prompt_ids):
            raise ValueError(f"prompt token ids must be non-empty and in [0, {self.vocab_size})")
        sequence = Sequence(
            # an id no other client can guess (63 random bits: a collision among even a
            # million live sequences has probability ~1e-7), so none can release another's
            secrets.randbits(63),
            list(request.prompt_ids),
            request.params,
            self._eos,
            self._detokenize,
            method=method,
        )
        verifier_drafts = method == self.verifier_drafted_method
        use_drafter = method != TARGET_ONLY and not verifier_drafts and self.drafter is not None
        seq = RemoteSeq(sequence, asyncio.Queue(), use_drafter, verifier_drafts)
        seq.keep_hidden = use_drafter and self.drafter.needs_hidden and not self.drafter.plane_ok
        self.scheduler.add(sequence)  # ValueError when prompt + max_tokens exceeds the context
        if len(self.scheduler.waiting) > self.config.max_waiting:
            self.scheduler.abort(sequence.seq_id)
            raise BackendBusy(f"{len(self.scheduler.waiting)} requests are already waiting")
        self._seqs[seq.seq_id] = seq
        self._admit.set()
        expiry = asyncio.get_running_loop().call_later(self.config.queue_timeout, self._expire, seq)
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            expiry.cancel()
            if not seq.done:
                seq.cancelled = True
                if seq in self._waiting:
                    self._forget(seq)

    # -- lanes -----------------------------------------------------------------------------

    async def _lane_loop(self, lane: _Lane) -> None:
        while True:
            cancelled = [s for s in lane.seqs if s.cancelled]
            if cancelled:
                lane.seqs = [s for s in lane.seqs if not s.cancelled]
                await self._release(cancelled)
            if not lane.seqs:
                if self._closing:
                    return
                lane.wake.clear()
                await lane.wake.wait()
                continue
            self._rebalance(lane)
            batch = list(lane.seqs)
            try:
                await self._step(batch)
            except Exception:  # a bug must not strand the lane's requests
                logger.exception("lane step failed")
                failure = BackendUnavailable("internal error (logged)")
                for seq in batch:
                    seq.deliver(failure)
            leaving = [s for s in batch if s.done or s.resume_by is not None]  # or to resume
            if leaving:
                lane.seqs = [s for s in lane.seqs if s not in leaving]
                resuming = [s for s in leaving if not s.done]
                await self._release([s for s in leaving if s.done])
                if resuming:
                    self._requeue(resuming)

    def _rebalance(self, lane: _Lane) -> None:
        """Hand sequences to the emptiest lane so both halves of the pipeline stay busy (safe:
        this lane's sequences are between steps, the other lane batches a copy)."""
        other = min(self._lanes, key=lambda candidate: len(candidate.seqs))
        while len(lane.seqs) > len(other.seqs) + 1:
            other.seqs.append(lane.seqs.pop())
            other.wake.set()

    async def _step(self, batch: list[RemoteSeq]) -> None:
        """One step of a lane, through the drafter when it drafts any sequence of the batch,
        else (or when that failed) directly against the verifier."""
        if self.drafter is not None:
            ready = await self.drafter.prepare(batch)
            if ready:
                start = time.perf_counter()
                response = await self.drafter.step(batch, ready)
                if response is not None:
                    return self._deliver(batch, response, time.perf_counter() - start)
        await self._verify(batch)

    def _deliver(
        self, batch: list[RemoteSeq], response: drafter_pb2.StepResponse, seconds: float
    ) -> None:
        """Commit and stream a drafter Step's results (the verifier's, relayed)."""
        verify_seconds = max(0.0, seconds - response.draft_seconds)
        timing = {"draft_seconds": response.draft_seconds, "verify_seconds": verify_seconds}
        for seq, result in zip(batch, response.results, strict=True):
            self._learn(seq, result.verified)
            self._commit(seq, result.verified, result.num_resampled_accepted, **timing)

    async def _verify(self, batch: list[RemoteSeq]) -> None:
        """Verify the batch's root-only trees directly (target-only, quiet and fallback
        steps), commit and stream its tokens. A step the verifier already committed (its
        relaying drafter failed) comes back as it was committed."""
        steps = self._plain_steps(batch)
        items = []
        for seq in batch:
            wants_hidden = self.drafter is not None and self.drafter.wants_hidden(seq, False)
            items.append(
                verifier_pb2.VerifyItem(
                    ref=seq.ref(),
                    tree=codec.root_only_tree(seq.next_token),
                    return_hidden=wants_hidden,
                    steps=steps,
                    free_drafts=seq.use_drafter or seq.verifier_drafts,  # (never for `ar`)
                )
            )
        request = verifier_pb2.VerifyRequest(items=items)
        start = time.perf_counter()
        try:
            response = await self._verifier.Verify(request, timeout=self.config.verify_deadline)
        except grpc.aio.AioRpcError as error:
            if error.code() in RESUMABLE:  # the lane requeues them for a re-prefill
                logger.warning("verify failed (%s); resuming %d", error.code().name, len(batch))
                for seq in batch:
                    seq.resume_by = time.monotonic() + self.config.queue_timeout
                return
            failure = verifier_failure(error)
            for seq in batch:
                seq.deliver(failure)
            return
        verify_seconds = (time.perf_counter() - start) / steps
        self.num_verify_calls += 1
        for seq, result in zip(batch, response.results, strict=True):
            fallback = seq.use_drafter and not seq.quiet_step
            for step, part in enumerate(split_steps(result)):
                if step:  # the drafter said so: a quiet step (see _plain_steps)
                    seq.quiet_step, seq.quiet_left = True, max(0, seq.quiet_left - 1)
                self._learn(seq, part, direct=True)
                fell_back = fallback and not step
                self.num_fallback_steps += fell_back
                # a learned drafter's step the verifier drafted (free drafts): its fallback's
                free = seq.use_drafter and part.num_drafted > 0
                self._commit(
                    seq,
                    part,
                    verify_seconds=verify_seconds,
                    drafter_fallback=fell_back,
                    fallback_drafted=free,
                )
                if seq.done:
                    break  # tokens decoded past the end are dropped with the sequence

    def _plain_steps(self, batch: list[RemoteSeq]) -> int:
        """Decode steps one direct Verify may run for the batch: 1 unless no sequence drafts
        now or in the next steps (the fewest any sequence allows, at most
        ``max_steps_per_call``). A sequence allows its remaining tokens when it never drafts
        (target-only method, refused by the drafter), and 1 + its quiet steps when its drafter
        said it would not draft them; a fallback step allows 1."""
        allowed = self.config.max_steps_per_call
        for seq in batch:
            if self.drafter is not None and seq.use_drafter:
                if not seq.quiet_step:
                    return 1  # a fallback step: the drafter may be back next time
                allowed = min(allowed, 1 + seq.quiet_left)
            left = seq.sequence.params.max_tokens - len(seq.sequence.output_ids)
            allowed = min(allowed, left)
        return max(1, allowed)

    def _commit(
        self, seq: RemoteSeq, part: verifier_pb2.VerifyResult, resampled: int = 0, **timing
    ) -> None:
        """Commit a verification's tokens (the scheduler counts the step) and stream them."""
        item = self.scheduler.commit(seq.sequence, part)
        self.scheduler.record_drafter_facts([item], {seq.seq_id: resampled})
        method = seq.sequence.method
        facts = StepFacts(method, part.num_drafted, part.num_accepted, resampled, **timing)
        logprobs = None
        if part.logprobs:  # one per verdict token; the emitted tokens are a prefix of them
            logprobs = [codec.decode_logprob(e) for e in part.logprobs[: len(item.tokens)]]
        seq.deliver(TokenDelta(item.tokens, seq.sequence.finish_reason, facts, logprobs=logprobs))

    def _learn(
        self, seq: RemoteSeq, result: verifier_pb2.VerifyResult, direct: bool = False
    ) -> None:
        """Record a verification: history, next token, hidden rows, and (``direct``: one the
        drafter did not relay) what the drafter must hear of it."""
        seq.history.extend(result.committed)
        seq.next_token = result.tokens[-1]
        if seq.keep_hidden:
            if result.hidden.WhichOneof("payload") == "tensor":
                rows = codec.decode_tensor(result.hidden.tensor)
                seq.keep_rows(rows, self.config.max_hidden_bytes)
            elif self.drafter is not None and self.drafter.needs_hidden:  # (a history with a
                seq.keep_hidden, seq.hidden_history, seq.hidden_bytes = False, [], 0  # gap)
        if direct and self.drafter is not None:
            self.drafter.learn(seq, result)

    async def _release(self, seqs: list[RemoteSeq]) -> None:
        """Forget finished, failed or cancelled sequences, in both services best effort."""
        for seq in seqs:
            self._forget(seq)
        self._admit.set()
        deadline = self.config.control_deadline
        request = self.drafter.release_request(seqs) if self.drafter is not None else None
        if request is not None:  # not awaited here: a stuck drafter must not stall the lane
            task = asyncio.get_running_loop().create_task(
                _released(self.drafter.stub.Release(request, timeout=deadline), "drafter")
            )
            self._drafter_releases.add(task)
            task.add_done_callback(self._drafter_releases.discard)
        request = common_pb2.ReleaseRequest(seq_ids=[s.seq_id for s in seqs])
        await _released(self._verifier.Release(request, timeout=deadline), "verifier")


async def _released(call, service: str) -> None:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        logger.warning("%s release failed: %s", service, error.details())
