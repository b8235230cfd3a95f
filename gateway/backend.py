"""The contract between the HTTP gateway and whatever generates tokens: a
``GenerationBackend`` turns one tokenized request into a stream of ``TokenDelta`` events
(``gateway.adapter`` over the embedded or the remote engine). Backends never touch
Prometheus: each delta carries its verification's facts and the gateway records them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from lyanna.sampling import SamplingParams

if TYPE_CHECKING:
    from lyanna.scheduler import Emitted


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # the gateway applies params.stop on the text; backends may ignore it
    method: str | None = None  # a name from lyanna.drafters.DRAFTERS; None = server default


@dataclass(frozen=True, slots=True)
class StepFacts:
    """What one verification of this request did (for metrics and ``lyanna chat``)."""

    method: str
    num_drafted: int  # draft nodes verified (tree size minus the root)
    num_accepted: int  # accepted draft tokens; acceptance length = num_accepted + 1
    num_resampled_accepted: int = 0  # accepted tokens that came from a re-sampled subtree
    draft_seconds: float = 0.0  # drafting time of the micro-batch holding this request
    verify_seconds: float = 0.0  # its verification forward's time
    drafter_fallback: bool = False  # the drafter was down or late: target-only step
    fallback_drafted: bool = False  # a gated learned drafter's free n-gram fallback drafted it

    @classmethod
    def of(cls, item: Emitted) -> StepFacts:
        """From a local ``Verdict`` or a verifier's ``VerifyResult`` (which counts drafts)."""
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

    async def stop(self) -> None:  # drains in-flight requests, then frees resources
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Deltas until one has a finish_reason; closing it early cancels the request."""
        ...

    async def health(self) -> dict[str, str]:
        """Component -> "ok" | "degraded: <why>" (still serving) | an error (/health: 503)."""
        ...
