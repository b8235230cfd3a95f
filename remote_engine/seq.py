"""Per-request state of the remote engine and the message builders it needs.

A request's committed tokens and next token live in its ``lyanna.sequence.Sequence`` (the
engine's history is the source of truth for both services). A ``RemoteSeq`` keeps only what
the remote engine adds to it: whether the drafter's state is in step (``drafter_synced``), the
quiet steps the engine verified without the drafter and has yet to hand it, the resume
bookkeeping after the verifier lost the sequence and, when the drafter reads hidden states,
every committed token's target hidden state so a drafter that lost the sequence (restart,
failed step, deadline) can be started again from the full history.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from lyanna.sequence import Sequence
from services import codec
from services.pb import common_pb2, drafter_pb2, verifier_pb2


@dataclass(slots=True, eq=False)
class RemoteSeq:
    sequence: Sequence  # committed tokens, next token, stop conditions and method
    use_drafter: bool  # False: target-only steps ("ar", or the drafter cannot hold it)
    # the verifier drafts every step itself (free drafts: n-gram needs no model), no drafter
    verifier_drafts: bool = False
    hidden_history: list[torch.Tensor] = field(default_factory=list)  # each [n_i, hidden]
    keep_hidden: bool = False  # collect hidden_history (drafter needs hidden, inline mode)
    drafter_started: bool = False  # the drafter may hold state for it
    drafter_synced: bool = False  # the drafter's state matches the sequence's committed tokens
    # quiet steps (the drafter said it would not draft them): verified root-only directly
    # against the verifier; their verifications wait in ``unseen_steps`` for the next Step
    quiet_left: int = 0
    quiet_step: bool = False  # the step in flight is a quiet one
    unseen_steps: list[drafter_pb2.VerifiedStep] = field(default_factory=list)
    resume_by: float | None = None  # set while waiting to be re-prefilled (monotonic deadline)
    may_hold_slot: bool = False  # waiting, yet the verifier may still hold its KV slot
    hidden_bytes: int = 0  # size of hidden_history (kept, not summed on every step)

    @property
    def seq_id(self) -> int:
        return self.sequence.seq_id

    def ref(self) -> common_pb2.SeqRef:
        return common_pb2.SeqRef(seq_id=self.seq_id, num_committed=self.sequence.num_committed)

    def desync(self) -> None:
        """The drafter's state for this sequence is unknown: start it again before drafting."""
        self.drafter_synced = False
        self.quiet_left, self.quiet_step, self.unseen_steps = 0, False, []

    def prefill_item(self, return_hidden: bool) -> verifier_pb2.PrefillItem:
        """Prefill the prompt, or when resuming (after the verifier lost the sequence) every
        committed token, with the next token already decided and the tokens still allowed."""
        sequence = self.sequence
        params = sequence.params
        if self.resume_by is None:
            prompt, next_token = sequence.prompt_ids, None
        else:
            left = max(1, params.max_tokens - len(sequence.output_ids))
            prompt, next_token = sequence.history(), sequence.next_token
            params = replace(params, max_tokens=left)
        return verifier_pb2.PrefillItem(
            seq_id=self.seq_id,
            prompt_ids=prompt,
            params=codec.encode_params(params),
            return_hidden=return_hidden,
            next_token=next_token,
            # resuming: the prompt's rows prefill as a prompt, the decoded ones as decoding ran
            prompt_len=len(self.sequence.prompt_ids) if next_token is not None else 0,
        )

    def keep_rows(self, rows: torch.Tensor, max_bytes: int, fresh: bool = False) -> None:
        """Keep committed tokens' hidden rows for a drafter resync (``fresh``: they replace
        the history), at most ``max_bytes`` per sequence: past it the history is dropped and
        a drafter that loses this sequence leaves it target-only (its tokens stay exact)."""
        size = rows.numel() * rows.element_size()
        if fresh:
            self.hidden_history, self.hidden_bytes = [], 0
        if self.hidden_bytes + size > max_bytes:
            self.hidden_history, self.hidden_bytes, self.keep_hidden = [], 0, False
            return
        self.hidden_history.append(rows)
        self.hidden_bytes += size

    def can_resync(self, needs_hidden: bool) -> bool:
        return not needs_hidden or self.keep_hidden

    def start_item(self, needs_hidden: bool) -> drafter_pb2.StartItem:
        """Start the drafter from everything committed so far (also the first start); a
        resync when an earlier Start may have reached it (its metrics count those apart)."""
        item = drafter_pb2.StartItem(
            ref=self.ref(),
            prompt_ids=self.sequence.history(),
            first_token=self.sequence.next_token,
            params=codec.encode_params(self.sequence.params),
            resync=self.drafter_started,
        )
        if needs_hidden:
            rows = torch.cat(self.hidden_history)  # [num_committed, hidden]
            item.prompt_hidden.tensor.CopyFrom(codec.encode_tensor(rows))
        return item

    def step_item(self, drafted: bool, return_hidden: bool) -> drafter_pb2.StepItem:
        """This sequence in a drafter Step: drafted (with the quiet steps the drafter has not
        seen), or verified root-only in the same forward (``drafted`` False)."""
        item = drafter_pb2.StepItem(
            ref=self.ref(),
            next_token=self.sequence.next_token,
            draft=drafted,
            want_draft_probs=drafted and not self.sequence.params.greedy,
            return_hidden=return_hidden,
        )
        if drafted:
            item.unseen.extend(self.unseen_steps)
        return item


def split_steps(result: verifier_pb2.VerifyResult) -> list[verifier_pb2.VerifyResult]:
    """A result of several decode steps as one result per step, oldest first: one token each,
    or with the verifier's free drafts ``step_accepted[i] + 1``."""
    if result.num_steps <= 1:
        return [result]
    accepted = list(result.step_accepted) or [0] * result.num_steps
    drafted = list(result.step_drafted) or [0] * result.num_steps
    if len(accepted) != result.num_steps or len(drafted) != result.num_steps:
        raise ValueError("a several-step result needs one count per step")
    if sum(accepted) + result.num_steps != len(result.committed) or len(result.tokens) != len(
        result.committed
    ):
        raise ValueError("a several-step result's tokens do not match its per-step counts")
    rows = None
    if result.hidden.WhichOneof("payload") == "tensor":
        rows = codec.decode_tensor(result.hidden.tensor)
    parts, start = [], 0
    before = result.ref.num_committed - len(result.committed)
    for step in range(result.num_steps):
        end = start + accepted[step] + 1
        part = verifier_pb2.VerifyResult(
            ref=common_pb2.SeqRef(seq_id=result.ref.seq_id, num_committed=before + end),
            committed=result.committed[start:end],
            tokens=result.tokens[start:end],
            logprobs=result.logprobs[start:end],
            num_accepted=accepted[step],
            num_drafted=drafted[step],
        )
        if rows is not None:
            part.hidden.tensor.CopyFrom(codec.encode_tensor(rows[start:end]))
        parts.append(part)
        start = end
    return parts
