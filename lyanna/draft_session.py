"""A drafter whose target runs elsewhere (the drafter service): the drafter half of the
engine's step (``SpecEngine._speculate``: propose, then learn each verification) and the one
record it keeps of each sequence, ``DraftSeq``.

In one process the engine's ``Sequence`` holds a request's committed history. A drafter in
another process knows only what it was told, so every caller's view is checked against its
record before any drafting: an unknown sequence raises ``UnknownSequenceError``, a committed
length or next token that disagrees ``OutOfStepError`` (the caller starts it again from its
own history). A verification that comes back after the sequence was released or started
again is not learned.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

import torch

from lyanna.drafters.base import Drafter, VerifiedStep
from lyanna.drafters.gate import GatedDrafter
from lyanna.sampling import SamplingParams
from lyanna.target import OutOfStepError, UnknownSequenceError
from lyanna.tree import TokenTree


@dataclass(slots=True, eq=False)
class DraftSeq:
    """What the drafter knows of a sequence beside its own draft state."""

    committed: int  # tokens in the target KV, as far as the drafter has learned
    next_token: int  # the root of its next tree
    generation: int  # which start began this state (a sequence started again is another)


@dataclass(frozen=True, slots=True, eq=False)
class Unseen:
    """A verification the drafter did not run (a quiet step its caller verified directly)."""

    committed: list[int]  # the root and the accepted tokens
    hidden: torch.Tensor | None  # their target hidden states, when the drafter reads them
    next_token: int


class DraftSession:
    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.seqs: dict[int, DraftSeq] = {}
        self._generations = count()

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def start(
        self,
        seq_id: int,
        prompt_ids: list[int],
        hidden: torch.Tensor | None,
        first_token: int,
        params: SamplingParams | None,
    ) -> None:
        if seq_id in self.seqs:
            raise OutOfStepError(f"sequence {seq_id} is already started")
        self.drafter.start(seq_id, prompt_ids, hidden, first_token, params)
        self.seqs[seq_id] = DraftSeq(len(prompt_ids), first_token, next(self._generations))

    def check(self, seq_id: int, num_committed: int, unseen_tokens: int) -> None:
        """The caller's committed length must be ours plus its unseen steps' tokens."""
        seq = self._seq(seq_id)
        if seq.committed + unseen_tokens != num_committed:
            raise OutOfStepError(
                f"sequence {seq_id}: caller has {num_committed} committed tokens, the drafter "
                f"has {seq.committed} and {unseen_tokens} unseen tokens"
            )

    def catch_up(self, seq_id: int, unseen: list[Unseen]) -> list[VerifiedStep]:
        """Learn the verifications the drafter did not run, in order (after ``check``)."""
        seq, steps = self._seq(seq_id), []
        for step in unseen:
            seq.committed += len(step.committed)
            steps.append(
                VerifiedStep(
                    seq_id=seq_id,
                    committed=step.committed,
                    hidden=step.hidden,
                    next_token=step.next_token,
                    num_accepted=len(step.committed) - 1,
                    num_committed=seq.committed,
                )
            )
            self.drafter.on_verified(steps[-1:])
            seq.next_token = step.next_token
        return steps

    def propose(self, seq_ids: list[int], roots: list[int]) -> list[TokenTree]:
        """One tree per sequence, rooted at the caller's next token (which must be ours)."""
        seqs = [self._seq(seq_id) for seq_id in seq_ids]
        wrong = [
            s for s, seq, root in zip(seq_ids, seqs, roots, strict=True) if seq.next_token != root
        ]
        if wrong:
            raise OutOfStepError(f"sequences {wrong}: the caller's next token is another root")
        trees = self.drafter.propose(seq_ids) if seq_ids else []
        for seq, tree in zip(seqs, trees, strict=True):
            assert int(tree.tokens[0]) == seq.next_token, "the drafter lost a step"
        return trees

    def marks(self, seq_ids: list[int]) -> dict[int, tuple[int, int]]:
        """Each sequence's (generation, committed length) now, for ``learn``."""
        return {s: (self.seqs[s].generation, self.seqs[s].committed) for s in seq_ids}

    def learn(
        self, steps: list[VerifiedStep], marks: dict[int, tuple[int, int]], route: float = 0.0
    ) -> tuple[list[VerifiedStep], dict[int, int]]:
        """Learn the verifications of trees drafted at ``marks`` in one batched call, leaving
        a sequence released or started again since alone: the steps learned and, per
        sequence, the accepted tokens only a re-sampled subtree held. A gated drafter learns
        the ``route``'s cost: the hops a drafted step takes that a directly verified one
        skips."""
        fresh = []
        for step in steps:
            seq = self.seqs.get(step.seq_id)
            if seq is not None and (seq.generation, seq.committed) == marks[step.seq_id]:
                fresh.append(step)
        if isinstance(self.drafter, GatedDrafter):
            self.drafter.routed(route, [step.seq_id for step in fresh])
        resampled = self.drafter.on_verified(fresh) if fresh else {}
        for step in fresh:
            seq = self.seqs[step.seq_id]
            seq.committed, seq.next_token = step.num_committed, step.next_token
        return fresh, resampled

    def quiet_steps(self, seq_id: int, bound: int) -> int:
        """Steps the drafter will certainly not draft for ``seq_id`` (gated drafters), at
        most ``bound``."""
        quiet_steps = getattr(self.drafter, "quiet_steps", None)
        return min(quiet_steps(seq_id), bound) if quiet_steps else 0

    def release(self, seq_id: int) -> bool:
        if self.seqs.pop(seq_id, None) is None:
            return False
        self.drafter.release(seq_id)
        return True

    def _seq(self, seq_id: int) -> DraftSeq:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id}") from None
