"""The remote backend's link to the drafter service: proposing trees for a micro-batch,
(re)starting sequences from their committed history, the circuit breaker behind the
target-only fallback, and the verified steps the drafter has yet to see.

A drafter call that fails for an unreachable or late drafter opens the breaker for
``retry_seconds`` (those steps verify root-only trees); NOT_FOUND / FAILED_PRECONDITION mean
the drafter lost or disagrees about a sequence, which is then started again from its full
history; INVALID_ARGUMENT / RESOURCE_EXHAUSTED (cannot parse or hold it) leave that sequence
target-only for good. Target-only steps are exact, so none of this changes the output.

A gated drafter says how many of a sequence's next steps it will not draft
(``Proposal.quiet_steps``); those steps verify root-only trees without a drafter call (one
round trip per step instead of two), and their verifications ride along with the next
Propose, oldest first (``ProposeItem.quiet``).
"""

from __future__ import annotations

import logging
import time

import grpc

from gateway.remote_config import RemoteConfig
from gateway.remote_seq import RemoteSeq
from services.pb import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2

logger = logging.getLogger(__name__)

STATE_ERRORS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
MAX_QUIET_STEPS = 64  # the most quiet steps trusted from one proposal (the drafter's bound)


class DrafterLink:
    def __init__(self, stub: drafter_pb2_grpc.DrafterStub, config: RemoteConfig) -> None:
        self.stub = stub
        self.method = config.method
        self.draft_deadline, self.control_deadline = config.draft_deadline, config.control_deadline
        self.retry_seconds = config.drafter_retry_seconds
        self.plane_ok = config.use_data_plane  # off for good once the drafter has failed
        self.needs_hidden = True  # until the drafter says otherwise
        self.budget = 0  # max draft tokens (the budget of verifier-side fusion)
        self.num_plane_transfers = 0  # verified steps whose hidden rows used the data plane
        self.num_starts = 0  # sequences started on the drafter (first starts + resyncs)
        self.num_propose_calls = 0
        self._down_until = 0.0
        self._error = ""

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def status(self) -> str:
        return "ok" if self.available else f"fallback: {self._error}"

    async def describe(self) -> bool:
        """Learn the drafter's method, budget and whether it reads hidden states."""
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
        return True

    async def propose(self, batch: list[RemoteSeq]) -> dict[int, drafter_pb2.Proposal]:
        """One tree per drafted sequence of the batch; {} when the step must run target-only."""
        for seq in batch:
            seq.quiet_step = False
        await self._drain(batch)
        drafted = [s for s in batch if s.use_drafter]
        if not drafted or not self.available:
            return {}
        stale = [s for s in drafted if not s.drafter_synced]
        if stale and not await self._start(stale):
            return {}
        ready = [s for s in drafted if s.drafter_synced and s.use_drafter]
        for seq in ready:  # a quiet step verifies root-only without asking the drafter (its
            # hidden rows would go over a data plane only a Propose drains: not with one)
            seq.quiet_step = seq.quiet_left > 0 and not self.plane_ok
            seq.quiet_left -= seq.quiet_step
        ready = [s for s in ready if not s.quiet_step]
        if not ready:
            return {}
        request = drafter_pb2.ProposeRequest(items=[s.propose_item() for s in ready])
        self.num_propose_calls += 1
        try:
            response = await self.stub.Propose(request, timeout=self.draft_deadline)
        except grpc.aio.AioRpcError as error:
            self._failed(error, ready)
            return {}
        if len(response.proposals) != len(ready):
            logger.warning("drafter answered %d of %d", len(response.proposals), len(ready))
            for seq in ready:
                seq.desync()
            return {}
        proposals = {}
        for seq, proposal in zip(ready, response.proposals, strict=True):
            seq.pending_step, seq.unseen_steps = None, []
            seq.quiet_left = min(proposal.quiet_steps, MAX_QUIET_STEPS)
            seq.drafter_committed = proposal.ref.num_committed
            seq.resampled_accepted += proposal.num_resampled_accepted
            tree = proposal.tree
            if (
                proposal.ref.seq_id != seq.seq_id
                or not tree.tokens
                or tree.tokens[0] != (seq.next_token)
            ):
                logger.warning("drafter proposed a tree for the wrong root; target-only step")
                seq.desync()
                continue
            proposals[seq.seq_id] = proposal
        return proposals

    def wants_hidden(self, seq: RemoteSeq, proposed: bool) -> bool:
        """Ask the verifier for the accepted path's hidden states of this sequence?"""
        wanted = seq.keep_hidden or proposed or seq.quiet_step
        return seq.use_drafter and self.needs_hidden and wanted

    def learn(self, seq: RemoteSeq, result: verifier_pb2.VerifyResult) -> None:
        """Queue a verification for the drafter's next Propose of this sequence."""
        if seq.quiet_step and seq.drafter_synced and seq.pending_step is not None:
            seq.unseen_steps.append(seq.pending_step)  # the step before: root-only too
            seq.pending_step = None
        if not (seq.use_drafter and seq.drafter_synced) or seq.pending_step is not None:
            if seq.pending_step is not None:  # it missed a step (fallback): start it again
                seq.desync()
            if result.hidden.HasField("plane"):  # rows nobody will ask for: drain them
                seq.dropped_refs.append(_copy(result.hidden.plane))
            return
        seq.pending_step = drafter_pb2.VerifiedStep(
            committed=result.committed,
            next_token=result.tokens[-1],
            num_accepted=result.num_accepted,
        )
        if result.HasField("hidden"):
            seq.pending_step.hidden.CopyFrom(result.hidden)
            self.num_plane_transfers += result.hidden.WhichOneof("payload") == "plane"

    def release_request(
        self, leaving: list[RemoteSeq], staying: list[RemoteSeq]
    ) -> common_pb2.ReleaseRequest | None:
        """Release the leaving sequences and drain data-plane transfers only they would have
        consumed (so the verifier's sends complete)."""
        orphans = _orphans(
            [ref for s in leaving for ref in (*_take_dropped(s), _plane_ref(s)) if ref], staying
        )
        seq_ids = [s.seq_id for s in leaving if s.drafter_started]
        if not seq_ids and not orphans:
            return None
        return common_pb2.ReleaseRequest(seq_ids=seq_ids, discard=list(orphans.values()))

    async def _drain(self, batch: list[RemoteSeq]) -> None:
        """Have the drafter receive (and drop) the data-plane transfers that desynced
        sequences of the batch left unread and no sequence still in step will read, so the
        verifier's sends complete (best effort; the drafter skips transfers it already
        received, and one without a data plane has nothing to drain)."""
        if not self.available or not any(s.dropped_refs for s in batch):
            return  # (kept until the drafter is back)
        dropped = [ref for s in batch for ref in _take_dropped(s)]
        orphans = _orphans(dropped, batch)
        if not orphans:
            return
        request = common_pb2.ReleaseRequest(discard=list(orphans.values()))
        try:
            await self.stub.Release(request, timeout=self.control_deadline)
        except grpc.aio.AioRpcError as error:
            logger.warning("draining %d data-plane transfers failed: %s", len(orphans), error)

    async def _start(self, seqs: list[RemoteSeq]) -> bool:
        """(Re)start the drafter for ``seqs`` from their full history; False if it failed."""
        for seq in seqs:
            rows = sum(h.shape[0] for h in seq.hidden_history)
            if self.needs_hidden and rows != seq.num_committed:
                seq.use_drafter = False  # hidden states went over the data plane: no resync
        seqs = [s for s in seqs if s.use_drafter]
        try:
            started = [s.seq_id for s in seqs if s.drafter_started]
            if started:
                request = common_pb2.ReleaseRequest(seq_ids=started)
                await self.stub.Release(request, timeout=self.control_deadline)
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
            seq.drafter_synced, seq.pending_step = True, None
            seq.drafter_committed = seq.num_committed
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
        self._down_until = time.monotonic() + self.retry_seconds
        logger.warning(
            "drafter unavailable (%s: %s); target-only steps", self._error, error.details()
        )


def _plane_ref(seq: RemoteSeq) -> common_pb2.PlaneRef | None:
    step = seq.pending_step
    if step is None or step.hidden.WhichOneof("payload") != "plane":
        return None
    return step.hidden.plane


def _take_dropped(seq: RemoteSeq) -> list[common_pb2.PlaneRef]:
    dropped, seq.dropped_refs = seq.dropped_refs, []
    return dropped


def _orphans(
    refs: list[common_pb2.PlaneRef], readers: list[RemoteSeq]
) -> dict[int, common_pb2.PlaneRef]:
    """The transfers of ``refs`` that no pending step of ``readers`` will read."""
    live = {ref.transfer_id for s in readers if (ref := _plane_ref(s)) is not None}
    return {ref.transfer_id: ref for ref in refs if ref.transfer_id not in live}


def _copy(ref: common_pb2.PlaneRef) -> common_pb2.PlaneRef:
    out = common_pb2.PlaneRef()
    out.CopyFrom(ref)
    return out
