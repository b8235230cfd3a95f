"""Pick the weight format that is faster on this machine, measured once and cached.

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
from lyanna.model.quant import GROUP, BF16Linear, Int4Linear, Q4Blocks, int4_kernel_available

ROWS = (1, 4)


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
    return f"{_cpu_name()}|{torch.__version__}|{torch.get_num_threads()}t|{shape}"


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
    mods.append(BF16Linear(head) if fmt == "q4" else PackedLinear(head))
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
    from lyanna.model.default import cache_root

    path = cache_root() / "calibration.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    key = _key(config)
    entry = cached.get(key, {}).get("weights")
    if entry is None:
        timing = measure(config)
        q4_wins = all(timing["q4"][r] < timing["fp32"][r] for r in ROWS)
        entry = {
            "choice": "q4" if q4_wins else "fp32",
            "ms": {f: {str(r): round(s * 1e3, 2) for r, s in t.items()} for f, t in timing.items()},
        }
        cached.setdefault(key, {})["weights"] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=2))
    return entry["choice"]
