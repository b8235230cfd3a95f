"""``training.chain_probe``: with every token hot and no token-info bias, the true next state
ranks the target's argmax first (1.0) and the predicted state alone equals the state with the
bias; a bias that points elsewhere moves the biased columns only."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
from tests.conftest import make_tiny_model
from training.chain_probe import probe

VOCAB = 16


def _setup():
    target = make_tiny_model(5, vocab_size=VOCAB)
    torch.manual_seed(0)
    config = LyannaDraftConfig(target.config, num_hot=VOCAB, info_rank=4, chain_steps=3)
    draft = LyannaDraftModel(config, target.embed_tokens.weight, torch.arange(VOCAB))
    batch = SimpleNamespace(
        tokens=torch.randint(0, VOCAB, (2, 12)),
        hidden=torch.randn(2, 12, target.config.hidden_size),
        answer=torch.ones(2, 12, dtype=torch.bool),
    )
    return draft, batch


def test_without_bias_the_true_state_is_always_right() -> None:
    draft, batch = _setup()  # w2 starts at zero: no bias
    rows = probe(draft, draft.embedding, [batch], 3)
    assert [r["rows"] for r in rows] == [2 * 10, 2 * 9, 2 * 8]
    for r in rows:
        assert r["true_state_and_bias"] == 1.0 and r["bias_rms"] == 0.0
        assert r["state_alone"] == r["state_and_bias"]


def test_a_bias_moves_only_the_biased_columns() -> None:
    draft, batch = _setup()
    plain = probe(draft, draft.embedding, [batch], 2)
    with torch.no_grad():
        draft.w2.normal_(0.0, 50.0)
        draft.info_norm.weight.fill_(100.0)  # a bias that outweighs any state
    biased = probe(draft, draft.embedding, [batch], 2)
    for p, b in zip(plain, biased, strict=True):
        assert b["state_alone"] == p["state_alone"] and b["cosine"] == p["cosine"]
        assert b["bias_rms"] > 10.0 and b["true_state_and_bias"] < 0.5
