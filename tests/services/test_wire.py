"""The wire layer: committed stubs match the protos, the tensor codec round-trips every
allowed dtype and rejects bad dtypes, shapes and byte lengths, trees and sampling parameters
round-trip, malformed trees are refused."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lyanna.sampling import SamplingParams
from lyanna.tree import DraftScheme, TokenTree
from services import codec, protogen
from services.pb import common_pb2


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    fresh = {p.name for p in protogen.generate(tmp_path)}
    committed = {p.name for p in protogen.DEFAULT_OUT.iterdir() if p.name != "__init__.py"}
    committed -= {"__pycache__"}
    assert fresh == committed, "run `make proto` and commit services/pb"
    for name in sorted(fresh):
        same = filecmp.cmp(tmp_path / name, protogen.DEFAULT_OUT / name, shallow=False)
        assert same, f"services/pb/{name} is stale: run `make proto` and commit it"


def test_core_package_imports_without_grpc() -> None:
    check = "import sys, lyanna.engine, lyanna.target; assert 'grpc' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True)


@pytest.mark.parametrize("dtype", list(codec.DTYPES.values()))
def test_tensor_round_trip(dtype: torch.dtype) -> None:
    tensor = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    decoded = codec.decode_tensor(codec.encode_tensor(tensor))
    assert decoded.dtype == dtype and decoded.shape == (3, 4) and torch.equal(decoded, tensor)
    empty = codec.decode_tensor(codec.encode_tensor(torch.zeros(0, 5, dtype=dtype)))
    assert empty.shape == (0, 5)


def test_tensor_codec_rejects_bad_messages() -> None:
    good = codec.encode_tensor(torch.ones(2, 3))
    with pytest.raises(codec.WireError, match="not allowed"):
        codec.decode_tensor(common_pb2.Tensor(dtype="object", shape=[1], data=b"\0" * 8))
    with pytest.raises(codec.WireError, match="bytes"):
        codec.decode_tensor(common_pb2.Tensor(dtype="float32", shape=[2, 3], data=good.data[:-1]))
    with pytest.raises(codec.WireError, match="bytes"):
        codec.decode_tensor(common_pb2.Tensor(dtype="float32", shape=[2, 4], data=good.data))
    with pytest.raises(codec.WireError, match="invalid"):
        codec.decode_tensor(common_pb2.Tensor(dtype="float32", shape=[-2, -3], data=good.data))
    with pytest.raises(codec.WireError, match="elements"):
        huge = common_pb2.Tensor(dtype="float32", shape=[1 << 20, 1 << 20], data=b"")
        codec.decode_tensor(huge)
    with pytest.raises(codec.WireError, match="invalid"):
        codec.decode_tensor(common_pb2.Tensor(dtype="float32", shape=[1] * 5, data=b"\0" * 4))
    with pytest.raises(codec.WireError, match="expected a int64"):
        codec.decode_tensor(good, dtype=torch.int64)
    with pytest.raises(codec.WireError, match="cannot travel"):
        codec.encode_tensor(torch.zeros(2, dtype=torch.complex64))


def test_tree_round_trip_with_and_without_rows() -> None:
    rows = torch.softmax(torch.randn(4, 6), dim=-1)
    tree = TokenTree.from_parents(
        [3, 1, 2, 5], [-1, 0, 0, 1], scheme=DraftScheme.IID, draft_probs=rows
    )
    light = codec.decode_tree(codec.encode_tree(tree), vocab_size=6, max_nodes=8)
    assert light.tokens.tolist() == [3, 1, 2, 5] and light.parents.tolist() == [-1, 0, 0, 1]
    assert light.scheme is DraftScheme.IID and light.draft_probs is None
    assert torch.equal(light.draft_token_probs, tree.draft_token_probs)
    full = codec.decode_tree(codec.encode_tree(tree, True), vocab_size=6, max_nodes=8)
    assert torch.equal(full.draft_probs, rows)


def test_malformed_trees_are_refused() -> None:
    def tree(tokens, parents, scheme=common_pb2.DRAFT_SCHEME_TOPK):
        return common_pb2.TokenTree(tokens=tokens, parents=parents, scheme=scheme)

    with pytest.raises(codec.WireError, match="parents"):
        codec.decode_tree(tree([1, 2], [-1, 1]), vocab_size=8, max_nodes=8)
    with pytest.raises(codec.WireError, match="token ids"):
        codec.decode_tree(tree([1, 9], [-1, 0]), vocab_size=8, max_nodes=8)
    with pytest.raises(codec.WireError, match="1..2 tokens"):
        codec.decode_tree(tree([1, 2, 3], [-1, 0, 1]), vocab_size=8, max_nodes=2)
    with pytest.raises(codec.WireError, match="scheme"):
        codec.decode_tree(tree([1], [-1], scheme=99), vocab_size=8, max_nodes=8)


def test_sampling_params_round_trip() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=33, seed=5)
    assert codec.decode_params(codec.encode_params(params)) == params
    assert codec.decode_params(codec.encode_params(SamplingParams())).seed is None
