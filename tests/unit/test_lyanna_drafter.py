"""The Lyanna drafter: chain independent of sampled tokens, collapsed token-info table, tree
sampling by hand, re-sampling from the remaining logits, fusion within the budget, and
temperature-0 output equal to plain decoding with fusion on and off."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lyanna.decode import generate
from lyanna.drafters.base import DraftBudget
from lyanna.drafters.lyanna import LyannaDrafter, ResampleConfig
from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
from lyanna.drafters.token_info_tree import GatedTokenInfo, build_subtree, resample_subtree
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.tree_cost import VerifyCost
from tests.conftest import make_tiny_model
from training.lyanna import draft_loss

VOCAB = 16


def tiny_draft(target, seed: int = 0, num_hot: int = 12) -> LyannaDraftModel:
    torch.manual_seed(seed)
    config = LyannaDraftConfig(target.config, num_hot=num_hot, info_rank=4, chain_steps=3)
    draft = LyannaDraftModel(config, target.embed_tokens.weight, torch.randperm(VOCAB)[:num_hot])
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return draft


def hot_maps(num_hot: int = 4, vocab: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    hot_ids = torch.arange(num_hot)
    hot_index = torch.full((vocab,), -1)
    hot_index[:num_hot] = torch.arange(num_hot)
    return hot_ids, hot_index


def test_tree_sampling_matches_hand_worked_example() -> None:
    """Root 5 (not hot: no token info). Step 1 probs (.6, .3, .05, .05): children 0 and 1.
    Step 2 rows get token info: after token 0 the best are 2 (.7) and 3; after token 1 the
    best are 3 (.8) and 2. Joint: 0->2 .42, 1->3 .24 are the kept frontier."""
    hot_ids, hot_index = hot_maps()
    step1 = torch.tensor([0.6, 0.3, 0.05, 0.05]).log()
    info = torch.zeros(4, 4)
    info[0] = torch.tensor([0.0, 0.0, 0.7, 0.2]).clamp_min(1e-9).log()
    info[1] = torch.tensor([0.0, 0.0, 0.1, 0.8]).clamp_min(1e-9).log()
    logits = torch.stack([step1, torch.zeros(4), torch.zeros(4)])
    tree = build_subtree(logits[:2], 5, 2, info, hot_ids, hot_index).to_tree()
    assert tree.tokens.tolist() == [5, 0, 1, 2, 3, 3, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    joint = tree.log_joint.exp()
    assert math.isclose(joint[3], 0.6 * 0.7 / 0.9, rel_tol=1e-5)  # softmax renormalises .7/.9
    assert math.isclose(joint[5], 0.3 * 0.8 / 0.9, rel_tol=1e-5)
    deeper = build_subtree(logits, 5, 2, info, hot_ids, hot_index).to_tree()
    # step 3 expands only the two best depth-2 nodes (3 and 5), not 4 or 6
    assert sorted(set(deeper.parents[7:].tolist())) == [3, 5]


def test_resampled_subtree_uses_only_remaining_logits() -> None:
    hot_ids, hot_index = hot_maps()
    logits = torch.randn(5, 4)
    sub = resample_subtree(logits, 1, 3, 1, 2, None, hot_ids, hot_index)
    assert sub.tokens[0] == 3 and sub.to_tree().max_depth == 3  # rows 2, 3, 4 remain
    expected = build_subtree(logits[2:], 3, 2, None, hot_ids, hot_index)
    assert sub.tokens == expected.tokens
    changed = logits.clone()
    changed[:2] = torch.randn(2, 4)  # rows already used by the accepted path do not matter
    again = resample_subtree(changed, 1, 3, 1, 2, None, hot_ids, hot_index)
    assert again.tokens == sub.tokens
    assert resample_subtree(logits, 3, 3, 2, 2, None, hot_ids, hot_index) is None  # 1 left < r


def test_collapsed_table_equals_low_rank_product() -> None:
    target = make_tiny_model(vocab_size=VOCAB)
    draft = tiny_draft(target)
    table = draft.collapsed_token_info(torch.float32)
    hot = draft.hot_ids
    product = target.embed_tokens.weight[hot] @ draft.w1 @ draft.w2
    expected = draft.info_norm(product)
    assert torch.allclose(table, expected, atol=1e-5)
    cold = torch.tensor([t for t in range(VOCAB) if t not in set(hot.tolist())])
    assert draft.token_info(cold).abs().max() == 0  # no row outside the hot set


def engine_outputs(target, drafter, prompts, max_tokens=20):
    engine = SpecEngine(target, drafter, EngineConfig(max_running=2, max_len=128))
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.submit(s)
    stats = engine.run()
    return [s.output_ids for s in seqs], stats


PROMPTS = [[1, 2, 3, 4], [7, 8, 9, 7, 8, 9, 7], [3]]


@pytest.mark.parametrize("cost_aware", [False, True])
@pytest.mark.parametrize("fusion", [True, False])
def test_greedy_output_equals_plain_decoding(fusion: bool, cost_aware: bool) -> None:
    target = make_tiny_model(4, vocab_size=VOCAB)
    cost = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.02, 1.1, 1.3, 1.9)) if cost_aware else None
    drafter = LyannaDrafter(
        target,
        tiny_draft(target),
        DraftBudget(depth=3, top_k=3, max_tokens=8, cost=cost),
        ResampleConfig(enabled=True, fusion=fusion),
        max_running=2,
        max_len=128,
    )
    outputs, stats = engine_outputs(target, drafter, PROMPTS)
    plain = [Sequence(i, p, SamplingParams(max_tokens=20)) for i, p in enumerate(PROMPTS)]
    generate(target, plain)
    assert outputs == [s.output_ids for s in plain]
    assert stats.num_drafted > 0
    assert drafter.cache.num_free_slots == 2  # every sequence released its draft slot


def test_chain_does_not_depend_on_sampled_tokens() -> None:
    """Same context, different token-info tables (so different trees): identical chains."""
    target = make_tiny_model(5, vocab_size=VOCAB)
    draft = tiny_draft(target, seed=1)
    hidden = torch.randn(6, target.config.hidden_size)
    chains, trees = [], []
    for info_seed in (0, 1):
        drafter = LyannaDrafter(target, draft, DraftBudget(depth=3, top_k=2, max_tokens=6))
        drafter.info_table = (
            torch.randn(12, 12, generator=torch.Generator().manual_seed(info_seed)) * 5
        )
        drafter.start(0, [1, 2, 3, 4, 5, 6], hidden, 7)
        trees.append(drafter.propose([0])[0])
        chains.append(drafter.seqs[0].chain_logits)
    assert torch.equal(chains[0], chains[1])
    assert not torch.equal(trees[0].tokens, trees[1].tokens)


@pytest.mark.parametrize("feed_residual", [False, True], ids=["normed-feed", "residual-feed"])
def test_served_chain_is_the_trained_chain(feed_residual: bool) -> None:
    """The drafter's chain logits for a sequence equal the training pass's (``unrolled``) at
    its last anchor, step for step, whichever input the chain feeds itself."""

    target = make_tiny_model(5, vocab_size=VOCAB)
    draft = tiny_draft(target, seed=2)
    draft.config = dataclasses.replace(draft.config, feed_residual=feed_residual)
    torch.manual_seed(4)
    hidden = torch.randn(6, target.config.hidden_size)
    drafter = LyannaDrafter(target, draft, DraftBudget(depth=3, top_k=2, max_tokens=6))
    drafter.start(0, [1, 2, 3, 4, 5, 6], hidden, 7)
    drafter.propose([0])
    served = drafter.seqs[0].chain_logits.float()
    padded = torch.cat([hidden, torch.zeros(1, hidden.shape[1])])[None]  # the anchor j = 5
    with torch.no_grad():
        chain = draft.unrolled(padded, torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), 3)
        trained = torch.stack([y[0, 5] for y in chain]) @ draft.hot_head.T
    torch.testing.assert_close(served, trained, rtol=1e-4, atol=1e-4)


def test_fused_tree_holds_both_trees_within_budget() -> None:
    target = make_tiny_model(6, vocab_size=VOCAB)
    drafter = LyannaDrafter(
        target, tiny_draft(target, 2), DraftBudget(depth=3, top_k=2, max_tokens=10)
    )
    hot_ids, hot_index = drafter.draft.hot_ids, drafter.draft.hot_index
    drafter.start(0, [1, 2, 3], torch.randn(3, target.config.hidden_size), int(hot_ids[0]))
    state = drafter.seqs[0]
    state.resampled = build_subtree(torch.randn(2, 12) * 3, state.root, 2, None, hot_ids, hot_index)
    fused = drafter.propose([0])[0]
    assert fused.num_drafted <= 10
    fused_paths = {tuple(fused.tokens[fused.path_to(i)].tolist()) for i in range(fused.num_nodes)}
    best_resampled = state.resampled.prune(2).to_tree()  # its two most likely nodes survive
    for i in range(best_resampled.num_nodes):
        assert tuple(best_resampled.tokens[best_resampled.path_to(i)].tolist()) in fused_paths


def test_draft_loss_decreases_with_training() -> None:
    target = make_tiny_model(7, vocab_size=VOCAB)
    draft = tiny_draft(target, 3)
    hidden = torch.randn(2, 12, target.config.hidden_size)
    tokens = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(30):
        loss, metrics = draft_loss(draft, hidden, tokens, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss.detach())
    assert float(loss.detach()) < 0.7 * first
    assert {"top1_1", "top3_3", "mse2"} <= set(metrics)


@pytest.mark.parametrize("flag", ["token_info", "fuse_first_token"])
def test_ablation_flags_reach_the_model_and_remove_the_input(flag: str) -> None:
    """`--token-info false` / `--fuse-first-token false` train models whose loss does not
    depend on the parent token's info / on the bonus token at step 1."""
    from training.config import parse_overrides
    from training.losses import FrozenTarget
    from training.lyanna import LyannaTrainModel

    target = make_tiny_model(5, vocab_size=VOCAB)
    config = parse_overrides([f"--{flag.replace('_', '-')}", "false", "--hot-vocab-size", "8"])
    frozen = FrozenTarget.from_embedding(target.embed_tokens.weight, torch.arange(8))
    draft = LyannaTrainModel.build(frozen, target.config, config).draft
    attribute = {"token_info": "use_token_info", "fuse_first_token": "fuse_first_token"}[flag]
    assert getattr(draft.config, attribute) is False
    torch.manual_seed(0)
    hidden = torch.randn(1, 10, target.config.hidden_size)
    tokens = torch.randint(0, 8, (1, 10))
    other = tokens.clone()
    other[0, 1:] = (tokens[0, 1:] + 1) % 8  # every token as input changes
    mask = torch.ones(1, 10, dtype=torch.bool)
    with torch.no_grad():
        draft.w2.normal_()
        outputs = draft.unrolled(hidden, tokens, 1)[0], draft.unrolled(hidden, other, 1)[0]
        bias = draft.token_info(tokens), draft.token_info(other)
    if flag == "fuse_first_token":
        torch.testing.assert_close(*outputs)  # the chain never sees a token
        assert not torch.allclose(*bias)
    else:
        assert not torch.allclose(*outputs)
        assert float(bias[0].abs().max()) == 0.0 and float(bias[1].abs().max()) == 0.0
    assert draft_loss(draft, hidden, tokens, mask)[0].isfinite()


def test_info_and_chain_knobs_reach_the_model() -> None:
    """`--info-rank`, `--info-scale-init` and `--feed-residual true` (issue 41 ablations) build
    that model: the rank of W1 W2, RMSNorm's starting weight, and a chain whose step 2 reads
    the layer's raw output (step 1 unchanged, step 2 different from the normed feed)."""
    from training.config import parse_overrides
    from training.losses import FrozenTarget
    from training.lyanna import LyannaTrainModel

    target = make_tiny_model(5, vocab_size=VOCAB)
    frozen = FrozenTarget.from_embedding(target.embed_tokens.weight, torch.arange(8))
    base = ["--hot-vocab-size", "8"]
    knobs = ["--info-rank", "12", "--info-scale-init", "0.7", "--feed-residual", "true"]
    torch.manual_seed(0)
    plain = LyannaTrainModel.build(frozen, target.config, parse_overrides(base)).draft
    torch.manual_seed(0)
    tuned = LyannaTrainModel.build(frozen, target.config, parse_overrides(base + knobs)).draft
    assert tuned.w1.shape[1] == 12 and tuned.w2.shape[0] == 12
    assert torch.all(tuned.info_norm.weight == 0.7) and torch.all(plain.info_norm.weight == 0.1)
    tuned.load_state_dict(
        {k: v for k, v in plain.state_dict().items() if k not in ("w1", "w2", "info_norm.weight")},
        strict=False,
    )
    hidden = torch.randn(1, 10, target.config.hidden_size)
    tokens = torch.randint(0, 8, (1, 10))
    with torch.no_grad():
        a, b = plain.unrolled(hidden, tokens, 2), tuned.unrolled(hidden, tokens, 2)
    torch.testing.assert_close(a[0], b[0])
    assert not torch.allclose(a[1], b[1])


def test_state_gated_token_info() -> None:
    """``info_gate`` (issue 41): the bias is RMSNorm(((W_E[t] W1) * (1 + G h)) W2), written out
    here by hand; it starts as the paper's table bias (G = 0), then depends on the chain state,
    so it has no lookup table."""
    target = make_tiny_model(5, vocab_size=VOCAB)
    hot = torch.arange(8)
    n = target.config.hidden_size
    torch.manual_seed(0)
    config = LyannaDraftConfig(target.config, num_hot=8, info_rank=4, chain_steps=3)
    plain = LyannaDraftModel(config, target.embed_tokens.weight, hot)
    gated = LyannaDraftModel(dataclasses.replace(config, info_gate=True),
                             target.embed_tokens.weight, hot)  # fmt: skip
    gated.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        plain.w2.normal_()
        gated.w2.copy_(plain.w2)
    parents, states = torch.tensor([1, 5, 7]), torch.randn(3, n)
    torch.testing.assert_close(gated.token_info(parents, states), plain.token_info(parents))
    with torch.no_grad():
        gated.info_gate.weight.normal_()
    a = target.embed_tokens.weight[parents] @ gated.w1 * (1 + states @ gated.info_gate.weight.T)
    u = a @ gated.w2
    by_hand = 0.1 * u / (u.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps).sqrt()
    with torch.no_grad():
        torch.testing.assert_close(gated.token_info(parents, states), by_hand)
        assert not torch.allclose(gated.token_info(parents, states),
                                  gated.token_info(parents, states.flip(0)))  # fmt: skip
    with pytest.raises(ValueError, match="chain states"):
        gated.token_info(parents)
    with pytest.raises(ValueError, match="lookup table"):
        gated.collapsed_token_info()


def gated_draft(target, seed: int, info_space: str = "logits",
                info_gate: bool = True) -> LyannaDraftModel:  # fmt: skip
    """``tiny_draft`` with the state-gated token info, its gate random too (``info_space``:
    the bias on the logits, or the correction of the state)."""
    torch.manual_seed(seed)
    config = LyannaDraftConfig(target.config, num_hot=12, info_rank=4, chain_steps=3,
                               info_gate=info_gate, info_space=info_space)  # fmt: skip
    draft = LyannaDraftModel(config, target.embed_tokens.weight, torch.randperm(VOCAB)[:12])
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return draft


@pytest.mark.parametrize("info_space", ["logits", "state"])
def test_served_gated_token_info_is_the_trained_one(info_space: str) -> None:
    """The drafter serves an ``info_gate`` checkpoint with the bias training computes
    (``token_info(parent, state)`` at each chain step's state), on the host loop; for a state
    correction that is ``(h + D) W_head``, checked here against the corrected state."""
    target = make_tiny_model(5, vocab_size=VOCAB)
    draft = gated_draft(target, seed=2, info_space=info_space)
    torch.manual_seed(4)
    hidden = torch.randn(6, target.config.hidden_size)
    gate = draft.info_gate.weight.detach().clone()  # (the drafter packs its linear layers)
    drafter = LyannaDrafter(target, draft, DraftBudget(depth=3, top_k=2, max_tokens=6))
    assert drafter.info_table is None and not drafter.device_steps
    drafter.start(0, [1, 2, 3, 4, 5, 6], hidden, 7)
    tree = drafter.propose([0])[0]
    padded = torch.cat([hidden, torch.zeros(1, hidden.shape[1])])[None]  # the anchor j = 5
    with torch.no_grad():
        chain = draft.unrolled(padded, torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), 3)
        states = torch.stack([y[0, 5] for y in chain])  # [3, n]
        step1 = states[0] @ draft.hot_head.T + draft.token_info(torch.tensor(7), states[0])
        if info_space == "state":
            corrected = states[0] + draft.info_delta(torch.tensor(7), states[0])
            torch.testing.assert_close(step1, corrected @ draft.hot_head.T)
    assert_root_children(tree, step1, draft.hot_ids)
    gates = 1 + states @ gate.T
    torch.testing.assert_close(drafter.seqs[0].chain_info.gates[0], gates, rtol=1e-4, atol=1e-4)


def assert_root_children(tree, logits: torch.Tensor, hot_ids: torch.Tensor,
                         rel: float = 1e-4) -> None:  # fmt: skip
    """The tree's depth-1 children are the top-2 of ``softmax(logits)`` [num_hot] over the hot
    vocabulary, with those probabilities."""
    children = [i for i, p in enumerate(tree.parent_list) if p == 0]
    served = {tree.token_list[i]: float(tree.draft_token_probs[i]) for i in children}
    top = logits.softmax(-1).topk(2)
    expected = {int(hot_ids[c]): float(v) for v, c in zip(*top, strict=True)}
    assert served.keys() == expected.keys()
    for token, p in expected.items():
        assert served[token] == pytest.approx(p, rel=rel, abs=1e-5)


def test_gated_resample_reads_the_remaining_steps_gates() -> None:
    """A re-sampled subtree from a gated chain uses the gates of the steps it re-reads (the
    rows after the accepted path), not the chain's first ones."""
    hot_ids, hot_index = hot_maps()
    torch.manual_seed(0)
    logits = torch.randn(5, 4)
    info = GatedTokenInfo(torch.randn(4, 3), torch.randn(3, 4), torch.rand(4) * 4, 1e-6,
                          torch.randn(3, 2), torch.randn(1, 5, 3) * 3)  # fmt: skip
    sub = resample_subtree(logits, 1, 3, 1, 2, info, hot_ids, hot_index)
    after = dataclasses.replace(info, gates=info.gates[:, 2:])
    expected = build_subtree(logits[2:], 3, 2, after, hot_ids, hot_index)
    assert sub.tokens == expected.tokens and sub.probs == expected.probs
    first = dataclasses.replace(info, gates=info.gates[:, :3])
    misaligned = build_subtree(logits[2:], 3, 2, first, hot_ids, hot_index)
    assert misaligned.probs != sub.probs


@pytest.mark.parametrize(("info_space", "info_gate"), [("logits", True), ("state", True),
                                                       ("state", False)])  # fmt: skip
def test_gated_drafter_output_equals_plain_decoding(info_space: str, info_gate: bool) -> None:
    target = make_tiny_model(4, vocab_size=VOCAB)
    draft = gated_draft(target, seed=0, info_space=info_space, info_gate=info_gate)
    drafter = LyannaDrafter(target, draft,
                            DraftBudget(depth=3, top_k=3, max_tokens=8),
                            ResampleConfig(enabled=True, fusion=True), max_running=2,
                            max_len=128)  # fmt: skip
    outputs, stats = engine_outputs(target, drafter, PROMPTS)
    plain = [Sequence(i, p, SamplingParams(max_tokens=20)) for i, p in enumerate(PROMPTS)]
    generate(target, plain)
    assert outputs == [s.output_ids for s in plain]
    assert stats.num_drafted > 0


def test_a_gateless_checkpoint_continues_with_the_gate_at_zero() -> None:
    """``--init-from`` a committed (gate-less) checkpoint with ``--info-gate true``: the gated
    model loads it with its gate at zero, the same bias; any other mismatch is refused."""
    from training.config import parse_overrides
    from training.losses import FrozenTarget
    from training.lyanna import LyannaTrainModel

    target = make_tiny_model(5, vocab_size=VOCAB)
    frozen = FrozenTarget.from_embedding(target.embed_tokens.weight, torch.arange(8))
    base = ["--hot-vocab-size", "8"]
    plain = LyannaTrainModel.build(frozen, target.config, parse_overrides(base))
    with torch.no_grad():
        plain.draft.w2.normal_()
    gated = LyannaTrainModel.build(frozen, target.config,
                                   parse_overrides(base + ["--info-gate", "true"]))  # fmt: skip
    with torch.no_grad():
        gated.draft.info_gate.weight.normal_()  # whatever it held is replaced by zeros
    gated.load_export(plain.export())
    parents, states = torch.tensor([0, 3, 7]), torch.randn(3, target.config.hidden_size)
    with torch.no_grad():  # (exported in fp16)
        served, expected = gated.draft.token_info(parents, states), plain.draft.token_info(parents)
    torch.testing.assert_close(served, expected, rtol=1e-3, atol=1e-3)
    broken = {k: v for k, v in plain.export().items() if k != "w1"}
    with pytest.raises(RuntimeError, match="missing"):
        gated.load_export(broken)


def test_state_correction_token_info() -> None:
    """``info_space="state"`` (issue 41): the parent's info is a correction
    ``D = ((W_E[t] W1) * (1 + G h)) U`` of the state the LM head reads, so its logit bias is
    ``D W_head`` (written out here by hand). Without the gate it collapses to a table like the
    paper's bias; non-hot parents add nothing."""
    target = make_tiny_model(5, vocab_size=VOCAB)
    n = target.config.hidden_size
    torch.manual_seed(0)
    hot = torch.randperm(VOCAB)[:8]
    emb = target.embed_tokens.weight
    for info_gate in (False, True):
        config = LyannaDraftConfig(target.config, num_hot=8, info_rank=4, chain_steps=3,
                                   info_gate=info_gate, info_space="state")  # fmt: skip
        draft = LyannaDraftModel(config, emb, hot)
        assert draft.w2 is None and draft.info_norm is None
        with torch.no_grad():
            draft.info_up.normal_()
            if info_gate:
                draft.info_gate.weight.normal_()
            parents, states = hot[[1, 5, 7]], torch.randn(3, n)
            a = emb[parents] @ draft.w1
            if info_gate:
                a = a * (1 + states @ draft.info_gate.weight.T)
            by_hand = a @ draft.info_up @ emb[hot].T
            torch.testing.assert_close(draft.token_info(parents, states), by_hand)
            cold = torch.tensor([int(t) for t in range(VOCAB) if t not in hot.tolist()][:2])
            assert draft.token_info(cold, states[:2]).abs().max() == 0
            if not info_gate:
                table = draft.collapsed_token_info(torch.float32)
                torch.testing.assert_close(table, emb[hot] @ draft.w1 @ draft.info_up @ emb[hot].T)
    logits_space = LyannaDraftModel(dataclasses.replace(config, info_space="logits"), emb, hot)
    with pytest.raises(ValueError, match="corrects its states"):
        logits_space.info_delta(parents, states)
    with pytest.raises(ValueError, match="info_space"):
        dataclasses.replace(config, info_space="hidden")
