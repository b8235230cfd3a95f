"""What one verification did for one request, read off the scheduler's ``Emitted``: the
facts the gateway's metrics and ``lyanna chat`` show, the same from either engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lyanna.scheduler import Emitted


@dataclass(frozen=True, slots=True)
class StepFacts:
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
