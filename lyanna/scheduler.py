"""Who runs next and what a verification means for each request: one scheduler, no I/O.

nano-vllm style. Requests wait in a FIFO queue and are admitted while capacity lasts
(``max_running`` sequences, each needing prompt + max_tokens + one tree of KV rows). A step
is ``schedule_prefill()`` (admitted sequences, prefilled by the driver), then
``decode_batch()`` (every running sequence not yet finished: one speculative step), then
``postprocess()`` (commit each verdict's tokens, count the step in the stats of the
sequence's method, collect what finished), then ``retire()``. The driver owns the model
and drafters: the in-process engine and the remote one (``lyanna.engine.StepLoop``, the one
step loop) drive this class, so admission, acceptance accounting and retirement are written
once. The remote engine (``remote_engine``) bounds admission further by the verifier's free
KV slots and what one message holds (``schedule_prefill(limit, fits)``), commits the
verifier service's results (a ``Verification`` like a local ``Verdict``), and puts
sequences the verifier lost back first in line (``requeue``).
"""

from __future__ import annotations

from collections import abc, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from lyanna.sequence import Sequence
from lyanna.stats import SpecStats
from lyanna.verify import Verdict

TREE_MARGIN = 64  # KV rows kept free beyond prompt + max_tokens: one tree in flight


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running: int = 8  # sequences decoding at once (one KV slot each)
    max_len: int = 4096  # KV rows per sequence (prompt + output + one tree)
    reserved_rows: int = TREE_MARGIN  # of them kept for the tree in flight (a remote
    #                                   verifier says how many it keeps)

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_len < 2 or self.reserved_rows < 0:
            raise ValueError("max_running must be >= 1, max_len >= 2 and reserved_rows >= 0")

    @property
    def max_context(self) -> int:
        """The longest prompt + max_tokens a request may ask for."""
        return self.max_len - self.reserved_rows


class Verification(Protocol):
    """What the scheduler reads of one verification: a local ``Verdict``, or a verifier
    service's result (its ``VerifyResult`` message has these fields too)."""

    tokens: abc.Sequence[int]  # accepted draft tokens + one residual-or-bonus token
    num_accepted: int
    num_drafted_per_depth: abc.Sequence[int]


@dataclass(frozen=True, slots=True, eq=False)
class StepTiming:
    """Where one speculative step's time went, as seen by one of its sequences."""

    draft_seconds: float = 0.0  # its method's drafter (propose + feedback) this step
    verify_seconds: float = 0.0  # the shared target forward and acceptance rules


@dataclass(slots=True, eq=False)
class Emitted:
    """Tokens a step handed to one sequence (the driver adds the step's timing and drafter
    facts once the drafters have learned the step)."""

    sequence: Sequence
    tokens: list[int]  # newly emitted output tokens (may be empty when EOS ended it)
    verdict: Verification | None = None  # the verification behind them; None for the prefill
    timing: StepTiming = field(default_factory=StepTiming)
    num_resampled_accepted: int = 0  # accepted tokens only a re-sampled subtree held
    source: str = "method"  # what drafted the tree (lyanna.drafters.gate.DRAFT_SOURCES)
    logprobs: list | None = None  # one lyanna.sampling.TokenLogprob per token (when asked)
    finish_reason: str | None = None  # the sequence's, once these tokens were committed
    drafter_fallback: bool = False  # a remote drafter was down or late: a target-only step
    error: Exception | None = None  # the request failed (the driver aborted it): no tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.stats = SpecStats()  # every method together
        self.stats_by_method: dict[str, SpecStats] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free(self) -> int:
        return self.config.max_running - len(self.running)

    def add(self, sequence: Sequence) -> None:
        """Queue a request; refused (ValueError) when it could never fit its KV slot: the
        admission bound of this scheduler's capacity (an HTTP intake checks the backend's
        context first). The request itself was checked at the edge (the HTTP intake, the
        gRPC codec): a prompt holds at least one token."""
        assert sequence.prompt_ids, "an empty prompt (the edges refuse it)"
        needed = len(sequence.prompt_ids) + sequence.params.max_tokens
        if needed > self.config.max_context:
            raise ValueError(
                f"prompt + max_tokens = {needed} exceeds the context of {self.config.max_context}"
                f" ({self.config.max_len} KV rows, {self.config.reserved_rows} kept for a tree)"
            )
        self.waiting.append(sequence)

    def schedule_prefill(
        self,
        limit: int | None = None,
        fits: Callable[[Sequence, list[Sequence]], bool] | None = None,
    ) -> list[Sequence]:
        """Admit waiting sequences (FIFO) while slots are free, at most ``limit``, and (when
        ``fits`` is given) while ``fits(next, admitted so far)`` says the next one joins this
        batch; they are running from now on, and the driver prefills them."""
        room = self.num_free if limit is None else min(limit, self.num_free)
        admitted: list[Sequence] = []
        while self.waiting and len(admitted) < room:
            if fits is not None and not fits(self.waiting[0], admitted):
                break  # it stays first in line
            sequence = self.waiting.popleft()
            self.running[sequence.seq_id] = sequence
            admitted.append(sequence)
        return admitted

    def decode_batch(self) -> list[Sequence]:
        """The running sequences that take part in the next speculative step."""
        return [s for s in self.running.values() if not s.finished]

    def postprocess_prefill(self, sequence: Sequence, first_token: int) -> Emitted:
        tokens = sequence.append([first_token])
        return Emitted(sequence, tokens, finish_reason=sequence.finish_reason)

    def postprocess(self, batch: list[Sequence], verdicts: list[Verdict]) -> list[Emitted]:
        """Commit a step's verdicts to their sequences and count them, once, in the stats."""
        return [self.commit(s, v) for s, v in zip(batch, verdicts, strict=True)]

    def commit(self, sequence: Sequence, verification: Verification) -> Emitted:
        """Commit one verification's tokens to its sequence and count it in the stats (once
        overall, once for the sequence's method)."""
        self.stats.record(verification)
        self.method_stats(sequence.method).record(verification)
        tokens = sequence.append(verification.tokens)
        return Emitted(sequence, tokens, verification, finish_reason=sequence.finish_reason)

    def record_drafter_facts(self, emitted: list[Emitted], resampled: dict[int, int]) -> None:
        """What the drafters reported after learning the step (per sequence)."""
        for item in emitted:
            count = resampled.get(item.sequence.seq_id, 0)
            item.num_resampled_accepted = count
            self.stats.num_resampled_accepted += count
            self.method_stats(item.sequence.method).num_resampled_accepted += count

    def retire(self) -> list[Sequence]:
        """Remove and return the running sequences that finished."""
        done = [s for s in self.running.values() if s.finished]
        for sequence in done:
            del self.running[sequence.seq_id]
        return done

    def requeue(self, sequences: list[Sequence]) -> None:
        """Put running sequences back first in line, in this order, to be admitted (and
        prefilled) again: a remote verifier lost them, or their prefill must be retried."""
        for sequence in sequences:
            self.running.pop(sequence.seq_id, None)
        self.waiting.extendleft(reversed(sequences))

    def abort(self, seq_id: int) -> bool:
        """Forget a waiting or running sequence (the driver first frees a running one's slot
        and drafter state); False when it was not known."""
        for sequence in self.waiting:
            if sequence.seq_id == seq_id:
                self.waiting.remove(sequence)
                return True
        return self.running.pop(seq_id, None) is not None

    def method_stats(self, method: str | None) -> SpecStats:
        return self.stats_by_method.setdefault(method, SpecStats())
