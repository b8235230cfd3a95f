"""The logits processors in services mode: the sampling parameters travel to the verifier over
gRPC (common.SamplingParams fields 5-8), the verifier's greedy decoding with them equals a
reference loop over full-model logits, and out-of-range values answer INVALID_ARGUMENT."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
import torch

from lyanna.sampling import SamplingParams
from lyanna.target import TargetConfig, TargetRunner
from lyanna.tree import TokenTree
from services import codec
from services.codec import WireError
from services.hidden import HiddenSender
from services.pb import common_pb2, verifier_pb2
from services.verifier.config import VerifierConfig
from services.verifier.server import VerifierServicer
from tests.conftest import make_tiny_model, prompt_logits
from tests.services.test_servicers import Aborted, FakeContext

VOCAB = 16
PROMPT = [1, 2, 3, 1, 2]
PARAMS = SamplingParams(
    max_tokens=12,
    presence_penalty=0.6,
    frequency_penalty=-0.3,
    logit_bias=((3, 1.5), (7, -100.0)),
    top_k=5,
)


def reference_greedy(model, prompt: list[int], params: SamplingParams, steps: int) -> list[int]:
    """Greedy over full-model logits with the processors applied here, step by step."""
    output: list[int] = []
    bias = dict(params.logit_bias)
    for _ in range(steps):
        raw = prompt_logits(model, torch.tensor([prompt + output]))[-1].double()
        counts = Counter(output)
        logits = [
            float(raw[v])
            - params.frequency_penalty * counts[v]
            - params.presence_penalty * (counts[v] > 0)
            + bias.get(v, 0.0)
            for v in range(VOCAB)
        ]
        kth = sorted(logits, reverse=True)[params.top_k - 1]
        logits = [x if x >= kth else float("-inf") for x in logits]
        output.append(logits.index(max(logits)))
    return output


def servicer(model) -> VerifierServicer:
    runner = TargetRunner(model, TargetConfig(max_running=2, max_len=128))
    return VerifierServicer(runner, VerifierConfig(max_tree_nodes=32), HiddenSender())


def test_the_processors_round_trip_on_the_wire() -> None:
    assert codec.decode_params(codec.encode_params(PARAMS)) == PARAMS
    message = codec.encode_params(PARAMS)
    assert message.top_k == 5 and dict(message.logit_bias) == {3: 1.5, 7: -100.0}


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"logit_bias": {1: 100.5}},
        {"logit_bias": {i: 1.0 for i in range(301)}},
    ],
)
def test_out_of_range_values_are_wire_errors(fields) -> None:
    message = common_pb2.SamplingParams(max_tokens=4, **fields)
    with pytest.raises(WireError):
        codec.decode_params(message)


def test_the_verifier_decodes_greedily_with_the_processors() -> None:
    model = make_tiny_model(2, vocab_size=VOCAB)
    service = servicer(model)
    item = verifier_pb2.PrefillItem(seq_id=1, prompt_ids=PROMPT, params=codec.encode_params(PARAMS))
    first = service.Prefill(verifier_pb2.PrefillRequest(items=[item]), FakeContext())
    root = first.results[0].first_token
    tokens = [root]
    for step in range(9):
        ref = common_pb2.SeqRef(seq_id=1, num_committed=len(PROMPT) + step)
        tree = codec.encode_tree(TokenTree.root_only(root))
        request = verifier_pb2.VerifyRequest(items=[verifier_pb2.VerifyItem(ref=ref, tree=tree)])
        (result,) = service.Verify(request, FakeContext()).results
        root = result.tokens[-1]
        tokens.append(root)
    assert tokens == reference_greedy(model, PROMPT, PARAMS, 10)
    plain = reference_greedy(model, PROMPT, SamplingParams(top_k=VOCAB), 10)
    assert tokens != plain  # the parameters were honoured, not dropped on the wire


def test_bad_values_answer_invalid_argument() -> None:
    service = servicer(make_tiny_model(2, vocab_size=VOCAB))
    for params in (
        common_pb2.SamplingParams(max_tokens=4, presence_penalty=3.0),
        common_pb2.SamplingParams(max_tokens=4, logit_bias={VOCAB: 1.0}),  # outside the vocab
    ):
        item = verifier_pb2.PrefillItem(seq_id=1, prompt_ids=PROMPT, params=params)
        with pytest.raises(Aborted) as error:
            service.Prefill(verifier_pb2.PrefillRequest(items=[item]), FakeContext())
        assert error.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert service.runner.num_free_slots == 2  # nothing held
