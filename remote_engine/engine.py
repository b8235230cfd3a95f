"""The remote engine: ``SpecEngine``'s step loop over the drafter and verifier services.

It is a ``lyanna.engine.StepLoop``, so it drives ``lyanna.scheduler`` exactly as the
in-process engine does: ``admit`` (``schedule_prefill`` then ``postprocess_prefill``), then
``step`` = ``decode_batch`` -> the services' step -> ``postprocess`` -> ``retire``. Only the
model work differs, and it runs as gRPC calls (async clients, a deadline on every call) on an
event loop of the engine's own (a thread), so the engine's methods are plain blocking calls
like ``SpecEngine``'s and one asyncio front (``lyanna.async_engine``) serves both.

- *Admission*: waiting sequences are prefilled in batches bounded by the scheduler's
  ``max_running``, the free KV slots the verifier reports (``Capacity``) and one message
  (``max_hidden_bytes`` of inline prompt hidden states).
- *Lanes*: with ``pipeline=True`` the decode batch is split in two lanes that step
  concurrently, so while the verifier verifies one the drafter drafts the other (the
  asynchronous pipeline); ``pipeline=False`` steps the batch as one lane. A lane's step is
  one drafter ``Step`` (the drafter drafts every tree, verifies them in one ``Verify`` to the
  verifier itself, learns the outcome and relays the verifier's results): one round trip on
  the critical path. The engine stays the source of truth of every sequence's tokens.
- *Plain steps together*: when no sequence of a lane drafts this step and the next ones are
  known to be plain (target-only methods, a gated drafter's quiet steps), the lane calls the
  verifier directly, and one ``Verify`` runs up to ``max_steps_per_call`` decode steps; the
  scheduler commits (``postprocess``) each of them as its own step.
- *Fallback*: when the drafter fails or misses ``draft_deadline`` the lane verifies root-only
  trees directly (plain target decoding, still exact) and the drafter is retried after
  ``drafter_retry_seconds`` (``remote_engine.drafter``). ``Verify`` is idempotent per step,
  so a step the drafter's verifier call already committed is answered again, not doubled; a
  sequence whose drafter state is in doubt is started again from its full committed history.
- *Resume*: a verifier call that failed as UNAVAILABLE, NOT_FOUND or DEADLINE_EXCEEDED may
  have lost the sequences: they go back first in line (``scheduler.requeue``) and are
  prefilled again from their history (with the next token already decided) within
  ``queue_timeout``, else they fail.
- *Errors*: a request that fails comes back as an ``Emitted`` with ``error`` set (it has
  left the scheduler): ``ValueError`` for the request's own fault, ``Unavailable`` else.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch

from lyanna.engine import StepLoop
from lyanna.scheduler import Emitted, Scheduler, SchedulerConfig, StepTiming
from lyanna.sequence import Sequence
from remote_engine.config import RemoteConfig
from remote_engine.drafter import DrafterLink
from remote_engine.seq import RemoteSeq, split_steps
from services import codec
from services.codec import TARGET_ONLY
from services.pb import common_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from services.tls import aio_channel

logger = logging.getLogger(__name__)

T = TypeVar("T")

# a verifier call that failed this way may have lost the sequences (restart, outage): they
# wait, up to queue_timeout, to be re-prefilled from the engine's history and go on
RESUMABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED}
)
ADMIT_RETRY_SECONDS = 0.2  # a full verifier: look again shortly
UNREACHABLE_RETRY_SECONDS = 0.5  # an unreachable verifier


class Unavailable(RuntimeError):
    """The services cannot serve this request (a gateway answers 503)."""


@dataclass(slots=True, eq=False)
class _Ran:
    """What a lane's step did for one of its sequences."""

    seq: RemoteSeq
    parts: list  # verifier_pb2.VerifyResult per decode step, oldest first
    direct: bool = False  # verified against the verifier directly (not relayed by the drafter)
    resampled: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    error: Exception | None = None  # the request fails
    resume: bool = False  # the verifier may have lost it: prefill it again


class RemoteEngine(StepLoop):
    supports_logprobs = True  # the verifier returns them (VerifyResult.logprobs)

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(SchedulerConfig(config.max_running))  # limits: start()
        self.default_method = config.method if config.drafter_addr else TARGET_ONLY
        self.methods = tuple(dict.fromkeys((self.default_method, TARGET_ONLY)))
        self.max_context = self.vocab_size = 0
        self.hidden_row_bytes = 0  # one hidden state on the wire (from the verifier's Capacity)
        self.num_fallback_steps = self.num_verify_calls = 0
        self.num_resumed = 0  # sequences re-prefilled after the verifier lost them
        self.drafter: DrafterLink | None = None  # None: target-only decoding
        self.verifier_drafted_method: str | None = None  # a method the verifier drafts itself
        self.verifier: verifier_pb2_grpc.VerifierStub | None = None
        self._seqs: dict[int, RemoteSeq] = {}  # the remote state of each scheduled sequence
        self._admit_after = 0.0  # monotonic: the verifier was full or down, ask again then
        self._channels: list[grpc.aio.Channel] = []
        self._drafter_releases: set[asyncio.Task] = set()  # best effort, off the step
        self.loop = asyncio.new_event_loop()  # every gRPC call runs on it
        self._io = threading.Thread(target=self.loop.run_forever, name="remote-io", daemon=True)

    # -- the services' event loop ------------------------------------------------------------

    def call(self, work: Awaitable[T]) -> T:
        """Run ``work`` on the engine's event loop and wait for it (not from that loop)."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def submit_io(self, make: Callable[[RemoteEngine], Awaitable[T]]) -> asyncio.Future:
        """``make(self)`` awaited on the engine's loop, as a future of the caller's loop (a
        gateway's health probe, a test's direct call to a service)."""

        async def run() -> T:
            return await make(self)

        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self.loop))

    def start(self) -> None:
        """Connect to the services and learn their limits (``Unavailable`` when the verifier
        does not answer)."""
        self._io.start()
        self.call(self._connect())

    def close(self) -> None:
        if self._io.is_alive():
            self.call(self._close())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._io.join()

    async def _connect(self) -> None:
        options = self.config.channel_options()
        channel = aio_channel(self.config.verifier_addr, self.config.tls, options)
        self._channels.append(channel)
        self.verifier = verifier_pb2_grpc.VerifierStub(channel)
        if self.config.drafter_addr:
            channel = aio_channel(self.config.drafter_addr, self.config.tls, options)
            self._channels.append(channel)
            self.drafter = DrafterLink(drafter_pb2_grpc.DrafterStub(channel), self.config)
        try:
            capacity = await self.verifier.Capacity(
                verifier_pb2.CapacityRequest(), timeout=self.config.control_deadline
            )
        except grpc.aio.AioRpcError as error:
            where = self.config.verifier_addr
            raise Unavailable(f"verifier at {where}: {error.details()}") from None
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

    async def _close(self) -> None:
        if self._drafter_releases:  # a second's grace; a stuck drafter's go with its channel
            await asyncio.wait(self._drafter_releases, timeout=1.0)
        for channel in self._channels:
            await channel.close()

    async def health(self) -> dict[str, str]:
        """Component -> "ok" or what is wrong (run it on the engine's loop: ``submit_io``)."""
        status = {}
        try:
            await self.verifier.Capacity(verifier_pb2.CapacityRequest(), timeout=2.0)
            status["verifier"] = "ok"
        except grpc.aio.AioRpcError as error:
            status["verifier"] = error.code().name  # details name peers: the log only
            logger.debug("verifier health: %s", error.details())
        if self.drafter is not None:
            status["drafter"] = self.drafter.status()
        return status

    # -- StepLoop --------------------------------------------------------------------------

    @property
    def num_verified_steps(self) -> int:
        """Sequence-steps verified."""
        return self.scheduler.stats.num_steps

    def serves(self, method: str) -> bool:
        return method in self.methods

    def submit(self, sequence: Sequence) -> None:
        super().submit(sequence)  # ValueError: an unknown method, or it cannot fit
        method = sequence.method
        verifier_drafts = method == self.verifier_drafted_method
        use_drafter = method != TARGET_ONLY and not verifier_drafts and self.drafter is not None
        seq = RemoteSeq(sequence, use_drafter, verifier_drafts)
        seq.keep_hidden = use_drafter and self.drafter.needs_hidden and not self.drafter.plane_ok
        self._seqs[sequence.seq_id] = seq

    def admit(self, limit: int | None = None) -> list[Emitted]:
        return self.call(self._admit(limit))

    def abort(self, seq_id: int) -> bool:
        seq = self._seqs.get(seq_id)
        if seq is None:
            return self.scheduler.abort(seq_id)
        holds = seq_id in self.running or seq.may_hold_slot or seq.drafter_started
        self._forget(seq)
        if holds:
            self.call(self._release([seq]))  # in both services
        return True

    def _speculate(self, batch: list[Sequence]) -> list[Emitted]:
        return self.call(self._step([self._seqs[s.seq_id] for s in batch]))

    def _free(self, sequences: list[Sequence]) -> None:
        seqs = [self._seqs[s.seq_id] for s in sequences if s.seq_id in self._seqs]
        if seqs:
            self.call(self._release(seqs))

    # -- admission ----------------------------------------------------------------------------

    @property
    def _waiting(self) -> list[RemoteSeq]:
        """The waiting sequences, first in line first."""
        return [self._seqs[s.seq_id] for s in self.scheduler.waiting]

    async def _admit(self, limit: int | None) -> list[Emitted]:
        now = time.monotonic()
        lost = [s for s in self._waiting if s.resume_by is not None and now >= s.resume_by]
        timeout = self.config.queue_timeout
        lost_error = Unavailable(f"the verifier lost this request; not resumed in {timeout:g} s")
        emitted = self._drop(lost, lost_error)
        if not self.scheduler.waiting or now < self._admit_after or self.scheduler.num_free <= 0:
            return emitted
        held = [s for s in self._waiting if s.resume_by is not None and s.may_hold_slot]
        # a verifier that only timed out may still hold their slots: free them before
        # counting free slots (or a full verifier never has room) and before prefilling them
        # again; retried until the verifier answers
        if held:
            if not await self._release_on_verifier(held):
                self._admit_after = now + UNREACHABLE_RETRY_SECONDS
                return emitted
            for seq in held:
                seq.may_hold_slot = False
        try:
            capacity = await self.verifier.Capacity(
                verifier_pb2.CapacityRequest(), timeout=self.config.control_deadline
            )
        except grpc.aio.AioRpcError as error:
            # new requests fail at once, resuming ones wait on (retried shortly)
            failing = [s for s in self._waiting if not self._may_resume(s, error.code())]
            self._admit_after = now + UNREACHABLE_RETRY_SECONDS
            return emitted + self._drop(failing, verifier_failure(error) if failing else None)
        if capacity.free_slots <= 0:  # slots held elsewhere
            self._admit_after = now + ADMIT_RETRY_SECONDS
            return emitted
        room = capacity.free_slots if limit is None else min(limit, capacity.free_slots)
        batch = self._take_batch(room)
        try:
            return emitted + await self._prefill(batch)
        except Exception:  # a bug must not stop admission
            logger.exception("prefill failed")
            return emitted + self._drop(batch, Unavailable("internal error (logged)"))

    def _take_batch(self, room: int) -> list[RemoteSeq]:
        """Up to ``room`` waiting sequences whose inline prompt hidden states fit one message
        (``max_hidden_bytes``) together; one that alone does not fit is prefilled without them
        and decodes target-only (its tokens stay exact), instead of failing the Prefill."""
        inline = (
            self.drafter is not None and self.drafter.needs_hidden and not self.drafter.plane_ok
        )
        budget = self.config.max_hidden_bytes

        def fits(sequence: Sequence, batch: list[Sequence]) -> bool:
            nonlocal budget
            seq = self._seqs[sequence.seq_id]
            # the rows of its prefill: the prompt, or (resuming) every committed token
            size = sequence.num_committed * self.hidden_row_bytes
            wants = inline and self.drafter.wants_hidden(seq, True)
            if wants and size > self.config.max_hidden_bytes:
                seq.use_drafter = seq.keep_hidden = False  # too large for any message
            elif wants and batch and size > budget:
                return False  # the next Prefill takes it
            elif wants:
                budget -= size
            return True

        return [self._seqs[s.seq_id] for s in self.scheduler.schedule_prefill(room, fits)]

    async def _prefill(self, batch: list[RemoteSeq]) -> list[Emitted]:
        items, emitted = [], []
        for seq in list(batch):  # one request's bad field must not fail the others
            try:
                wants_hidden = self.drafter is not None and self.drafter.wants_hidden(seq, True)
                items.append(seq.prefill_item(wants_hidden))
            except (ValueError, TypeError) as error:
                batch.remove(seq)
                emitted += self._drop([seq], ValueError(f"the request cannot be encoded: {error}"))
        if not batch:
            return emitted
        try:
            response = await self.verifier.Prefill(
                verifier_pb2.PrefillRequest(items=items), timeout=self.config.prefill_deadline
            )
        except grpc.aio.AioRpcError as error:
            return emitted + await self._prefill_failed(batch, error)
        for seq, result in zip(batch, response.results, strict=True):
            if result.prompt_hidden.WhichOneof("payload") == "tensor":
                rows = codec.decode_tensor(result.prompt_hidden.tensor)
                seq.keep_rows(rows, self.config.max_hidden_bytes, fresh=True)
            if seq.resume_by is not None:  # its committed tokens and next token are known
                seq.resume_by = None
                self.num_resumed += 1
                continue
            item = self.scheduler.postprocess_prefill(seq.sequence, result.first_token)
            if result.HasField("first_logprob"):
                item.logprobs = [codec.decode_logprob(result.first_logprob)][: len(item.tokens)]
            emitted.append(item)
        return emitted

    async def _prefill_failed(
        self, batch: list[RemoteSeq], error: grpc.aio.AioRpcError
    ) -> list[Emitted]:
        retry = [
            s
            for s in batch
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # slots went elsewhere
            or self._may_resume(s, error.code())
        ]
        for seq in retry:
            seq.may_hold_slot = True  # a prefill past its deadline may have run anyway
        self.scheduler.requeue([s.sequence for s in retry])
        if retry:
            self._admit_after = time.monotonic() + ADMIT_RETRY_SECONDS
        batch = [s for s in batch if s not in retry]
        if not batch:
            return []
        failure: Exception = verifier_failure(error)
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the request's own fault
            failure = ValueError(error.details())
        else:  # e.g. past the deadline: the verifier may have prefilled them anyway
            await self._release_on_verifier(batch)
        return self._drop(batch, failure)

    def _requeue(self, seqs: list[RemoteSeq]) -> None:
        """Sequences the verifier may have lost go first in line to be prefilled again."""
        for seq in seqs:
            seq.desync()  # the drafter restarts from the history too
            seq.may_hold_slot = True
        self.scheduler.requeue([s.sequence for s in seqs])

    def _may_resume(self, seq: RemoteSeq, code: grpc.StatusCode) -> bool:
        return seq.resume_by is not None and code in RESUMABLE and time.monotonic() < seq.resume_by

    # -- the step -------------------------------------------------------------------------------

    async def _step(self, batch: list[RemoteSeq]) -> list[Emitted]:
        """The decode batch's step: its lanes concurrently, then each verification committed
        by the scheduler (``postprocess``), step by step; sequences the verifier may have
        lost go back in line, failed ones leave with their error."""
        lanes = 2 if self.config.pipeline and len(batch) > 1 else 1
        runs = await asyncio.gather(*(self._run_lane(batch[i::lanes]) for i in range(lanes)))
        emitted = [item for ran in runs for item in self._postprocess(ran)]
        resuming = [r.seq for ran in runs for r in ran if r.resume]
        if resuming:
            self._requeue(resuming)
        for error in {id(r.error): r.error for ran in runs for r in ran if r.error}.values():
            failed = [r.seq for ran in runs for r in ran if r.error is error]
            for seq in failed:
                self._forget(seq)
            await self._release(failed)
            emitted += [Emitted(s.sequence, [], error=error) for s in failed]
        return emitted

    async def _run_lane(self, lane: list[RemoteSeq]) -> list[_Ran]:
        """One step of a lane, through the drafter when it drafts any sequence of it, else
        (or when that failed) directly against the verifier."""
        try:
            if self.drafter is not None:
                ready = await self.drafter.prepare(lane)
                if ready:
                    start = time.perf_counter()
                    response = await self.drafter.step(lane, ready)
                    if response is not None:
                        seconds = time.perf_counter() - start
                        verify_seconds = max(0.0, seconds - response.draft_seconds)
                        return [
                            _Ran(
                                seq,
                                [result.verified],
                                resampled=result.num_resampled_accepted,
                                draft_seconds=response.draft_seconds,
                                verify_seconds=verify_seconds,
                            )
                            for seq, result in zip(lane, response.results, strict=True)
                        ]
            return await self._verify(lane)
        except Exception:  # a bug must not strand the lane's requests
            logger.exception("lane step failed")
            failure = Unavailable("internal error (logged)")
            return [_Ran(seq, [], error=failure) for seq in lane]

    async def _verify(self, lane: list[RemoteSeq]) -> list[_Ran]:
        """Verify the lane's root-only trees directly (target-only, quiet and fallback
        steps). A step the verifier already committed (its relaying drafter failed) comes
        back as it was committed."""
        steps = self._plain_steps(lane)
        items = []
        for seq in lane:
            wants_hidden = self.drafter is not None and self.drafter.wants_hidden(seq, False)
            items.append(
                verifier_pb2.VerifyItem(
                    ref=seq.ref(),
                    tree=codec.root_only_tree(seq.sequence.next_token),
                    return_hidden=wants_hidden,
                    steps=steps,
                    free_drafts=seq.use_drafter or seq.verifier_drafts,  # (never for `ar`)
                )
            )
        start = time.perf_counter()
        try:
            response = await self.verifier.Verify(
                verifier_pb2.VerifyRequest(items=items), timeout=self.config.verify_deadline
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in RESUMABLE:
                logger.warning("verify failed (%s); resuming %d", error.code().name, len(lane))
                for seq in lane:
                    seq.resume_by = time.monotonic() + self.config.queue_timeout
                return [_Ran(seq, [], resume=True) for seq in lane]
            failure = verifier_failure(error)
            return [_Ran(seq, [], error=failure) for seq in lane]
        verify_seconds = (time.perf_counter() - start) / steps
        self.num_verify_calls += 1
        return [
            _Ran(seq, split_steps(result), direct=True, verify_seconds=verify_seconds)
            for seq, result in zip(lane, response.results, strict=True)
        ]

    def _plain_steps(self, lane: list[RemoteSeq]) -> int:
        """Decode steps one direct Verify may run for the lane: 1 unless no sequence drafts
        now or in the next steps (the fewest any sequence allows, at most
        ``max_steps_per_call``). A sequence allows its remaining tokens when it never drafts
        (target-only method, refused by the drafter), and 1 + its quiet steps when its drafter
        said it would not draft them; a fallback step allows 1."""
        allowed = self.config.max_steps_per_call
        for seq in lane:
            if self.drafter is not None and seq.use_drafter:
                if not seq.quiet_step:
                    return 1  # a fallback step: the drafter may be back next time
                allowed = min(allowed, 1 + seq.quiet_left)
            left = seq.sequence.params.max_tokens - len(seq.sequence.output_ids)
            allowed = min(allowed, left)
        return max(1, allowed)

    def _postprocess(self, ran: list[_Ran]) -> list[Emitted]:
        """A lane's verifications, one decode step at a time: learned (hidden rows, what the
        drafter must hear) and committed by the scheduler (the sequence's committed tokens
        and next token). Tokens decoded past a sequence's end are dropped with it."""
        fallback = {r.seq.seq_id: r.seq.use_drafter and not r.seq.quiet_step for r in ran}
        emitted: list[Emitted] = []
        for step in range(max((len(r.parts) for r in ran), default=0)):
            live = [r for r in ran if step < len(r.parts) and not r.seq.sequence.finished]
            if not live:
                break
            for r in live:
                if step:  # the drafter said so: a quiet step (see _plain_steps)
                    r.seq.quiet_step, r.seq.quiet_left = True, max(0, r.seq.quiet_left - 1)
                self._learn(r.seq, r.parts[step], r.direct)
            parts = [r.parts[step] for r in live]
            items = self.scheduler.postprocess([r.seq.sequence for r in live], parts)
            self.scheduler.record_drafter_facts(items, {r.seq.seq_id: r.resampled for r in live})
            for r, part, item in zip(live, parts, items, strict=True):
                item.timing = StepTiming(r.draft_seconds, r.verify_seconds)
                item.drafter_fallback = r.direct and fallback[r.seq.seq_id] and not step
                self.num_fallback_steps += item.drafter_fallback
                if r.direct and r.seq.use_drafter and part.num_drafted > 0:
                    item.source = "fallback"  # the verifier drafted a learned drafter's step
                if part.logprobs:  # one per verdict token; the emitted ones are a prefix
                    n = len(item.tokens)
                    item.logprobs = [codec.decode_logprob(e) for e in part.logprobs[:n]]
            emitted += items
        return emitted

    def _learn(self, seq: RemoteSeq, result: verifier_pb2.VerifyResult, direct: bool) -> None:
        """Before the scheduler commits a verification to the sequence: keep its hidden rows
        and (``direct``: one the drafter did not relay) tell the drafter link of it."""
        if seq.keep_hidden:
            if result.hidden.WhichOneof("payload") == "tensor":
                rows = codec.decode_tensor(result.hidden.tensor)
                seq.keep_rows(rows, self.config.max_hidden_bytes)
            elif self.drafter is not None and self.drafter.needs_hidden:  # (a history with a
                seq.keep_hidden, seq.hidden_history, seq.hidden_bytes = False, [], 0  # gap)
        if direct and self.drafter is not None:
            self.drafter.learn(seq, result)

    # -- leaving ----------------------------------------------------------------------------------

    def _forget(self, seq: RemoteSeq) -> None:
        """Drop a waiting or running sequence from the scheduler (not from the services)."""
        self.scheduler.abort(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)

    def _drop(self, seqs: list[RemoteSeq], error: Exception | None) -> list[Emitted]:
        """Forget sequences (in the scheduler): their requests fail with ``error``."""
        for seq in seqs:
            self._forget(seq)
        return [Emitted(s.sequence, [], error=error) for s in seqs]

    async def _release(self, seqs: list[RemoteSeq]) -> None:
        """Release sequences that left the scheduler in both services, best effort."""
        for seq in seqs:
            self._seqs.pop(seq.seq_id, None)
        deadline = self.config.control_deadline
        request = self.drafter.release_request(seqs) if self.drafter is not None else None
        if request is not None:  # not awaited here: a stuck drafter must not stall the step
            task = asyncio.get_running_loop().create_task(
                _released(self.drafter.stub.Release(request, timeout=deadline), "drafter")
            )
            self._drafter_releases.add(task)
            task.add_done_callback(self._drafter_releases.discard)
        request = common_pb2.ReleaseRequest(seq_ids=[s.seq_id for s in seqs])
        await _released(self.verifier.Release(request, timeout=deadline), "verifier")

    async def _release_on_verifier(self, seqs: list[RemoteSeq]) -> bool:
        """Free whatever KV slots the verifier holds for these sequences (it releases unknown
        ids as a no-op); False when the call failed."""
        request = common_pb2.ReleaseRequest(seq_ids=[s.seq_id for s in seqs])
        try:
            await self.verifier.Release(request, timeout=self.config.control_deadline)
        except grpc.aio.AioRpcError as error:
            logger.warning("release on the verifier failed: %s", error.details())
            return False
        return True


async def _released(call, service: str) -> None:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        logger.warning("%s release failed: %s", service, error.details())


def verifier_failure(error: grpc.aio.AioRpcError) -> Unavailable:
    """What a client learns of a failed verifier call: the status code only. The details
    (peer addresses, internal messages) go to the log."""
    logger.warning("verifier call failed: %s: %s", error.code().name, error.details())
    return Unavailable(f"verifier unavailable ({error.code().name})")
