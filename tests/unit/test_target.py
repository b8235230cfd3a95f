"""TargetRunner: the target side shared by the engine and the verifier service refuses unknown
sequences and out-of-step trees, and a root-only tree is one step of plain greedy decoding."""

from __future__ import annotations

import pytest

from lyanna.sampling import SamplingParams
from lyanna.target import OutOfStepError, TargetConfig, TargetRunner, UnknownSequenceError
from lyanna.tree import TokenTree
from tests.conftest import make_tiny_model


def test_root_only_steps_follow_greedy_and_commit() -> None:
    runner = TargetRunner(make_tiny_model(1, vocab_size=16), TargetConfig(max_seqs=2, max_len=64))
    prefilled = runner.prefill(7, [1, 2, 3], SamplingParams(max_tokens=8))
    assert prefilled.num_committed == 3 and prefilled.hidden.shape[0] == 3
    [result] = runner.verify([7], [TokenTree.root_only(prefilled.first_token)], True)
    assert result.committed == [prefilled.first_token] and result.num_committed == 4
    assert result.hidden.shape[0] == 1 and runner.next_token(7) == result.verdict.tokens[-1]
    assert runner.num_free_slots == 1 and runner.release(7) and not runner.release(7)


def test_unknown_and_out_of_step_sequences_are_refused() -> None:
    runner = TargetRunner(make_tiny_model(1, vocab_size=16), TargetConfig(max_seqs=1, max_len=64))
    with pytest.raises(UnknownSequenceError):
        runner.verify([3], [TokenTree.root_only(1)])
    first = runner.prefill(3, [1, 2], SamplingParams()).first_token
    with pytest.raises(OutOfStepError, match="next token"):
        runner.verify([3], [TokenTree.root_only((first + 1) % 16)])
    with pytest.raises(OutOfStepError, match="already"):
        runner.prefill(3, [1], SamplingParams())


def test_prefill_accepts_stop_strings_it_leaves_to_the_caller() -> None:
    """The runner decides tokens; stop strings are matched by whoever detokenizes."""
    runner = TargetRunner(make_tiny_model(1, vocab_size=16), TargetConfig(max_seqs=1, max_len=64))
    params = SamplingParams(max_tokens=8, stop=("\n\n",))
    plain = TargetRunner(make_tiny_model(1, vocab_size=16), TargetConfig(max_seqs=1, max_len=64))
    expected = plain.prefill(0, [1, 2, 3], SamplingParams(max_tokens=8)).first_token
    assert runner.prefill(0, [1, 2, 3], params).first_token == expected
