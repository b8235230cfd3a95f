"""The servicers called in-process (no sockets): the verifier keeps no slot and runs no forward
for a caller that is gone, refuses duplicate sequences in one call and runs several plain
steps in one call like one call each; the drafter's data-plane references are checked before
anything is received (its Step: ``test_step.py``)."""

from __future__ import annotations

import grpc
import pytest
import torch

from lyanna.drafters.ngram import NgramDrafter
from lyanna.target import TargetConfig, TargetRunner
from lyanna.tree import TokenTree
from services import codec
from services.codec import WireError
from services.data_plane import sign_ref
from services.drafter.server import DrafterConfig, DrafterServicer
from services.hidden import HiddenReceiver, HiddenSender
from services.pb import common_pb2, drafter_pb2, verifier_pb2
from services.verifier.config import VerifierConfig
from services.verifier.server import VerifierServicer
from tests.conftest import make_tiny_model


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self, active: bool = True) -> None:
        self.active = active  # False: the caller is gone (deadline passed, cancelled)

    def is_active(self) -> bool:
        return self.active

    def time_remaining(self) -> float | None:
        return None  # no deadline

    def abort(self, code: grpc.StatusCode, details: str):
        raise Aborted(code, details)


def verifier() -> VerifierServicer:
    runner = TargetRunner(
        make_tiny_model(2, vocab_size=16), TargetConfig(max_running=2, max_len=128)
    )
    return VerifierServicer(runner, VerifierConfig(max_tree_nodes=32), HiddenSender())


def test_verifier_keeps_no_slot_for_a_caller_that_is_gone() -> None:
    servicer = verifier()
    item = verifier_pb2.PrefillItem(seq_id=1, prompt_ids=[1, 2, 3])
    with pytest.raises(Aborted) as aborted:
        servicer.Prefill(verifier_pb2.PrefillRequest(items=[item]), FakeContext(active=False))
    assert aborted.value.args[0] == grpc.StatusCode.CANCELLED
    assert servicer.runner.num_free_slots == 2 and 1 not in servicer.runner
    prefill(servicer, 1, [1, 2, 3])  # the same id prefills again: nothing was left behind


def prefill(servicer: VerifierServicer, seq_id: int, prompt: list[int]) -> int:
    item = verifier_pb2.PrefillItem(seq_id=seq_id, prompt_ids=prompt)
    item.params.max_tokens = 8
    response = servicer.Prefill(verifier_pb2.PrefillRequest(items=[item]), FakeContext())
    return response.results[0].first_token


def test_verifier_runs_no_forward_for_a_caller_that_is_gone() -> None:
    servicer = verifier()
    root = prefill(servicer, 1, [1, 2, 3])
    item = verifier_pb2.VerifyItem(
        ref=common_pb2.SeqRef(seq_id=1, num_committed=3),
        tree=codec.encode_tree(TokenTree.root_only(root)),
    )
    request = verifier_pb2.VerifyRequest(items=[item])
    with pytest.raises(Aborted) as aborted:
        servicer.Verify(request, FakeContext(active=False))
    assert aborted.value.args[0] == grpc.StatusCode.CANCELLED
    response = servicer.Verify(request, FakeContext())  # the same step, still at 3 rows
    assert response.results[0].ref.num_committed == 4


def test_a_resume_replaces_a_stale_copy_a_plain_duplicate_is_refused() -> None:
    """A verifier that stalled past the gateway's deadline may still hold a sequence the
    gateway re-prefills from its history (``next_token`` set): the stale copy is replaced,
    not a FAILED_PRECONDITION that fails the request. A second plain Prefill stays refused."""
    servicer = verifier()
    root = prefill(servicer, 1, [1, 2, 3])
    item = verifier_pb2.PrefillItem(seq_id=1, prompt_ids=[1, 2, 3, root], next_token=5)
    item.params.max_tokens = 8
    response = servicer.Prefill(verifier_pb2.PrefillRequest(items=[item]), FakeContext())
    assert response.results[0].first_token == 5 and servicer.runner.num_committed(1) == 4
    assert servicer.runner.num_free_slots == 1  # replaced, not a second slot
    with pytest.raises(Aborted) as duplicate:
        prefill(servicer, 1, [1, 2, 3])
    assert duplicate.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION


def test_verifier_refuses_duplicates_and_room_overflow() -> None:
    servicer = verifier()
    root = prefill(servicer, 1, [1, 2, 3])
    ref = common_pb2.SeqRef(seq_id=1, num_committed=3)
    tree = codec.encode_tree(TokenTree.root_only(root))
    item = verifier_pb2.VerifyItem(ref=ref, tree=tree)
    with pytest.raises(Aborted) as error:
        servicer.Verify(verifier_pb2.VerifyRequest(items=[item, item]), FakeContext())
    assert error.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(Aborted) as error:
        prefill(servicer, 2, [1] * 100)  # 100 + 8 + 32-node tree > 128 rows
    assert error.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert servicer.runner.num_free_slots == 1


def test_drafter_without_hidden_ignores_them() -> None:
    receiver = HiddenReceiver(32, torch.float32)
    config = DrafterConfig(method="ngram", depth=4, top_k=2, max_draft_tokens=6)
    servicer = DrafterServicer(NgramDrafter(config.shape()), config, receiver, 16)
    start = drafter_pb2.StartItem(
        ref=common_pb2.SeqRef(seq_id=5, num_committed=2), prompt_ids=[1, 2], first_token=1
    )
    servicer.Start(drafter_pb2.StartRequest(items=[start]), FakeContext())
    info = servicer.Info(drafter_pb2.InfoRequest(), FakeContext())
    assert info.method == "ngram" and not info.needs_hidden and info.max_draft_tokens == 6


class RecordingPlane:
    """A data plane that hands out zero rows and records what was received."""

    ready = True
    key = b"k" * 32

    def sign(self, transfer_id: int, total_rows: int) -> bytes:
        return sign_ref(self.key, transfer_id, total_rows)

    def verify(self, transfer_id: int, total_rows: int, mac: bytes) -> bool:
        return mac == self.sign(transfer_id, total_rows)

    def __init__(self) -> None:
        self.received: list[int] = []

    def recv(self, transfer_id: int, shape, dtype) -> torch.Tensor:
        self.received.append(transfer_id)
        return torch.zeros(shape, dtype=dtype)


def test_stale_or_forged_plane_references_are_refused_before_receiving() -> None:
    plane = RecordingPlane()
    receiver = HiddenReceiver(8, torch.float32, plane)

    def ref(transfer_id: int, mac: bytes | None = None) -> common_pb2.HiddenStates:
        plane_ref = common_pb2.PlaneRef(
            transfer_id=transfer_id,
            row_offset=0,
            num_rows=2,
            total_rows=4,
            mac=plane.sign(transfer_id, 4) if mac is None else mac,
        )
        return common_pb2.HiddenStates(plane=plane_ref)

    for forged in (b"", sign_ref(b"another key" * 3, 2, 4), plane.sign(2, 40)):
        with pytest.raises(WireError, match="not signed"):  # in the window, not the verifier's
            receiver.decode(ref(2, forged), 2)
    assert plane.received == []
    assert receiver.decode(ref(1), 2).shape == (2, 8)
    assert receiver.decode(ref(1), 2).shape == (2, 8)  # the same call: received once
    receiver.end_batch()
    for stale_or_forged, why in ((1, "already received"), (10_000, "not expected")):
        with pytest.raises(WireError, match=why):
            receiver.decode(ref(stale_or_forged), 2)
    receiver.decode(ref(3), 2)  # a lane ahead of the other: within the window
    assert plane.received == [1, 3]


def verify_item(seq_id: int, num_committed: int, root: int, **fields) -> verifier_pb2.VerifyItem:
    return verifier_pb2.VerifyItem(
        ref=common_pb2.SeqRef(seq_id=seq_id, num_committed=num_committed),
        tree=codec.encode_tree(TokenTree.root_only(root)),
        **fields,
    )


def test_several_plain_steps_in_one_call_equal_one_call_each() -> None:
    """``steps`` root-only decode steps in one Verify: the same tokens, KV rows and hidden
    rows as that many single-step calls; a sequence asking fewer steps stops early."""
    together, apart = verifier(), verifier()
    prompts = {1: [1, 2, 3], 2: [4, 5, 6, 7]}
    roots = {s: prefill(together, s, p) for s, p in prompts.items()}
    assert roots == {s: prefill(apart, s, p) for s, p in prompts.items()}
    request = verifier_pb2.VerifyRequest(
        items=[
            verify_item(1, 3, roots[1], steps=5, return_hidden=True),
            verify_item(2, 4, roots[2], steps=2, return_hidden=True),
        ]
    )
    results = together.Verify(request, FakeContext()).results
    for result, steps in zip(results, (5, 2), strict=True):
        seq_id, committed = result.ref.seq_id, len(prompts[result.ref.seq_id])
        assert result.num_steps == steps and result.ref.num_committed == committed + steps
        root, tokens, rows = roots[seq_id], [], []
        for step in range(steps):
            item = verify_item(seq_id, committed + step, root, return_hidden=True)
            request = verifier_pb2.VerifyRequest(items=[item])
            (single,) = apart.Verify(request, FakeContext()).results
            assert list(single.committed) == [root] and single.num_steps == 1
            root = single.tokens[-1]
            tokens.append(root)
            rows.append(codec.decode_tensor(single.hidden.tensor))
        assert list(result.tokens) == tokens
        assert list(result.committed) == [roots[seq_id], *tokens[:-1]]
        # (close, not equal: the tiny model's fp32 path rounds by batch shape)
        torch.testing.assert_close(codec.decode_tensor(result.hidden.tensor), torch.cat(rows))


def test_several_steps_are_refused_for_a_drafted_tree_or_past_the_kv() -> None:
    servicer = verifier()
    root = prefill(servicer, 1, [1, 2, 3])
    drafted = verify_item(1, 3, root, steps=2)
    drafted.tree.CopyFrom(codec.encode_tree(TokenTree.chain(root, [4])))
    cases = [
        (drafted, grpc.StatusCode.INVALID_ARGUMENT),
        (verify_item(1, 3, root, steps=65), grpc.StatusCode.INVALID_ARGUMENT),
        (verify_item(1, 3, root, steps=126), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for item, code in cases:
        with pytest.raises(Aborted) as error:
            servicer.Verify(verifier_pb2.VerifyRequest(items=[item]), FakeContext())
        assert error.value.args[0] == code
    big = verifier()  # steps within the bound but past the 128 rows the sequence has
    root = prefill(big, 1, [1] * 80)
    with pytest.raises(Aborted) as error:
        big.Verify(
            verifier_pb2.VerifyRequest(items=[verify_item(1, 80, root, steps=49)]), FakeContext()
        )
    assert error.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        big.Verify(  # nothing was committed: the same sequence still verifies
            verifier_pb2.VerifyRequest(items=[verify_item(1, 80, root, steps=48)]), FakeContext()
        )
        .results[0]
        .ref.num_committed
        == 128
    )


def test_every_model_call_runs_on_one_thread_whatever_thread_the_rpc_arrives_on() -> None:
    """torch's OpenMP team belongs to the thread that runs a parallel op: forwards spread
    over gRPC's worker threads made a team each (and libgomp, with more threads than CPUs,
    slept at every barrier). Prefill, Verify and Release from different threads all reach
    the model on one compute thread."""
    import threading

    servicer = verifier()
    seen: set[int] = set()
    runner = servicer.runner
    for name in ("prefill", "verify", "release"):
        original = getattr(runner, name)

        def recorded(*args, _original=original, **kwargs):
            seen.add(threading.get_ident())
            return _original(*args, **kwargs)

        setattr(runner, name, recorded)

    def rpc_on_a_new_thread(call) -> None:
        failures: list[BaseException] = []

        def run() -> None:
            try:
                call()
            except BaseException as error:  # reported below, in the test's thread
                failures.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert not failures, failures

    roots: list[int] = []
    rpc_on_a_new_thread(lambda: roots.append(prefill(servicer, 1, [1, 2, 3])))
    request = verifier_pb2.VerifyRequest(items=[verify_item(1, 3, roots[0])])
    rpc_on_a_new_thread(lambda: servicer.Verify(request, FakeContext()))
    release = common_pb2.ReleaseRequest(seq_ids=[1])
    rpc_on_a_new_thread(lambda: servicer.Release(release, FakeContext()))
    assert len(seen) == 1 and threading.get_ident() not in seen
