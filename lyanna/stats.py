"""Speculation statistics with vLLM-like semantics: verification steps, drafted and accepted
tokens, acceptance per depth, and where the time went.

*Acceptance length* (tau) counts the residual/bonus token: tokens emitted per verification.
vLLM's mean acceptance length divides by *drafts* instead, the verifications with at least one
draft token (``draft_acceptance_length``): root-only steps (target-only decoding, a gated-off
drafter's plain steps, drafter fallbacks) accept nothing by construction and are counted
apart (``num_root_only_steps``). The gateway's Prometheus counters and the recording rules use
vLLM's meaning.
The *conditional acceptance rate* at depth d is P(depth d accepted | depth d-1 accepted and the
tree had a node at depth d), the quantity of the Lyanna paper's Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lyanna.verify import Verdict


def acceptance_length(num_accepted: int, num_steps: int) -> float:
    """Tokens emitted per verification: accepted draft tokens + the residual/bonus token.
    The one formula every report uses (engine stats, gateway metrics; the recording rule
    computes it from the same two counters). 1 before any verification."""
    return 1.0 + num_accepted / num_steps if num_steps else 1.0


@dataclass(slots=True)
class SpecStats:
    num_steps: int = 0  # verifications (one per sequence per engine step)
    num_drafted_steps: int = 0  # verifications with at least one draft token (vLLM's drafts)
    num_drafted: int = 0
    num_accepted: int = 0
    num_resampled_accepted: int = 0  # accepted tokens only a re-sampled subtree held (Lyanna)
    reached: list[int] = field(default_factory=list)  # [d-1]: steps with depth d-1 accepted and
    #                                                   a depth-d node drafted
    accepted: list[int] = field(default_factory=list)  # [d-1]: steps with depth d accepted
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    num_prefill_tokens: int = 0

    def record(self, verdict: Verdict) -> None:
        self.num_steps += 1
        drafted = sum(verdict.num_drafted_per_depth)
        self.num_drafted_steps += drafted > 0
        self.num_drafted += drafted
        self.num_accepted += verdict.num_accepted
        depths = len(verdict.num_drafted_per_depth)
        while len(self.reached) < depths:
            self.reached.append(0)
            self.accepted.append(0)
        for d in range(depths):
            if d > verdict.num_accepted or verdict.num_drafted_per_depth[d] == 0:
                break
            self.reached[d] += 1
            if d < verdict.num_accepted:
                self.accepted[d] += 1

    @property
    def num_emitted(self) -> int:
        """Tokens handed to sequences by verifications (accepted + one residual/bonus each)."""
        return self.num_accepted + self.num_steps

    @property
    def num_root_only_steps(self) -> int:
        """Verifications without a draft token (they accept nothing)."""
        return self.num_steps - self.num_drafted_steps

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.num_accepted, self.num_steps)

    @property
    def draft_acceptance_length(self) -> float:
        """vLLM's mean acceptance length: tokens emitted per draft (root-only steps left out);
        what ``lyanna:acceptance_length:rate5m`` records from the gateway's counters."""
        return acceptance_length(self.num_accepted, self.num_drafted_steps)

    @property
    def conditional_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached, strict=True)]

    def merge(self, other: SpecStats) -> None:
        for name in (
            "num_steps",
            "num_drafted_steps",
            "num_drafted",
            "num_accepted",
            "num_resampled_accepted",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("draft_seconds", "verify_seconds", "prefill_seconds", "num_prefill_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.reached, other.reached), (self.accepted, other.accepted)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for d, count in enumerate(theirs):
                mine[d] += count
