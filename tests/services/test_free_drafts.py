"""The verifier's free drafts: which trees they replace, the batch sizes where a row can pay,
and several-step results that carry drafted steps split back into their steps."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from gateway.remote import RemoteConfig
from lyanna.drafters.base import DraftBudget
from lyanna.multi_step import FreeDrafts
from lyanna.sampling import SamplingParams
from lyanna.tree import DraftScheme, TokenTree
from lyanna.tree_cost import VerifyCost
from remote_engine.seq import split_steps
from services import codec
from services.launch import launch
from services.pb import common_pb2, verifier_pb2
from tests.services.remote_client import MAX_TOKENS, PROMPTS, plain_greedy, run_remote

# a one-row forward 10 ms, +1 ms for a second row, then 5 ms per row: compute bound
COST = VerifyCost((1, 2, 4, 8), (0.010, 0.011, 0.021, 0.041))


@dataclass
class ChainDrafter:
    """Drafts root -> root + 1 -> root + 2 for every sequence it is asked for."""

    budget: DraftBudget
    roots: dict[int, int]

    def start(self, seq_id, prompt_ids, hidden, first_token, params=None) -> None:
        self.roots[seq_id] = first_token

    def propose(self, seq_ids: list[int]) -> list[TokenTree]:
        return [
            TokenTree.chain(r, [r + 1, r + 2], scheme=DraftScheme.TOPK)
            for r in (self.roots[s] for s in seq_ids)
        ]

    def release(self, seq_id: int) -> None:
        self.roots.pop(seq_id)


def test_free_drafts_replace_only_root_only_trees_of_allowed_known_sequences() -> None:
    free = FreeDrafts(ChainDrafter(DraftBudget(), {}))  # no cost curve: rows always pay
    for seq_id, root in ((1, 10), (2, 20), (3, 30)):
        free.start(seq_id, [5], root, None)
    drafted = TokenTree.chain(30, [7], scheme=DraftScheme.TOPK)
    trees = [TokenTree.root_only(10), TokenTree.root_only(20), drafted, TokenTree.root_only(40)]
    out = free.trees([1, 2, 3, 4], trees, [True, False, True, True])
    assert out[0].token_list == (10, 11, 12)  # drafted here
    assert out[1] is trees[1]  # not allowed (plain decoding)
    assert out[2] is drafted  # the drafter service's own tree stays
    assert out[3] is trees[3]  # unknown to the free drafter
    free.release(1)
    assert free.trees([1], trees[:1], [True])[0] is trees[0]
    assert FreeDrafts().trees([1], trees[:1], [True])[0] is trees[0]  # disabled


def test_free_drafts_only_where_a_row_can_pay() -> None:
    """A row pays while it costs at most 0.4 of a token's share of the step: T(2) - T(1) = 1 ms
    against 0.4 * 10 ms; at 4 sequences 5 ms against 0.4 * 21 / 4 ms."""
    free = FreeDrafts(ChainDrafter(DraftBudget(cost=COST), {}))
    assert free.pays(1) and not free.pays(4) and not free.pays(8)
    free.start(1, [5], 10, None)
    plain = [TokenTree.root_only(10)] + [TokenTree.root_only(t) for t in (1, 2, 3)]
    assert free.trees([1, 9, 8, 7], plain, [True] * 4)[0] is plain[0]  # batch 4: no draft
    assert FreeDrafts(ChainDrafter(DraftBudget(), {})).pays(64)  # no cost curve: always


def several_steps(accepted: list[int], drafted: list[int]) -> verifier_pb2.VerifyResult:
    committed = list(range(100, 100 + sum(accepted) + len(accepted)))
    result = verifier_pb2.VerifyResult(
        ref=common_pb2.SeqRef(seq_id=3, num_committed=50),
        committed=committed,
        tokens=[t + 1 for t in committed],
        num_steps=len(accepted),
        step_accepted=accepted,
        step_drafted=drafted,
    )
    rows = torch.arange(len(committed), dtype=torch.float32)[:, None].repeat(1, 4)
    result.hidden.tensor.CopyFrom(codec.encode_tensor(rows))
    return result


def test_several_steps_with_drafts_split_back_into_their_steps() -> None:
    parts = split_steps(several_steps([0, 2, 1], [0, 3, 2]))
    assert [list(p.committed) for p in parts] == [[100], [101, 102, 103], [104, 105]]
    assert [list(p.tokens) for p in parts] == [[101], [102, 103, 104], [105, 106]]
    assert [p.ref.num_committed for p in parts] == [45, 48, 50]
    assert [(p.num_accepted, p.num_drafted) for p in parts] == [(0, 0), (2, 3), (1, 2)]
    rows = [codec.decode_tensor(p.hidden.tensor)[:, 0].tolist() for p in parts]
    assert rows == [[0.0], [1.0, 2.0, 3.0], [4.0, 5.0]]
    plain = several_steps([0, 0], [0, 0])
    del plain.step_accepted[:], plain.step_drafted[:]  # plain steps: no counts
    assert [list(p.committed) for p in split_steps(plain)] == [[100], [101]]
    with pytest.raises(ValueError, match="tokens do not match"):
        split_steps(_short())


def _short() -> verifier_pb2.VerifyResult:
    result = several_steps([0, 2], [0, 3])
    del result.committed[-1]  # one token fewer than the counts say
    return result


@pytest.mark.parametrize("verifier_drafts", [True, False])
def test_ngram_requests_skip_the_drafter_when_the_verifier_drafts(
    tiny_model_dir, tiny_loaded, verifier_drafts
) -> None:
    """With the default n-gram drafter and a verifier that drafts n-gram trees itself, the
    gateway never calls the drafter (no Start, no Step): every step is a direct Verify with
    free drafts, several steps per call, and greedy output is still plain greedy decoding's.
    With the verifier's free drafts off, the same requests draft through the drafter."""
    verifier_args = [] if verifier_drafts else ["--free-drafts", "false"]
    with launch(tiny_model_dir, "ngram", verifier_args=verifier_args) as deployment:
        config = RemoteConfig(deployment.verifier_addr, deployment.drafter_addr, method="ngram")
        outcomes, backend = run_remote(config, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.tokens for o in outcomes] == plain_greedy(tiny_loaded, PROMPTS, MAX_TOKENS)
    steps = [s for o in outcomes for s in o.steps]
    assert sum(s.num_drafted for s in steps) > 0 and sum(s.num_accepted for s in steps) > 0
    if verifier_drafts:
        assert backend.drafter.num_step_calls == 0 and backend.drafter.num_starts == 0
        assert backend.num_verify_calls < len(steps)  # several steps per call
    else:
        assert backend.drafter.num_step_calls > 0
