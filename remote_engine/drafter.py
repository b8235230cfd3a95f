"""The remote engine's link to the drafter service: one ``Step`` per speculative step of a
micro-batch (the drafter drafts, verifies through the verifier itself and returns the
verifier's results), (re)starting sequences from their committed history, the circuit breaker
behind the target-only fallback, and the quiet steps the drafter has yet to see.

A Step that fails for an unreachable or late drafter opens the breaker for ``retry_seconds``
(those steps verify root-only trees directly against the verifier); NOT_FOUND /
FAILED_PRECONDITION mean the drafter lost or disagrees about a sequence, and ABORTED that its
verifier call failed: the step then runs directly (the verifier answers a step it already
committed again, so nothing is lost or doubled) and the drafted sequences are started again
from their full history; INVALID_ARGUMENT / RESOURCE_EXHAUSTED (cannot parse or hold it)
leave those sequences target-only for good. Target-only steps are exact, so none of this
changes the output.

A gated drafter says how many of a sequence's next steps it will not draft
(``StepResult.quiet_steps``). When every drafted sequence of a micro-batch is quiet, the step
verifies root-only trees directly, several steps per call when the batch allows, and the
verifications ride along with the sequence's next Step, oldest first (``StepItem.unseen``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from remote_engine.config import RemoteConfig
from remote_engine.seq import RemoteSeq
from services.codec import MAX_HOP_SECONDS, MAX_QUIET_STEPS
from services.pb import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2

logger = logging.getLogger(__name__)

STATE_ERRORS = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
)
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
HANG_GRACE_SECONDS = 1.0
MAX_STUCK_BACKOFF_SECONDS = 60.0  # the longest wait before asking a stuck drafter again


class DrafterLink:
    def __init__(self, stub: drafter_pb2_grpc.DrafterStub, config: RemoteConfig) -> None:
        self.stub = stub
        self.method = config.method
        self.draft_deadline, self.control_deadline = config.draft_deadline, config.control_deadline
        self.step_deadline = config.draft_deadline + config.verify_deadline
        # the drafter answers DEADLINE_EXCEEDED itself once drafting took draft_deadline; the
        # grace lets that answer arrive before the caller gives up on a silent drafter
        self.hang_seconds = config.draft_deadline + HANG_GRACE_SECONDS
        self.retry_seconds = config.drafter_retry_seconds
        self.plane_ok = config.use_data_plane  # off for good once the drafter has failed
        self.needs_hidden = True  # until the drafter says otherwise
        self.linked = True  # the drafter has a verifier to verify through (its Info says)
        self.drafts_in_verifier = False  # a verifier with free drafts can draft its trees
        self.budget = 0  # max draft tokens
        self.num_plane_transfers = 0  # Steps whose hidden rows used the data plane
        self.num_starts = 0  # sequences started on the drafter (first starts + resyncs)
        self.num_step_calls = 0
        # the last answered Step's wall time less the drafter's own: the hop a drafted step
        # adds, sent with the next Step for the drafter's gate (0 until measured)
        self.hop_seconds = 0.0
        self._down_until = 0.0
        self._error = ""
        # each try of a stuck drafter stalls its lane for hang_seconds, so consecutive stuck
        # Steps back off (2x hang_seconds, doubling, capped); any answered Step resets it
        self._stuck_backoff = 0.0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    @property
    def retry_in(self) -> float:
        """Seconds until the drafter is asked again (0 when it is in use)."""
        return max(0.0, self._down_until - time.monotonic())

    def status(self) -> str:
        return "ok" if self.available else f"fallback: {self._error}"

    async def describe(self) -> bool:
        """Learn the drafter's method, budget, whether it reads hidden states and whether it
        can verify."""
        try:
            info = await self.stub.Info(drafter_pb2.InfoRequest(), timeout=self.control_deadline)
        except grpc.aio.AioRpcError as error:
            self._unreachable(error)
            return False
        self.method, self.needs_hidden, self.budget = (
            info.method,
            info.needs_hidden,
            info.max_draft_tokens,
        )
        self.linked = info.verifier_linked
        self.drafts_in_verifier = info.drafts_in_verifier
        return True

    async def prepare(self, batch: list[RemoteSeq]) -> list[RemoteSeq]:
        """The sequences the drafter drafts this step, started first where needed; [] when the
        step runs directly against the verifier (nothing to draft, the breaker open, or every
        drafted sequence on a quiet step)."""
        for seq in batch:
            seq.quiet_step = False
        drafted = [s for s in batch if s.use_drafter]
        if not drafted or not self.available:
            return []
        stale = [s for s in drafted if not s.drafter_synced]
        if stale and not await self._start(stale):
            return []
        ready = [s for s in drafted if s.drafter_synced and s.use_drafter]
        if all(s.quiet_left > 0 for s in ready):  # a quiet step for all: no drafter call
            for seq in ready:
                seq.quiet_step, seq.quiet_left = True, seq.quiet_left - 1
            return []
        return ready  # (quiet ones too: the drafter learns their root-only steps at once)

    async def step(
        self, batch: list[RemoteSeq], ready: list[RemoteSeq]
    ) -> drafter_pb2.StepResponse | None:
        """One Step for the whole batch (``ready`` drafted, the others verified root-only in
        the same forward); None when it failed, with the drafted sequences desynced: the
        caller then runs the step directly."""
        drafted = {id(s) for s in ready}
        items = [
            s.step_item(id(s) in drafted, id(s) in drafted and self.wants_hidden(s, False))
            for s in batch
        ]
        request = drafter_pb2.StepRequest(
            items=items,
            use_data_plane=self.plane_ok,
            draft_deadline=self.draft_deadline,
            caller_hop_seconds=self.hop_seconds,
        )
        self.num_step_calls += 1
        sent = time.perf_counter()
        try:
            response = await self._step_response(
                self.stub.Step(request, timeout=self.step_deadline)
            )
        except grpc.aio.AioRpcError as error:
            self._failed(error, ready)
            return None
        if not _consistent(batch, response):
            logger.warning("the drafter's results do not match the batch; a direct step")
            for seq in ready:
                seq.desync()
            return None
        self._stuck_backoff = 0.0
        hop = time.perf_counter() - sent - response.handled_seconds
        self.hop_seconds = min(max(hop, 0.0), MAX_HOP_SECONDS)
        self.num_plane_transfers += response.used_data_plane
        for seq, result in zip(batch, response.results, strict=True):
            if id(seq) in drafted:
                seq.unseen_steps = []
                seq.quiet_left = min(result.quiet_steps, MAX_QUIET_STEPS)
        return response

    async def _step_response(self, call) -> drafter_pb2.StepResponse:
        """Read a Step's two events. No ``drafted`` event within ``hang_seconds`` means the
        drafter is stuck (a hung or frozen process): the call is cancelled and fails as
        DEADLINE_EXCEEDED at once, not after the whole step's deadline."""
        try:
            drafted = await asyncio.wait_for(call.read(), self.hang_seconds)
        except TimeoutError:
            call.cancel()
            self._stuck_backoff = min(
                MAX_STUCK_BACKOFF_SECONDS, max(2 * self.hang_seconds, 2 * self._stuck_backoff)
            )
            raise _error(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"nothing drafted in {self.hang_seconds:g} s"
            ) from None
        last = await call.read()
        if _event(drafted) != "drafted" or _event(last) != "response":
            call.cancel()
            raise _error(grpc.StatusCode.INTERNAL, "the drafter's Step events are out of order")
        return last.response

    def wants_hidden(self, seq: RemoteSeq, for_start: bool) -> bool:
        """Ask for the hidden states of this sequence's committed tokens? For its Start (the
        prompt's), to keep its history for a resync, and on a quiet step (the drafter gets
        them with the next Step)."""
        wanted = for_start or seq.keep_hidden or seq.quiet_step
        return seq.use_drafter and self.needs_hidden and wanted

    def learn(self, seq: RemoteSeq, result: verifier_pb2.VerifyResult) -> None:
        """A step verified directly against the verifier: a quiet one is queued for the
        drafter's next Step; any other is a step the drafter missed (start it again)."""
        if not (seq.use_drafter and seq.drafter_synced):
            return
        if not seq.quiet_step:
            seq.desync()
            return
        step = drafter_pb2.VerifiedStep(
            committed=result.committed,
            next_token=result.tokens[-1],
            num_accepted=result.num_accepted,
        )
        if result.HasField("hidden"):
            step.hidden.CopyFrom(result.hidden)
        seq.unseen_steps.append(step)

    def release_request(self, leaving: list[RemoteSeq]) -> common_pb2.ReleaseRequest | None:
        seq_ids = [s.seq_id for s in leaving if s.drafter_started]
        return common_pb2.ReleaseRequest(seq_ids=seq_ids) if seq_ids else None

    async def _start(self, seqs: list[RemoteSeq]) -> bool:
        """(Re)start the drafter for ``seqs`` from their full history; False if it failed."""
        for seq in seqs:
            rows = sum(h.shape[0] for h in seq.hidden_history)
            if self.needs_hidden and rows != seq.sequence.num_committed:
                seq.use_drafter = False  # hidden states went over the data plane: no resync
        seqs = [s for s in seqs if s.use_drafter]
        try:
            started = [s.seq_id for s in seqs if s.drafter_started]
            if started:
                request = common_pb2.ReleaseRequest(seq_ids=started)
                await self.stub.Release(request, timeout=self.control_deadline)
            # built before drafter_started is set: a sequence started before is a resync
            items = [s.start_item(self.needs_hidden) for s in seqs]
            for seq in seqs:
                seq.drafter_started = True
            if items:
                request = drafter_pb2.StartRequest(items=items)
                await self.stub.Start(request, timeout=self.control_deadline)
        except grpc.aio.AioRpcError as error:
            self._failed(error, seqs)
            return False
        self.num_starts += len(seqs)
        for seq in seqs:
            seq.drafter_synced = True
            if not seq.keep_hidden:
                seq.hidden_history, seq.hidden_bytes = [], 0
        return True

    def _failed(self, error: grpc.aio.AioRpcError, seqs: list[RemoteSeq]) -> None:
        for seq in seqs:
            seq.desync()
            if error.code() in REFUSED:
                seq.use_drafter = False
        if error.code() in STATE_ERRORS or error.code() in REFUSED:
            logger.warning("drafter refused %d sequences: %s", len(seqs), error.details())
        else:
            self._unreachable(error)

    def _unreachable(self, error: grpc.aio.AioRpcError) -> None:
        self.plane_ok = False  # a restarted drafter is not in the old process group
        self._error = error.code().name  # shown by /health: the details (peers) are logged
        self._down_until = time.monotonic() + max(self.retry_seconds, self._stuck_backoff)
        logger.warning(
            "drafter unavailable (%s: %s); target-only steps", self._error, error.details()
        )


def _event(event) -> str | None:
    return None if event is grpc.aio.EOF else event.WhichOneof("event")


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _consistent(batch: list[RemoteSeq], response: drafter_pb2.StepResponse) -> bool:
    """Each result names its sequence, in order, and commits what its length says."""
    if len(response.results) != len(batch):
        return False
    for seq, result in zip(batch, response.results, strict=True):
        verified = result.verified
        if verified.ref.seq_id != seq.seq_id or not verified.tokens:
            return False
        if verified.ref.num_committed != seq.sequence.num_committed + len(verified.committed):
            return False
    return True
