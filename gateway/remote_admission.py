"""Admission for the remote backend (``gateway.remote``): the scheduler admits waiting
requests in batches bounded by ``max_running``, the free KV slots the verifier reports
(``Capacity``) and one message, the first token streams right away, and each admitted
sequence joins the emptiest lane. Sequences the verifier may have lost (restart, outage)
wait, first in line, to be re-prefilled from the gateway's history; a request still waiting
after ``queue_timeout`` gets ``BackendBusy``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from gateway.backend import BackendBusy, BackendUnavailable, TokenDelta
from gateway.remote_seq import RemoteSeq
from lyanna.sequence import Sequence
from services import codec
from services.pb import common_pb2, verifier_pb2

logger = logging.getLogger(__name__)

# a verifier call that failed this way may have lost the sequences (restart, outage): they
# wait, up to queue_timeout, to be re-prefilled from the gateway's history and go on
RESUMABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED}
)


class Admission:
    """The admission half of ``RemoteBackend`` (a mixin: it works on the backend's
    scheduler, sequences, lanes, counters and verifier stub)."""

    @property
    def _waiting(self) -> list[RemoteSeq]:
        """The waiting sequences, first in line first."""
        return [self._seqs[s.seq_id] for s in self.scheduler.waiting]

    def _forget(self, seq: RemoteSeq) -> None:
        """Drop a waiting or running sequence from the scheduler (not from the services)."""
        self.scheduler.abort(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)

    def _drop(self, seqs: list[RemoteSeq], error: Exception) -> None:
        """Forget sequences (in the scheduler) and fail their requests with ``error``."""
        for seq in seqs:
            self._forget(seq)
            seq.deliver(error)

    def _expire(self, seq: RemoteSeq) -> None:
        """A request still waiting for a slot after ``queue_timeout`` gets BackendBusy; one
        waiting to be re-prefilled (the verifier lost it) gets BackendUnavailable once its
        own deadline passes, even when no slot ever comes back (no wait forever)."""
        if seq not in self._waiting:
            return
        timeout = self.config.queue_timeout
        if seq.resume_by is None:
            self._drop([seq], BackendBusy(f"no sequence slot became free within {timeout:g} s"))
        elif time.monotonic() >= seq.resume_by:
            lost = f"the verifier lost this request; not resumed in {timeout:g} s"
            self._drop([seq], BackendUnavailable(lost))

    # -- admission -------------------------------------------------------------------------

    async def _admit_loop(self) -> None:
        while not self._closing:
            await self._admit.wait()
            self._admit.clear()
            while self.scheduler.waiting and not self._closing:
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
                if self.scheduler.num_free <= 0:
                    break
                try:
                    capacity = await self._verifier.Capacity(
                        verifier_pb2.CapacityRequest(), timeout=self.config.control_deadline
                    )
                except grpc.aio.AioRpcError as error:
                    self._fail_waiting(error)
                    break
                if capacity.free_slots <= 0:  # slots held elsewhere: look again shortly
                    asyncio.get_running_loop().call_later(0.2, self._admit.set)
                    break
                batch = self._take_batch(capacity.free_slots)
                try:
                    await self._prefill(batch)
                except Exception:  # a bug must not stop admission
                    logger.exception("prefill failed")
                    self._drop(batch, BackendUnavailable("internal error (logged)"))

    def _take_batch(self, room: int) -> list[RemoteSeq]:
        """Up to ``room`` waiting sequences whose inline prompt hidden states fit one message
        (``max_hidden_bytes``) together; one that alone does not fit is prefilled without them
        and decodes target-only (its tokens stay exact), instead of failing the Prefill."""
        for seq in self._waiting:
            if seq.cancelled:  # put back in line (a retry) while it was in flight
                self._forget(seq)
        inline = (
            self.drafter is not None and self.drafter.needs_hidden and not self.drafter.plane_ok
        )
        budget = self.config.max_hidden_bytes

        def fits(sequence: Sequence, batch: list[Sequence]) -> bool:
            nonlocal budget
            seq = self._seqs[sequence.seq_id]
            size = len(seq.history or sequence.prompt_ids) * self.hidden_row_bytes
            wants = inline and self.drafter.wants_hidden(seq, True)
            if wants and size > self.config.max_hidden_bytes:
                seq.use_drafter = seq.keep_hidden = False  # too large for any message
            elif wants and batch and size > budget:
                return False  # the next Prefill takes it
            elif wants:
                budget -= size
            return True

        return [self._seqs[s.seq_id] for s in self.scheduler.schedule_prefill(room, fits)]

    def _fail_waiting(self, error: grpc.aio.AioRpcError) -> None:
        """The verifier is unreachable: new requests fail at once, resuming ones wait on."""
        failing = [s for s in self._waiting if not self._may_resume(s, error.code())]
        if failing:  # (retries while resuming ones wait log nothing each time)
            self._drop(failing, verifier_failure(error))
        if self.scheduler.waiting:
            asyncio.get_running_loop().call_later(0.5, self._admit.set)

    def _may_resume(self, seq: RemoteSeq, code: grpc.StatusCode) -> bool:
        return seq.resume_by is not None and code in RESUMABLE and time.monotonic() < seq.resume_by

    def _requeue(self, seqs: list[RemoteSeq]) -> None:
        """Sequences the verifier may have lost go first in line to be re-prefilled."""
        loop = asyncio.get_running_loop()
        for seq in seqs:
            seq.desync()  # the drafter restarts from the history too
            seq.may_hold_slot = True
            loop.call_later(max(0.0, seq.resume_by - time.monotonic()), self._expire, seq)
        self.scheduler.requeue([s.sequence for s in seqs])
        self._admit.set()

    async def _prefill(self, batch: list[RemoteSeq]) -> None:
        items = []
        for seq in list(batch):  # one request's bad field must not fail the others
            try:
                wants_hidden = self.drafter is not None and self.drafter.wants_hidden(seq, True)
                items.append(seq.prefill_item(wants_hidden))
            except (ValueError, TypeError) as error:
                batch.remove(seq)
                self._drop([seq], ValueError(f"the request cannot be encoded: {error}"))
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
            self.scheduler.requeue([s.sequence for s in retry])
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
            self._drop(batch, failure)
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
                item = self.scheduler.postprocess_prefill(seq.sequence, result.first_token)
                prompt_tokens = len(seq.sequence.prompt_ids)
                logprobs = None
                if result.HasField("first_logprob"):
                    logprobs = [codec.decode_logprob(result.first_logprob)][: len(item.tokens)]
                seq.deliver(
                    TokenDelta(
                        item.tokens,
                        seq.sequence.finish_reason,
                        prompt_tokens=prompt_tokens,
                        logprobs=logprobs,
                    )
                )
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
