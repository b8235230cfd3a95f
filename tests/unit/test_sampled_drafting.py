"""Sampling-mode drafting (temperature > 0): children drawn without replacement from the
processed draft rows, expansion by the joint probability of what was drawn, pruning by what
was known before each draw. The exact-law checks enumerate every tree this procedure can draw
on a tiny vocabulary (with the production pruning code) and compare the emitted law with the
target's; a control that prunes by each node's own draw must fail the same check."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from lyanna.draft_nodes import DraftNodes
from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.lyanna import LyannaDrafter
from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
from lyanna.drafters.sampled import DraftSampling, draw_children
from lyanna.drafters.sps import SpsDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.sampling import SamplingParams, logits_to_probs, sample_distinct
from lyanna.sequence import Sequence
from lyanna.tree import DraftScheme, best_nodes, log_joint_of
from lyanna.tree_cost import VerifyCost
from lyanna.verify import RULES
from tests.conftest import make_tiny_model
from tests.unit.exact_law import (
    ROOT,
    ToyModel,
    _child_choices,
    _prefixes,
    check_trees,
    chi_square_pvalue,
)
from tests.unit.test_eagle import random_head

TOLERANCE = 1e-9
K = 2
EXPAND = (2, 1)  # nodes of the newest depth that draw children at depth 2 and 3
LENGTH = 1 + 1 + len(EXPAND)  # emitted tokens checked: up to max depth + 1


def sampled_drafts(draft: ToyModel, k: int, expand: tuple[int, ...]) -> Iterator[tuple]:
    """Every (DraftNodes, probability) the sampled dynamic tree can draw: the root draws k
    children without replacement; at each further depth the ``expand[d]`` newest nodes with
    the highest joint draft probability draw k children each. Nodes carry rows, probabilities
    and gains exactly as ``DynamicTreeDrafter`` attaches them."""

    def level(tokens, parents, probs, gains, rows, to_expand, rest, prob):
        node_rows = [draft.probs(_prefixes(tokens, parents)[n]) for n in to_expand]
        choices = [list(_child_choices(r, k, DraftScheme.WITHOUT_REPLACEMENT)) for r in node_rows]
        log_joint = log_joint_of(parents, torch.tensor(probs, dtype=torch.float64))
        for combo in itertools.product(*choices):
            combo_prob = prob * math.prod(p for _, p in combo)
            if combo_prob == 0.0:
                continue
            t, pa, q, g, r = list(tokens), list(parents), list(probs), list(gains), dict(rows)
            newest = []
            for node, row, (drawn, _) in zip(to_expand, node_rows, combo, strict=True):
                r[node] = row
                top = row.sort(descending=True).values[:k].tolist()
                for j, token in enumerate(drawn):
                    newest.append(len(t))
                    t.append(token), pa.append(node), q.append(float(row[token]))
                    g.append(math.exp(log_joint[node]) * top[j])
            if rest:
                joint = log_joint_of(pa, torch.tensor(q, dtype=torch.float64))
                chosen = sorted(newest, key=lambda i: (-joint[i], i))[: rest[0]]
                yield from level(t, pa, q, g, r, chosen, rest[1:], combo_prob)
            else:
                table = torch.zeros(len(t), draft.vocab, dtype=torch.float64)
                for node, row in r.items():
                    table[node] = row
                yield DraftNodes(t, pa, q, draft_rows=table, gains=g), combo_prob

    yield from level([ROOT], [-1], [1.0], [0.0], {}, [0], list(expand), 1.0)


def models(seed: int, vocab: int = 3, **processing) -> tuple[ToyModel, ToyModel]:
    target = ToyModel(vocab, seed, **processing)
    return target, ToyModel(vocab, 1000 + seed, base=target, **processing)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("width", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("name", ["traversal", "rrs_wor"])
def test_sampled_trees_pruned_to_a_width_are_lossless(name: str, width: int, seed: int) -> None:
    target, draft = models(seed)
    trees = ((n.prune(width).to_tree(), p) for n, p in sampled_drafts(draft, K, EXPAND))
    result = check_trees(RULES[name], target, trees, LENGTH)
    assert result.total_mass == pytest.approx(1.0, abs=TOLERANCE)
    assert result.max_error < TOLERANCE, result


@pytest.mark.parametrize("name", ["traversal", "rrs_wor"])
def test_cost_aware_sampled_trees_are_lossless(name: str) -> None:
    """The width follows the drawn trees' gains (``first_peak_width``), yet the law holds."""
    target, draft = models(0, temperature=0.7)
    cost = VerifyCost((1, 2, 4, 8), (1.0, 1.15, 1.5, 2.4))
    budget = DraftBudget(depth=3, top_k=K, max_tokens=8, cost=cost)
    widths: set[int] = set()

    def trees():
        for nodes, prob in sampled_drafts(draft, K, EXPAND):
            (kept,) = budget.prune([nodes])
            widths.add(kept.num_drafted)
            yield kept.to_tree(), prob

    result = check_trees(RULES[name], target, trees(), LENGTH)
    assert len(widths) >= 3, widths  # the check covers trees of several sizes
    assert result.total_mass == pytest.approx(1.0, abs=TOLERANCE)
    assert result.max_error < TOLERANCE, result


@pytest.mark.parametrize("name", ["traversal", "rrs_wor"])
def test_control_pruning_sampled_nodes_by_their_own_draw_is_lossy(name: str) -> None:
    """EAGLE-2's ranking (each node's own joint probability) on sampled children keeps a
    child only when it drew a likely token: the same check must catch it."""
    target, draft = models(0)

    def by_own_draw(nodes: DraftNodes, width: int) -> DraftNodes:
        log_joint = log_joint_of(nodes.parents, torch.tensor(nodes.probs, dtype=torch.float64))
        return nodes._keep(best_nodes(nodes.parents, log_joint, width))

    trees = ((by_own_draw(n, 3).to_tree(), p) for n, p in sampled_drafts(draft, K, EXPAND))
    assert check_trees(RULES[name], target, trees, LENGTH).max_error > 1e-3


def test_sampled_pruning_keeps_a_prefix_of_each_sibling_draw() -> None:
    """Whatever the width, each node keeps the first of its children in drawing order (nodes
    are named by their token paths, unique since siblings are distinct draws)."""
    _, draft = models(1, vocab=4)

    def children_by_path(nodes: DraftNodes) -> dict[tuple[int, ...], list[int]]:
        paths, out = nodes.token_paths(), {}
        for i in range(1, len(nodes.tokens)):
            out.setdefault(paths[nodes.parents[i]], []).append(nodes.tokens[i])
        return out

    for nodes, _ in itertools.islice(sampled_drafts(draft, K, EXPAND), 50):
        drawn = children_by_path(nodes)
        for width in range(nodes.num_drafted + 1):
            kept = nodes.prune(width)
            assert kept.num_drafted == width
            assert kept.to_tree().scheme is DraftScheme.WITHOUT_REPLACEMENT
            for path, tokens in children_by_path(kept).items():
                assert tokens == drawn[path][: len(tokens)], (width, path)


def test_draws_without_replacement_follow_the_sequential_law() -> None:
    """Gumbel-top-k's (first, second) draw has the law of two sequential draws without
    replacement; the other order's law is rejected."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    generator = torch.Generator().manual_seed(0)
    n = 20000
    picks = sample_distinct(probs.expand(n, 4), 2, generator).tolist()
    law = {}
    for a, b in itertools.permutations(range(4), 2):
        law[(a, b)] = float(probs[a] * probs[b] / (1 - probs[a]))

    class Draw:  # the chi-square helper's verdict shape
        def __init__(self, a, b):
            self.path, self.tokens = (a,), [b]

    draws = [Draw(a, b) for a, b in picks]
    assert chi_square_pvalue({((a,), b): p for (a, b), p in law.items()}, draws) > 1e-3
    swapped = {((b,), a): p for (a, b), p in law.items()}
    assert chi_square_pvalue(swapped, draws) < 1e-6


def test_draws_never_pick_a_token_outside_the_support() -> None:
    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3], [0.0, 0.0, 1.0, 0.0]])
    picks = sample_distinct(probs, 2, torch.Generator().manual_seed(1))
    assert set(picks[0].tolist()) == {1, 3}
    assert picks[1, 0] == 2  # then a zero-probability pad the drafter drops


def test_per_row_processing_equals_processing_each_row() -> None:
    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(2)) * 3
    temperature = torch.tensor([0.0, 0.7, 1.3])[:, None, None]
    top_p = torch.tensor([1.0, 0.9, 1.0])[:, None, None]
    rows = logits_to_probs(logits, temperature, top_p)
    for b, (t, p) in enumerate([(0.0, 1.0), (0.7, 0.9), (1.3, 1.0)]):
        torch.testing.assert_close(rows[b], logits_to_probs(logits[b], t, p))


def test_a_batch_draws_what_each_sequence_draws_alone() -> None:
    """``draw_children`` over a batch of greedy and sampling sequences (two requests' settings,
    or one shared by all) gives every sequence the children it gets alone with the same
    generator: top-k for greedy rows; for sampled rows, draws from its own processed row."""
    logits = torch.randn(4, 3, 40, generator=torch.Generator().manual_seed(5)) * 2
    settings = [None, (0.7, 1.0), (1.3, 0.8), None]

    def draws(batch: list[int]) -> list[DraftSampling | None]:
        return [
            None
            if settings[b] is None
            else DraftSampling(*settings[b], torch.Generator().manual_seed(10 + b))
            for b in batch
        ]

    for k in (1, 2):
        for batch in ([0, 1, 2, 3], [1, 2], [2], [1]):
            together = draw_children(logits[batch], k, draws(batch))
            for i, b in enumerate(batch):
                alone = draw_children(logits[b : b + 1], k, draws([b]))
                assert torch.equal(together.columns[i], alone.columns[0])
                torch.testing.assert_close(together.values[i], alone.values[0])
                if settings[b] is None:
                    top = logits[b].log_softmax(-1).topk(k, dim=-1)
                    assert torch.equal(alone.columns[0], top.indices)
                    continue
                rows = logits_to_probs(logits[b], *settings[b])
                s = together.sampled.index(i)
                torch.testing.assert_close(together.rows[s], rows)
                expected = sample_distinct(rows, k, torch.Generator().manual_seed(10 + b))
                assert torch.equal(alone.columns[0], expected)
                torch.testing.assert_close(together.top[s], rows.topk(k, dim=-1).values)


def test_one_draw_per_row_follows_the_row() -> None:
    """k = 1 takes a shorter path (a draft step's one child): its law on a small row, no pick
    outside the support, and a pad for rows with no mass."""
    probs = torch.tensor([0.5, 0.3, 0.0, 0.2])
    picks = sample_distinct(probs.expand(20000, 4), 1, torch.Generator().manual_seed(3))
    counts = Counter(picks[:, 0].tolist())
    assert counts[2] == 0
    for token in (0, 1, 3):
        assert abs(counts[token] / 20000 - float(probs[token])) < 0.015
    empty = sample_distinct(torch.zeros(2, 4), 1, torch.Generator().manual_seed(4))
    assert empty.shape == (2, 1)


# -- the drafters and the engine ------------------------------------------------------------


def eagle_drafter(model, budget: DraftBudget, hot: int | None = 20, **kwargs) -> EagleDrafter:
    head = random_head(model, hot=hot)
    return EagleDrafter(model, head, budget, max_running=4, max_len=128, **kwargs)


def start(drafter, model, params_by_seq: list[SamplingParams | None]) -> None:
    for seq_id, params in enumerate(params_by_seq):
        prompt = PROMPTS[seq_id]
        hidden = model(
            torch.tensor([prompt]),
            torch.arange(len(prompt))[None],
            model.new_cache(1, 64),
            torch.tensor([0]),
        )[0]
        drafter.start(seq_id, prompt, hidden, 7, params)


PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7]]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=3)


def test_eagle_samples_trees_for_sampling_sequences_only() -> None:
    model = make_tiny_model(1, vocab_size=32)
    budget = DraftBudget(3, 2, 8)
    mixed, greedy = eagle_drafter(model, budget), eagle_drafter(model, budget)
    start(mixed, model, [None, SAMPLED])
    start(greedy, model, [None, None])
    top_k_tree, sampled_tree = mixed.propose([0, 1])
    reference = greedy.propose([0, 1])[0]
    assert mixed.scheme is DraftScheme.WITHOUT_REPLACEMENT
    assert top_k_tree.scheme is DraftScheme.TOPK  # a greedy sequence's tree is unchanged
    assert top_k_tree.tokens.tolist() == reference.tokens.tolist()
    assert top_k_tree.parents.tolist() == reference.parents.tolist()

    tree = sampled_tree
    assert tree.scheme is DraftScheme.WITHOUT_REPLACEMENT and tree.num_drafted == 8
    assert torch.equal(tree.vocab_index, mixed.hot_vocab)
    rows = tree.full_draft_probs(32)
    for node in range(tree.num_nodes):
        children = tree.children(node)
        if not children:
            continue
        assert float(rows[node].sum()) == pytest.approx(1.0, abs=1e-5)
        tokens = tree.tokens[list(children)]
        assert len(set(tokens.tolist())) == len(children)  # drawn without replacement
        torch.testing.assert_close(
            tree.draft_token_probs[list(children)], rows[node, tokens].double()
        )
        assert bool((rows[node, tokens] > 0).all())


def test_seeded_sampled_drafts_repeat_and_top_k_is_an_option() -> None:
    model = make_tiny_model(1, vocab_size=32)
    budget = DraftBudget(3, 2, 8)
    trees = []
    for seed in (3, 3, 4):
        drafter = eagle_drafter(model, budget)
        start(drafter, model, [replace(SAMPLED, seed=seed)])
        trees.append(drafter.propose([0])[0].tokens.tolist())
    assert trees[0] == trees[1]
    off = eagle_drafter(model, budget, sample_drafts=False)
    start(off, model, [SAMPLED])
    assert off.scheme is DraftScheme.TOPK and off.propose([0])[0].scheme is DraftScheme.TOPK


def lyanna_draft(model, num_hot: int) -> LyannaDraftModel:
    torch.manual_seed(0)
    config = LyannaDraftConfig(model.config, num_hot=num_hot, info_rank=4, chain_steps=3)
    hot = torch.randperm(model.config.vocab_size)[:num_hot]
    draft = LyannaDraftModel(config, model.embed_tokens.weight, hot)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return draft


def test_lyanna_samples_fresh_trees_and_fuses_top_k_unions() -> None:
    model = make_tiny_model(1, vocab_size=32)
    budget = DraftBudget(3, 2, 8)
    drafter = LyannaDrafter(model, lyanna_draft(model, 20), budget, max_len=128)
    start(drafter, model, [None, SAMPLED])
    assert drafter.scheme is DraftScheme.WITHOUT_REPLACEMENT
    top_k_tree, sampled_tree = drafter.propose([0, 1])
    assert top_k_tree.scheme is DraftScheme.TOPK
    assert sampled_tree.scheme is DraftScheme.WITHOUT_REPLACEMENT
    assert torch.equal(sampled_tree.vocab_index, drafter.draft.hot_ids)
    rows = sampled_tree.full_draft_probs(32)
    for node in range(sampled_tree.num_nodes):
        children = list(sampled_tree.children(node))
        if children:
            assert float(rows[node].sum()) == pytest.approx(1.0, abs=1e-5)
            tokens = sampled_tree.tokens[children]
            assert len(set(tokens.tolist())) == len(children)
    # reject everything: the next step fuses a re-sampled (top-k) subtree into a TOPK union
    hidden = torch.randn(1, model.config.hidden_size)
    root = int(sampled_tree.tokens[0])
    bonus = next(t for t in range(32) if t not in sampled_tree.tokens[1:].tolist())
    drafter.on_verified([VerifiedStep(1, [root], hidden, bonus, 0, len(PROMPTS[1]) + 1)])
    fused = drafter.propose([1])[0]
    assert drafter.seqs[1].resampled is not None
    assert fused.scheme is DraftScheme.TOPK and fused.draft_probs is None


def target_law(model, prompt: list[int], temperature: float, length: int) -> dict:
    """Exact law of the first `length` tokens of plain sampling (every continuation)."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in law.items():
            ids = torch.tensor([prompt + list(prefix)])
            positions = torch.arange(ids.shape[1])[None]
            hidden = model(ids, positions, model.new_cache(1, 32), torch.tensor([0]))
            probs = logits_to_probs(model.logits(hidden[0, -1]).double(), temperature).tolist()
            for token, p in enumerate(probs):
                grown[prefix + (token,)] = mass * p
        law = grown
    return law


@pytest.mark.parametrize("method", ["eagle", "sps", "lyanna"])
def test_speculative_sampling_matches_plain_sampling(method: str) -> None:
    """Statistical: 3,000 seeded runs of three tokens at T = 1 against the exact law of
    plain sampling (a chi-square test; the drafters are random, so many drafts are rejected)."""
    from scipy.stats import chisquare

    model = make_tiny_model(4, vocab_size=6)
    prompt, length, runs = [1, 2, 3], 3, 3000
    budget = DraftBudget(3, 2, 6)
    if method == "eagle":
        drafter = eagle_drafter(model, budget, hot=None)
    elif method == "sps":
        drafter = SpsDrafter(make_tiny_model(5, vocab_size=6), torch.arange(6), budget)
    else:  # fresh sampled trees, and top-k unions when a re-sampled subtree is fused
        drafter = LyannaDrafter(model, lyanna_draft(model, 6), budget, max_len=128)
    schemes = Counter()
    propose = drafter.propose

    def counting_propose(seq_ids):
        trees = propose(seq_ids)
        schemes.update(t.scheme for t in trees if t.num_drafted)
        return trees

    drafter.propose = counting_propose
    engine = SpecEngine(model, drafter, EngineConfig(max_running=4, max_len=128))
    params = [SamplingParams(1.0, max_tokens=length, seed=i) for i in range(runs)]
    seqs = [Sequence(i, prompt, p) for i, p in enumerate(params)]
    for seq in seqs:
        engine.submit(seq)
    engine.run()
    assert engine.stats.num_drafted > 0 and engine.stats.num_accepted > 0
    assert schemes[DraftScheme.WITHOUT_REPLACEMENT] > 0
    if method == "lyanna":  # steps that fused a re-sampled subtree proposed top-k unions
        assert schemes[DraftScheme.TOPK] > 0
    law = target_law(model, prompt, 1.0, length)
    counts = {key: 0 for key in law}
    for seq in seqs:
        counts[tuple(seq.output_ids)] += 1
    big = [key for key in law if law[key] * runs >= 5]  # the rest is pooled into one bin
    observed = [counts[key] for key in big] + [runs - sum(counts[key] for key in big)]
    expected = [law[key] * runs for key in big]
    expected.append(runs - sum(expected))
    assert chisquare(observed, expected).pvalue > 1e-3
