"""The drafter relays verification, with real processes: while the drafter is healthy each
step of a lane is one gateway call (a drafter Step) and the gateway calls the verifier's
Verify never, the verifier's forwards matching the Steps one for one; a drafter that dies
after the verifier committed a step and before answering loses and doubles no token (the
gateway's direct retry gets the committed step again, drafted tokens included)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lyanna.sampling import SamplingParams
from services.launch import free_port, launch
from tests.services.remote_client import PROMPTS, plain_greedy, run_remote
from tests.services.test_remote import BUDGET_FLAGS, config_for


def verify_forwards(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "lyanna_verifier_forward_seconds_count"
        and sample.labels.get("op") == "verify"
    )


def test_one_drafter_call_per_step_and_none_to_the_verifier(tiny_model_dir, tiny_loaded) -> None:
    port = free_port()
    with launch(
        tiny_model_dir,
        "ngram",
        verifier_args=["--metrics-port", str(port)],
        drafter_args=BUDGET_FLAGS,
    ) as deployment:
        before = verify_forwards(port)
        params, steps = SamplingParams(max_tokens=24), 0
        for pipeline in (False, True):
            config = config_for(deployment, pipeline=pipeline)
            (outcome,), backend = run_remote(config, PROMPTS[:1], params)
            assert outcome.tokens == plain_greedy(tiny_loaded, PROMPTS[:1], 24)[0]
            assert not any(s.drafter_fallback for s in outcome.steps)
            assert sum(s.num_drafted for s in outcome.steps) > 0
            # one request: every step of its lane is one Step, and no direct Verify
            assert backend.drafter.num_step_calls == len(outcome.steps) > 0
            assert backend.num_verify_calls == 0
            steps += backend.num_verified_steps
        # the drafter's own Verify calls: one forward per Step, nothing run twice
        assert verify_forwards(port) - before == steps


def test_a_drafter_dying_between_verify_and_its_answer_loses_no_token(
    tiny_model_dir, tiny_loaded
) -> None:
    """The drafter process exits while learning a verification that accepted a draft token:
    the verifier has committed it, the gateway never heard. The gateway's fallback step names
    the same committed length, the verifier answers it with that step, and the output is
    plain greedy decoding's token for token."""
    max_tokens = 60
    expected = plain_greedy(tiny_loaded, PROMPTS[:2], max_tokens)
    env = {"LYANNA_TEST_DIE_AT": "3"}
    flags = (*BUDGET_FLAGS, "--factory", "tests.services.tiny_drafters:dying_ngram")
    with launch(tiny_model_dir, "ngram", drafter_args=flags, env=env) as deployment:
        config = config_for(deployment, drafter_retry_seconds=0.2, pipeline=False)
        outcomes, backend = run_remote(config, PROMPTS[:2], SamplingParams(max_tokens=max_tokens))
        drafter_code = deployment.children["drafter"].process.wait(10)
        verifier_log = (deployment.log_dir / "verifier.log").read_text()
    assert drafter_code == 3  # it did die mid-step
    assert [o.tokens for o in outcomes] == expected
    steps = [s for o in outcomes for s in o.steps]
    # the first fallback step of each sequence is the drafted step the verifier had committed
    replayed = [s for s in steps if s.drafter_fallback and s.num_drafted > 0]
    assert replayed and "is retried; answered again" in verifier_log
    assert any(s.drafter_fallback and s.num_drafted == 0 for s in steps)  # then plain steps
