"""The scripted fault runs (``loadtests.faults``) over HTTP against the three processes, on a
tiny model, a few runs per fault: a SIGKILLed gateway's slots come back through the lease
(the verifier's slot gauge at 0 after the TTL) and its clients' text so far is a prefix of
the greedy answer; a drafter killed mid-stream and a client walking away lose or duplicate
nothing. ``python -m loadtests.faults --runs 20`` is the full measurement
(docs/reliability.md)."""

from __future__ import annotations

import pytest

from loadtests.faults import run_faults, table

pytestmark = pytest.mark.slow

PROMPTS = ["one two three one two three", "alpha beta gamma", "the cat sat on the mat"]


def test_gateway_kill_and_other_faults_lose_nothing_and_leak_no_slot(
    tiny_chat_dir, tmp_path
) -> None:
    faults = ["gateway-kill", "drafter-kill", "client-disconnect"]
    tallies = run_faults(
        tiny_chat_dir,
        faults,
        runs=2,
        method="ngram",
        max_tokens=24,
        lease_seconds=2.0,
        prompts=PROMPTS,
        service_args=("--max-len", "512"),
        log_dir=tmp_path,
    )
    print(table(tallies))
    assert list(tallies) == faults
    for fault, tally in tallies.items():
        assert tally.runs == 2 and tally.requests == 6, fault
        assert tally.mismatched == 0 and tally.client_errors == 0, (fault, tally)
        assert tally.slots_leaked == 0, (fault, tally)
    kill = tallies["gateway-kill"]
    # the kill landed mid-stream: streams were cut and the dead gateway held slots, which
    # only the lease could give back (nobody released them)
    assert kill.cut_prefix >= 1 and kill.cut_by_kill >= 1
    assert kill.held_at_kill >= 1 and len(kill.reclaim_seconds) == 2
    assert tallies["client-disconnect"].cut_prefix == 2
    assert tallies["drafter-kill"].exact == 6
