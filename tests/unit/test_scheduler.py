"""The scheduler on its own (no model): FIFO admission by capacity (and by a driver's own
bound), refusal of requests that could never fit, the sequence as the record of committed
tokens and the next token, one accounting of each verification
(overall and per method, a local verdict or a verifier service's result alike), requeueing,
retirement and abort."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lyanna.sampling import SamplingParams
from lyanna.scheduler import TREE_MARGIN, Scheduler, SchedulerConfig
from lyanna.sequence import Sequence
from lyanna.verify import Verdict


def seq(seq_id: int, method: str = "ar", max_tokens: int = 8, prompt_len: int = 3) -> Sequence:
    prompt = list(range(1, prompt_len + 1))
    return Sequence(seq_id, prompt, SamplingParams(max_tokens=max_tokens), method=method)


def verdict(tokens: list[int], drafted: list[int]) -> Verdict:
    accepted = len(tokens) - 1
    return Verdict(
        path=list(range(len(tokens))),
        tokens=tokens,
        num_accepted=accepted,
        accepted_per_depth=[d < accepted for d in range(len(drafted))],
        num_drafted_per_depth=drafted,
    )


def test_admits_in_arrival_order_while_slots_are_free() -> None:
    scheduler = Scheduler(SchedulerConfig(max_running=2, max_len=256))
    for i in range(4):
        scheduler.add(seq(i))
    assert [s.seq_id for s in scheduler.schedule_prefill(limit=1)] == [0]
    assert [s.seq_id for s in scheduler.schedule_prefill()] == [1]  # one slot left
    assert scheduler.schedule_prefill() == [] and scheduler.num_free == 0
    assert [s.seq_id for s in scheduler.waiting] == [2, 3]


def test_refuses_a_request_that_cannot_fit_its_slot() -> None:
    scheduler = Scheduler(SchedulerConfig(max_running=1, max_len=TREE_MARGIN + 20))
    scheduler.add(seq(0, max_tokens=10, prompt_len=10))  # exactly the context
    with pytest.raises(ValueError, match="exceeds the context of 20"):
        scheduler.add(seq(1, max_tokens=11, prompt_len=10))
    with pytest.raises(AssertionError, match="empty prompt"):  # the edges refuse it
        scheduler.add(Sequence(2, [], SamplingParams()))
    assert len(scheduler.waiting) == 1


def test_the_sequence_is_the_record_of_committed_tokens_and_the_next_token() -> None:
    """Every output token but the last is in the target's KV; the last is the next root. The
    remote engine's per-request state reads them here (it keeps no copy)."""
    scheduler = Scheduler(SchedulerConfig(max_running=1, max_len=256))
    scheduler.add(seq(0, "lyanna"))
    [sequence] = scheduler.schedule_prefill()
    assert (sequence.num_committed, sequence.next_token, sequence.history()) == (3, None, [1, 2, 3])
    scheduler.postprocess_prefill(sequence, 7)
    assert (sequence.num_committed, sequence.next_token, sequence.history()) == (3, 7, [1, 2, 3])
    scheduler.postprocess([sequence], [verdict([8, 9], [2])])  # committed: 7 (root), 8
    assert (sequence.num_committed, sequence.next_token) == (5, 9)
    assert sequence.history() == [1, 2, 3, 7, 8] and sequence.output_ids == [7, 8, 9]


def test_each_verification_is_counted_once_overall_and_per_method() -> None:
    scheduler = Scheduler(SchedulerConfig(max_running=4, max_len=256))
    a, b = seq(0, "ngram", max_tokens=3), seq(1, "ar")
    scheduler.add(a)
    scheduler.add(b)
    for s in scheduler.schedule_prefill():
        scheduler.postprocess_prefill(s, 7)
    emitted = scheduler.postprocess(
        scheduler.decode_batch(), [verdict([4, 5, 6], [2, 1]), verdict([9], [])]
    )
    assert [e.tokens for e in emitted] == [[4, 5], [9]]  # max_tokens 3 cuts the third token
    assert a.finished and a.finish_reason == "length" and not b.finished
    assert scheduler.stats.num_steps == 2 and scheduler.stats.num_accepted == 2
    assert scheduler.stats.acceptance_length == 2.0  # (2 + 0) accepted over 2 steps, + 1
    ngram, ar = scheduler.stats_by_method["ngram"], scheduler.stats_by_method["ar"]
    assert (ngram.num_steps, ngram.num_drafted, ngram.acceptance_length) == (1, 3, 3.0)
    assert (ar.num_steps, ar.num_drafted, ar.acceptance_length) == (1, 0, 1.0)
    scheduler.record_drafter_facts(emitted, {0: 1})
    assert emitted[0].num_resampled_accepted == 1 and emitted[1].num_resampled_accepted == 0
    assert scheduler.stats.num_resampled_accepted == ngram.num_resampled_accepted == 1
    assert [s.seq_id for s in scheduler.retire()] == [0]
    assert list(scheduler.running) == [1] and scheduler.decode_batch() == [b]


def test_abort_forgets_waiting_and_running_sequences() -> None:
    scheduler = Scheduler(SchedulerConfig(max_running=1, max_len=256))
    scheduler.add(seq(0))
    scheduler.add(seq(1))
    scheduler.schedule_prefill()
    assert scheduler.abort(1) and not scheduler.waiting
    assert scheduler.abort(0) and not scheduler.running and not scheduler.has_work
    assert not scheduler.abort(0)


def test_admission_stops_where_the_batch_is_full_and_keeps_the_order() -> None:
    """A driver bounds a batch beyond its slots (the remote backend: the verifier's free KV
    slots as ``limit``, one message's worth of prompt hidden states as ``fits``); the
    sequence that does not fit stays first in line."""
    scheduler = Scheduler(SchedulerConfig(max_running=8, max_len=256))
    for i, prompt_len in enumerate((4, 4, 9, 1, 1)):
        scheduler.add(seq(i, prompt_len=prompt_len))

    def fits(sequence: Sequence, admitted: list[Sequence]) -> bool:
        return sum(len(s.prompt_ids) for s in admitted) + len(sequence.prompt_ids) <= 10

    assert [s.seq_id for s in scheduler.schedule_prefill(fits=fits)] == [0, 1]
    assert [s.seq_id for s in scheduler.waiting] == [2, 3, 4]
    assert [s.seq_id for s in scheduler.schedule_prefill(limit=1, fits=fits)] == [2]
    assert [s.seq_id for s in scheduler.schedule_prefill(fits=fits)] == [3, 4]
    assert list(scheduler.running) == [0, 1, 2, 3, 4]


def test_requeued_sequences_go_first_in_line_and_free_their_slots() -> None:
    scheduler = Scheduler(SchedulerConfig(max_running=3, max_len=256))
    for i in range(5):
        scheduler.add(seq(i))
    lost = scheduler.schedule_prefill()
    scheduler.requeue([lost[2], lost[0]])
    assert list(scheduler.running) == [1] and scheduler.num_free == 2
    assert [s.seq_id for s in scheduler.waiting] == [2, 0, 3, 4]
    assert [s.seq_id for s in scheduler.schedule_prefill()] == [2, 0]


def test_a_verifier_reserving_other_rows_sets_the_context() -> None:
    scheduler = Scheduler(SchedulerConfig(max_running=1, max_len=100, reserved_rows=30))
    assert scheduler.config.max_context == 70
    scheduler.add(seq(0, max_tokens=60, prompt_len=10))
    with pytest.raises(ValueError, match=r"exceeds the context of 70 \(100 KV rows, 30 kept"):
        scheduler.add(seq(1, max_tokens=61, prompt_len=10))
    with pytest.raises(ValueError, match="reserved_rows"):
        SchedulerConfig(reserved_rows=-1)


@dataclass
class RemoteResult:
    """A verification as a verifier service returns it (tokens and counts, no tree path)."""

    tokens: tuple[int, ...]
    num_accepted: int
    num_drafted_per_depth: tuple[int, ...]


def test_a_remote_verification_commits_and_counts_as_a_verdict_does() -> None:
    local, remote = Scheduler(), Scheduler()
    for scheduler in (local, remote):
        scheduler.add(seq(0, "lyanna", max_tokens=3))
        scheduler.postprocess_prefill(scheduler.schedule_prefill()[0], 7)
    [by_verdict] = local.postprocess(local.decode_batch(), [verdict([4, 5, 6], [2, 1])])
    by_result = remote.commit(remote.running[0], RemoteResult((4, 5, 6), 2, (2, 1)))
    assert by_result.tokens == by_verdict.tokens == [4, 5]
    assert remote.running[0].finish_reason == "length"
    assert remote.stats == local.stats and remote.stats_by_method == local.stats_by_method
    assert remote.stats_by_method["lyanna"].acceptance_length == 3.0
    assert [s.seq_id for s in remote.retire()] == [0]
