"""The drafter gRPC servicer: any drafter of ``lyanna.drafters.DRAFTERS`` (or a custom
factory) in a ``lyanna.draft_session.DraftSession``, which keeps the one record of each
sequence, relaying each step's verification (docs/services.md, "One step of one micro-batch").

Start begins a sequence from its committed tokens (+ their target hidden states) and next
token. Step applies the caller's unseen quiet steps, proposes one tree per drafted sequence,
verifies the whole call in one ``Verify`` to ``--verifier`` (undrafted items root-only),
learns the outcome at once and returns it. ``services.codec`` checks each request first
(INVALID_ARGUMENT); a drafted item's ``SeqRef`` must match the session's record plus its
unseen steps (FAILED_PRECONDITION; NOT_FOUND for an unknown sequence). A failed drafter or
verifier call drops the drafted sequences (the caller re-Starts them); a failed verifier call
answers ABORTED and the caller re-runs the step directly (Verify answers a retried step with
what it committed). Each sequence is leased (``--lease-seconds``): Start and Step renew it,
a reaper drops what a dead gateway left, and a later Step for it answers NOT_FOUND.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator

import grpc
import torch

from lyanna.draft_session import DraftSession, Unseen
from lyanna.drafters import DraftBudget, Drafter, VerifiedStep
from lyanna.model import load_model
from lyanna.threads import serving_threads
from lyanna.tree import TokenTree
from services import codec
from services.config import ServerConfig
from services.data_plane import start_plane
from services.drafter.config import DrafterConfig, make_configured_drafter
from services.drafter.relay import VerifierLink, describe_failure, port_file_addr, verify_request
from services.hidden import HiddenReceiver
from services.metrics import DrafterMetrics
from services.pb import common_pb2, drafter_pb2, drafter_pb2_grpc
from services.server import (
    ComputeWatch,
    Leases,
    Service,
    ServiceError,
    WatchedLock,
    caller_gone,
    out_of_step,
    rpc_errors,
    run_service,
)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
log = logging.getLogger("lyanna.services.drafter")

__all__ = ["DrafterConfig", "DrafterServicer", "build_servicer", "main", "make_configured_drafter"]


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self,
        drafter: Drafter,
        config: DrafterConfig,
        receiver: HiddenReceiver,
        vocab_size: int,
        budget: DraftBudget | None = None,
        verifier: VerifierLink | None = None,  # None: Step is refused
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.drafter = drafter
        self.session = DraftSession(drafter)  # the one record of each sequence
        self.config = config
        self.budget = budget or config.shape()
        self.receiver = receiver
        self.vocab_size = vocab_size
        self.verifier = verifier
        self.metrics = DrafterMetrics()
        self.watch = ComputeWatch(clock)  # liveness: a forward hung under the lock
        self._lock = WatchedLock(self.watch)
        self.leases = Leases(config.lease_seconds, clock)

    @rpc_errors
    def Info(self, request, context) -> drafter_pb2.InfoResponse:
        return drafter_pb2.InfoResponse(
            method=self.config.method,
            scheme=codec.SCHEMES[self.drafter.scheme],
            needs_hidden=self.drafter.needs_hidden,
            max_draft_tokens=self.budget.max_tokens,
            max_depth=self.budget.depth,
            top_k=self.budget.top_k,
            verifier_linked=self.verifier is not None,
            drafts_in_verifier=self.config.drafts_in_verifier,
        )

    @rpc_errors
    def Start(self, request, context) -> drafter_pb2.StartResponse:
        jobs = codec.decode_start(request, self.vocab_size, self.drafter.needs_hidden)
        with self._lock:
            try:
                for job in jobs:
                    hidden = self._hidden(job.message, "prompt_hidden", len(job.prompt))
                    self.session.start(job.seq_id, job.prompt, hidden, job.first_token, job.params)
                    self.leases.hold(job.seq_id)
                    self.metrics.started(job.resync)
            finally:
                self.metrics.sequences.set(len(self.session))
                self.receiver.end_batch()
        return drafter_pb2.StartResponse(num_started=len(jobs))

    @rpc_errors
    def Step(self, request, context) -> Iterator[drafter_pb2.StepEvent]:
        """Draft, verify through the verifier, learn: one micro-batch, which the caller's
        deadline bounds and a failure retries whole, directly. Two events: ``drafted`` once
        the trees exist (the caller's proof this drafter is not stuck), then ``response``."""
        arrived = time.monotonic()
        jobs = codec.decode_step(request, self.vocab_size, self.drafter.needs_hidden)
        if self.verifier is None:
            raise out_of_step("this drafter has no verifier to verify through (--verifier)")
        self.leases.renew(job.seq_id for job in jobs)  # (an unknown one stays unknown)
        drafted = [job for job in jobs if job.draft]
        trees, quiet, marks, draft_seconds = self._draft(request, drafted, context, arrived)
        yield drafter_pb2.StepEvent(drafted=drafter_pb2.StepDrafted(draft_seconds=draft_seconds))
        plane = self.receiver.plane
        use_plane = bool(request.use_data_plane and plane is not None and plane.ready)
        items = [job.message for job in jobs]  # undrafted ones root-only, at their next token
        verify = verify_request(items, trees, self.drafter.needs_hidden, use_plane)
        try:
            sent = time.perf_counter()
            response = self.verifier.verify(verify, context.time_remaining())
            hop = time.perf_counter() - sent - response.forward_seconds
            if [r.ref.seq_id for r in response.results] != [job.seq_id for job in jobs]:
                raise ServiceError(grpc.StatusCode.INTERNAL, "the verifier answered other items")
        except (grpc.RpcError, ServiceError, ValueError) as error:  # (ValueError: no address)
            with self._lock:
                self._drop_all([job.seq_id for job in drafted])
            what = describe_failure(error) if isinstance(error, grpc.RpcError) else str(error)
            raise ServiceError(grpc.StatusCode.ABORTED, f"verifier: {what}") from None
        route = hop + (request.caller_hop_seconds or hop)  # (unmeasured: as far as ours)
        resampled, used_plane = self._learn_verified(jobs, response.results, marks, route)
        results = [
            drafter_pb2.StepResult(
                verified=result,
                num_resampled_accepted=resampled.get(job.seq_id, 0),
                quiet_steps=quiet.get(job.seq_id, 0),
            )
            for job, result in zip(jobs, response.results, strict=True)
        ]
        reply = drafter_pb2.StepResponse(
            results=results,
            draft_seconds=draft_seconds,
            forward_seconds=response.forward_seconds,
            used_data_plane=used_plane,
            handled_seconds=time.monotonic() - arrived,
        )
        yield drafter_pb2.StepEvent(response=reply)

    def _draft(
        self, request, drafted: list[codec.StepJob], context, arrived: float
    ) -> tuple[dict[int, TokenTree], dict[int, int], dict, float]:
        """Learn the unseen steps and propose a tree per drafted job: the trees and quiet
        steps by sequence, the session's marks for ``learn`` and the seconds it took."""
        ids = [job.seq_id for job in drafted]
        with self._lock:
            try:
                for job in drafted:
                    unseen_tokens = sum(len(step.committed) for step in job.unseen)
                    self.session.check(job.seq_id, job.num_committed, unseen_tokens)
                unseen = [[self._unseen(step) for step in job.unseen] for job in drafted]
            finally:
                self.receiver.end_batch()
            if not context.is_active():  # waited past the caller's deadline: the gateway
                # will start these sequences again, so drop them rather than draft for no one
                self._drop_all(ids)
                raise caller_gone("nothing drafted")
            start = time.perf_counter()
            try:
                for seq_id, steps in zip(ids, unseen, strict=True):
                    self.metrics.learned(self.drafter, self.session.catch_up(seq_id, steps))
                trees = self.session.propose(ids, [job.next_token for job in drafted])
                quiet = {s: self.session.quiet_steps(s, codec.MAX_QUIET_STEPS) for s in ids}
            except Exception:
                self._drop_all(ids)
                raise
            draft_seconds = time.perf_counter() - start
            deadline = request.draft_deadline
            if deadline > 0 and time.monotonic() - arrived > deadline:
                self._drop_all(ids)
                raise ServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"drafting took over {deadline:g} s"
                )
            self.metrics.drafted(draft_seconds, trees)
            marks = self.session.marks(ids)
        return dict(zip(ids, trees, strict=True)), quiet, marks, draft_seconds

    def _learn_verified(
        self, jobs: list[codec.StepJob], results, marks: dict, route: float
    ) -> tuple[dict[int, int], bool]:
        """Hand each drafted sequence its verification (the caller gets inline hidden rows
        where it asked); returns the re-sampled accepted counts and whether rows came over the
        data plane."""
        steps: list[VerifiedStep] = []
        used_plane = any(r.hidden.WhichOneof("payload") == "plane" for r in results)
        with self._lock:
            try:
                for job, result in zip(jobs, results, strict=True):
                    needed = job.draft and self.drafter.needs_hidden
                    keep = job.message.return_hidden
                    rows = self.receiver.take(result, len(result.committed), needed, keep)
                    if job.draft:
                        steps.append(codec.verified_step(job.seq_id, result, rows))
                learned, resampled = self.session.learn(steps, marks, route)
                self.metrics.learned(self.drafter, learned)
            except Exception as error:  # committed on the verifier: the caller retries there
                self._drop_all([job.seq_id for job in jobs if job.draft])
                log.exception("learning a verified step failed")
                raise ServiceError(grpc.StatusCode.ABORTED, f"learning failed: {error}") from None
            finally:
                self.receiver.end_batch()
        return resampled, used_plane

    @rpc_errors
    def Release(self, request, context) -> common_pb2.ReleaseResponse:
        with self._lock:
            released = sum(self._drop(seq_id) for seq_id in request.seq_ids)
            self.metrics.sequences.set(len(self.session))
        return common_pb2.ReleaseResponse(num_released=released)

    def _unseen(self, step: drafter_pb2.VerifiedStep) -> Unseen:
        hidden = self._hidden(step, "hidden", len(step.committed))
        return Unseen(list(step.committed), hidden, step.next_token)

    def _hidden(self, message, field: str, num_rows: int) -> torch.Tensor | None:
        """The message's hidden rows when the drafter reads them (the codec checked that
        they are there)."""
        if not self.drafter.needs_hidden:
            return None
        return self.receiver.decode(getattr(message, field), num_rows)

    def _drop_all(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._drop(seq_id)
        self.metrics.sequences.set(len(self.session))

    def _drop(self, seq_id: int) -> bool:
        self.leases.drop(seq_id)
        return self.session.release(seq_id)

    def reclaim_expired(self) -> list[int]:
        """Drop every sequence whose lease ran out (its gateway is gone); the ids dropped."""
        if not self.leases.due():
            return []
        with self._lock:
            expired = self.leases.reclaim(self.session.release)
            self.metrics.sequences.set(len(self.session))
        return expired


def build_servicer(config: DrafterConfig, server_config: ServerConfig) -> DrafterServicer:
    from lyanna.model import fetch_default_model

    path = config.model or fetch_default_model()
    model = load_model(path, config.torch_dtype, config.device, weights=config.weights)
    budget = config.budget(model)
    drafter = make_configured_drafter(config, model, budget)
    plane = start_plane(server_config, rank=1)
    device = model.embed_tokens.weight.device
    receiver = HiddenReceiver(model.config.hidden_size, model.dtype, plane, device=device)
    verifier, addr = None, config.verifier or None
    if addr is None and config.verifier_port_file:
        addr = port_file_addr(config.verifier_port_file)
    if addr is not None:
        tls, size = config.verifier_tls(), server_config.max_message_mb
        verifier = VerifierLink(addr, tls, size, config.verify_deadline)
    else:
        log.warning("no --verifier: Step is refused (the gateway decodes target-only)")
    return DrafterServicer(
        drafter, config, receiver, model.config.vocab_size, budget, verifier=verifier
    )


def start_service(config: DrafterConfig, server_config: ServerConfig) -> Service:
    torch.set_num_threads(serving_threads(server_config.torch_threads))
    servicer = build_servicer(config, server_config)
    servicer.leases.start_reaper(servicer.reclaim_expired)
    plane = servicer.receiver.plane

    def stop() -> None:
        if servicer.verifier is not None:
            servicer.verifier.close()
        if plane is not None:
            plane.close()

    add = functools.partial(drafter_pb2_grpc.add_DrafterServicer_to_server, servicer)
    return Service(
        SERVICE_NAME, add, servicer.metrics.registry, plane, on_stop=stop, watch=servicer.watch
    )


def main(argv: list[str] | None = None) -> int:
    return run_service("drafter", DrafterConfig, argv, __doc__, start_service)
