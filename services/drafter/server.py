"""The drafter gRPC servicer: wraps any drafter of ``lyanna.drafters.DRAFTERS`` (or a custom
factory) and relays each step's verification (docs/services.md, "One step of one micro-batch").

Start begins a sequence from its committed tokens (+ their target hidden states) and next
token. Step applies the caller's unseen quiet steps (``drafter.on_verified``), proposes one
tree per drafted sequence, verifies the whole call in one ``Verify`` to ``--verifier``
(undrafted items root-only), learns the outcome at once and returns it. A drafted item's
``SeqRef`` must match the drafter's length plus its unseen steps (FAILED_PRECONDITION;
NOT_FOUND for an unknown sequence). A failed drafter or verifier call drops the drafted
sequences (the caller re-Starts them); a failed verifier call answers ABORTED, and the caller
re-runs the step directly (Verify answers a retried step with what it already committed).
Verification fusion stays inside the drafter (``LyannaDrafter``), as in the in-process engine.
Each sequence's state is leased (``--lease-seconds``): Start and Steps renew it, a reaper drops
what a dead gateway left behind, and a later Step for it answers NOT_FOUND (the gateway starts
it again from its history).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from itertools import count

import grpc
import torch

from lyanna.drafters import DraftBudget, Drafter, VerifiedStep
from lyanna.drafters.gate import GatedDrafter
from lyanna.model import load_model
from lyanna.threads import serving_threads
from lyanna.tree import TokenTree
from services import codec
from services.config import ServerConfig
from services.data_plane import DataPlane
from services.drafter.config import DrafterConfig, make_configured_drafter
from services.drafter.relay import (
    VerifierLink,
    describe_failure,
    port_file_addr,
    verify_request,
)
from services.hidden import HiddenReceiver
from services.metrics import DrafterMetrics
from services.pb import common_pb2, drafter_pb2, drafter_pb2_grpc
from services.server import (
    ComputeWatch,
    Service,
    ServiceError,
    WatchedLock,
    invalid,
    not_found,
    out_of_step,
    rpc_errors,
    run_service,
    start_lease_reaper,
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
        self.config = config
        self.budget = budget or config.shape()
        self.receiver = receiver
        self.vocab_size = vocab_size
        self.verifier = verifier
        self._committed: dict[int, int] = {}  # seq id -> tokens in the target KV
        self._starts: dict[int, int] = {}  # seq id -> which Start began its state
        self._start_ids = count()
        self.metrics = DrafterMetrics()
        self.watch = ComputeWatch(clock)  # liveness: a forward hung under the lock
        self._lock = WatchedLock(self.watch)
        self._clock = clock
        self._leases: dict[int, float] = {}  # seq id -> when its lease runs out (clock)
        self.num_reclaimed = 0  # sequences whose lease ran out
        self._reaper: threading.Thread | None = None

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
        with self._lock:
            for item in request.items:
                seq_id, prompt = item.ref.seq_id, list(item.prompt_ids)
                if seq_id in self._committed:
                    raise out_of_step(f"sequence {seq_id} is already started")
                if not prompt or item.ref.num_committed != len(prompt):
                    raise invalid(f"sequence {seq_id}: num_committed must equal the prompt length")
                self._check_tokens([*prompt, item.first_token])
                hidden = self._hidden(item, "prompt_hidden", len(prompt))
                params = codec.decode_params(item.params) if item.HasField("params") else None
                self.drafter.start(seq_id, prompt, hidden, item.first_token, params)
                self._committed[seq_id] = len(prompt)
                self._starts[seq_id] = next(self._start_ids)
                self._lease(seq_id)
                self.metrics.started(item.resync)
            self.metrics.sequences.set(len(self._committed))
            self.receiver.end_batch()
        return drafter_pb2.StartResponse(num_started=len(request.items))

    @rpc_errors
    def Step(self, request, context) -> Iterator[drafter_pb2.StepEvent]:
        """Draft, verify through the verifier, learn (see the module docstring). One
        micro-batch a call like every RPC here: the caller's deadline bounds the whole step
        and a failed step is retried as a whole, directly (the verifier answers a retried
        step again). The reply streams two events: ``drafted`` once the trees exist (the
        caller's proof that this drafter is not stuck), then ``response``."""
        arrived = time.monotonic()
        if self.verifier is None:
            raise out_of_step("this drafter has no verifier to verify through (--verifier)")
        items = list(request.items)
        seq_ids = [item.ref.seq_id for item in items]
        if len(set(seq_ids)) != len(seq_ids):
            raise invalid("a sequence may appear once per Step call")
        for seq_id in seq_ids:  # renew the held ones (an unknown one stays unknown)
            if seq_id in self._leases:
                self._lease(seq_id)
        if not 0 <= request.caller_hop_seconds <= codec.MAX_HOP_SECONDS:
            raise invalid(f"caller_hop_seconds must be in [0, {codec.MAX_HOP_SECONDS}]")
        self._check_tokens([item.next_token for item in items])
        drafted = [item for item in items if item.draft]
        trees, quiet, starts, draft_seconds = self._draft(request, drafted, context, arrived)
        yield drafter_pb2.StepEvent(drafted=drafter_pb2.StepDrafted(draft_seconds=draft_seconds))
        use_plane = bool(request.use_data_plane and self.receiver.plane is not None)
        use_plane = use_plane and self.receiver.plane.ready
        verify = verify_request(items, trees, self.drafter.needs_hidden, use_plane)
        try:
            sent = time.perf_counter()
            response = self.verifier.verify(verify, context.time_remaining())
            hop = time.perf_counter() - sent - response.forward_seconds
            if [r.ref.seq_id for r in response.results] != seq_ids:
                raise ServiceError(grpc.StatusCode.INTERNAL, "the verifier answered other items")
        except (grpc.RpcError, ServiceError, ValueError) as error:  # (ValueError: no address)
            with self._lock:
                self._drop_all([item.ref.seq_id for item in drafted])
            what = describe_failure(error) if isinstance(error, grpc.RpcError) else str(error)
            raise ServiceError(grpc.StatusCode.ABORTED, f"verifier: {what}") from None
        route = hop + (request.caller_hop_seconds or hop)  # (unmeasured: as far as ours)
        resampled, used_plane = self._learn_verified(items, response.results, starts, route)
        results = [
            drafter_pb2.StepResult(
                verified=result,
                num_resampled_accepted=resampled.get(item.ref.seq_id, 0),
                quiet_steps=quiet.get(item.ref.seq_id, 0),
            )
            for item, result in zip(items, response.results, strict=True)
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
        self, request, drafted: list[drafter_pb2.StepItem], context, arrived: float
    ) -> tuple[dict[int, TokenTree], dict[int, int], dict[int, int], float]:
        """Learn the unseen steps and propose a tree per drafted item: the trees, quiet steps
        and start numbers by sequence, and the seconds it took."""
        ids = [item.ref.seq_id for item in drafted]
        with self._lock:
            try:
                unseen = [self._unseen_of(item) for item in drafted]
            finally:
                self.receiver.end_batch()
            deadline = request.draft_deadline
            if not context.is_active():  # waited past the caller's deadline: the gateway
                # will start these sequences again, so drop them rather than draft for no one
                self._drop_all(ids)
                raise ServiceError(grpc.StatusCode.CANCELLED, "the caller is gone; nothing drafted")
            start = time.perf_counter()
            try:
                for steps in unseen:
                    self._learn(steps)
                trees = self.drafter.propose(ids) if ids else []
                quiet = {seq_id: self._quiet_steps(seq_id) for seq_id in ids}
            except Exception:
                self._drop_all(ids)
                raise
            for seq_id, steps in zip(ids, unseen, strict=True):
                if steps:
                    self._committed[seq_id] = steps[-1].num_committed
            draft_seconds = time.perf_counter() - start
            wrong = [
                item.ref.seq_id
                for item, tree in zip(drafted, trees, strict=True)
                if int(tree.tokens[0]) != item.next_token
            ]
            late = deadline > 0 and time.monotonic() - arrived > deadline
            if wrong or late:
                self._drop_all(ids)
                if late:
                    raise ServiceError(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"drafting took over {deadline:g} s"
                    )
                raise out_of_step(f"sequences {wrong}: the caller's next token is another root")
            self.metrics.drafted(draft_seconds, trees)
            starts = {seq_id: self._starts[seq_id] for seq_id in ids}
        return dict(zip(ids, trees, strict=True)), quiet, starts, draft_seconds

    def _learn_verified(
        self, items: list[drafter_pb2.StepItem], results, starts: dict[int, int], route: float
    ) -> tuple[dict[int, int], bool]:
        """Hand each drafted sequence its verification (the caller gets inline hidden rows
        where it asked); returns the re-sampled accepted counts and whether rows came over the
        data plane. A sequence released or restarted meanwhile is left alone. A gated drafter
        learns the ``route``'s cost: the hops caller -> drafter -> verifier, less the forward,
        which a step the caller verifies directly skips."""
        steps: list[VerifiedStep] = []
        used_plane = any(r.hidden.WhichOneof("payload") == "plane" for r in results)
        with self._lock:
            try:
                for item, result in zip(items, results, strict=True):
                    seq_id, num_rows = item.ref.seq_id, len(result.committed)
                    rows = None
                    kind = result.hidden.WhichOneof("payload")
                    needed = item.draft and self.drafter.needs_hidden
                    if kind == "plane" or (kind and needed):  # (plane rows: claimed always)
                        rows = self.receiver.decode(result.hidden, num_rows)
                    if not item.return_hidden or kind is None:
                        result.ClearField("hidden")
                    elif kind == "plane":
                        result.hidden.tensor.CopyFrom(codec.encode_tensor(rows))
                    held = self._committed.get(seq_id) == item.ref.num_committed
                    if not item.draft or not held or self._starts.get(seq_id) != starts[seq_id]:
                        continue
                    steps.append(
                        VerifiedStep(
                            seq_id=seq_id,
                            committed=list(result.committed),
                            hidden=rows if needed else None,
                            next_token=result.tokens[-1],
                            num_accepted=result.num_accepted,
                            num_committed=result.ref.num_committed,
                        )
                    )
                if isinstance(self.drafter, GatedDrafter):
                    self.drafter.routed(route, [step.seq_id for step in steps])
                resampled = self.drafter.on_verified(steps) if steps else {}  # one batched call
                self.metrics.learned(self.drafter, steps)
                for step in steps:
                    self._committed[step.seq_id] = step.num_committed
            except Exception as error:  # committed on the verifier: the caller retries there
                self._drop_all([item.ref.seq_id for item in items if item.draft])
                log.exception("learning a verified step failed")
                raise ServiceError(grpc.StatusCode.ABORTED, f"learning failed: {error}") from None
            finally:
                self.receiver.end_batch()
        return resampled, used_plane

    @rpc_errors
    def Release(self, request, context) -> common_pb2.ReleaseResponse:
        with self._lock:
            released = sum(self._drop(seq_id) for seq_id in request.seq_ids)
            self.metrics.sequences.set(len(self._committed))
        return common_pb2.ReleaseResponse(num_released=released)

    def _unseen_of(self, item: drafter_pb2.StepItem) -> list[VerifiedStep]:
        """A drafted item's unseen (quiet) verifications, checked, in order."""
        seq_id = item.ref.seq_id
        if seq_id not in self._committed:
            raise not_found(f"unknown sequence {seq_id}")
        held = self._committed[seq_id]
        if len(item.unseen) > codec.MAX_QUIET_STEPS:
            raise invalid(f"sequence {seq_id}: more than {codec.MAX_QUIET_STEPS} unseen steps")
        if held + sum(len(step.committed) for step in item.unseen) != item.ref.num_committed:
            raise out_of_step(
                f"sequence {seq_id}: caller has {item.ref.num_committed} committed tokens, "
                f"the drafter has {held} and {len(item.unseen)} unseen steps"
            )
        steps = []
        for verified in item.unseen:
            steps.append(self._verified_step(seq_id, verified, held))
            held = steps[-1].num_committed
        return steps

    def _verified_step(
        self, seq_id: int, verified: drafter_pb2.VerifiedStep, held: int
    ) -> VerifiedStep:
        committed = list(verified.committed)
        if not committed or verified.num_accepted != len(committed) - 1:
            raise invalid(f"sequence {seq_id}: committed must hold the root + accepted tokens")
        self._check_tokens([*committed, verified.next_token])
        return VerifiedStep(
            seq_id=seq_id,
            committed=committed,
            hidden=self._hidden(verified, "hidden", len(committed)),
            next_token=verified.next_token,
            num_accepted=verified.num_accepted,
            num_committed=held + len(committed),
        )

    def _learn(self, steps: list[VerifiedStep]) -> None:
        """Feed a sequence's unseen verifications to the drafter, in order."""
        for step in steps:
            self.drafter.on_verified([step])
        self.metrics.learned(self.drafter, steps)

    def _quiet_steps(self, seq_id: int) -> int:
        """Steps the drafter will certainly not draft for ``seq_id`` (gated drafters only)."""
        quiet_steps = getattr(self.drafter, "quiet_steps", None)
        return min(quiet_steps(seq_id), codec.MAX_QUIET_STEPS) if quiet_steps else 0

    def _hidden(self, message, field: str, num_rows: int) -> torch.Tensor | None:
        if not self.drafter.needs_hidden:
            return None
        if not message.HasField(field):
            raise invalid(f"the {self.config.method} drafter needs {field}")
        return self.receiver.decode(getattr(message, field), num_rows)

    def _check_tokens(self, tokens: list[int]) -> None:
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise invalid(f"token ids must be in [0, {self.vocab_size})")

    def _drop_all(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._drop(seq_id)
        self.metrics.sequences.set(len(self._committed))

    def _lease(self, seq_id: int) -> None:
        if self.config.lease_seconds > 0:
            self._leases[seq_id] = self._clock() + self.config.lease_seconds

    def reclaim_expired(self) -> list[int]:
        """Drop every sequence whose lease ran out (its gateway is gone); the ids dropped."""
        now = self._clock()
        if not any(until <= now for until in list(self._leases.values())):
            return []
        with self._lock:
            now = self._clock()
            expired = [seq_id for seq_id, until in list(self._leases.items()) if until <= now]
            self._drop_all(expired)
            self.num_reclaimed += len(expired)
        if expired:
            log.warning(
                "dropped %d sequence(s) unrenewed for %.0f s",
                len(expired),
                self.config.lease_seconds,
            )
        return expired

    def start_lease_reaper(self, period: float | None = None) -> None:
        """Reclaim expired leases from a daemon thread (default: every quarter lease, at most
        1 s); a no-op without leases."""
        if self._reaper is None:
            self._reaper = start_lease_reaper(
                self.reclaim_expired, self.config.lease_seconds, period
            )

    def _drop(self, seq_id: int) -> bool:
        self._leases.pop(seq_id, None)
        self._starts.pop(seq_id, None)
        if self._committed.pop(seq_id, None) is None:
            return False
        self.drafter.release(seq_id)
        return True


def build_servicer(config: DrafterConfig, server_config: ServerConfig) -> DrafterServicer:
    from lyanna.model import fetch_default_model

    model = load_model(
        config.model or fetch_default_model(),
        config.torch_dtype,
        config.device,
        weights=config.weights,
    )
    budget = config.budget(model)
    drafter = make_configured_drafter(config, model, budget)
    plane = None
    if server_config.plane != "grpc":
        plane = DataPlane(
            server_config.plane, server_config.plane_addr, 1, server_config.plane_timeout
        )
        plane.connect_in_background()
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
    servicer.start_lease_reaper()
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
