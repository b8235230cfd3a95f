"""The n-gram drafter's corpus store: counts match a naive count, lookups take the longest
known context, the artefact round-trips and is checked, and drafting from it stays lossless."""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict

import numpy as np
import pytest

from lyanna.decode import generate
from lyanna.drafters import DRAFTERS, DraftCapacity
from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.checkpoint import checkpoint_dir
from lyanna.drafters.ngram import HISTORY, STORE, NgramDrafter
from lyanna.drafters.ngram_store import (
    DEFAULT_STORE,
    STORE_FILE,
    NgramStore,
    StoreConfig,
    load_default_store,
)
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from tests.conftest import make_tiny_model
from training.ngram_store import DATA_ROOT as DISTILL_DATA


def naive_counts(sequences, max_n):
    """context tuple -> Counter of next answer tokens, by brute force."""
    counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for ids, answer_start in sequences:
        for i in range(max(answer_start, 1), len(ids)):
            for n in range(1, max_n + 1):
                if i - n >= 0:
                    counts[tuple(ids[i - n : i])][ids[i]] += 1
    return counts


def random_corpus(seed: int, vocab: int = 7):
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randrange(1, 40))], rng.randrange(0, 6))
        for _ in range(30)
    ]


@pytest.mark.parametrize("seed", range(4))
def test_store_keeps_what_a_naive_count_says(seed: int) -> None:
    config = StoreConfig(max_n=3, min_count=2, top_k=2, vocab_size=7)
    corpus = random_corpus(seed)
    store = NgramStore.build(corpus, config)
    expected = {c: n for c, n in naive_counts(corpus, 3).items() if sum(n.values()) >= 2}
    assert len(store) == len(expected)
    for context, nexts in expected.items():
        total = sum(nexts.values())
        ranked = sorted(nexts.items(), key=lambda kv: (-kv[1], kv[0]))[:2]
        # a longer history ending in `context` whose longer suffixes are unknown -> `context`
        found = _lookup_exact(store, context)
        assert found == ([t for t, _ in ranked], [c / total for _, c in ranked])


def _lookup_exact(store: NgramStore, context: tuple[int, ...]):
    from lyanna.drafters.ngram_store import context_hash

    row = int(store.keys.searchsorted(np.uint64(context_hash(context))))
    assert int(store.keys[row]) == context_hash(context), context
    tokens = [t for t in store.tokens[row].tolist() if t >= 0]
    return tokens, pytest.approx(store.shares[row][: len(tokens)].tolist())


def test_prompt_tokens_are_contexts_never_targets_and_sequences_stay_apart() -> None:
    config = StoreConfig(max_n=2, min_count=1, top_k=2, vocab_size=10)
    # prompt 5 5 5 then answer 1 2; a second sequence starting with 3
    store = NgramStore.build([([5, 5, 5, 1, 2], 3), ([3, 4], 0)], config)
    assert store.continuations([5, 5]) == (2, [1], [1.0])  # 5 5 -> 1 only (5 was prompt)
    assert store.continuations([5]) == (1, [1], [1.0])
    # nothing follows the first sequence's last token, and "2 3" would cross two sequences
    assert store.continuations([2]) is None
    assert store.continuations([2, 3]) == (1, [4], [1.0])
    assert store.continuations([9, 3]) == (1, [4], [1.0])  # falls back to the known 1-gram


def test_lookup_prefers_the_longest_known_context() -> None:
    config = StoreConfig(max_n=3, min_count=1, top_k=2, vocab_size=10)
    corpus = [([1, 2, 3], 0), ([1, 2, 3], 0), ([7, 2, 4], 0), ([2, 5], 0), ([2, 5], 0)]
    store = NgramStore.build(corpus, config)
    assert store.continuations([0, 1, 2]) == (2, [3], [1.0])
    assert store.continuations([7, 2]) == (2, [4], [1.0])
    used, tokens, shares = store.continuations([8, 2])  # only the 1-gram "2" is known
    assert used == 1 and tokens == [3, 5] and shares == pytest.approx([0.4, 0.4])
    assert store.continuations([]) is None


def test_store_round_trips_and_checks_its_sha(tmp_path) -> None:
    store = NgramStore.build(random_corpus(0), StoreConfig(max_n=3, min_count=2, vocab_size=7))
    store.save(tmp_path, {"kind": "test"})
    loaded = NgramStore.load(tmp_path)
    assert (loaded.keys == store.keys).all() and (loaded.tokens == store.tokens).all()
    assert loaded.shares == pytest.approx(store.shares, abs=1e-3)  # fp16 on disk
    assert json.loads((tmp_path / "manifest.json").read_text())["kind"] == "test"
    raw = bytearray((tmp_path / STORE_FILE).read_bytes())
    raw[-1] ^= 1
    (tmp_path / STORE_FILE).write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        NgramStore.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        NgramStore.load(tmp_path / "missing")


def test_bad_corpus_and_config_are_refused() -> None:
    with pytest.raises(ValueError, match="out of the vocabulary"):
        NgramStore.build([([1, 12], 0)], StoreConfig(vocab_size=10))
    with pytest.raises(ValueError):
        StoreConfig(vocab_size=1 << 16)
    with pytest.raises(ValueError):
        StoreConfig(max_n=0)


def test_committed_store_is_checked_and_comes_from_training_runs_only() -> None:
    path = checkpoint_dir(DEFAULT_STORE)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["data"] and "distill-heldout-v1" not in manifest["data"]
    for run in manifest["data"]:  # training-split runs only: never held-out or Spec-Bench
        recipe = json.loads((DISTILL_DATA / run / "manifest.json").read_text())
        assert recipe["config"]["split"] == "train", run
    assert manifest["metrics"]["distill-heldout-v1"]["top1"] > 0.25
    store = load_default_store(49152)
    assert store is not None and len(store) == manifest["num_contexts"]
    assert load_default_store(1000) is None  # another vocabulary: not this store


SMALL_TREE = DraftBudget(depth=2, top_k=2, max_tokens=4)


def make_drafter(store, budget=SMALL_TREE):
    return NgramDrafter(budget, store=store)


def test_drafter_uses_the_store_only_without_a_long_match_in_the_request() -> None:
    store = NgramStore.build(
        [([4, 5, 6], 0)] * 3, StoreConfig(max_n=2, min_count=1, top_k=2, vocab_size=10)
    )
    drafter = make_drafter(store)
    drafter.start(0, [1, 2, 3, 1, 2], None, 3)  # "2 3" occurred before: the request wins
    drafter.start(1, [9, 8], None, 4)  # no repeat; the store knows 4 -> 5 -> 6
    trees = drafter.propose([0, 1])
    assert trees[0].tokens.tolist()[:2] == [3, 1] and drafter._sources[0] == HISTORY
    assert trees[1].tokens.tolist() == [4, 5, 6] and drafter._sources[1] == STORE
    assert trees[1].draft_token_probs.tolist() == pytest.approx([1.0, 1.0, 1.0])
    # accepted tokens are credited to the source that drafted them
    steps = [
        VerifiedStep(0, [3], None, 7, 0, 6),
        VerifiedStep(1, [4, 5, 6], None, 7, 2, 5),
    ]
    drafter.on_verified(steps)
    assert drafter.calibrations[STORE].accepted == 2
    assert drafter.calibrations[HISTORY].accepted == 0


def test_drafting_from_the_store_is_lossless() -> None:
    model = make_tiny_model(2, vocab_size=16)
    prompts = [[1, 2, 3], [9], [5, 6, 7, 8]]

    def greedy(drafter) -> list[list[int]]:
        engine = SpecEngine(model, drafter, EngineConfig(max_running=2, max_len=128))
        seqs = [Sequence(i, p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)]
        for s in seqs:
            engine.submit(s)
        stats = engine.run()
        return [s.output_ids for s in seqs], stats

    plain = [Sequence(i, p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)]
    generate(model, plain)
    expected = [s.output_ids for s in plain]
    # a store of the model's own greedy text (as the committed one is) and one of noise
    own = NgramStore.build(
        [(p + out, len(p)) for p, out in zip(prompts, expected, strict=True)],
        StoreConfig(max_n=3, min_count=1, vocab_size=16),
    )
    noise = NgramStore.build(
        random_corpus(1, vocab=16), StoreConfig(max_n=3, min_count=1, vocab_size=16)
    )
    outputs, stats = greedy(make_drafter(own))
    assert outputs == expected and stats.num_accepted > 0
    assert greedy(make_drafter(noise))[0] == expected


def test_registry_offers_the_store_and_the_request_only_variant() -> None:
    model = make_tiny_model(2, vocab_size=16)  # not the store's vocabulary: no store
    assert DRAFTERS["ngram"](model, DraftBudget(), DraftCapacity()).store is None
    assert DRAFTERS["ngram-prompt"](model, DraftBudget(), DraftCapacity()).store is None


def test_committed_store_rebuilds_from_its_recipe(tmp_path) -> None:
    """The manifest's reproduce command, run again, writes the same store bit for bit."""
    from training import ngram_store

    committed = checkpoint_dir(DEFAULT_STORE)
    command = json.loads((committed / "manifest.json").read_text())["reproduce"].split()
    args = command[3:]
    args[args.index("--out") + 1] = str(tmp_path)
    ngram_store.main(args)
    assert (tmp_path / STORE_FILE).read_bytes() == (committed / STORE_FILE).read_bytes()


def test_sampled_sequences_draft_to_the_budgets_sampled_depth() -> None:
    """A budget's ``sampled_depth`` caps a sampled sequence's drafts where a greedy one with
    the same text drafts the whole chain, from the request's text and from the store alike;
    without it a sampled sequence drafts as deep as a greedy one."""
    store = NgramStore.build(
        [([7, 8, 9, 6, 5], 0)] * 3, StoreConfig(max_n=2, min_count=1, top_k=1, vocab_size=10)
    )
    repeat = [1, 2, 3, 4, 1, 2]  # "1 2" occurred before: the request's text drafts 3 4 1
    sampled = SamplingParams(temperature=1.0, max_tokens=8)
    for sampled_depth, expected in ((1, [[3, 4], [7, 8]]), (0, [[3, 4, 1, 2], [7, 8, 9, 6]])):
        chain = DraftBudget(depth=3, top_k=1, max_tokens=3, sampled_depth=sampled_depth)
        drafter = make_drafter(store, chain)
        drafter.start(0, repeat, None, 3)
        drafter.start(1, repeat, None, 3, sampled)
        drafter.start(2, [0], None, 7)  # no repeat: the store drafts 8 9 6
        drafter.start(3, [0], None, 7, sampled)
        trees = [t.tokens.tolist() for t in drafter.propose([0, 1, 2, 3])]
        assert trees[0] == [3, 4, 1, 2] and trees[2] == [7, 8, 9, 6]  # greedy: the chain
        assert [trees[1], trees[3]] == expected
