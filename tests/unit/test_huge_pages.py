"""Weights moved to a huge-page arena keep their values, every object that viewed them sees
the move, storages viewed in several ways stay put, and a model computes the same logits."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

from lyanna.model.huge_pages import ENV, move_to_huge_pages, on_huge_pages
from tests.conftest import make_tiny_model


def in_arena(tensor: torch.Tensor, arena) -> bool:
    start = arena._buffer.data_ptr()
    return start <= tensor.data_ptr() < start + arena._buffer.numel()


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 32))
        self.register_buffer("table", torch.randn(128, 16))
        self.packed = torch.randint(0, 255, (4096,), dtype=torch.uint8)  # a plain attribute
        self.alias = [self.weight.detach()]  # another object viewing the same storage
        base = torch.randn(2048)
        self.halves = [base[:1024], base[1024:]]  # one storage, two views: left alone
        self.small = torch.randn(8)  # below the threshold


def test_weights_move_with_their_values_and_every_alias() -> None:
    holder = Holder()
    before = {
        "weight": holder.weight.detach().clone(),
        "table": holder.table.clone(),
        "packed": holder.packed.clone(),
    }
    halves = [h.data_ptr() for h in holder.halves]
    small = holder.small.data_ptr()
    arena = move_to_huge_pages(holder)
    assert arena is not None
    for name, value in before.items():
        tensor = getattr(holder, name)
        assert torch.equal(tensor, value)
        assert in_arena(tensor, arena)
        assert tensor.data_ptr() % 4096 == 0
    assert holder.alias[0].data_ptr() == holder.weight.data_ptr()  # the alias moved too
    assert isinstance(holder.weight, nn.Parameter)
    assert [h.data_ptr() for h in holder.halves] == halves
    assert holder.small.data_ptr() == small
    assert arena.nbytes == (64 * 32 + 128 * 16) * 4 + 4096


def test_a_model_on_huge_pages_computes_the_same_logits(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    model = make_tiny_model()
    tokens = torch.tensor([[3, 7, 11, 2]])
    with torch.inference_mode():
        expected = model.logits(model.embed_tokens(tokens))
        on_huge_pages(model)
        assert model.weight_arena is not None
        assert in_arena(model.embed_tokens.weight, model.weight_arena)
        assert torch.equal(model.logits(model.embed_tokens(tokens)), expected)


def test_the_variable_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "0")
    holder = on_huge_pages(Holder())
    assert not hasattr(holder, "weight_arena")


def test_a_model_on_huge_pages_copies_and_pickles() -> None:
    holder = Holder()
    holder.weight_arena = move_to_huge_pages(holder)
    copied = copy.deepcopy(holder)
    assert torch.equal(copied.weight, holder.weight)
    assert copied.weight.data_ptr() != holder.weight.data_ptr()
    restored = pickle.loads(pickle.dumps(holder))
    assert torch.equal(restored.table, holder.table) and restored.weight_arena is None
