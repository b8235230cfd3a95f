"""TargetRunner: the target side shared by the engine and the verifier service refuses unknown
sequences and out-of-step trees, and a root-only tree is one step of plain greedy decoding."""

from __future__ import annotations

import pytest

from lyanna.sampling import SamplingParams
from lyanna.target import OutOfStepError, TargetConfig, TargetRunner, UnknownSequenceError
from lyanna.tree import TokenTree
from tests.conftest import make_tiny_model


def test_root_only_steps_follow_greedy_and_commit() -> None:
    runner = TargetRunner(
        make_tiny_model(1, vocab_size=16), TargetConfig(max_running=2, max_len=64)
    )
    prefilled = runner.prefill(7, [1, 2, 3], SamplingParams(max_tokens=8))
    assert prefilled.num_committed == 3 and prefilled.hidden.shape[0] == 3
    [result] = runner.verify([7], [TokenTree.root_only(prefilled.first_token)], True)
    assert runner.rule_seconds > 0  # the rules' share of verify, for the verifier's metrics
    assert result.committed == [prefilled.first_token] and result.num_committed == 4
    assert result.hidden.shape[0] == 1 and runner.next_token(7) == result.verdict.tokens[-1]
    assert runner.num_free_slots == 1 and runner.release(7) and not runner.release(7)


def test_unknown_and_out_of_step_sequences_are_refused() -> None:
    runner = TargetRunner(
        make_tiny_model(1, vocab_size=16), TargetConfig(max_running=1, max_len=64)
    )
    with pytest.raises(UnknownSequenceError):
        runner.verify([3], [TokenTree.root_only(1)])
    first = runner.prefill(3, [1, 2], SamplingParams()).first_token
    with pytest.raises(OutOfStepError, match="next token"):
        runner.verify([3], [TokenTree.root_only((first + 1) % 16)])
    with pytest.raises(OutOfStepError, match="already"):
        runner.prefill(3, [1], SamplingParams())


def test_prefill_accepts_stop_strings_it_leaves_to_the_caller() -> None:
    """The runner decides tokens; stop strings are matched by whoever detokenizes."""
    runner = TargetRunner(
        make_tiny_model(1, vocab_size=16), TargetConfig(max_running=1, max_len=64)
    )
    params = SamplingParams(max_tokens=8, stop=("\n\n",))
    plain = TargetRunner(make_tiny_model(1, vocab_size=16), TargetConfig(max_running=1, max_len=64))
    expected = plain.prefill(0, [1, 2, 3], SamplingParams(max_tokens=8)).first_token
    assert runner.prefill(0, [1, 2, 3], params).first_token == expected


def test_a_batch_verifies_in_slot_order_and_reads_the_kv_as_a_view() -> None:
    """After a retirement the next sequence reuses the freed slot, so arrival order and slot
    order differ; the forward runs in slot order (a contiguous run reads the KV without a
    copy) and every sequence still gets its own verdict, the same as alone. (The eager
    forward's order: the static step runs slot b as row b, ``test_static_step``.)"""
    model = make_tiny_model(1, vocab_size=16)
    runner = TargetRunner(model, TargetConfig(max_running=3, max_len=64, static_step=False))
    prompts = {0: [1, 2, 3], 1: [4, 5], 2: [6, 7, 8, 9]}
    for seq_id in (0, 1, 2):
        runner.prefill(seq_id, prompts[seq_id], SamplingParams(max_tokens=8))
    runner.release(0)
    prompts[3] = [10, 11]
    runner.prefill(3, prompts[3], SamplingParams(max_tokens=8))  # takes slot 0
    seq_ids = [1, 2, 3]  # arrival order: slots 1, 2, 0
    assert [runner.slot(s) for s in seq_ids] == [1, 2, 0]
    trees = [TokenTree.root_only(runner.next_token(s)) for s in seq_ids]
    results = runner.verify(seq_ids, trees)
    used, run = runner.cache._run_of  # the slots of the last forward and their run
    assert used.tolist() == [0, 1, 2] and run == slice(0, 3)
    for seq_id, result in zip(seq_ids, results, strict=True):
        alone = TargetRunner(model, TargetConfig(max_running=1, max_len=64))
        alone.prefill(seq_id, prompts[seq_id], SamplingParams(max_tokens=8))
        expected = alone.verify([seq_id], [TokenTree.root_only(alone.next_token(seq_id))])[0]
        assert result.verdict.tokens == expected.verdict.tokens
        assert result.committed == expected.committed
