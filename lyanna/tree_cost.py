"""Cost-aware tree size: keep a draft node only while it pays for its verification.

A target forward over r rows costs T(r) seconds, and T grows with r at a rate that depends on
the machine and the weight format (measured: on one CPU the 8th row is almost free in fp32
and costs a whole decode step in 4-bit). A drafted node adds its acceptance probability to the
step's expected tokens; EAGLE-2 estimates that probability by the node's joint draft
probability, which is also the order pruning keeps nodes in. So the best number of draft
nodes per tree is the w that maximises expected tokens per second of the step,

    (B + sum of the best w gains of each of the B trees) / (draft seconds + T(B * (w + 1))),

one width for the whole batch because every tree is padded to the widest one. The fixed
budget becomes a cap; the tree size is chosen per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class VerifyCost:
    """Seconds of one target forward (+ LM head on every row) by the number of new rows,
    measured at a few row counts (``lyanna.model.calibrate.verify_cost``) and interpolated."""

    rows: tuple[int, ...]  # ascending row counts measured, starting at 1
    seconds: tuple[float, ...]  # forward seconds at each of them (non-decreasing)

    def __post_init__(self) -> None:
        if not self.rows or self.rows[0] != 1 or len(self.rows) != len(self.seconds):
            raise ValueError("a cost curve needs seconds for 1 row and each further row count")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:], strict=False)):
            raise ValueError("row counts must be ascending")
        if any(s <= 0 for s in self.seconds):
            raise ValueError("forward seconds must be positive")
        if any(b < a for a, b in zip(self.seconds, self.seconds[1:], strict=False)):
            raise ValueError("forward seconds must not decrease with rows")

    @classmethod
    def from_measurements(cls, seconds_by_rows: dict[int, float]) -> VerifyCost:
        """A curve from noisy timings: a later row count never costs less than an earlier
        one (a running maximum), so noise cannot make a bigger tree look cheaper."""
        rows = sorted(seconds_by_rows)
        seconds, high = [], 0.0
        for r in rows:
            high = max(high, seconds_by_rows[r])
            seconds.append(high)
        return cls(tuple(rows), tuple(seconds))

    def forward_seconds(self, rows: int) -> float:
        """T(rows): linear between measured counts, the last slope beyond them."""
        if rows < 1:
            raise ValueError("a forward has at least one row")
        xs, ys = self.rows, self.seconds
        if len(xs) == 1:
            return ys[0] * rows
        i = next((j for j in range(1, len(xs)) if xs[j] >= rows), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def best_width(
        self,
        gains: Sequence[Sequence[float]],  # per tree: its nodes' gains, best first
        max_width: int,
        draft_seconds: float = 0.0,
    ) -> int:
        """Draft nodes per tree (0..max_width) with the most expected tokens per second.
        Ties go to the smaller tree."""
        return self.best(gains, max_width, draft_seconds)[0]

    def best(
        self, gains: Sequence[Sequence[float]], max_width: int, draft_seconds: float = 0.0
    ) -> tuple[int, float, float]:
        """``best_width`` with the expected tokens and the seconds of the step it implies."""
        batch = len(gains)
        if batch == 0:
            return 0, 0.0, draft_seconds
        best = (0, float(batch), draft_seconds + self.forward_seconds(batch))
        expected = float(batch)
        for width in range(1, max_width + 1):
            expected += sum(g[width - 1] for g in gains if len(g) >= width)
            seconds = draft_seconds + self.forward_seconds(batch * (width + 1))
            if expected * best[2] > best[1] * seconds:  # a higher rate, without dividing
                best = (width, expected, seconds)
        return best

    def first_peak_width(
        self,
        gains: Sequence[Sequence[float]],  # per tree: its nodes' gains in pruning order
        max_width: int,
        draft_seconds: float = 0.0,
    ) -> int:
        """Widen while each next width raises the rate; stop at the first that does not.
        Unlike ``best_width`` it never looks past the width it decides on, so whether a node
        is kept depends only on the nodes before it in pruning order: what sampled trees
        need (see ``DraftNodes``), whose gains need not decrease along that order."""
        batch = len(gains)
        if batch == 0:
            return 0
        expected, seconds = float(batch), draft_seconds + self.forward_seconds(batch)
        for width in range(1, max_width + 1):
            more = expected + sum(g[width - 1] for g in gains if len(g) >= width)
            more_seconds = draft_seconds + self.forward_seconds(batch * (width + 1))
            if more * seconds <= expected * more_seconds:
                return width - 1
            expected, seconds = more, more_seconds
        return max_width

    def worth_drafting_deeper(
        self,
        gains: Sequence[Sequence[float]],  # per tree: the gains of the nodes drafted so far
        frontier_gain: float,  # the summed gains of the nodes the next depth would expand
        max_width: int,
        draft_seconds: float,  # spent so far this step
        depth_seconds: float,  # what one more depth costs to draft
    ) -> bool:
        """Whether another draft depth can raise the step's rate. Its nodes add at most the
        frontier's gains (a child is never likelier than its parent); even if they cost no
        verification rows at all, they must beat stopping here."""
        _, expected, seconds = self.best(gains, max_width, draft_seconds)
        optimistic = expected + frontier_gain
        return optimistic * seconds > expected * (seconds + depth_seconds)


@dataclass(slots=True)
class GainCalibration:
    """How many tokens a drafter's predicted gains are really worth, learned online: joint
    draft probability is a fair estimate for the learned drafters (measured: 1.06-1.10
    accepted per predicted token) and a poor one for n-gram frequencies (0.20). The width
    choice multiplies gains by ``scale``, which starts at 1 and follows accepted / predicted
    over recent steps (``decay`` per step; ``prior`` pseudo-tokens at scale 1)."""

    prior: float = 4.0
    decay: float = 0.98
    predicted: float = 0.0
    accepted: float = 0.0
    pending: float = field(default=0.0)  # predicted gain of the trees awaiting verification

    @property
    def scale(self) -> float:
        return (self.accepted + self.prior) / (self.predicted + self.prior)

    def proposed(self, gains: float) -> None:
        """The summed gains of the nodes just proposed."""
        self.pending += gains

    def verified(self, accepted: int) -> None:
        """The draft tokens accepted from them."""
        self.predicted = self.decay * self.predicted + self.pending
        self.accepted = self.decay * self.accepted + accepted
        self.pending = 0.0
