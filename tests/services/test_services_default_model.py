"""On the real default model, the three-process path (verifier + Lyanna drafter subprocesses
driven by the RemoteBackend's asynchronous pipeline) reproduces plain greedy decoding token
for token, with real speculation (accepted drafts, no fallback) and a clean SIGTERM exit."""

from __future__ import annotations

import pytest

from gateway.remote import RemoteConfig
from lyanna.sampling import SamplingParams
from lyanna.tokenizer import chat_prompt_ids
from services.launch import launch
from tests.services.remote_client import plain_greedy, run_remote

pytestmark = pytest.mark.slow

PROMPTS = [
    "Explain why the sky is blue in three sentences.",
    "Write a Python function that reverses a string.",
]
MAX_TOKENS = 40


def test_lyanna_services_equal_plain_greedy(default_model, default_tokenizer, default_model_dir):
    prompts = [
        chat_prompt_ids(default_tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS
    ]
    expected = plain_greedy(default_model, prompts, MAX_TOKENS)
    verifier_args = ("--max-len", "1024", "--weights", "fp32")  # the reference is fp32
    # a large fixed tree, so the acceptance length below measures the drafter, not the cost
    # model (which keeps few nodes where rows are dear)
    drafter_args = ("--weights", "fp32", "--tree", "fixed", "--depth", "5", "--top-k", "4")
    drafter_args += ("--max-draft-tokens", "16")
    with launch(
        default_model_dir, "lyanna", verifier_args=verifier_args, drafter_args=drafter_args
    ) as deployment:
        config = RemoteConfig(deployment.verifier_addr, deployment.drafter_addr, method="lyanna")
        outcomes, backend = run_remote(config, prompts, SamplingParams(max_tokens=MAX_TOKENS))
        processes = [child.process for child in deployment.children.values()]
    assert [o.tokens for o in outcomes] == expected
    steps = [s for o in outcomes for s in o.steps]
    assert backend.default_method == "lyanna" and not any(s.drafter_fallback for s in steps)
    emitted = sum(s.num_accepted + 1 for s in steps)
    assert emitted / len(steps) > 1.5  # mean acceptance length of a trained drafter
    assert all(p.returncode == 0 for p in processes)  # SIGTERM: drained and exited cleanly
