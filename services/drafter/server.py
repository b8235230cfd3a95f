"""The drafter gRPC servicer: wraps any drafter of ``lyanna.drafters.DRAFTERS`` (or a custom
factory) and tracks each sequence's committed length.

Start begins a sequence from its committed tokens (+ their target hidden states) and next
token. Propose first hands each sequence's last verification to ``drafter.on_verified``, then
asks ``drafter.propose`` for one tree per sequence of the micro-batch. Every item's ``SeqRef``
must match the length the drafter holds (FAILED_PRECONDITION otherwise, NOT_FOUND for an
unknown sequence). If the drafter itself fails, the batch's sequences are dropped, so the
caller's next call gets NOT_FOUND and re-Starts them instead of drafting from broken state.

Verification fusion stays inside the drafter (``LyannaDrafter`` merges the re-sampled subtree
of the last verification into the fresh tree under the budget): it owns the chain logits the
subtree is re-sampled from, and the in-process engine then runs the very same code.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from lyanna.drafters import (
    DRAFTERS,
    TREE_MODES,
    DraftBudget,
    DraftCapacity,
    Drafter,
    VerifiedStep,
    default_budget,
    make_drafter,
    tree_budget,
)
from lyanna.model import load_model
from lyanna.model.device import parse_dtype, parse_placement
from lyanna.model.loader import WEIGHT_FORMATS
from lyanna.model.transformer import Transformer
from lyanna.threads import serving_threads
from services import codec
from services.config import ServerConfig, parse_configs
from services.data_plane import DataPlane
from services.hidden import HiddenReceiver
from services.metrics import DrafterMetrics, serve_metrics
from services.pb import common_pb2, drafter_pb2, drafter_pb2_grpc
from services.server import (
    ServiceError,
    exit_with_parent,
    invalid,
    not_found,
    out_of_step,
    rpc_errors,
    serve,
)

MAX_QUIET_STEPS = 64  # quiet steps one Propose may hand over (the gate waits at most 32)
SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
log = logging.getLogger("lyanna.services.drafter")


@dataclass(frozen=True, slots=True)
class DrafterConfig:
    method: str = "lyanna"  # a name from lyanna.drafters.DRAFTERS
    model: str = ""  # target checkpoint (drafters share its embeddings); "" = default model
    # the target's format here, the verifier's (auto picks the same on the same machine):
    # the cost curve of --tree cost is measured on it
    weights: str = "auto"
    # where the target (and the drafter's inputs) live: the verifier's --device / --dtype;
    # learned drafters draft on the CPU only (lyanna.drafters.make_drafter says so)
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "float32"  # float32 | bfloat16 (bf16) | float16 (fp16)
    # tree shape; unset = the method's measured default (lyanna.drafters.DEFAULT_BUDGETS)
    depth: int | None = None
    top_k: int | None = None
    max_draft_tokens: int | None = None
    tree: str = "cost"  # cost: trees sized by the target's cost curve; fixed: the budget
    # gated-off steps of a learned drafter draft n-gram (true) or nothing (false: they are
    # announced quiet, and the gateway verifies them in multi-step calls without asking).
    # Measured (bench.serving, 16 requests of 64 tokens, Zen 5): a Propose call on every step
    # cost more than the n-gram drafts won, 146 / 248 / 362 tok/s at concurrency 1 / 4 / 16
    # against 189 / 290 / 423 without; in one process (embedded) the fallback wins
    free_fallback: bool = False
    # sequences held and rows each may grow to: the verifier's --max-running / --max-len
    max_running: int = 16
    max_len: int = 4096
    # "module:function" building a Drafter from (target model, budget, capacity) instead of the
    # registry: custom drafters, tests with random-weight heads
    factory: str | None = None

    def __post_init__(self) -> None:
        self.shape()  # DraftBudget validates it
        DraftCapacity(self.max_running, self.max_len)  # validates them
        if self.tree not in TREE_MODES:
            raise ValueError(f"tree must be one of {TREE_MODES}, got {self.tree!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}")
        if self.factory is None and self.method not in DRAFTERS:
            raise ValueError(f"unknown method {self.method!r}; known: {sorted(DRAFTERS)}")
        if self.factory is not None and ":" not in self.factory:
            raise ValueError("factory must look like 'package.module:function'")
        parse_placement(self.device, self.dtype, self.weights)  # at start-up, not in a forward

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def shape(self, model: Transformer | None = None) -> DraftBudget:
        """The tree shape: the method's default (for ``model``'s engine) with the fields set
        here on top."""
        base = default_budget(self.method, model)
        return DraftBudget(
            base.depth if self.depth is None else self.depth,
            base.top_k if self.top_k is None else self.top_k,
            base.max_tokens if self.max_draft_tokens is None else self.max_draft_tokens,
        )

    def budget(self, model: Transformer) -> DraftBudget:
        """The shape, with the target's cost curve for ``tree='cost'``."""
        return tree_budget(self.method, model, self.tree, self.shape(model))


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self,
        drafter: Drafter,
        config: DrafterConfig,
        receiver: HiddenReceiver,
        vocab_size: int,
        budget: DraftBudget | None = None,
    ) -> None:
        self.drafter = drafter
        self.config = config
        self.budget = budget or config.shape()
        self.receiver = receiver
        self.vocab_size = vocab_size
        self._committed: dict[int, int] = {}  # seq id -> tokens in the target KV
        self.metrics = DrafterMetrics()
        self._lock = threading.Lock()

    @rpc_errors
    def Info(self, request, context) -> drafter_pb2.InfoResponse:
        budget = self.budget
        return drafter_pb2.InfoResponse(
            method=self.config.method,
            scheme=codec.SCHEMES[self.drafter.scheme],
            needs_hidden=self.drafter.needs_hidden,
            max_draft_tokens=budget.max_tokens,
            max_depth=budget.depth,
            top_k=budget.top_k,
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
                self.metrics.starts.inc()
            self.metrics.sequences.set(len(self._committed))
            self.receiver.end_batch()
        return drafter_pb2.StartResponse(num_started=len(request.items))

    @rpc_errors
    def Propose(self, request, context) -> drafter_pb2.ProposeResponse:
        items = list(request.items)
        seq_ids = [item.ref.seq_id for item in items]
        if len(set(seq_ids)) != len(seq_ids):
            raise invalid("a sequence may appear once per Propose call")
        with self._lock:
            try:
                steps = [self._step_of(item) for item in items]
            finally:
                self.receiver.end_batch()
            if not context.is_active():  # waited past the caller's deadline: the gateway
                # will start these sequences again, so drop them rather than draft for no one
                for seq_id in seq_ids:
                    self._drop(seq_id)
                raise ServiceError(grpc.StatusCode.CANCELLED, "the caller is gone; nothing drafted")
            start = time.perf_counter()
            try:
                resampled = [self._learn(seq_steps) for seq_steps in steps]
                trees = self.drafter.propose(seq_ids) if seq_ids else []
                quiet = [self._quiet_steps(seq_id) for seq_id in seq_ids]
            except Exception:
                for seq_id in seq_ids:
                    self._drop(seq_id)
                raise
            for seq_id, seq_steps in zip(seq_ids, steps, strict=True):
                if seq_steps:
                    self._committed[seq_id] = seq_steps[-1].num_committed
            draft_seconds = time.perf_counter() - start
            held = [self._committed[seq_id] for seq_id in seq_ids]
            self.metrics.draft_seconds.observe(draft_seconds)
            self.metrics.proposals.inc(len(trees))
            self.metrics.proposed_tokens.inc(sum(tree.num_drafted for tree in trees))
        proposals = [
            drafter_pb2.Proposal(
                ref=common_pb2.SeqRef(seq_id=seq_id, num_committed=num_committed),
                tree=codec.encode_tree(tree, with_draft_probs=item.want_draft_probs),
                num_resampled_accepted=count,
                quiet_steps=num_quiet,
            )
            for seq_id, num_committed, item, tree, count, num_quiet in zip(
                seq_ids, held, items, trees, resampled, quiet, strict=True
            )
        ]
        return drafter_pb2.ProposeResponse(proposals=proposals, draft_seconds=draft_seconds)

    @rpc_errors
    def Release(self, request, context) -> common_pb2.ReleaseResponse:
        with self._lock:
            released = sum(self._drop(seq_id) for seq_id in request.seq_ids)
            self.metrics.sequences.set(len(self._committed))
            try:
                for ref in request.discard:
                    self.receiver.discard(ref)
            finally:
                self.receiver.end_batch()
        return common_pb2.ReleaseResponse(num_released=released)

    # -- helpers ---------------------------------------------------------------------------

    def _step_of(self, item: drafter_pb2.ProposeItem) -> list[VerifiedStep]:
        """The item's verifications in order: its quiet steps, then ``verified``."""
        seq_id = item.ref.seq_id
        if seq_id not in self._committed:
            raise not_found(f"unknown sequence {seq_id}")
        held = self._committed[seq_id]
        if held != item.ref.num_committed:
            raise out_of_step(
                f"sequence {seq_id}: caller has {item.ref.num_committed} committed tokens, "
                f"the drafter has {held}"
            )
        if len(item.quiet) > MAX_QUIET_STEPS:
            raise invalid(f"sequence {seq_id}: more than {MAX_QUIET_STEPS} quiet steps")
        if item.quiet and not item.HasField("verified"):
            raise invalid(f"sequence {seq_id}: quiet steps come before a verified step")
        if any(len(quiet.committed) != 1 for quiet in item.quiet):
            raise invalid(f"sequence {seq_id}: a quiet step verifies a root-only tree")
        steps = []
        for verified in [*item.quiet, item.verified] if item.HasField("verified") else []:
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

    def _learn(self, steps: list[VerifiedStep]) -> int:
        """Feed a sequence's verifications to the drafter in order; returns how many accepted
        tokens of the last one only a re-sampled subtree had proposed (drafters without
        re-sampling: 0)."""
        resampled = 0
        for step in steps:
            resampled = self.drafter.on_verified([step]).get(step.seq_id, 0)
        return resampled

    def _quiet_steps(self, seq_id: int) -> int:
        """Steps the drafter will certainly not draft for ``seq_id`` (gated drafters only)."""
        quiet_steps = getattr(self.drafter, "quiet_steps", None)
        return min(quiet_steps(seq_id), MAX_QUIET_STEPS) if quiet_steps else 0

    def _hidden(self, message, field: str, num_rows: int) -> torch.Tensor | None:
        if not self.drafter.needs_hidden:
            return None
        if not message.HasField(field):
            raise invalid(f"the {self.config.method} drafter needs {field}")
        return self.receiver.decode(getattr(message, field), num_rows)

    def _check_tokens(self, tokens: list[int]) -> None:
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise invalid(f"token ids must be in [0, {self.vocab_size})")

    def _drop(self, seq_id: int) -> bool:
        if self._committed.pop(seq_id, None) is None:
            return False
        self.drafter.release(seq_id)
        return True


def make_configured_drafter(
    config: DrafterConfig, model: Transformer, budget: DraftBudget
) -> Drafter:
    capacity = DraftCapacity(config.max_running, config.max_len)
    if config.factory is None:
        return make_drafter(
            config.method, model, budget, capacity, free_fallback=config.free_fallback
        )
    module_name, _, function = config.factory.partition(":")
    factory = getattr(importlib.import_module(module_name), function)
    return factory(model, budget, capacity)


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
    return DrafterServicer(drafter, config, receiver, model.config.vocab_size, budget)


def main(argv: list[str] | None = None) -> int:
    server_config, config = parse_configs(
        (ServerConfig, DrafterConfig), argv, "LYANNA_DRAFTER_", description=__doc__
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s drafter %(message)s")
    exit_with_parent()
    torch.set_num_threads(serving_threads(server_config.torch_threads))
    servicer = build_servicer(config, server_config)

    def add(server: grpc.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)

    serve_metrics(servicer.metrics.registry, server_config)
    plane = servicer.receiver.plane
    if plane is not None and not plane.wait_ready(server_config.plane_timeout):
        logging.warning("data plane not ready; hidden states travel inline")
    serve(server_config, add, (SERVICE_NAME,), on_stop=plane.close if plane else None)
    return 0
