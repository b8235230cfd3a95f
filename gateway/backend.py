"""The contract between the HTTP gateway and whatever generates tokens.

The gateway owns the request lifecycle (parsing, tokenizing, streaming, metrics); a
``GenerationBackend`` turns one tokenized request into a stream of ``TokenDelta`` events.
Two backends implement it, one adapter (``gateway.adapter``) over the two engines of one
step loop: the embedded one (``SpecEngine``, drafter and verifier in this process, for a
laptop) and the remote one (``remote_engine.RemoteEngine``, the gRPC services).
Backends never touch Prometheus: each delta carries the speculation facts of the
verification that produced it, and the gateway records them (one registry of names).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from lyanna.sampling import SamplingParams

if TYPE_CHECKING:
    from lyanna.scheduler import Emitted


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # params.stop is applied by the gateway on the decoded text (it
    #                         closes the iterator at a stop string); backends may ignore it
    method: str | None = None  # a name from lyanna.drafters.DRAFTERS; None = server default


@dataclass(frozen=True, slots=True)
class StepFacts:
    """What one verification of this request did (for metrics and ``lyanna chat``)."""

    method: str
    num_drafted: int  # draft nodes verified (tree size minus the root)
    num_accepted: int  # accepted draft tokens; acceptance length = num_accepted + 1
    num_resampled_accepted: int = 0  # accepted tokens that came from a re-sampled subtree
    draft_seconds: float = 0.0  # time spent drafting for the micro-batch holding this request
    verify_seconds: float = 0.0  # time of the verification forward for that micro-batch
    drafter_fallback: bool = False  # the drafter was down or late: target-only step
    fallback_drafted: bool = False  # a gated learned drafter's free n-gram fallback drafted it

    @classmethod
    def of(cls, item: Emitted) -> StepFacts:
        """The facts of a step (``lyanna.scheduler.Emitted`` with its verification: a local
        ``Verdict`` or a verifier service's ``VerifyResult``, which counts ``num_drafted``)."""
        verdict = item.verdict
        drafted = getattr(verdict, "num_drafted", None)
        drafted = sum(verdict.num_drafted_per_depth) if drafted is None else drafted
        return cls(
            method=item.sequence.method,
            num_drafted=drafted,
            num_accepted=verdict.num_accepted,
            num_resampled_accepted=item.num_resampled_accepted,
            fallback_drafted=item.source == "fallback" and drafted > 0,
            draft_seconds=item.timing.draft_seconds,
            verify_seconds=item.timing.verify_seconds,
            drafter_fallback=item.drafter_fallback,
        )


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Newly committed output tokens of one request (empty when only a finish arrives)."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    step: StepFacts | None = None  # None for the first token (it comes from prefill)
    prompt_tokens: int = 0  # set on the first delta
    extra: dict = field(default_factory=dict)
    logprobs: list | None = None  # one lyanna.sampling.TokenLogprob per token (when asked)


class BackendUnavailable(RuntimeError):
    """The verifier (or the embedded engine) cannot serve: the gateway answers 503."""


class BackendBusy(RuntimeError):
    """The waiting queue is full: the gateway answers 429."""


@runtime_checkable
class GenerationBackend(Protocol):
    max_context: int  # prompt + max_tokens must fit (the gateway answers 400 otherwise)
    default_method: str
    methods: tuple[str, ...]  # methods a request may choose

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Drain in-flight requests, then free resources."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Stream deltas until one has a finish_reason. Closing the iterator early (client
        disconnect) cancels the request and frees its state everywhere."""
        ...

    async def health(self) -> dict[str, str]:
        """Component -> "ok" | "degraded: <why>" (still serving, e.g. one method or the
        drafter is out and requests fall back) | an error message (the gateway's /health
        answers 503 when any component reports an error)."""
        ...
