"""This engine's decode and verify steps on a device beside transformers' ``LlamaForCausalLM``
(eager, and with a static cache + ``torch.compile``), in one run, on random weights of the
default model's shape: decoding speed does not depend on the weights' values, so no
checkpoint needs to travel to the GPU machine.

Prints, per batch size: ms per decode step and aggregate tokens/s of this engine through its
static step (a CUDA graph per bucket on a GPU), this engine's eager forward, transformers
eager and transformers compiled; then the verify forward by rows per sequence (batch 1) and
its cost relative to one row. ``python -m bench.engine_vs_peers --device cuda --dtype bf16``
runs it (``--device cpu --shape tiny`` rehearses it on a CPU in seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bench.common import print_table
from bench.random_weights import random_hf_state, shape_config
from lyanna.model.loader import build_model
from lyanna.model.static_step import window_inputs
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.target import TargetConfig, TargetRunner
from lyanna.tree import DraftScheme, TokenTree

VERIFY_ROWS = (1, 2, 8, 16, 64)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_ms_per_step(
    model: Transformer, batch: int, prompt_len: int, new_tokens: int, static: bool, seed: int = 0
) -> float:
    """Greedy decoding of ``batch`` sequences in lockstep through ``TargetRunner.verify`` with
    one-node trees (what the engine's AR method runs). A first pass over the same lengths
    captures every bucket the timed pass meets."""
    device = model.embed_tokens.weight.device
    config = TargetConfig(
        max_running=batch, max_len=prompt_len + 2 * new_tokens + 8, static_step=static
    )
    runner = TargetRunner(model, config)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    seconds = 0.0
    for _ in range(2):  # the first pass captures the buckets, the second is timed
        ids = list(range(batch))
        for i in ids:
            prompt = torch.randint(vocab, (prompt_len,), generator=gen).tolist()
            runner.prefill(i, prompt, params)
        _sync(device)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            trees = [
                TokenTree.from_parents([runner.next_token(i)], [-1], scheme=DraftScheme.TOPK)
                for i in ids
            ]
            runner.verify(ids, trees)
        _sync(device)
        seconds = time.perf_counter() - start
        for i in ids:
            runner.release(i)
    return 1e3 * seconds / (new_tokens - 1)


def verify_rows_ms(model: Transformer, context: int, repeats: int = 20) -> dict[int, float]:
    """The static step's forward (logits and argmax, one read back) over a chain of ``r``
    new rows after ``context`` committed ones, batch 1: median ms per ``r``."""
    device = model.embed_tokens.weight.device
    runner = TargetRunner(model, TargetConfig(max_running=1, max_len=context + 256))
    step = runner.static_step
    if step is None:
        raise ValueError("the verify table times the static step (a generic-forward model)")
    prompt = torch.randint(model.config.vocab_size, (context,)).tolist()
    runner.prefill(0, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    out = {}
    for rows in VERIFY_ROWS:
        tree = TokenTree.from_parents(
            list(range(rows)), list(range(-1, rows - 1)), scheme=DraftScheme.TOPK
        )
        key = step.key_for(0, rows)
        inputs = window_inputs(
            key,
            runner.cache.lengths,
            [0],
            [list(tree.token_list)],
            [list(tree.depth_list)],
            [tree.attention_mask()],
            model.config.max_position_embeddings - 1,
        )
        times = []
        for i in range(repeats + 3):
            _sync(device)
            start = time.perf_counter()
            step.run(key, inputs).best.tolist()
            if i >= 3:
                times.append(time.perf_counter() - start)
        out[rows] = 1e3 * sorted(times)[len(times) // 2]
    return out


def transformers_ms_per_step(
    hf_model, batch: int, prompt_len: int, new_tokens: int, compiled: bool, seed: int = 0
) -> float:
    """transformers ``generate`` (greedy, exactly ``new_tokens``): decode ms per step, the
    prefill (one forward over the prompts) subtracted."""
    device = next(hf_model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(hf_model.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    kwargs: dict[str, object] = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    if compiled:
        kwargs["cache_implementation"] = "static"

    def run() -> float:
        _sync(device)
        start = time.perf_counter()
        hf_model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        _sync(device)
        return time.perf_counter() - start

    with torch.no_grad():
        for _ in range(2 if compiled else 1):  # compiles and captures on the first calls
            run()
        total = run()
        _sync(device)
        start = time.perf_counter()
        hf_model(x)
        _sync(device)
        prefill = time.perf_counter() - start
    return 1e3 * (total - prefill) / (new_tokens - 1)


def build_transformers(config, state, dtype: torch.dtype, device: str, compiled: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**config.to_hf()))
    hf.load_state_dict(state, strict=False)  # lm_head is tied to the embedding
    hf = hf.to(device=device, dtype=dtype).eval()
    if compiled:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    return hf


def run(
    device: str,
    dtype: torch.dtype,
    shape: str = "default",
    batches: tuple[int, ...] = (1, 16, 64),
    prompt_len: int = 64,
    new_tokens: int = 128,
    skip: frozenset[str] = frozenset(),
    print_fn: Callable[[str], None] = print,
) -> list[list[object]]:
    config = shape_config(shape)
    state = random_hf_state(config)
    model = build_model(config, state, dtype, device, prepack=False)
    print_fn(
        f"{shape} shape, random weights, {dtype}, {device}: {prompt_len}-token prompts, "
        f"{new_tokens} new tokens, greedy"
    )
    engines: dict[str, Callable[[int], float]] = {
        "lyanna (static step)": lambda b: engine_ms_per_step(
            model, b, prompt_len, new_tokens, True
        ),
        "lyanna (eager)": lambda b: engine_ms_per_step(model, b, prompt_len, new_tokens, False),
    }
    if "transformers" not in skip:
        eager_hf = build_transformers(config, state, dtype, device, compiled=False)
        engines["transformers eager"] = lambda b: transformers_ms_per_step(
            eager_hf, b, prompt_len, new_tokens, False
        )
        if torch.device(device).type == "cuda" and "compile" not in skip:
            compiled_hf = build_transformers(config, state, dtype, device, compiled=True)
            engines["transformers static cache + compile"] = lambda b: transformers_ms_per_step(
                compiled_hf, b, prompt_len, new_tokens, True
            )
    rows = []
    for name, fn in engines.items():
        cells: list[object] = [name]
        for b in batches:
            try:
                ms = fn(b)
                cells += [ms, 1e3 * b / ms]
            except Exception as err:  # one engine's failure must not hide the others
                print_fn(f"{name} at batch {b}: {type(err).__name__}: {err}")
                cells += ["-", "-"]
        rows.append(cells)
    header = ["engine"]
    for b in batches:
        header += [f"batch {b}: ms/step", f"batch {b}: tok/s"]
    print_table(header, rows)
    costs = verify_rows_ms(model, prompt_len)
    print_fn("")
    print_fn(f"verify forward, batch 1, {prompt_len} committed rows (static step):")
    print_table(["rows", "ms", "x one row"], [[r, ms, ms / costs[1]] for r, ms in costs.items()])
    return rows
