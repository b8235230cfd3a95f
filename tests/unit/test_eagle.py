"""The EAGLE-2 drafter on a tiny random model: greedy speculative decoding equals plain greedy
decoding, trees respect the budget, the draft KV tracks the target KV, and the runtime head
computes exactly what the unrolled training forward computes."""

from __future__ import annotations

import pytest
import torch

from lyanna.decode import generate
from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.eagle_head import EagleConfig, EagleHead
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.model.cpu_kernels import bf16_prepacking_supported
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.tree_cost import VerifyCost
from tests.conftest import make_tiny_model

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [9], [4, 4, 4, 4, 4, 4]]


# a synthetic cost curve (seconds by forward rows) with cheap early rows and dear late ones:
# cost-aware trees change size from step to step and must stay lossless
COST = VerifyCost((1, 2, 4, 8, 16, 32), (1.0, 1.02, 1.1, 1.3, 1.9, 3.0))


def random_head(model, seed: int = 0, hot: int | None = None) -> EagleHead:
    torch.manual_seed(seed)
    config = EagleConfig.for_target(model.config, hot or model.config.vocab_size)
    head = EagleHead(config)
    if hot is not None:
        head.hot_vocab.copy_(torch.randperm(model.config.vocab_size)[:hot])
    return head


def run_engine(model, drafter, prompts, max_running: int, max_tokens: int = 24):
    engine = SpecEngine(model, drafter, EngineConfig(max_running=max_running, max_len=256))
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.submit(s)
    return engine, seqs


def run_checking_draft_kv(engine: SpecEngine, drafter: EagleDrafter) -> None:
    """Step to the end, checking after every step: draft KV (+ queued rows) == target KV."""
    while engine.has_work:
        engine.step()
        for seq_id, slot in engine.slots.items():
            state = drafter._seqs[seq_id]
            num_rows = int(drafter.cache.lengths[state.slot]) + len(state.pending_tokens)
            assert num_rows == int(engine.cache.lengths[slot])


def plain_outputs(model, prompts, max_tokens: int = 24) -> list[list[int]]:
    expected = [
        Sequence(i, p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)
    ]
    generate(model, expected)
    return [s.output_ids for s in expected]


@pytest.mark.parametrize("max_running", [1, 3])
@pytest.mark.parametrize(
    "budget", [DraftBudget(3, 2, 5), DraftBudget(5, 4, 16), DraftBudget(5, 4, 16, cost=COST)]
)
def test_greedy_equals_plain_decoding(max_running: int, budget: DraftBudget) -> None:
    model = make_tiny_model(2, vocab_size=16)
    drafter = EagleDrafter(model, random_head(model), budget, max_running=max_running, max_len=256)
    engine, seqs = run_engine(model, drafter, PROMPTS, max_running)
    run_checking_draft_kv(engine, drafter)
    assert [s.output_ids for s in seqs] == plain_outputs(model, PROMPTS)
    assert drafter.cache.num_free_slots == max_running and not drafter._seqs
    assert engine.stats.num_drafted > 0


def test_bf16_draft_weights_stay_lossless() -> None:
    """A drafter computing in bf16 (next to a q4 target) proposes other trees, same output."""
    model = make_tiny_model(2, vocab_size=16)
    budget = DraftBudget(4, 2, 8)
    drafter = EagleDrafter(model, random_head(model), budget, weight_dtype=torch.bfloat16)
    assert drafter.lm_head.dtype == (  # AVX2-only CPUs keep the bf16-rounded weights in fp32
        torch.bfloat16 if bf16_prepacking_supported() else torch.float32
    )
    engine, seqs = run_engine(model, drafter, PROMPTS, max_running=2)
    engine.run()
    expected = [Sequence(i, p, SamplingParams(max_tokens=24)) for i, p in enumerate(PROMPTS)]
    generate(model, expected)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in expected]
    assert engine.stats.num_drafted > 0


def test_sampled_decoding_runs_with_the_deterministic_rule() -> None:
    model = make_tiny_model(3, vocab_size=16)
    drafter = EagleDrafter(model, random_head(model), DraftBudget(3, 2, 6), max_running=2)
    engine = SpecEngine(model, drafter, EngineConfig(max_running=2, max_len=128))
    seq = Sequence(0, PROMPTS[0], SamplingParams(temperature=0.8, max_tokens=20, seed=1))
    engine.submit(seq)
    engine.run()
    assert len(seq.output_ids) == 20


@pytest.mark.parametrize(
    "budget", [DraftBudget(1, 3, 8), DraftBudget(4, 3, 7), DraftBudget(6, 2, 40)]
)
def test_tree_respects_budget(budget: DraftBudget) -> None:
    model = make_tiny_model(1, vocab_size=32)
    drafter = EagleDrafter(model, random_head(model, hot=20), budget, max_running=2)
    hidden = [
        model(
            torch.tensor([p]), torch.arange(len(p))[None], model.new_cache(1, 64), torch.tensor([0])
        )[0]
        for p in PROMPTS[:2]
    ]
    for i, (p, h) in enumerate(zip(PROMPTS[:2], hidden, strict=True)):
        drafter.start(i, p, h, first_token=7)
    for tree in drafter.propose([0, 1]):
        assert int(tree.tokens[0]) == 7
        assert 1 <= tree.num_drafted <= budget.max_tokens
        assert tree.max_depth <= budget.depth
        assert all(len(tree.children(n)) <= budget.top_k for n in range(tree.num_nodes))
        assert set(tree.tokens[1:].tolist()) <= set(drafter.hot_vocab.tolist())
        probs = tree.draft_token_probs
        assert torch.all((probs > 0) & (probs <= 1))
        joint = tree.joint_probs
        assert all(joint[i] <= joint[int(tree.parents[i])] for i in range(1, tree.num_nodes))
        full = min(budget.max_tokens, budget.top_k + (budget.depth - 1) * budget.top_k**2)
        assert tree.num_drafted == full
    assert drafter.cache.lengths[drafter._seqs[0].slot] == len(PROMPTS[0])


def test_runtime_matches_unrolled_training_forward() -> None:
    """Root feature = step 1, a depth-1 node = step 2, its child = step 3 of the TTT forward."""
    from training.eagle import EagleTrainModel
    from training.losses import FrozenTarget

    model = make_tiny_model(4, vocab_size=32)
    head = random_head(model, seed=5)
    tokens = torch.tensor([[3, 9, 4, 1, 8, 2, 6, 5, 7, 11, 12]])
    hidden = model(
        tokens, torch.arange(tokens.shape[1])[None], model.new_cache(1, 32), torch.tensor([0])
    )
    target = FrozenTarget.from_embedding(model.embed_tokens.weight, head.hot_vocab.clone())
    trainer = EagleTrainModel(head, target, config=None)
    with torch.no_grad():
        steps = trainer.unroll(tokens, hidden.clone(), num_steps=3)
    P = 6  # prompt length; the root (first token) is tokens[P]
    drafter = EagleDrafter(model, head, DraftBudget(3, 2, 8), max_running=1, max_len=64)
    drafter.start(0, tokens[0, :P].tolist(), hidden[0, :P], int(tokens[0, P]))
    state = drafter._seqs[0]
    torch.testing.assert_close(state.root_state, steps[0][0, P - 1], atol=1e-4, rtol=1e-4)
    lengths, slots = drafter.cache.lengths[[state.slot]].clone(), torch.tensor([state.slot])
    seen = torch.ones(1, 1, 2, dtype=torch.bool)  # tree rows: the depth-1 node, then its child
    with torch.inference_mode():
        depth1 = drafter._tree_forward(
            lengths, slots, 1, state.root_state[None, None], tokens[:, P + 1 : P + 2], seen[..., :1]
        )
        depth2 = drafter._tree_forward(lengths, slots, 2, depth1, tokens[:, P + 2 : P + 3], seen)
    torch.testing.assert_close(depth1[0, 0], steps[1][0, P], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(depth2[0, 0], steps[2][0, P + 1], atol=1e-4, rtol=1e-4)


def test_calibration_counts_only_the_steps_it_proposed() -> None:
    """Behind a gate the drafter learns every step, also those its n-gram fallback drafted or
    that were plain: their accepted tokens were never predicted by its own gains, so only the
    steps it proposed may move its calibration (counting the others inflated its scale)."""
    model = make_tiny_model()
    drafter = EagleDrafter(model, random_head(model), DraftBudget(3, 2, 5, cost=COST))
    prompt = PROMPTS[0]
    hidden = torch.randn(len(prompt), model.config.hidden_size)
    drafter.start(0, prompt, hidden, first_token=3)

    def verified(committed: list[int], num_committed: int) -> VerifiedStep:
        rows = torch.randn(len(committed), model.config.hidden_size)
        return VerifiedStep(0, committed, rows, 4, len(committed) - 1, num_committed)

    drafter.on_verified([verified([3, 1, 2], len(prompt) + 3)])  # someone else's draft
    assert drafter.calibration.accepted == 0.0
    drafter.propose([0])
    drafter.on_verified([verified([4, 5], len(prompt) + 5)])  # its own: one token accepted
    assert drafter.calibration.accepted == 1.0
    drafter.on_verified([verified([4, 4, 4], len(prompt) + 8)])  # someone else's again
    assert drafter.calibration.accepted == 1.0
