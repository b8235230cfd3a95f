"""The ``Drafter`` protocol every speculative method implements, so the engine never branches
on the method: ``start`` a sequence after prefill, ``propose`` one token tree per sequence,
learn the outcome in ``on_verified``, ``release`` the sequence's state.

Token ids and hidden states handed over follow one convention: the target's KV cache holds
every *committed* token except the newest one, the *next token* (the residual or bonus token
of the last verification), which is the root of the next tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from lyanna.draft_nodes import DraftNodes
from lyanna.sampling import SamplingParams
from lyanna.tree import DraftScheme, TokenTree
from lyanna.tree_cost import GainCalibration, VerifyCost

if TYPE_CHECKING:
    from lyanna.target import Verified


@dataclass(frozen=True, slots=True)
class DraftBudget:
    """Tree-shape knobs shared by every drafter (the same budget for a fair comparison)."""

    depth: int = 5  # maximum draft depth
    top_k: int = 4  # children per expanded node
    max_tokens: int = 16  # verification budget B: draft nodes per sequence per step
    # the target's forward cost by rows: when set, each step keeps only the nodes that pay
    # for their verification (at most max_tokens); None = always max_tokens (EAGLE-2)
    cost: VerifyCost | None = None
    # maximum draft depth of a sampled (T > 0) sequence, 0 = ``depth``; read by the n-gram
    # drafter, whose later chain tokens a sampled continuation accepts too rarely on a 4-bit
    # target (``lyanna.drafters.NGRAM_CHAIN``)
    sampled_depth: int = 0

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.max_tokens < 1 or self.sampled_depth < 0:
            raise ValueError("depth, top_k and max_tokens must be >= 1, sampled_depth >= 0")

    def depth_for(self, greedy: bool) -> int:
        """The deepest draft of a greedy or a sampled sequence."""
        if greedy or not self.sampled_depth:
            return self.depth
        return min(self.sampled_depth, self.depth)

    def prune(
        self,
        nodes: list[DraftNodes],
        draft_seconds: float = 0.0,
        calibrations: Sequence[GainCalibration] | None = None,  # one per tree
    ) -> list[DraftNodes]:
        """Cut a step's trees to one width: ``max_tokens``, or with a cost curve the width
        whose expected tokens per second is highest given ``draft_seconds`` already spent
        drafting them (``VerifyCost.best_width``), each tree's gains scaled by its
        calibration (which is told what the tree proposed). A batch holding a sampled
        tree takes the first width that stops paying (``first_peak_width``): looking further
        ahead would keep a sampled node for what its own draw led to."""
        width = self.max_tokens
        if self.cost is None or not nodes:
            return [n.prune(width) for n in nodes]
        gains = [n.ranked_gains() for n in nodes]
        if any(g is None for g in gains):
            return [n.prune(width) for n in nodes]
        scales = [1.0] * len(nodes) if calibrations is None else [c.scale for c in calibrations]
        scaled = [[s * x for x in g[:width]] for s, g in zip(scales, gains, strict=True)]  # type: ignore[index]
        if any(n.sampled for n in nodes):
            width = self.cost.first_peak_width(scaled, width, draft_seconds)
        else:
            width = self.cost.best_width(scaled, width, draft_seconds)
        for c, g in zip(calibrations or [], gains, strict=bool(calibrations)):
            c.proposed(sum(g[:width]))  # type: ignore[index]
        return [n.prune(width) for n in nodes]


@dataclass(frozen=True, slots=True)
class DraftCapacity:
    """The sequences a drafter keeps state for and the rows each may grow to: the engine's or
    verifier's capacity (``max_running`` KV slots of ``max_len`` rows), handed to every drafter so
    the two never disagree (a drafter with fewer slots than the engine admits would fail the
    sequences beyond them)."""

    max_running: int = 16
    max_len: int = 4096

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_len < 2:
            raise ValueError("a drafter needs max_running >= 1 and max_len >= 2")


@dataclass(frozen=True, slots=True, eq=False)
class VerifiedStep:
    """What one verification taught about one sequence."""

    seq_id: int
    committed: list[int]  # tokens that entered the target KV this step: old root + accepted
    hidden: torch.Tensor | None  # [len(committed), hidden] target final hidden states of them
    next_token: int  # residual or bonus token: the next root, not yet in the target KV
    num_accepted: int  # accepted draft tokens (len(committed) - 1)
    num_committed: int  # total tokens in the target KV after this step

    @classmethod
    def of(cls, seq_id: int, verified: Verified, hidden: bool = True) -> VerifiedStep:
        """The step a target verification (``lyanna.target.Verified``) made, with its hidden
        rows unless ``hidden`` is False (a drafter that reads none)."""
        return cls(
            seq_id=seq_id,
            committed=verified.committed,
            hidden=verified.hidden if hidden else None,
            next_token=verified.verdict.tokens[-1],
            num_accepted=verified.verdict.num_accepted,
            num_committed=verified.num_committed,
        )


@runtime_checkable
class Drafter(Protocol):
    """Proposes token trees. ``scheme`` states how children are chosen, which fixes the
    lossless acceptance rule at temperature > 0 (see ``lyanna.verify.rule_for``)."""

    scheme: DraftScheme
    needs_hidden: bool  # whether start/on_verified need target hidden states

    def start(
        self,
        seq_id: int,
        prompt_ids: list[int],
        prompt_hidden: torch.Tensor | None,  # [len(prompt_ids), hidden]
        first_token: int,
        params: SamplingParams | None = None,  # the request's; sampling drafters use it
    ) -> None: ...

    def propose(self, seq_ids: list[int]) -> list[TokenTree]: ...

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        """Learn the verified steps; returns, per sequence, the accepted tokens that only a
        re-sampled subtree held (Lyanna's re-sampling; other drafters return {})."""
        ...

    def release(self, seq_id: int) -> None: ...


class NoDrafter:
    """Plain autoregressive decoding through the speculative engine: root-only trees."""

    scheme = DraftScheme.TOPK
    needs_hidden = False

    def __init__(self) -> None:
        self._roots: dict[int, int] = {}

    def start(self, seq_id, prompt_ids, prompt_hidden, first_token, params=None) -> None:
        self._roots[seq_id] = first_token

    def propose(self, seq_ids: list[int]) -> list[TokenTree]:
        return [TokenTree.root_only(self._roots[s]) for s in seq_ids]

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        for step in steps:
            self._roots[step.seq_id] = step.next_token
        return {}

    def release(self, seq_id: int) -> None:
        self._roots.pop(seq_id, None)
