"""Admission for the remote backend (``gateway.remote``): waiting requests are prefilled in
batches bounded by ``max_running`` and by the free KV slots the verifier reports
(``Capacity``), the first token streams right away, and each admitted sequence joins the
emptiest lane. Sequences the verifier may have lost (restart, outage) wait here, first in
line, to be re-prefilled from the gateway's history; a request still waiting after
``queue_timeout`` gets ``BackendBusy``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import grpc

from gateway.backend import BackendBusy, BackendUnavailable, TokenDelta
from gateway.remote_seq import RemoteSeq
from services import codec
from services.pb import common_pb2, verifier_pb2

logger = logging.getLogger(__name__)

# a verifier call that failed this way may have lost the sequences (restart, outage): they
# wait, up to queue_timeout, to be re-prefilled from the gateway's history and go on
RESUMABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED}
)


class Admission:
    """The admission half of ``RemoteBackend`` (a mixin: it works on the backend's queue,
    lanes, counters and verifier stub)."""

    def _expire(self, seq: RemoteSeq) -> None:
        """A request still waiting for a slot after ``queue_timeout`` gets BackendBusy; one
        waiting to be re-prefilled (the verifier lost it) gets BackendUnavailable once its
        own deadline passes, even when no slot ever comes back (no wait forever)."""
        if seq not in self._waiting:
            return
        timeout = self.config.queue_timeout
        if seq.resume_by is None:
            self._waiting.remove(seq)
            seq.deliver(BackendBusy(f"no sequence slot became free within {timeout:g} s"))
        elif time.monotonic() >= seq.resume_by:
            self._waiting.remove(seq)
            seq.deliver(
                BackendUnavailable(f"the verifier lost this request; not resumed in {timeout:g} s")
            )

    # -- admission -------------------------------------------------------------------------

    async def _admit_loop(self) -> None:
        while not self._closing:
            await self._admit.wait()
            self._admit.clear()
            while self._waiting and not self._closing:
                held = [s for s in self._waiting if s.resume_by is not None and s.may_hold_slot]
                # a verifier that only timed out may still hold their slots: free them before
                # counting free slots (or a full verifier never has room) and before prefilling
                # them again; retried until the verifier answers
                if held:
                    if not await self._release_on_verifier(held):
                        asyncio.get_running_loop().call_later(0.5, self._admit.set)
                        break
                    for seq in held:
                        seq.may_hold_slot = False
                room = self.config.max_running - self._num_running
                if room <= 0:
                    break
                try:
                    capacity = await self._verifier.Capacity(
                        verifier_pb2.CapacityRequest(), timeout=self.config.control_deadline
                    )
                except grpc.aio.AioRpcError as error:
                    self._fail_waiting(error)
                    break
                room = min(room, capacity.free_slots)
                if room <= 0:  # slots held elsewhere: look again shortly
                    asyncio.get_running_loop().call_later(0.2, self._admit.set)
                    break
                batch = self._take_batch(room)
                try:
                    await self._prefill(batch)
                except Exception:  # a bug must not stop admission
                    logger.exception("prefill failed")
                    for seq in batch:
                        seq.deliver(BackendUnavailable("internal error (logged)"))

    def _take_batch(self, room: int) -> list[RemoteSeq]:
        """Up to ``room`` waiting sequences whose inline prompt hidden states fit one message
        (``max_hidden_bytes``) together; one that alone does not fit is prefilled without them
        and decodes target-only (its tokens stay exact), instead of failing the Prefill."""
        inline = (
            self.drafter is not None and self.drafter.needs_hidden and not self.drafter.plane_ok
        )
        budget, batch = self.config.max_hidden_bytes, []
        while self._waiting and len(batch) < room:
            seq = self._waiting[0]
            size = len(seq.history or seq.sequence.prompt_ids) * self.hidden_row_bytes
            wants = inline and self.drafter.wants_hidden(seq, True)
            if wants and size > self.config.max_hidden_bytes:
                seq.use_drafter = seq.keep_hidden = False  # too large for any message
            elif wants and batch and size > budget:
                break  # the next Prefill takes it
            elif wants:
                budget -= size
            self._waiting.popleft()
            if not seq.cancelled:
                batch.append(seq)
        return batch

    def _fail_waiting(self, error: grpc.aio.AioRpcError) -> None:
        """The verifier is unreachable: new requests fail at once, resuming ones wait on."""
        waiting = self._waiting
        self._waiting = deque(s for s in waiting if self._may_resume(s, error.code()))
        failing = [s for s in waiting if s not in self._waiting]
        if failing:  # (retries while resuming ones wait log nothing each time)
            failure = verifier_failure(error)
            for seq in failing:
                seq.deliver(failure)
        if self._waiting:
            asyncio.get_running_loop().call_later(0.5, self._admit.set)

    def _may_resume(self, seq: RemoteSeq, code: grpc.StatusCode) -> bool:
        return seq.resume_by is not None and code in RESUMABLE and time.monotonic() < seq.resume_by

    def _requeue(self, seqs: list[RemoteSeq]) -> None:
        """Sequences the verifier may have lost go first in line to be re-prefilled."""
        self._num_running -= len(seqs)
        loop = asyncio.get_running_loop()
        for seq in seqs:
            seq.desync()  # the drafter restarts from the history too
            seq.may_hold_slot = True
            loop.call_later(max(0.0, seq.resume_by - time.monotonic()), self._expire, seq)
        self._waiting.extendleft(reversed(seqs))
        self._admit.set()

    async def _prefill(self, batch: list[RemoteSeq]) -> None:
        items = []
        for seq in list(batch):  # one request's bad field must not fail the others
            try:
                wants_hidden = self.drafter is not None and self.drafter.wants_hidden(seq, True)
                items.append(seq.prefill_item(wants_hidden))
            except (ValueError, TypeError) as error:
                batch.remove(seq)
                seq.deliver(ValueError(f"the request cannot be encoded: {error}"))
        if not batch:
            return
        try:
            response = await self._verifier.Prefill(
                verifier_pb2.PrefillRequest(items=items), timeout=self.config.prefill_deadline
            )
        except grpc.aio.AioRpcError as error:
            retry = [
                s
                for s in batch
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # slots went elsewhere
                or self._may_resume(s, error.code())
            ]
            for seq in retry:
                seq.may_hold_slot = True  # a prefill past its deadline may have run anyway
            self._waiting.extendleft(reversed(retry))
            if retry:
                asyncio.get_running_loop().call_later(0.2, self._admit.set)
            batch = [s for s in batch if s not in retry]
            if not batch:
                return
            failure: Exception = verifier_failure(error)
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the request's own fault
                failure = ValueError(error.details())
            else:  # e.g. past the deadline: the verifier may have prefilled them anyway
                await self._release_on_verifier(batch)
            for seq in batch:
                seq.deliver(failure)
            return
        finished = []
        for seq, result in zip(batch, response.results, strict=True):
            if result.prompt_hidden.WhichOneof("payload") == "tensor":
                rows = codec.decode_tensor(result.prompt_hidden.tensor)
                seq.keep_rows(rows, self.config.max_hidden_bytes, fresh=True)
            if seq.resume_by is not None:  # its history and next token are already known
                seq.resume_by = None
                self.num_resumed += 1
            else:
                seq.history = list(seq.sequence.prompt_ids)
                seq.next_token = result.first_token
                emitted = seq.sequence.append([result.first_token])
                prompt_tokens = len(seq.sequence.prompt_ids)
                seq.deliver(
                    TokenDelta(emitted, seq.sequence.finish_reason, prompt_tokens=prompt_tokens)
                )
            self._num_running += 1
            if seq.sequence.finished or seq.cancelled:
                finished.append(seq)
            else:
                lane = min(self._lanes, key=lambda lane: len(lane.seqs))
                lane.seqs.append(seq)
                lane.wake.set()
        if finished:
            await self._release(finished)

    async def _release_on_verifier(self, seqs: list[RemoteSeq]) -> bool:
        """Free whatever KV slots the verifier holds for these sequences (it releases unknown
        ids as a no-op); False when the call failed."""
        request = common_pb2.ReleaseRequest(seq_ids=[s.seq_id for s in seqs])
        try:
            await self._verifier.Release(request, timeout=self.config.control_deadline)
        except grpc.aio.AioRpcError as error:
            logger.warning("release on the verifier failed: %s", error.details())
            return False
        return True


def verifier_failure(error: grpc.aio.AioRpcError) -> BackendUnavailable:
    """What a client learns of a failed verifier call: the status code only. The details
    (peer addresses, internal messages) go to the log."""
    logger.warning("verifier call failed: %s: %s", error.code().name, error.details())
    return BackendUnavailable(f"verifier unavailable ({error.code().name})")
