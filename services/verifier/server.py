"""The verifier gRPC servicer around ``lyanna.target.TargetRunner``.

Prefill fills each prompt's KV and decides its first token; Verify runs every tree of the call
in one target forward (a root-only item may ask for several decode steps, ``VerifyItem.steps``:
``lyanna.multi_step``) and returns the emitted tokens with the accepted paths' hidden states.
``services.codec`` checks each request first (INVALID_ARGUMENT) before any model work; a
sequence that is unknown answers NOT_FOUND, a committed length that disagrees
FAILED_PRECONDITION. Model work runs on one compute thread under one lock (its progress feeds
liveness); health, reflection and Capacity answer meanwhile.

Verify is idempotent per step: a drafter that relays a step may die after the verifier
committed it, and the gateway then retries the step directly with its own committed length
(the length *before* the last verification); it gets that verification's result again (kept
with its hidden rows), nothing runs twice. Each held sequence has a lease (``--lease-seconds``)
that each Prefill and Verify naming it renews; a reaper reclaims slots a dead gateway left, and
a late call for one answers NOT_FOUND (the gateway re-prefills it from its history: nothing
lost or duplicated). Lease and last step are one record (``Held``), held and dropped with the
slot and the free drafts' state of the sequence.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from lyanna.model import load_model
from lyanna.multi_step import FreeDrafts, Runs, verify_steps
from lyanna.target import TargetConfig, TargetRunner
from lyanna.threads import StepThreads, serving_threads
from services import codec
from services.config import ServerConfig
from services.data_plane import start_plane
from services.hidden import HiddenSender
from services.metrics import VerifierMetrics
from services.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from services.server import (
    ComputeThread,
    Lease,
    Leases,
    Service,
    ServiceError,
    caller_gone,
    out_of_step,
    rpc_errors,
    run_service,
)
from services.verifier.config import VerifierConfig

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
log = logging.getLogger("lyanna.services.verifier")


@dataclass(slots=True, eq=False)
class LastStep:
    """A sequence's last verification, answered again to a retry of the same step."""

    before: int  # committed length before it (the retry's ref)
    result: verifier_pb2.VerifyResult  # without hidden rows
    hidden: torch.Tensor | None  # its accepted-path rows, when they were computed


@dataclass(slots=True, eq=False)
class Held(Lease):
    """The verifier's record of a sequence beside the runner's (``TargetRunner``: slot, params,
    next token): its lease and last step. Prefill holds it with the slot and the free drafts'
    state of the sequence, ``_forget`` drops all three: nothing is half-released."""

    last: LastStep | None = None


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(
        self,
        runner: TargetRunner,
        config: VerifierConfig,
        sender: HiddenSender,
        model_name: str = "",
        threads: StepThreads | None = None,
        compute: ThreadPoolExecutor | None = None,
        free: FreeDrafts | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner
        self.free = free or FreeDrafts()  # drafts for root-only steps that allow them
        self.config = config
        self.threads = threads  # None: leave torch's thread count alone
        self.sender = sender
        self.model_name = model_name
        self.vocab_size = runner.model.config.vocab_size
        self.metrics = VerifierMetrics(config.max_running)
        self.compute = ComputeThread(compute, clock)  # every model call: one thread, one lock
        self.watch = self.compute.watch  # its progress, for liveness
        self.leases: Leases[Held] = Leases(config.lease_seconds, clock)  # seq id -> its record

    @rpc_errors
    def Prefill(self, request, context) -> verifier_pb2.PrefillResponse:
        room = self.runner.max_len - self.config.max_tree_nodes
        jobs = codec.decode_prefill(request, self.vocab_size, room)
        start = time.perf_counter()

        def work() -> list[verifier_pb2.PrefillResult]:
            done, results, hidden = [], [], []
            try:
                for job in jobs:
                    if job.next_token is not None:  # the gateway's history is the truth: a
                        self._forget(job.seq_id)  # copy this verifier still holds is stale
                    prefilled = self.runner.prefill(  # (a duplicate is refused: nothing held)
                        job.seq_id, job.prompt, job.params, None, job.next_token, job.prompt_len
                    )
                    done.append(job.seq_id)  # its record and free drafts: every piece of its
                    self.leases.hold(job.seq_id, Held())  # state starts here, ends in _forget
                    self.free.start(job.seq_id, job.prompt, prefilled.first_token, job.params)
                    hidden.append(prefilled.hidden if job.return_hidden else None)
                    results.append(codec.encode_prefilled(job.seq_id, prefilled))
                if not context.is_active():  # the caller gave up (deadline, cancel): keep no slot
                    raise caller_gone("its sequences were released")
            except Exception:
                for seq_id in done:
                    self._forget(seq_id)
                raise
            finally:
                self.metrics.slots(self.runner.num_free_slots)
            for result, message in zip(results, self.sender.encode(hidden), strict=True):
                if message is not None:
                    result.prompt_hidden.CopyFrom(message)
            return results

        results = self.compute.run(work)
        seconds = time.perf_counter() - start
        self.metrics.forward_seconds.labels("prefill").observe(seconds)
        self.metrics.prefill_tokens.inc(sum(len(job.prompt) for job in jobs))
        return verifier_pb2.PrefillResponse(results=results, forward_seconds=seconds)

    @rpc_errors
    def Verify(self, request, context) -> verifier_pb2.VerifyResponse:
        jobs = codec.decode_verify(request, self.vocab_size, self.config.max_tree_nodes)
        if not jobs:
            return verifier_pb2.VerifyResponse()
        self.leases.renew(job.seq_id for job in jobs)  # on arrival: a queued call keeps its slots

        def work() -> tuple[list[LastStep], list, float]:
            if not context.is_active():  # waited past the caller's deadline: verify nothing,
                # so the verifier commits no token the gateway never learns of
                raise caller_gone("nothing verified")
            last = [self._replay(job) for job in jobs]
            fresh = [job for job, replay in zip(jobs, last, strict=True) if replay is None]
            for job in fresh:
                self._check_ref(job)
            start = time.perf_counter()
            if fresh:
                if self.threads is not None:
                    self.threads.apply(len(fresh))
                runs = verify_steps(
                    self.runner,
                    [job.seq_id for job in fresh],
                    [job.tree for job in fresh],
                    [job.steps for job in fresh],
                    self.free,
                    [job.free_drafts for job in fresh],
                    self.metrics.verified,
                )
                remembered = iter(map(self._remember, fresh, runs))
                last = [replay or next(remembered) for replay in last]
            forward_seconds = time.perf_counter() - start
            rows = [s.hidden if j.return_hidden else None for j, s in zip(jobs, last, strict=True)]
            encoded = self.sender.encode(rows, use_plane=request.use_data_plane)
            return last, encoded, forward_seconds

        last, encoded, forward_seconds = self.compute.run(work)
        results = [verifier_pb2.VerifyResult() for _ in last]
        for result, step, message in zip(results, last, encoded, strict=True):
            result.CopyFrom(step.result)
            if message is not None:
                result.hidden.CopyFrom(message)
        return verifier_pb2.VerifyResponse(results=results, forward_seconds=forward_seconds)

    def _replay(self, job: codec.VerifyJob) -> LastStep | None:
        """The last verification of the job's sequence when the job retries it (its ref is
        the length before that verification, and nothing was committed since)."""
        last = getattr(self.leases.get(job.seq_id), "last", None)
        if last is None or last.before != job.num_committed:
            return None
        if self.runner.num_committed(job.seq_id) != last.result.ref.num_committed:
            return None  # (committed since: a stale ref, refused by ``_check_ref``)
        seq_id, before = job.seq_id, job.num_committed
        log.info("sequence %d: the step at %d is retried; answered again", seq_id, before)
        return last

    def _check_ref(self, job: codec.VerifyJob) -> None:
        """The caller's committed length is ours, and the tree and steps fit the KV."""
        held = self.runner.num_committed(job.seq_id)  # NOT_FOUND when unknown
        if held != job.num_committed:
            raise out_of_step(
                f"sequence {job.seq_id}: caller has {job.num_committed} committed tokens, "
                f"the verifier has {held}"
            )
        if held + job.tree.num_nodes + job.steps - 1 > self.runner.max_len:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"sequence {job.seq_id} has no room for a {job.tree.num_nodes}-node tree and "
                f"{job.steps} steps",
            )

    def _remember(self, job: codec.VerifyJob, runs: Runs) -> LastStep:
        """Keep a verification (its hidden rows too: a retry may ask for them) as the
        sequence's last."""
        rows = None
        if all(v.hidden is not None for _, v in runs):  # a copy: not a view of the batch's rows
            rows = torch.cat([v.hidden for _, v in runs]).clone()
        result = codec.encode_verify_result(job.seq_id, runs)
        self.leases.get(job.seq_id).last = step = LastStep(job.num_committed, result, rows)
        return step

    def _forget(self, seq_id: int) -> bool:
        """Drop every piece of a sequence's state, the slot before the free drafts (whatever
        fails, no slot stays held without a lease to reclaim it); False when unknown."""
        self.leases.drop(seq_id)
        released = self.runner.release(seq_id)
        self.metrics.slots(self.runner.num_free_slots)
        self.free.release(seq_id)
        return released

    @rpc_errors
    def Release(self, request, context) -> common_pb2.ReleaseResponse:
        released = self.compute.run(lambda: sum(map(self._forget, request.seq_ids)))
        return common_pb2.ReleaseResponse(num_released=released)

    def reclaim_expired(self) -> list[int]:
        """Release every sequence whose lease ran out (on the compute thread, under the model
        lock, so no call of it is running); the ids reclaimed."""
        if not self.leases.due():  # (idle: no compute job)
            return []
        return self.compute.run(functools.partial(self.leases.reclaim, self._forget))

    @rpc_errors
    def Capacity(self, request, context) -> verifier_pb2.CapacityResponse:
        return verifier_pb2.CapacityResponse(
            free_slots=self.runner.num_free_slots,
            total_slots=self.config.max_running,
            max_len=self.runner.max_len,
            vocab_size=self.vocab_size,
            hidden_size=self.runner.model.config.hidden_size,
            model=self.model_name,
            hidden_dtype=codec.DTYPE_NAMES[self.runner.model.dtype],
            reserved_rows=self.config.max_tree_nodes,
            free_drafts=self.free.drafter is not None,
        )


def build_servicer(
    config: VerifierConfig,
    server_config: ServerConfig,
    compute: ThreadPoolExecutor | None = None,
) -> VerifierServicer:
    from lyanna.model import fetch_default_model

    path = config.model or str(fetch_default_model())
    model = load_model(path, config.torch_dtype, config.device, weights=config.weights)
    runner = TargetRunner(model, TargetConfig(config.max_running, config.max_len, config.rule))
    free = FreeDrafts.build(model, config.free_drafts)
    plane = start_plane(server_config, rank=0)
    return VerifierServicer(
        runner, config, HiddenSender(plane), model_name=path, compute=compute, free=free
    )


def start_service(config: VerifierConfig, server_config: ServerConfig) -> Service:
    # every CPU: its forwards are the step (on 2 cores beside the drafter and the gateway,
    # 6-27 % more tokens/s than one thread at c = 1, 4, 16; docs/benchmarks.md)
    count = serving_threads(server_config.torch_threads, reserved=0)
    threads = StepThreads(count, count)
    compute = ThreadPoolExecutor(1, thread_name_prefix="verifier-compute")

    def build() -> VerifierServicer:  # on the compute thread: one OpenMP team in the process
        threads.apply(count)  # set before the model loads and its costs are measured
        return build_servicer(config, server_config, compute)

    servicer = compute.submit(build).result()
    servicer.threads = threads
    servicer.leases.start_reaper(servicer.reclaim_expired)
    plane = servicer.sender.plane
    return Service(
        SERVICE_NAME,
        functools.partial(verifier_pb2_grpc.add_VerifierServicer_to_server, servicer),
        servicer.metrics.registry,
        plane,
        on_stop=plane.close if plane else None,
        watch=servicer.watch,
    )


def main(argv: list[str] | None = None) -> int:
    return run_service("verifier", VerifierConfig, argv, __doc__, start_service)
