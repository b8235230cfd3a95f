"""Machine-specific measurements, taken once and cached: which weight format is faster, and
what a target forward costs by the number of rows it verifies.

Which kernel wins depends on the CPU (the int4 kernel's fast path needs AVX-512; oneDNN's fp32
products run near bandwidth on some machines and at half of it on others), so ``auto`` times
one decode step's worth of linear products in each format, with weights of the model's shapes
streamed from memory as in a real forward (sizes beyond the caches), for 1 and 4 new rows
(decode and a small verification). The verdict is cached per CPU, torch version, thread count
and model shape in ``$LYANNA_CACHE/calibration.json``; delete the file to measure again.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable

import torch

from lyanna.model.config import ModelConfig
from lyanna.model.cpu_kernels import PackedLinear, prepacking_available
from lyanna.model.native import build_key
from lyanna.model.paths import cache_root
from lyanna.model.quant import GROUP, Int4Linear, Q4Blocks, int4_kernel_available, runs_q4
from lyanna.model.transformer import Transformer
from lyanna.tree_cost import VerifyCost

ROWS = (1, 4)
COST_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # verification forwards timed for the cost curve
COST_CONTEXT = 256  # cached rows behind them
# a cached cost curve is measured again when a one-row forward now takes outside this share
# of what it recorded (it was measured on a busy machine, or the machine changed)
STALE_BELOW, STALE_ABOVE = 0.7, 1.5
_CHECKED: set[tuple[str, str]] = set()  # cached curves this process has already checked


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(config: ModelConfig) -> str:
    c = config
    shape = f"{c.num_layers}x{c.hidden_size}x{c.intermediate_size}x{c.vocab_size}"
    isa = torch.backends.cpu.get_cpu_capability()  # one model name spans CPU generations
    return f"{_cpu_name()}|{isa}|{torch.__version__}|{torch.get_num_threads()}t|{shape}"


def _linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    d, f = config.hidden_size, config.intermediate_size
    return [(qkv, d), (d, config.num_heads * config.head_dim), (2 * f, d), (d, f)]


def _layers(config: ModelConfig, fmt: str) -> list[torch.nn.Module]:
    mods: list[torch.nn.Module] = []
    for _ in range(config.num_layers):
        for out_f, in_f in _linear_shapes(config):
            if fmt == "q4":
                codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8)
                scale = torch.full((out_f, in_f // GROUP), 0.01)
                mods.append(Int4Linear(Q4Blocks(codes, scale, -8 * scale)))
            else:
                mods.append(PackedLinear(torch.randn(out_f, in_f) * 0.02))
    head = torch.randn(config.vocab_size, config.hidden_size) * 0.02
    mods.append(PackedLinear(head, torch.bfloat16 if fmt == "q4" else None))
    return mods


def _step(mods: list[torch.nn.Module], rows: int) -> Callable[[], None]:
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in mods}  # type: ignore

    def step() -> None:
        for m in mods:
            m(inputs[m.in_features])  # type: ignore[attr-defined]

    return step


def measure(config: ModelConfig, repeats: int = 7) -> dict[str, dict[int, float]]:
    """Median seconds per step of linear products, by format and new-row count. The formats
    take turns within each repeat, so a busy machine slows both alike."""
    formats = {fmt: _layers(config, fmt) for fmt in ("fp32", "q4")}
    result: dict[str, dict[int, float]] = {fmt: {} for fmt in formats}
    for rows in ROWS:
        steps = {fmt: _step(mods, rows) for fmt, mods in formats.items()}
        times: dict[str, list[float]] = {fmt: [] for fmt in formats}
        for i in range(repeats + 1):
            for fmt, step in steps.items():
                start = time.perf_counter()
                step()
                if i:  # the first round warms up
                    times[fmt].append(time.perf_counter() - start)
        for fmt, ts in times.items():
            result[fmt][rows] = sorted(ts)[len(ts) // 2]
    return result


def choose_weights(config: ModelConfig) -> str:
    """``q4`` when its products are faster for both 1 and 4 new rows, else ``fp32``."""
    if not int4_kernel_available() or not prepacking_available(torch.zeros(1)):
        return "fp32"

    def decide() -> dict:
        timing = measure(config)
        q4_wins = all(timing["q4"][r] < timing["fp32"][r] for r in ROWS)
        return {
            "choice": "q4" if q4_wins else "fp32",
            "ms": {f: {str(r): round(s * 1e3, 2) for r, s in t.items()} for f, t in timing.items()},
        }

    return _cached(_key(config), "weights", decide)["choice"]


def forward_seconds(
    model: Transformer, rows: tuple[int, ...], context: int = COST_CONTEXT, repeats: int = 7
) -> dict[int, float]:
    """Median seconds of a verification forward (+ LM head on every row) over each number
    of new rows, behind ``context`` cached ones (nothing is committed). The row counts take
    turns within each round (a machine whose speed drifts slows them alike), and each count
    is timed on its second forward in a row: the first forward after one of another size
    pays for the switch (measured: a one-row forward right after a 32-row one took 2.78 ms
    where back-to-back one-row forwards take 2.61). Timing one row just before each other
    count, as this did before, priced a second row at +2-4 % of a step where steady
    decoding pays +11-15 % (the engine's own step times), so drafts looked cheaper than
    they are."""
    device = model.embed_tokens.weight.device
    cache = model.new_cache(1, context + max(rows) + 1)
    slot = torch.tensor([cache.allocate()], device="cpu")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    model(
        torch.randint(0, vocab, (1, context), generator=gen).to(device),
        torch.arange(context)[None].to(device),
        cache,
        slot,
    )
    cache.commit(0, torch.arange(context))
    inputs = {
        r: (
            torch.randint(0, vocab, (1, r), generator=gen).to(device),
            (context + torch.arange(r))[None].to(device),
        )
        for r in rows
    }

    def timed(r: int) -> float:
        tokens, positions = inputs[r]
        start = time.perf_counter()
        model.logits(model(tokens, positions, cache, slot))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[int, list[float]] = {r: [] for r in rows}
    for i in range(repeats + 1):  # a warm-up round, then row counts take turns
        for r in rows:
            timed(r)  # the switch from the previous count
            seconds = timed(r)
            if i:
                times[r].append(seconds)
    return {r: sorted(ts)[len(ts) // 2] for r, ts in times.items()}


def verify_cost(model: Transformer) -> VerifyCost:
    """The target's forward cost by rows (``COST_ROWS``), measured once per machine, thread
    count, model shape and weight format, then read from the cache."""
    weights = "dense"
    if runs_q4(model):  # the native decoder's cost curve is its own build's
        weights = f"q4-native-{build_key()}" if model.native is not None else "q4"
        weights += "-a8" if model._native_int8_rows else ""
    device = model.embed_tokens.weight.device
    kind = f"verify_cost3|{weights}|{model.dtype}|{device.type}"  # 3: settled timings

    def measure_curve() -> dict:
        seconds = forward_seconds(model, COST_ROWS)
        return {"ms": {str(r): round(s * 1e3, 3) for r, s in seconds.items()}}

    def still_true(entry: dict) -> bool:
        """A curve measured while the machine was busy (a build, a test suite) prices every
        step too high, and a gate that believes it drafts where drafting loses (measured:
        8.9 ms cached for a 3.0 ms step). A one-row forward timed now must agree."""
        cached = entry["ms"]["1"] / 1e3
        now = forward_seconds(model, (1,), repeats=5)[1]
        return STALE_BELOW * cached <= now <= STALE_ABOVE * cached

    key = _key(model.config)
    entry = _cached(key, kind, measure_curve, None if (key, kind) in _CHECKED else still_true)
    _CHECKED.add((key, kind))  # once per process: every drafter built later shares the curve
    return VerifyCost.from_measurements({int(r): ms / 1e3 for r, ms in entry["ms"].items()})


def _cached(
    key: str,
    kind: str,
    compute: Callable[[], dict],
    still_true: Callable[[dict], bool] | None = None,
) -> dict:
    """``compute()`` once per (machine key, kind); later calls read $LYANNA_CACHE, unless
    ``still_true`` says the cached entry no longer holds (then it is measured again)."""
    path = cache_root() / "calibration.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key, {}).get(kind)
    if entry is not None and still_true is not None and not still_true(entry):
        entry = None
    if entry is None:
        entry = compute()
        cached.setdefault(key, {})[kind] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=2))
    return entry
