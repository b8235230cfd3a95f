"""Lyanna's copy read (issue 41, ``LyannaDraftConfig.info_copy``): the parent token looks up
the context positions that held it and reads the target's states there (what followed it),
seeing only the context before its anchor; a drafter without it continues as the same
drafter; evaluation's first choices follow it; the serving drafter refuses it clearly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from lyanna.decode import generate
from lyanna.drafters.base import DraftBudget
from lyanna.drafters.lyanna import LyannaDrafter, ResampleConfig
from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from tests.conftest import make_tiny_model
from tests.unit.test_lyanna_drafter import assert_root_children
from training.losses import TrainBatch
from training.lyanna import draft_loss

VOCAB = 16


def copy_draft(target, seed: int = 0, info_gate: bool = False,
               num_hot: int = VOCAB) -> LyannaDraftModel:  # fmt: skip
    torch.manual_seed(seed)
    config = LyannaDraftConfig(target.config, num_hot=num_hot, info_rank=4, chain_steps=3,
                               info_gate=info_gate, info_copy=True, copy_dim=16)  # fmt: skip
    return LyannaDraftModel(config, target.embed_tokens.weight, torch.randperm(VOCAB)[:num_hot])


def exact_copy(draft: LyannaDraftModel, sink_score: float = -1e4) -> None:
    """Make the read a hard lookup: query = key projection, a sharp temperature, the gate
    open, unit scale, the sink at ``sink_score``."""
    c = draft.copy
    with torch.no_grad():
        c.query.copy_(c.key)
        c.state_query.zero_()
        c.log_temperature.fill_(8.0)  # ~3000: cosine 1 against anything below wins outright
        c.sink.zero_()
        c.sink_bias.fill_(sink_score)
        c.gate.bias.fill_(30.0)  # sigmoid ~ 1
        c.scale.fill_(1.0)


def test_the_parent_reads_the_state_where_it_occurred_before() -> None:
    target = make_tiny_model(3, vocab_size=VOCAB)
    draft = copy_draft(target)
    exact_copy(draft)
    n = target.config.hidden_size
    tokens = torch.tensor([[4, 9, 2, 7, 11, 5]])
    hidden = torch.randn(1, 6, n)
    # anchors 0..3; parents: 2 (at p=2: unseen at anchor 0, seen at 2), 9 (p=1), 4 (p=0)
    parents = torch.tensor([[2, 9, 2, 4]])
    states = torch.randn(1, 4, n)
    read = draft.copy_read(parents, states, tokens, hidden)
    # anchor 0 sees only p=0 (token 4, not 2): the sink is far below, so it reads H_0
    torch.testing.assert_close(read[0, 0], hidden[0, 0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(read[0, 1], hidden[0, 1], rtol=1e-4, atol=1e-4)  # 9 at p=1
    torch.testing.assert_close(read[0, 2], hidden[0, 2], rtol=1e-4, atol=1e-4)  # 2 at p=2
    torch.testing.assert_close(read[0, 3], hidden[0, 0], rtol=1e-4, atol=1e-4)  # 4 at p=0
    # with a sink above every mismatch but below a match, a parent never seen reads nothing
    emb = torch.nn.functional.normalize(target.embed_tokens.weight @ draft.copy.key, dim=-1)
    cosines = emb @ emb.T - 2 * torch.eye(VOCAB)
    assert cosines.max() < 0.95  # distinct tokens: distinct keys
    exact_copy(draft, sink_score=0.97 * 2980.0)
    read = draft.copy_read(parents, states, tokens, hidden)
    assert read[0, 0].abs().max() < 1e-3  # 2 was not at p=0
    torch.testing.assert_close(read[0, 1], hidden[0, 1], rtol=1e-3, atol=1e-3)


def test_the_read_sees_only_the_context_up_to_its_anchor() -> None:
    target = make_tiny_model(4, vocab_size=VOCAB)
    draft = copy_draft(target, seed=2, info_gate=True)
    with torch.no_grad():
        for p in draft.copy.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    n = target.config.hidden_size
    tokens = torch.randint(0, VOCAB, (2, 10))
    hidden = torch.randn(2, 10, n)
    parents, states = torch.randint(0, VOCAB, (2, 7)), torch.randn(2, 7, n)
    before = draft.copy_read(parents, states, tokens, hidden)
    later_tokens, later_hidden = tokens.clone(), hidden.clone()
    later_tokens[:, 4:] = (later_tokens[:, 4:] + 1) % VOCAB
    later_hidden[:, 4:] += 1.0
    after = draft.copy_read(parents, states, later_tokens, later_hidden)
    torch.testing.assert_close(after[:, :4], before[:, :4])  # anchors 0..3 never saw p >= 4
    assert (after[:, 4:] - before[:, 4:]).abs().amax(-1).min() > 1e-4


def test_a_drafter_without_it_continues_as_the_same_drafter() -> None:
    """``--init-from`` a copy-less export with ``--info-copy true``: the scale starts at
    zero, so the loss is the copy-less drafter's; training then moves the read."""
    from training.config import parse_overrides
    from training.losses import FrozenTarget
    from training.lyanna import LyannaTrainModel

    target = make_tiny_model(5, vocab_size=VOCAB)
    frozen = FrozenTarget.from_embedding(target.embed_tokens.weight, torch.arange(VOCAB))
    base = ["--hot-vocab-size", str(VOCAB)]
    plain = LyannaTrainModel.build(frozen, target.config, parse_overrides(base))
    with torch.no_grad():
        plain.draft.w2.normal_()
    copying = LyannaTrainModel.build(frozen, target.config,
                                     parse_overrides(base + ["--info-copy", "true"]))  # fmt: skip
    assert float(copying.draft.copy.scale.detach().abs().min()) > 0  # a fresh one starts reading
    copying.load_export(plain.export())
    plain.load_export(plain.export())  # both hold the fp16-rounded weights
    assert float(copying.draft.copy.scale.detach().abs().max()) == 0
    torch.manual_seed(0)
    hidden, tokens = torch.randn(2, 9, target.config.hidden_size), torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    with torch.no_grad():
        expected, _ = draft_loss(plain.draft, hidden, tokens, mask)
    loss, _ = draft_loss(copying.draft, hidden, tokens, mask)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert float(copying.draft.copy.scale.grad.abs().sum()) > 0


def test_first_choices_copy_what_followed_the_parent() -> None:
    """A loud exact copy read (the chain's own logits drowned out) makes evaluation's first
    choice at every step the token that followed the parent earlier in the context."""
    from training.evaluate import lyanna_first_choices

    target = make_tiny_model(6, vocab_size=VOCAB)
    draft = copy_draft(target, seed=1)
    exact_copy(draft)
    emb = target.embed_tokens.weight
    assert ((emb @ emb.T).argmax(-1) == torch.arange(VOCAB)).all()  # H = E(next) ranks it first
    with torch.no_grad():
        draft.copy.scale.fill_(1e3)
        draft.w2.zero_()
    period = [3, 8, 1, 12, 6]
    tokens = torch.tensor([period * 4])  # [1, 20], each token followed by the same one
    hidden = torch.zeros(1, 20, emb.shape[1])
    hidden[0, :-1] = emb[tokens[0, 1:]]  # the target's state at p predicts t_(p+1)
    batch = TrainBatch(tokens, hidden, torch.ones(1, 20), torch.ones(1, 20, dtype=torch.bool))
    model = type("Wrapped", (), {"draft": draft})()
    for k, first in enumerate(lyanna_first_choices(model, batch, 3), start=1):
        # decided at s = anchor + k with parent t_s, anchor >= 4: the parent occurred before
        # (the state decided at s predicts t_(s+1))
        for s in range(4 + k, 19):
            assert int(first[0, s]) == int(tokens[0, s + 1]), (k, s)


def test_a_copy_checkpoint_loads_for_serving(tmp_path) -> None:
    target = make_tiny_model(7, vocab_size=VOCAB)
    draft = copy_draft(target)
    with torch.no_grad():
        draft.copy.scale.fill_(0.25)
    state = {k: v.contiguous() for k, v in draft.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(draft.config.to_dict()))
    served = LyannaDrafter.from_checkpoint(target, tmp_path)
    assert served.draft.copy is not None and float(served.per_chain_info.scale[0]) == 0.25


def noisy_copy_draft(target, seed: int, info_gate: bool, num_hot: int = VOCAB) -> LyannaDraftModel:
    """``copy_draft`` with every weight (the copy read's too) moved off its start."""
    draft = copy_draft(target, seed, info_gate=info_gate, num_hot=num_hot)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        draft.copy.log_temperature.fill_(1.5)
    return draft


@pytest.mark.parametrize(("info_gate", "cold_root"), [(False, False), (True, False), (True, True)])
def test_served_copy_read_is_the_trained_one(info_gate: bool, cold_root: bool) -> None:
    """The drafter serves a copy checkpoint with training's numbers: the tree's depth-1
    children and probabilities are the softmax of ``h W_head + token_info + copy_read W_head``
    at the root (a token of the prompt, so the read finds it), on the host loop. A cold root
    has no token info but still reads the context."""
    target = make_tiny_model(5, vocab_size=VOCAB)
    draft = noisy_copy_draft(target, seed=2, info_gate=info_gate, num_hot=12)
    hot = set(draft.hot_ids.tolist())
    root = next(t for t in range(VOCAB) if (t in hot) != cold_root)
    torch.manual_seed(4)
    prompt = [1, root, 2, 4, 5, 6]
    hidden = torch.randn(6, target.config.hidden_size)
    drafter = LyannaDrafter(target, draft, DraftBudget(depth=3, top_k=2, max_tokens=16))
    assert drafter.info_table is None and not drafter.device_steps
    drafter.start(0, prompt, hidden, root)
    tree = drafter.propose([0])[0]
    tokens = torch.tensor([[*prompt, root]])
    padded = torch.cat([hidden, torch.zeros(1, hidden.shape[1])])[None]  # the anchor j = 5
    with torch.no_grad():
        chain = draft.unrolled(padded, tokens, 3)
        states = torch.stack([y[:, :6] for y in chain])  # [3, 1, 6, n]
        read = draft.copy_read(tokens[:, 1:], states[0], tokens, padded)[0, 5]
        h = states[0, 0, 5]
        step1 = (h + read) @ draft.hot_head.T + draft.token_info(torch.tensor(root), h)
    assert read.abs().max() > 1e-3  # the read is part of the numbers checked
    # (a gate-less base is the collapsed table, served in fp16)
    assert_root_children(tree, step1, draft.hot_ids, rel=1e-4 if info_gate else 1e-3)


@pytest.mark.parametrize(("info_gate", "generic"), [(False, False), (True, False), (True, True)])
def test_a_copy_drafter_output_equals_plain_decoding(info_gate: bool, generic: bool) -> None:
    """Lossless with a copy read, re-sampling and fusion on, two sequences batched (their
    contexts of different lengths padded), and the context growing with each verified step;
    ``generic``: the device-generic placement a GPU uses, here on the CPU."""
    target = make_tiny_model(4, vocab_size=VOCAB)
    draft = noisy_copy_draft(target, seed=0, info_gate=info_gate)
    drafter = LyannaDrafter(target, draft, DraftBudget(depth=3, top_k=3, max_tokens=8),
                            ResampleConfig(enabled=True, fusion=True), max_running=2,
                            max_len=128, generic=generic)  # fmt: skip
    prompts = [[1, 5, 9, 2, 5, 9], [3, 3, 7]]
    engine = SpecEngine(target, drafter, EngineConfig(max_running=2, max_len=128))
    seqs = [Sequence(i, p, SamplingParams(max_tokens=20)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.submit(s)
    stats = engine.run()
    plain = [Sequence(i, p, SamplingParams(max_tokens=20)) for i, p in enumerate(prompts)]
    generate(target, plain)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    assert stats.num_drafted > 0 and stats.num_accepted > 0


def test_the_copy_contexts_grow_without_losing_rows() -> None:
    """Growing contexts keep every slot's rows; a reset slot starts empty; fixed rows (what a
    captured step holds) refuse to grow instead of moving."""
    from lyanna.drafters.copy_context import CopyContexts

    contexts = CopyContexts(num_slots=3, key_dim=3, value_dim=2, device="cpu")
    rows = {0: [], 2: []}
    for size in (50, 10, 30, 100):  # grows past 64, then past twice the need
        for slot in rows:
            new = torch.randn(size, 3)
            contexts.append(slot, new, new[:, :2] * 2)
            rows[slot].append(new)
    assert contexts.keys.shape[1] >= 190
    keys, values, visible = contexts.padded([2, 0])
    for b, slot in enumerate((2, 0)):
        torch.testing.assert_close(keys[b], torch.cat(rows[slot]))
        torch.testing.assert_close(values[b], 2 * torch.cat(rows[slot])[:, :2])
    assert visible.all()
    contexts.reset(0)
    contexts.append(0, torch.ones(4, 3), torch.ones(4, 2))
    keys, _, visible = contexts.padded([0, 2])
    assert visible[0].sum() == 4 and visible[1].all()
    torch.testing.assert_close(keys[0, :4], torch.ones(4, 3))
    one_keys, _, one_visible = contexts.padded([0])
    assert one_keys.shape == (1, 4, 3) and one_visible.all()
    fixed = CopyContexts(num_slots=1, key_dim=3, value_dim=2, device="cpu", rows=8)
    fixed.append(0, torch.ones(8, 3), torch.ones(8, 2))
    with pytest.raises(ValueError, match="exceeds"):
        fixed.append(0, torch.ones(1, 3), torch.ones(1, 2))
