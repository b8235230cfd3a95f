"""The drafter service's own settings (``DrafterConfig``, flags ``--method``, ``--verifier``,
...) and the drafter they build (``make_configured_drafter``)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace

import torch

from lyanna.drafters import (
    DRAFTERS,
    FREE_FALLBACK,
    TREE_MODES,
    DraftBudget,
    DraftCapacity,
    Drafter,
    default_budget,
    make_drafter,
    tree_budget,
)
from lyanna.model.device import parse_dtype, parse_placement
from lyanna.model.loader import WEIGHT_FORMATS
from lyanna.model.transformer import Transformer
from services.drafter.relay import client_tls
from services.tls import ClientTls


@dataclass(frozen=True, slots=True)
class DrafterConfig:
    method: str = "lyanna"  # a name from lyanna.drafters.DRAFTERS
    model: str = ""  # target checkpoint (drafters share its embeddings); "" = default model
    # the target's format here, the verifier's (auto picks the same on the same machine):
    # the cost curve of --tree cost is measured on it
    weights: str = "auto"
    # where the target (and the drafter's inputs) live: the verifier's --device / --dtype;
    # EAGLE-2 and Lyanna draft on that device too (lyanna.drafters.placement); SPS on the CPU only
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "float32"  # float32 | bfloat16 (bf16) | float16 (fp16)
    # tree shape; unset = the method's measured default (lyanna.drafters.DEFAULT_BUDGETS)
    depth: int | None = None
    top_k: int | None = None
    max_draft_tokens: int | None = None
    tree: str = "cost"  # cost: trees sized by the target's cost curve; fixed: the budget
    # gated-off steps of a learned drafter draft n-gram (true) or nothing (false: they are
    # announced quiet, and the gateway verifies them in multi-step calls without asking).
    # Measured (bench.serving, 16 requests of 64 tokens, Zen 5, when every drafter call was a
    # round trip of its own): a call on every step cost more than the n-gram drafts won, 146 /
    # 248 / 362 tok/s at concurrency 1 / 4 / 16 against 189 / 290 / 423 without; in one
    # process (embedded) the fallback wins
    free_fallback: bool = False
    # sequences held and rows each may grow to: the verifier's --max-running / --max-len
    max_running: int = 16
    max_len: int = 4096
    # a sequence's draft state is leased like the verifier's slot: Start and every Step
    # naming it renew it, and state nobody renewed for this long is dropped (a gateway killed
    # without a Release); a later Step for it gets NOT_FOUND and the gateway starts it again
    # from its history. Quiet steps do not call the drafter (at most 64 in a row), so keep it
    # well above their time; 0 = held until released
    lease_seconds: float = 120.0
    # "module:function" building a Drafter from (target model, budget, capacity) instead of the
    # registry: custom drafters, tests with random-weight heads
    factory: str | None = None
    # the verifier (host:port) Step verifies through; "" = none (Step is refused) unless
    # verifier_port_file names the file a local verifier writes its port to (services.launch)
    verifier: str = ""
    verifier_port_file: str | None = None
    verify_deadline: float = 60.0  # seconds a Verify may take when the caller's is longer
    # TLS to the verifier (services.tls): its CA turns it on, a certificate and key answer a
    # verifier that requires mutual TLS; the gateway's settings (lyanna serve passes them)
    verifier_ca: str | None = None
    verifier_cert: str | None = None
    verifier_key: str | None = None
    verifier_server_name: str | None = None

    def __post_init__(self) -> None:
        if self.verify_deadline <= 0:
            raise ValueError("verify_deadline must be > 0")
        if self.lease_seconds < 0:
            raise ValueError("lease_seconds must be >= 0 (0: no lease)")
        self.verifier_tls()  # validates the pairing
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

    def verifier_tls(self) -> ClientTls | None:
        return client_tls(
            self.verifier_ca, self.verifier_cert, self.verifier_key, self.verifier_server_name
        )

    def shape(self, model: Transformer | None = None) -> DraftBudget:
        """The tree shape: the method's default (for ``model``'s engine) with the fields set
        here on top."""
        base = default_budget(self.method, model)
        given = {"depth": self.depth, "top_k": self.top_k, "max_tokens": self.max_draft_tokens}
        return replace(base, **{k: v for k, v in given.items() if v is not None})

    @property
    def drafts_in_verifier(self) -> bool:
        """Whether a verifier's free drafts draft what this drafter would: the registry's
        n-gram drafter at its default, cost-aware shape (any other shape, or a factory, keeps
        drafting here)."""
        default_shape = (self.depth, self.top_k, self.max_draft_tokens) == (None, None, None)
        return (
            self.factory is None
            and self.method == FREE_FALLBACK
            and self.tree == "cost"
            and default_shape
        )

    def budget(self, model: Transformer) -> DraftBudget:
        """The shape, with the target's cost curve for ``tree='cost'``."""
        return tree_budget(self.method, model, self.tree, self.shape(model))


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
