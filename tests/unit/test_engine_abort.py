"""SpecEngine.abort frees a sequence wherever it is (waiting or running), admit prefills
without a verification (a server streams first tokens at once), and Emitted carries
the verdict behind each verification's tokens (the gateway's metrics read it)."""

from __future__ import annotations

from lyanna.drafters.base import DraftBudget
from lyanna.drafters.ngram import NgramDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from tests.conftest import make_tiny_model


def test_abort_frees_running_and_waiting_sequences() -> None:
    engine = SpecEngine(
        make_tiny_model(2, vocab_size=16),
        NgramDrafter(DraftBudget(depth=3, top_k=2, max_tokens=4)),
        EngineConfig(max_running=1, max_len=128),
    )
    seqs = [Sequence(i, [1, 2, 3, 1, 2], SamplingParams(max_tokens=30)) for i in range(2)]
    for seq in seqs:
        engine.submit(seq)
    emitted = engine.step()
    assert emitted[0].verdict is None  # the prefill token
    assert any(e.verdict is not None for e in emitted)
    assert engine.abort(1) and [s.seq_id for s in engine.waiting] == []
    assert engine.abort(0) and not engine.running and not engine.has_work
    assert engine.cache.num_free_slots == 1
    assert not engine.abort(0)


def test_admit_prefills_without_verifying() -> None:
    engine = SpecEngine(make_tiny_model(2, vocab_size=16), None, EngineConfig(max_running=2))
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(max_tokens=5)) for i in range(3)]
    for seq in seqs:
        engine.submit(seq)
    emitted = engine.admit()
    assert [(e.sequence.seq_id, len(e.tokens), e.verdict) for e in emitted] == [
        (0, 1, None),
        (1, 1, None),
    ]
    assert engine.stats.num_steps == 0 and len(engine.waiting) == 1
    engine.run()
    assert all(len(s.output_ids) == 5 for s in seqs)
