"""The verifier gRPC servicer around ``lyanna.target.TargetRunner``.

Prefill fills each prompt's KV and decides its first token; Verify checks every sequence's
``SeqRef`` (NOT_FOUND / FAILED_PRECONDITION), runs all trees of the call in one target forward
and returns the emitted tokens with the accepted path's hidden states. A root-only item may
ask for several plain decode steps (``VerifyItem.steps``): the call then runs that many
forwards, each step's token the next one's root, and returns them together. One lock
serializes model work; health, reflection and Capacity answer while a forward runs.

Verify is idempotent per step, so no token is lost or duplicated when the drafter that relays
a step dies after the verifier committed it and before the gateway heard: the gateway retries
the step directly with its own committed length, which is the sequence's length *before* the
last verification, and gets that verification's result again (kept per sequence with its
hidden rows) instead of a FAILED_PRECONDITION; nothing runs twice.

Every held sequence has a lease (``--lease-seconds``, default 60): each Prefill and Verify that
names it renews it, and a reaper reclaims the slots whose lease ran out, so a gateway that was
SIGKILLed or OOM-killed (no Release) does not hold its slots until the verifier restarts. A
late call for a reclaimed sequence gets NOT_FOUND, which the gateway answers by re-prefilling
it from its own history (nothing lost or duplicated). The compute thread's progress feeds the
liveness check (``services.server.ComputeWatch``): a hung forward turns it NOT_SERVING.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch

from lyanna.model import load_model
from lyanna.sampling import SamplingParams
from lyanna.target import TargetConfig, TargetRunner, Verified
from lyanna.threads import StepThreads, serving_threads
from lyanna.tree import TokenTree
from services import codec
from services.config import ServerConfig
from services.data_plane import DataPlane
from services.hidden import HiddenSender
from services.metrics import VerifierMetrics
from services.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from services.server import (
    ComputeWatch,
    Service,
    ServiceError,
    invalid,
    out_of_step,
    rpc_errors,
    run_service,
    start_lease_reaper,
)
from services.verifier.config import VerifierConfig
from services.verifier.free_drafts import FreeDrafts

T = TypeVar("T")

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
log = logging.getLogger("lyanna.services.verifier")


@dataclass(slots=True, eq=False)
class LastStep:
    """A sequence's last verification, answered again to a retry of the same step."""

    before: int  # committed length before it (the retry's ref)
    result: verifier_pb2.VerifyResult  # without hidden rows
    hidden: torch.Tensor | None  # its accepted-path rows, when they were computed


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
        self._last: dict[int, LastStep] = {}  # seq id -> its last verification
        self._lock = threading.Lock()
        # every model call on one thread (``compute``: the one that loaded the model): torch's
        # OpenMP team belongs to the thread that runs a parallel op, so forwards spread over
        # gRPC's workers each made a team of their own, and with more team threads than CPUs
        # libgomp stops spinning at barriers and sleeps (a 2-thread forward took 8.9 ms
        # against 4.4 on one thread)
        self._compute_thread = compute or ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.watch = ComputeWatch(clock)  # the compute thread's progress, for liveness
        self._clock = clock
        self._leases: dict[int, float] = {}  # seq id -> when its lease runs out (clock)
        self.num_reclaimed = 0  # slots whose lease ran out
        self._reaper: threading.Thread | None = None

    @rpc_errors
    def Prefill(
        self, request: verifier_pb2.PrefillRequest, context
    ) -> verifier_pb2.PrefillResponse:
        items = list(request.items)
        params = [codec.decode_params(item.params) for item in items]
        self._check_prompts(items, params)
        start = time.perf_counter()
        done: list[int] = []
        hidden: list[torch.Tensor | None] = []
        firsts: list = []  # the first token's TokenLogprob list, when asked

        def work() -> list[verifier_pb2.PrefillResult]:
            try:
                for item, item_params in zip(items, params, strict=True):
                    resume = item.next_token if item.HasField("next_token") else None
                    if resume is not None:  # the gateway's history is the truth: a copy this
                        self._forget(item.seq_id)  # verifier still holds is stale
                    prefilled = self.runner.prefill(
                        item.seq_id,
                        list(item.prompt_ids),
                        item_params,
                        next_token=resume,
                        prompt_len=item.prompt_len,
                    )
                    done.append(item.seq_id)
                    self._lease(item.seq_id)
                    first, prompt = prefilled.first_token, list(item.prompt_ids)
                    self.free.start(item.seq_id, prompt, first, item_params)
                    hidden.append(prefilled.hidden if item.return_hidden else None)
                    firsts.append(prefilled.logprobs)
            except Exception:
                for seq_id in done:
                    self._forget(seq_id)
                raise
            self.metrics.slots(self.runner.num_free_slots)
            if not context.is_active():  # the caller gave up (deadline, cancel): keep no slot
                for seq_id in done:
                    self._forget(seq_id)
                self.metrics.slots(self.runner.num_free_slots)
                raise ServiceError(
                    grpc.StatusCode.CANCELLED, "the caller is gone; its sequences were released"
                )
            encoded = self.sender.encode(hidden)
            return [
                verifier_pb2.PrefillResult(
                    ref=common_pb2.SeqRef(seq_id=item.seq_id, num_committed=len(item.prompt_ids)),
                    first_token=self.runner.next_token(item.seq_id),
                    prompt_hidden=message,
                    first_logprob=codec.encode_logprob(first[0]) if first else None,
                )
                for item, message, first in zip(items, encoded, firsts, strict=True)
            ]

        results = self._compute(work)
        seconds = time.perf_counter() - start
        self.metrics.forward_seconds.labels("prefill").observe(seconds)
        self.metrics.prefill_tokens.inc(sum(len(item.prompt_ids) for item in items))
        return verifier_pb2.PrefillResponse(results=results, forward_seconds=seconds)

    @rpc_errors
    def Verify(self, request, context) -> verifier_pb2.VerifyResponse:
        items = list(request.items)
        if not items:
            return verifier_pb2.VerifyResponse()
        seq_ids = [item.ref.seq_id for item in items]
        if len(set(seq_ids)) != len(seq_ids):
            raise invalid("a sequence may appear once per Verify call")
        trees = [self._tree_of(item) for item in items]
        self._renew(seq_ids)  # on arrival: a call queued behind others keeps its slots

        def work() -> tuple[dict[int, LastStep], list, float]:
            if not context.is_active():  # waited past the caller's deadline: verify nothing,
                # so the verifier commits no token the gateway never learns of
                raise ServiceError(
                    grpc.StatusCode.CANCELLED, "the caller is gone; nothing verified"
                )
            replays = {i: last for i, item in enumerate(items) if (last := self._replay(item))}
            fresh = [i for i in range(len(items)) if i not in replays]
            for i in fresh:
                self._check_ref(items[i].ref)
                rows = items[i].ref.num_committed + trees[i].num_nodes + max(items[i].steps, 1) - 1
                if rows > self.runner.max_len:
                    raise ServiceError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"sequence {seq_ids[i]} has no room for a {trees[i].num_nodes}-node "
                        f"tree and {max(items[i].steps, 1)} steps",
                    )
            start = time.perf_counter()
            if fresh:
                if self.threads is not None:
                    self.threads.apply(len(fresh))
                verified = self._verify_steps(
                    [seq_ids[i] for i in fresh],
                    [trees[i] for i in fresh],
                    [max(items[i].steps, 1) for i in fresh],
                    [items[i].free_drafts for i in fresh],
                )
                for i, runs in zip(fresh, verified, strict=True):
                    replays[i] = self._remember(items[i].ref, runs)
            forward_seconds = time.perf_counter() - start
            hidden = [
                replays[i].hidden if item.return_hidden else None for i, item in enumerate(items)
            ]
            encoded = self.sender.encode(hidden, use_plane=request.use_data_plane)
            return replays, encoded, forward_seconds

        replays, encoded, forward_seconds = self._compute(work)
        results = []
        for i, message in enumerate(encoded):
            result = verifier_pb2.VerifyResult()
            result.CopyFrom(replays[i].result)
            if message is not None:
                result.hidden.CopyFrom(message)
            results.append(result)
        return verifier_pb2.VerifyResponse(results=results, forward_seconds=forward_seconds)

    def _replay(self, item: verifier_pb2.VerifyItem) -> LastStep | None:
        """The last verification of the item's sequence when the item retries it (its ref is
        the length before that verification, and nothing was committed since)."""
        last = self._last.get(item.ref.seq_id)
        if last is None or last.before != item.ref.num_committed:
            return None
        if self.runner.num_committed(item.ref.seq_id) != last.result.ref.num_committed:
            return None
        log.info("sequence %d: the step at %d is retried; answered again", *_ref(item))
        return last

    def _remember(self, ref: common_pb2.SeqRef, runs: list[tuple[TokenTree, Verified]]) -> LastStep:
        """Keep a verification (its hidden rows too: a retry may ask for them) as the
        sequence's last."""
        (first_tree, first), (_, last) = runs[0], runs[-1]
        result = verifier_pb2.VerifyResult(
            ref=common_pb2.SeqRef(seq_id=ref.seq_id, num_committed=last.num_committed),
            committed=[token for _, v in runs for token in v.committed],
            tokens=[token for _, v in runs for token in v.verdict.tokens],
            num_accepted=first.verdict.num_accepted,
            num_drafted_per_depth=first.verdict.num_drafted_per_depth,
            num_drafted=first_tree.num_drafted,
            num_steps=len(runs),
        )
        if all(v.logprobs is not None for _, v in runs):  # one per token, when asked
            result.logprobs.extend(codec.encode_logprob(e) for _, v in runs for e in v.logprobs)
        if len(runs) > 1 and any(tree.num_drafted for tree, _ in runs):  # free drafts
            result.step_accepted.extend(v.verdict.num_accepted for _, v in runs)
            result.step_drafted.extend(tree.num_drafted for tree, _ in runs)
        rows = None
        if all(v.hidden is not None for _, v in runs):  # a copy: not a view of the batch's rows
            rows = torch.cat([v.hidden for _, v in runs]).clone()
        self._last[ref.seq_id] = step = LastStep(ref.num_committed, result, rows)
        return step

    def _forget(self, seq_id: int) -> bool:
        self._leases.pop(seq_id, None)
        self._last.pop(seq_id, None)
        self.free.release(seq_id)
        return self.runner.release(seq_id)

    def _verify_steps(
        self,
        seq_ids: list[int],
        trees: list[TokenTree],
        steps: list[int],
        free: list[bool],
    ) -> list[list[tuple[TokenTree, Verified]]]:
        """Each sequence's verifications: its tree, then decode steps until ``steps`` tokens
        are committed (one per plain step, more with ``free`` drafts: never past what the
        caller allowed), with the accepted paths' hidden rows (a retry may ask for them)."""
        runs: list[list[tuple[TokenTree, Verified]]] = [[] for _ in seq_ids]
        committed = [0] * len(seq_ids)
        active, step_trees = list(range(len(seq_ids))), trees
        while active:
            ids = [seq_ids[i] for i in active]
            if runs[active[0]]:  # after the first forward: root-only steps
                step_trees = [TokenTree.root_only(self.runner.next_token(s)) for s in ids]
            step_trees = self.free.trees(ids, step_trees, [free[i] for i in active])
            start = time.perf_counter()
            rules_before = self.runner.rule_seconds
            verified = self.runner.verify(ids, step_trees, return_hidden=True)
            self.metrics.rule_seconds.observe(self.runner.rule_seconds - rules_before)
            self._record_verify(step_trees, verified, time.perf_counter() - start)
            for i, tree, v in zip(active, step_trees, verified, strict=True):
                runs[i].append((tree, v))
                committed[i] += len(v.committed)
            self.free.learn(ids, verified)
            active = [i for i in active if committed[i] < steps[i]]
        return runs

    def _record_verify(self, trees: list[TokenTree], verified, seconds: float) -> None:
        metrics = self.metrics
        metrics.forward_seconds.labels("verify").observe(seconds)
        metrics.sequences_verified.inc(len(trees))
        metrics.accepted_tokens.inc(sum(v.verdict.num_accepted for v in verified))
        for tree in trees:
            metrics.tree_tokens.observe(tree.num_drafted)

    @rpc_errors
    def Release(self, request, context) -> common_pb2.ReleaseResponse:

        def work() -> int:
            released = sum(self._forget(seq_id) for seq_id in request.seq_ids)
            self.metrics.slots(self.runner.num_free_slots)
            return released

        return common_pb2.ReleaseResponse(num_released=self._compute(work))

    def _compute(self, work: Callable[[], T]) -> T:
        """``work`` under the model lock on the one compute thread (its exceptions raised
        here)."""

        def locked() -> T:
            self.watch.started()
            try:
                with self._lock:
                    return work()
            finally:
                self.watch.finished()

        self.watch.submitted()
        return self._compute_thread.submit(locked).result()

    # -- leases ----------------------------------------------------------------------------

    def _lease(self, seq_id: int) -> None:
        if self.config.lease_seconds > 0:
            self._leases[seq_id] = self._clock() + self.config.lease_seconds

    def _renew(self, seq_ids: list[int]) -> None:
        """Renew the leases of the held sequences among ``seq_ids`` (a reclaimed or unknown
        one stays unknown: its call answers NOT_FOUND)."""
        for seq_id in seq_ids:
            if seq_id in self._leases:
                self._lease(seq_id)

    def reclaim_expired(self) -> list[int]:
        """Release every sequence whose lease ran out (on the compute thread, under the model
        lock, so no call of it is running); the ids reclaimed."""

        def work() -> list[int]:
            now = self._clock()
            expired = [seq_id for seq_id, until in list(self._leases.items()) if until <= now]
            for seq_id in expired:
                self._forget(seq_id)
            if expired:
                self.num_reclaimed += len(expired)
                self.metrics.slots(self.runner.num_free_slots)
                log.warning(
                    "reclaimed %d slot(s) unrenewed for %.0f s (a gateway gone without a "
                    "Release?): %s",
                    len(expired),
                    self.config.lease_seconds,
                    expired,
                )
            return expired

        now = self._clock()
        if not any(until <= now for until in list(self._leases.values())):
            return []  # nothing due: leave the compute thread alone
        return self._compute(work)

    def start_lease_reaper(self, period: float | None = None) -> None:
        """Reclaim expired leases from a daemon thread every ``period`` seconds (default: a
        quarter of the lease, at most 1 s); a no-op without leases."""
        if self._reaper is None:
            self._reaper = start_lease_reaper(
                self.reclaim_expired, self.config.lease_seconds, period
            )

    @rpc_errors
    def Capacity(self, request, context) -> verifier_pb2.CapacityResponse:
        model_config = self.runner.model.config
        return verifier_pb2.CapacityResponse(
            free_slots=self.runner.num_free_slots,
            total_slots=self.config.max_running,
            max_len=self.runner.max_len,
            vocab_size=model_config.vocab_size,
            hidden_size=model_config.hidden_size,
            model=self.model_name,
            hidden_dtype=codec.DTYPE_NAMES[self.runner.model.dtype],
            reserved_rows=self.config.max_tree_nodes,
            free_drafts=self.free.drafter is not None,
        )

    # -- validation ------------------------------------------------------------------------

    def _check_prompts(self, items, params: list[SamplingParams]) -> None:
        for item, item_params in zip(items, params, strict=True):
            prompt = item.prompt_ids
            resume = [item.next_token] if item.HasField("next_token") else []
            if not prompt or any(not 0 <= t < self.vocab_size for t in (*prompt, *resume)):
                raise invalid(
                    f"sequence {item.seq_id}: prompt ids must be in [0, {self.vocab_size})"
                )
            needed = len(prompt) + item_params.max_tokens + self.config.max_tree_nodes
            if needed > self.runner.max_len:
                raise invalid(
                    f"sequence {item.seq_id}: prompt + max_tokens + tree needs {needed} KV rows, "
                    f"the verifier holds {self.runner.max_len}"
                )

    def _check_ref(self, ref: common_pb2.SeqRef) -> None:
        held = self.runner.num_committed(ref.seq_id)  # NOT_FOUND when unknown
        if held != ref.num_committed:
            raise out_of_step(
                f"sequence {ref.seq_id}: caller has {ref.num_committed} committed tokens, "
                f"the verifier has {held}"
            )

    def _tree_of(self, item: verifier_pb2.VerifyItem) -> TokenTree:
        tree = codec.decode_tree(item.tree, self.vocab_size, self.config.max_tree_nodes)
        if item.steps > codec.MAX_VERIFY_STEPS:
            raise invalid(f"sequence {item.ref.seq_id}: more than {codec.MAX_VERIFY_STEPS} steps")
        if item.steps > 1 and tree.num_nodes != 1:
            raise invalid(f"sequence {item.ref.seq_id}: several steps need a root-only tree")
        return tree


def _ref(item: verifier_pb2.VerifyItem) -> tuple[int, int]:
    return item.ref.seq_id, item.ref.num_committed


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
    plane = None
    if server_config.plane != "grpc":
        plane = DataPlane(
            server_config.plane, server_config.plane_addr, 0, server_config.plane_timeout
        )
        plane.connect_in_background()
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
    servicer.start_lease_reaper()
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
