"""Logits processors (presence / frequency penalties, logit_bias, top_k) on the target's
distribution, and speculation lossless with respect to that processed distribution.

The oracle is written here, in plain Python over full-model logits (a fresh forward of the
whole context for every row, the penalties counted with ``collections.Counter``): never the
implementation's own ``process_logits`` / ``path_counts``. Three checks:

* each tree node's row in ``TargetRunner.verify`` is the oracle's row for that node's own
  path (committed output + root + ancestors; siblings never leak into each other);
* exact law on a tiny vocabulary: chains drafted from the *unprocessed* model rows (a drafter
  that ignores the processors), verified by the default rule against the runner's processed
  rows, emit their first two tokens with exactly the processed target's joint law;
* greedy: the engine (plain and n-gram speculation) equals a reference greedy loop that
  applies the processors to full-model logits step by step.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from lyanna.drafters.base import DraftBudget
from lyanna.drafters.ngram import NgramDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams, greedy_or_sample, unsigned_seed
from lyanna.sequence import Sequence
from lyanna.target import TargetConfig, TargetRunner
from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify import choose_rule
from tests.conftest import make_tiny_model, prompt_logits

VOCAB = 8
PROMPT = [1, 2, 3]
DECODED = [4, 5, 4]  # output committed before this step (a resumed sequence): 4 twice, 5 once
ROOT = 6  # the next token: an output token every node's row counts


def oracle_logits(model, prompt: list[int], output: list[int], params: SamplingParams) -> list:
    """The processed next-token logits after ``prompt + output``, from first principles."""
    raw = prompt_logits(model, torch.tensor([prompt + output]))[-1].double().tolist()
    counts = Counter(output)
    bias = dict(params.logit_bias)
    out = [
        raw[v]
        - params.frequency_penalty * counts[v]
        - params.presence_penalty * (1.0 if counts[v] else 0.0)
        + bias.get(v, 0.0)
        for v in range(len(raw))
    ]
    if 0 < params.top_k < len(out):
        kth = sorted(out, reverse=True)[params.top_k - 1]
        out = [x if x >= kth else -math.inf for x in out]
    return out


def softmax(logits: list, temperature: float = 1.0) -> list:
    top = max(logits)
    weights = [math.exp((x - top) / temperature) if x > -math.inf else 0.0 for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def greedy(logits: list) -> int:
    best = max(logits)
    return logits.index(best)  # lowest index on ties, like torch.argmax


PROCESSED = SamplingParams(
    temperature=1.0,
    max_tokens=16,
    presence_penalty=0.7,
    frequency_penalty=0.5,
    logit_bias=((2, 1.5), (7, -100.0)),
    top_k=6,
)


def spy_rows(monkeypatch) -> list[torch.Tensor]:
    """The rows every acceptance rule of ``TargetRunner.verify`` receives, recorded."""
    captured: list[torch.Tensor] = []
    original = TargetRunner._rule

    class Spy:  # the rule itself for every attribute; its calls record their rows
        def __init__(self, rule) -> None:
            self.rule = rule

        def __getattr__(self, name: str):
            return getattr(self.rule, name)

        def __call__(self, tree, rows, generator=None):
            captured.append(rows.detach().clone())
            return self.rule(tree, rows, generator)

    def spied(self, params, tree):
        return Spy(original(self, params, tree))

    monkeypatch.setattr(TargetRunner, "_rule", spied)
    return captured


def resumed(model, params: SamplingParams) -> TargetRunner:
    """A runner holding PROMPT + DECODED with ROOT as its next token."""
    runner = TargetRunner(model, TargetConfig(max_running=1, max_len=128))
    runner.prefill(0, PROMPT + DECODED, params, next_token=ROOT, prompt_len=len(PROMPT))
    return runner


def full_tree(depth: int) -> tuple[TokenTree, dict[tuple[int, ...], int]]:
    """Every path of ``depth`` tokens below ROOT (top-k scheme); path -> node index."""
    tokens, parents, index = [ROOT], [-1], {(): 0}
    frontier = [()]
    for _ in range(depth):
        nxt = []
        for path in frontier:
            for v in range(VOCAB):
                index[path + (v,)] = len(tokens)
                tokens.append(v)
                parents.append(index[path])
                nxt.append(path + (v,))
        frontier = nxt
    return TokenTree.from_parents(tokens, parents, scheme=DraftScheme.TOPK), index


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_tree_row_is_processed_with_its_own_path(monkeypatch, temperature) -> None:
    model = make_tiny_model(5, vocab_size=VOCAB)
    params = dataclasses.replace(PROCESSED, temperature=temperature)
    captured = spy_rows(monkeypatch)
    runner = resumed(model, params)
    # repeated tokens on different branches: 4 under 4 (count 3 with the history), 6 under 2
    tree = TokenTree.from_parents([ROOT, 4, 4, 2, 6], [-1, 0, 1, 0, 3], scheme=DraftScheme.TOPK)
    runner.verify([0], [tree])
    (rows,) = captured
    paths = [[ROOT], [ROOT, 4], [ROOT, 4, 4], [ROOT, 2], [ROOT, 2, 6]]
    plain = SamplingParams(temperature=temperature)
    for node, path in enumerate(paths):
        expected = oracle_logits(model, PROMPT, DECODED + path, params)
        unprocessed = oracle_logits(model, PROMPT, DECODED + path, plain)
        if temperature == 0.0:  # greedy rules read processed logits
            got = rows[node].double()
            finite = [x > -math.inf for x in expected]
            assert [x > -math.inf for x in got.tolist()] == finite
            want = torch.tensor([x if f else 0.0 for x, f in zip(expected, finite, strict=True)])
            torch.testing.assert_close(
                torch.where(got > -math.inf, got, 0.0), want.double(), atol=1e-4, rtol=0
            )
        else:
            want = torch.tensor(softmax(expected, temperature), dtype=torch.float64)
            torch.testing.assert_close(rows[node].double(), want, atol=1e-5, rtol=0)
            # the processors matter on this row: ignoring them would fail the check above
            assert (want - torch.tensor(softmax(unprocessed, temperature))).abs().max() > 1e-2


def test_exact_law_of_chains_drafted_without_the_processors(monkeypatch) -> None:
    """A drafter that ignores the processors (q = the raw model rows) stays a proposal: the
    default chain rule, fed the runner's processed rows, emits the processed target's exact
    law of the first two tokens."""
    model = make_tiny_model(5, vocab_size=VOCAB)
    captured = spy_rows(monkeypatch)
    runner = resumed(model, PROCESSED)
    tree, node = full_tree(2)
    runner.verify([0], [tree])
    rows = captured[0].double()  # [73, VOCAB]: every node's processed row, from the runner
    plain = SamplingParams(temperature=1.0)
    raw = {
        path: torch.tensor(
            softmax(oracle_logits(model, PROMPT, DECODED + [ROOT, *path], plain)),
            dtype=torch.float64,
        )
        for path in [(), *((v,) for v in range(VOCAB))]
    }
    law = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for x1 in range(VOCAB):
        for x2 in range(VOCAB):
            weight = float(raw[()][x1] * raw[(x1,)][x2])
            if weight == 0.0:
                continue
            chain = TokenTree.chain(ROOT, [x1, x2], draft_probs=torch.stack([raw[()], raw[(x1,)]]))
            target = rows[[0, node[(x1,)], node[(x1, x2)]]]
            rule = choose_rule(chain, PROCESSED.temperature)
            for branch in rule.branches(chain, target):
                mass = weight * branch.probability
                if len(branch.path) == 3:
                    law[x1, x2] += mass
                elif len(branch.path) == 2:
                    law[x1] += mass * branch.next_token_probs
                else:  # rejected at once: the second token is the target's after it
                    for y in range(VOCAB):
                        law[y] += mass * branch.next_token_probs[y] * rows[node[(y,)]]
    first = softmax(oracle_logits(model, PROMPT, DECODED + [ROOT], PROCESSED))
    target_law = torch.tensor(
        [
            [
                first[a] * p
                for p in softmax(oracle_logits(model, PROMPT, DECODED + [ROOT, a], PROCESSED))
            ]
            for a in range(VOCAB)
        ],
        dtype=torch.float64,
    )
    assert abs(float(law.sum()) - 1.0) < 1e-6  # float32 rows
    torch.testing.assert_close(law, target_law, atol=2e-6, rtol=0)
    assert float(target_law[:, 7].sum()) == 0.0  # logit_bias -100 (and top-k) banned it
    unprocessed_first = softmax(oracle_logits(model, PROMPT, DECODED + [ROOT], plain))
    assert max(abs(a - b) for a, b in zip(first, unprocessed_first, strict=True)) > 1e-2


PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [9], [4, 4, 4, 4, 4, 4]]
SETTINGS = {
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.3),
    "negative-penalties": dict(presence_penalty=-0.6, frequency_penalty=-0.2),
    "bias-top-k": dict(logit_bias=((3, 2.0), (5, -100.0), (9, 0.7)), top_k=4),
    "all": dict(presence_penalty=0.4, frequency_penalty=-0.3, logit_bias=((2, 1.0),), top_k=3),
}


def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    output: list[int] = []
    while len(output) < params.max_tokens:
        output.append(greedy(oracle_logits(model, prompt, output, params)))
    return output


@pytest.mark.parametrize("drafter_name", ["ar", "ngram"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_with_processors_equals_the_reference_loop(drafter_name, setting) -> None:
    model = make_tiny_model(2, vocab_size=16)
    params = SamplingParams(max_tokens=20, **SETTINGS[setting])
    drafter = (
        NgramDrafter(DraftBudget(depth=4, top_k=2, max_tokens=6))
        if drafter_name == "ngram"
        else None
    )
    engine = SpecEngine(model, drafter, EngineConfig(max_running=3, max_len=128))
    seqs = [Sequence(i, p, params) for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        engine.submit(seq)
    stats = engine.run()
    expected = [reference_greedy(model, p, params) for p in PROMPTS]
    assert [s.output_ids for s in seqs] == expected
    plain = [reference_greedy(model, p, SamplingParams(max_tokens=20)) for p in PROMPTS]
    assert expected != plain  # the processors change this greedy output
    if drafter_name == "ngram" and setting == "negative-penalties":
        assert stats.num_accepted > 0  # drafted paths were accepted under the processors


def test_negative_seeds_map_to_the_unsigned_range() -> None:
    assert unsigned_seed(-1) == 2**64 - 1
    assert unsigned_seed(-(2**63)) == 2**63
    assert unsigned_seed(7) == 7
    model = make_tiny_model(3, vocab_size=16)

    def sampled(seed: int) -> list[int]:
        engine = SpecEngine(model, None, EngineConfig(max_running=1, max_len=128))
        seq = Sequence(0, [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=12, seed=seed))
        engine.submit(seq)
        engine.run()
        return seq.output_ids

    assert sampled(unsigned_seed(-1)) == sampled(2**64 - 1)
    assert sampled(unsigned_seed(-1)) != sampled(unsigned_seed(-2))


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"frequency_penalty": float("nan")},
        {"logit_bias": ((1, 101.0),)},
        {"logit_bias": ((1, 1.0), (1, 2.0))},
        {"logit_bias": tuple((i, 1.0) for i in range(301))},
        {"top_k": -1},
        {"logprobs": 21},
    ],
)
def test_out_of_range_processors_are_refused(fields) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**fields)


def test_penalties_without_a_history_are_an_error_not_ignored() -> None:
    params = SamplingParams(presence_penalty=1.0)
    with pytest.raises(ValueError, match="counts"):
        greedy_or_sample(torch.zeros(1, 8), params, None)
    # ids past the vocabulary are refused at the edges (the HTTP intake: 400, the gRPC
    # codec: INVALID_ARGUMENT; tests/gateway/test_api_surface.py, tests/services/test_edges.py);
    # past them the runner only asserts it, before it allocates anything
    runner = TargetRunner(make_tiny_model(5, vocab_size=VOCAB))
    with pytest.raises(AssertionError, match="logit_bias"):
        runner.prefill(0, PROMPT, SamplingParams(logit_bias=((VOCAB, 1.0),)))
    assert runner.num_free_slots == runner.config.max_running  # nothing was allocated


def test_logprobs_are_the_models_log_softmax(monkeypatch) -> None:
    """Chat logprobs: each emitted token's log-probability under the raw model row it was
    chosen from, and the most likely alternatives in order."""
    model = make_tiny_model(2, vocab_size=16)
    params = SamplingParams(max_tokens=10, logprobs=3, logit_bias=((4, 3.0),))
    engine = SpecEngine(
        model,
        NgramDrafter(DraftBudget(depth=4, top_k=2, max_tokens=6)),
        EngineConfig(max_running=1, max_len=128),
    )
    seq = Sequence(0, PROMPTS[0], params)
    engine.submit(seq)
    entries = []
    while engine.has_work:
        for item in engine.step():
            assert item.logprobs is not None and len(item.logprobs) == len(item.tokens)
            entries += item.logprobs
    assert [e.token for e in entries] == seq.output_ids
    for i, entry in enumerate(entries):
        raw = prompt_logits(model, torch.tensor([PROMPTS[0] + seq.output_ids[:i]]))[-1]
        logp = torch.log_softmax(raw.double(), -1)
        assert abs(entry.logprob - float(logp[entry.token])) < 1e-4
        best = logp.topk(3)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert all(
            abs(a - b) < 1e-4 for (_, a), b in zip(entry.top, best.values.tolist(), strict=True)
        )
