"""The scheduler on its own (no model): FIFO admission by capacity, refusal of requests that
could never fit, one accounting of each verification (overall and per method), retirement
and abort."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.add(Sequence(2, [], SamplingParams()))
    assert len(scheduler.waiting) == 1


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
