"""EAGLE-2 and Lyanna drafting next to a target on its device (``lyanna.drafters.placement``):
greedy speculation equals plain greedy decoding on that device, sampled runs (traversal and
tree-sampling rules) complete with valid tokens, and ``make_drafter`` builds both there. Each
runs on the CPU fast path, on the device-generic path forced on the CPU (the code a GPU runs),
and on CUDA where a GPU is visible (skipped otherwise)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lyanna.decode import generate
from lyanna.drafters import DEVICE_METHODS, DraftCapacity, make_drafter
from lyanna.drafters.base import DraftBudget
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.heads import Linear
from lyanna.drafters.lyanna import LyannaDrafter, ResampleConfig
from lyanna.drafters.placement import DraftPlacement, to_host
from lyanna.drafters.sampled import DraftSampling, draw_children
from lyanna.drafters.token_info_tree import build_subtrees
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.model.cpu_kernels import PackedLinear
from lyanna.model.transformer import Block
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.tree import DraftScheme
from lyanna.tree_cost import VerifyCost
from tests.conftest import make_tiny_model
from tests.unit.test_eagle import random_head
from tests.unit.test_lyanna_drafter import tiny_draft

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
# (device, generic): the CPU fast path, the generic path forced on the CPU, a GPU
PLACEMENTS = [
    pytest.param("cpu", False, id="cpu"),
    pytest.param("cpu", True, id="cpu-generic"),
    pytest.param("cuda", False, id="cuda", marks=CUDA),
]
GENERIC_PLACEMENTS = PLACEMENTS[1:]  # every path a GPU takes
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
VOCAB = 16  # tiny_draft's vocabulary
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [9], [4, 4, 4, 4, 4, 4]]
COST = VerifyCost((1, 2, 4, 8, 16, 32), (1.0, 1.02, 1.1, 1.3, 1.9, 3.0))


def target_on(device: str, dtype: torch.dtype = torch.float32):
    return make_tiny_model(2, vocab_size=VOCAB).to(device, dtype)


def drafter_for(method: str, model, budget: DraftBudget, generic: bool, **kwargs):
    """A random-weight drafter of ``method`` for ``model`` (built on the CPU, as a checkpoint
    loads, and placed next to the target by the drafter itself)."""
    capacity = {"max_running": 3, "max_len": 256}
    if method == "eagle":
        head = random_head(model)
        return EagleDrafter(model, head, budget, generic=generic, **capacity, **kwargs)
    return LyannaDrafter(model, tiny_draft(model), budget, generic=generic, **capacity, **kwargs)


def run(model, drafter, params: list[SamplingParams], rule: str | None = None):
    engine = SpecEngine(model, drafter, EngineConfig(max_running=3, max_len=256, rule=rule))
    seqs = [Sequence(i, PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params)]
    for s in seqs:
        engine.submit(s)
    engine.run()
    return engine, seqs


def plain_greedy(model, max_tokens: int) -> list[list[int]]:
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(PROMPTS)]
    generate(model, seqs)
    return [s.output_ids for s in seqs]


def check_placed(drafter, model) -> None:
    """Draft KV on the target's device; the CPU-bookkeeping tensors on the CPU."""
    device = model.embed_tokens.weight.device
    assert drafter.cache.keys.device == device
    assert drafter.cache.lengths.device.type == "cpu"
    hot = drafter.hot_vocab if isinstance(drafter, EagleDrafter) else drafter.hot_ids
    assert hot.device.type == "cpu"
    if drafter.placement.generic:  # plain modules: no CPU kernel or native layer
        network = drafter.head if isinstance(drafter, EagleDrafter) else drafter.draft
        assert isinstance(drafter.lm_head, Linear)
        assert not any(isinstance(m, PackedLinear) for m in network.modules())
        assert all(m.native is None for m in network.modules() if isinstance(m, Block))


@pytest.mark.parametrize("device, generic", PLACEMENTS)
@pytest.mark.parametrize(
    "method, budget",
    [
        ("eagle", DraftBudget(3, 2, 5)),
        ("eagle", DraftBudget(5, 4, 16, cost=COST)),
        ("lyanna", DraftBudget(3, 3, 8)),
        ("lyanna", DraftBudget(3, 1, 3)),  # one-child chains: their own fast builder
        ("lyanna", DraftBudget(3, 2, 8, cost=COST)),
    ],
)
def test_greedy_speculation_equals_plain_greedy(
    device: str, generic: bool, method: str, budget: DraftBudget
) -> None:
    model = target_on(device)
    drafter = drafter_for(method, model, budget, generic)
    assert drafter.placement.generic == (generic or device != "cpu")
    check_placed(drafter, model)
    engine, seqs = run(model, drafter, [SamplingParams(max_tokens=24)] * len(PROMPTS))
    assert [s.output_ids for s in seqs] == plain_greedy(model, 24)
    assert engine.stats.num_drafted > 0
    assert drafter.cache.num_free_slots == 3  # every sequence released its draft slot


@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("device, generic", GENERIC_PLACEMENTS)
def test_lyanna_resampling_stays_lossless_on_the_generic_path(
    device: str, generic: bool, fusion: bool
) -> None:
    """Re-sampled subtrees are built from chain logits kept on the device."""
    model = target_on(device)
    resample = ResampleConfig(enabled=True, fusion=fusion)
    drafter = drafter_for("lyanna", model, DraftBudget(3, 3, 8), generic, resample=resample)
    engine, seqs = run(model, drafter, [SamplingParams(max_tokens=20)] * len(PROMPTS))
    assert [s.output_ids for s in seqs] == plain_greedy(model, 20)
    assert engine.stats.num_drafted > 0


@pytest.mark.parametrize("device, generic", PLACEMENTS)
@pytest.mark.parametrize("method", ["eagle", "lyanna"])
@pytest.mark.parametrize("rule", [None, "traversal", "rrs_wor"])
def test_sampled_runs_complete_with_valid_tokens(
    device: str, generic: bool, method: str, rule: str | None
) -> None:
    """T = 1 sequences draft trees without replacement (their rows on the CPU, where the
    rules meet the target's rows), next to a greedy sequence that still equals plain greedy
    decoding. A configured rule needs every tree sampled: Lyanna then re-samples nothing."""
    model = target_on(device)
    kwargs = {} if method == "eagle" or rule is None else {"resample": ResampleConfig(False)}
    drafter = drafter_for(method, model, DraftBudget(3, 2, 6), generic, **kwargs)
    schemes: Counter = Counter()
    propose = drafter.propose

    def checking_propose(seq_ids):
        trees = propose(seq_ids)
        for tree in trees:
            schemes[tree.scheme] += tree.num_drafted > 0
            if tree.draft_probs is not None:
                assert tree.draft_probs.device.type == "cpu"
                assert tree.vocab_index.device.type == "cpu"
        return trees

    drafter.propose = checking_propose
    sampled = [SamplingParams(1.0, max_tokens=16, seed=i) for i in range(3)]
    engine, seqs = run(model, drafter, [SamplingParams(max_tokens=16), *sampled], rule)
    assert all(len(s.output_ids) == 16 for s in seqs)
    assert all(0 <= t < VOCAB for s in seqs for t in s.output_ids)
    assert seqs[0].output_ids == plain_greedy(model, 16)[0]
    assert schemes[DraftScheme.WITHOUT_REPLACEMENT] > 0
    assert engine.stats.num_drafted > 0


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu-generic"), DEVICES[1]])
@pytest.mark.parametrize("method", ["eagle", "lyanna"])
def test_bf16_target_drafts_in_bf16(device: str, method: str) -> None:
    """A bf16 target (the usual GPU deployment): the draft network and KV compute in bf16,
    the target's hidden rows enter as they are; greedy and sampled sequences complete."""
    model = target_on(device, torch.bfloat16)
    drafter = drafter_for(method, model, DraftBudget(3, 2, 6), generic=True)
    assert drafter.cache.keys.dtype == torch.bfloat16
    params = [SamplingParams(max_tokens=12), SamplingParams(1.0, max_tokens=12, seed=1)]
    engine, seqs = run(model, drafter, params)
    assert all(len(s.output_ids) == 12 for s in seqs)
    assert all(0 <= t < VOCAB for s in seqs for t in s.output_ids)
    assert engine.stats.num_drafted > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [m for m in DEVICE_METHODS if m.startswith(("eagle", "lyanna"))])
def test_make_drafter_builds_learned_drafters_on_the_target_device(
    device: str, name: str, monkeypatch
) -> None:
    """Checkpoints replaced by random weights of the tiny target's shape (the factories'
    own loading code still runs: a Lyanna checkpoint's state dict goes through
    ``from_checkpoint``)."""
    model = target_on(device)
    draft = tiny_draft(make_tiny_model(2, vocab_size=VOCAB))
    state = {k: v.clone() for k, v in draft.state_dict().items()}
    monkeypatch.setattr("lyanna.drafters.eagle.load_eagle_head", lambda *a: random_head(model))
    monkeypatch.setattr(
        "lyanna.drafters.lyanna.read_checkpoint", lambda *a: (draft.config.to_dict(), state)
    )
    drafter = make_drafter(name, model, DraftBudget(3, 2, 6), DraftCapacity(3, 256))
    assert isinstance(drafter, EagleDrafter if name == "eagle" else LyannaDrafter)
    assert drafter.placement.generic == (device != "cpu")
    check_placed(drafter, model)
    _, seqs = run(model, drafter, [SamplingParams(max_tokens=16)] * len(PROMPTS))
    assert [s.output_ids for s in seqs] == plain_greedy(model, 16)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=CUDA)])
def test_make_drafter_refuses_cpu_only_drafters_off_the_cpu(device: str) -> None:
    """SPS has no device path: refused, naming what does draft there (the meta device
    stands in for a GPU where there is none)."""
    model = make_tiny_model(2, vocab_size=VOCAB).to(device)
    with pytest.raises(ValueError, match="CPU only") as refused:
        make_drafter("sps", model, DraftBudget(3, 2, 6))
    assert all(m in str(refused.value) for m in ("eagle", "lyanna", "ngram"))


def test_placement_picks_the_path_and_dtype() -> None:
    cpu, bf16 = target_on("cpu"), target_on("cpu", torch.bfloat16)
    assert DraftPlacement.of(cpu) == DraftPlacement(torch.device("cpu"), False, torch.float32)
    assert DraftPlacement.of(bf16, generic=True).dtype == torch.bfloat16  # "auto": the target's
    assert DraftPlacement.of(bf16, None, generic=True).dtype == torch.float32
    assert DraftPlacement.of(target_on("meta")).generic  # off the CPU: always generic


@pytest.mark.parametrize("device", DEVICES)
def test_children_come_to_the_cpu_in_one_exact_copy(device: str) -> None:
    """Values, hot columns, rows and top probabilities keep their bits, shapes and dtypes."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 2, 40, generator=generator) * 4).to(device)
    draws = [None, DraftSampling(1.0, 0.9, torch.Generator().manual_seed(1)), None]
    children = draw_children(logits, 3, draws)
    host = children.to_host(force=True)
    for got, want in zip(
        (host.values, host.columns, host.rows, host.top),
        (children.values, children.columns, children.rows, children.top),
        strict=True,
    ):
        assert got.device.type == "cpu" and got.dtype == want.dtype
        assert torch.equal(got, want.cpu())
    assert host.sampled == [1]
    assert to_host(children.values)[0].device.type == "cpu"


@CUDA
@pytest.mark.parametrize("top_k", [1, 2])
def test_token_info_trees_on_cuda_equal_cpu_trees(top_k: int) -> None:
    """The same logits and table on the GPU give the CPU's trees (random logits: no ties
    for the two devices' kernels to break differently); sampled draws use the same CPU
    generators, so they draw the same children."""
    generator = torch.Generator().manual_seed(0)
    num_hot, vocab = 12, 20
    logits = torch.randn(3, 3, num_hot, generator=generator) * 3
    table = torch.randn(num_hot, num_hot, generator=generator).half()
    hot_ids = torch.randperm(vocab, generator=generator)[:num_hot]
    hot_index = torch.full((vocab,), -1, dtype=torch.int64)
    hot_index[hot_ids] = torch.arange(num_hot)
    roots = [int(hot_ids[0]), next(t for t in range(vocab) if hot_index[t] < 0), 3]

    def trees(device: str, sampled: bool):
        draws = [None] * 3
        if sampled:
            draws[1] = DraftSampling(1.0, 0.95, torch.Generator().manual_seed(5))
        return build_subtrees(
            logits.to(device), roots, top_k, table.to(device), hot_ids, hot_index, draws
        )

    for sampled in (False, True):
        for a, b in zip(trees("cuda", sampled), trees("cpu", sampled), strict=True):
            assert a.tokens == b.tokens and a.parents == b.parents
            assert a.probs == pytest.approx(b.probs, rel=1e-5)
            assert (a.draft_rows is None) == (b.draft_rows is None)
            if a.draft_rows is not None:
                assert a.draft_rows.device.type == "cpu"
                torch.testing.assert_close(a.draft_rows, b.draft_rows)
