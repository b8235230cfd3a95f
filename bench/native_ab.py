"""A/B of the native decoder in one process: the default build against builds with a define
(``LYANNA_NO_PREFETCH``: the block products without their software prefetch) or against the
sources of an earlier git revision (``rev:<commit>``), and the
target's KV cache in float16 (the default) against float32. Every variant times the same
model's forward + LM head over q new rows behind ``--context`` cached ones
(``lyanna.model.calibrate.forward_seconds``), the variants taking turns for ``--rounds``
rounds, so a machine whose speed drifts slows them alike.

    python -m bench.native_ab --context 300 1000 --threads 2 \\
        --builds default LYANNA_NO_PREFETCH rev:003e699 --kv float16 float32
    python -m bench.native_ab --batch 16 --builds default rev:003e699 --rounds 3

``--batch B``: a decode step of B sequences instead (one new row each behind ``--context``
cached rows, forward + LM head), ms per step and tokens/s.

``--engine ar,ngram``: whole engine decoding instead (batch 1, one Spec-Bench prompt per
category, ``--max-tokens``), decode-only tokens/s and ms per step per build and method: what
a build does to the Python and torch work between forwards shows only here (the weights a
forward streams likely evict it from the caches, see ``block_matmul.h``). The LM head follows
the build too.

    python -m bench.native_ab --engine ar,ngram --builds default LYANNA_PREFETCH_T0 --rounds 3
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path
from types import ModuleType
from unittest import mock

import torch

from bench.common import load_questions, print_table, question_prompt
from lyanna.model import fetch_default_model, load_model
from lyanna.model.calibrate import forward_seconds
from lyanna.model.default import cache_root
from lyanna.model.native import FLAGS, SOURCES, load_decoder, load_decoder_variant

ROWS = (1, 2, 4, 8, 16)
KV_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def load_revision(rev: str) -> ModuleType:
    """The native decoder as it was at git revision ``rev`` (its sources, today's flags)."""
    from torch.utils.cpp_extension import load

    commit = subprocess.run(
        ["git", "rev-parse", "--short", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    root = Path(__file__).resolve().parents[1]
    build_dir = cache_root() / "native" / f"rev-{commit}"
    build_dir.mkdir(parents=True, exist_ok=True)
    for source in SOURCES:
        path = source.relative_to(root).as_posix()
        text = subprocess.run(
            ["git", "show", f"{commit}:{path}"], capture_output=True, check=True, cwd=root
        ).stdout
        (build_dir / source.name).write_bytes(text)
    return load(
        name=f"lyanna_decoder_rev_{commit}",
        sources=[str(build_dir / SOURCES[0].name)],
        extra_cflags=list(FLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def load_build(build: str) -> ModuleType | None:
    if build == "default":
        return load_decoder()
    if build.startswith("rev:"):
        return load_revision(build.removeprefix("rev:"))
    return load_decoder_variant(build)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, nargs="+", default=[300])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--builds", nargs="+", default=["default", "LYANNA_NO_PREFETCH"])
    parser.add_argument("--kv", nargs="+", choices=sorted(KV_DTYPES), default=["float16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="time a B-sequence decode step")
    parser.add_argument("--engine", default="", help="methods: time whole engine decoding")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = load_model(fetch_default_model(), weights="q4")
    if model.native is None:
        raise SystemExit("the native decoder is unavailable (a C++ compiler is needed)")
    builds = {b: load_build(b) for b in args.builds}
    if args.batch:
        return batch_steps(model, builds, args)
    if args.engine:
        return engine_decode(model, builds, args)
    rows = []
    for context in args.context:
        for round_ in range(args.rounds):
            for build, extension in builds.items():
                for kv in args.kv:
                    model.native, model.kv_dtype = extension, KV_DTYPES[kv]
                    ms = forward_seconds(model, ROWS, context=context)
                    rows.append([context, round_, build, kv, *(f"{ms[q] * 1e3:.2f}" for q in ROWS)])
    model.native, model.kv_dtype = load_decoder(), torch.float16
    print(f"\nforward + LM head, ms (threads {args.threads}):\n")
    print_table(["context", "round", "build", "kv", *(f"q={q}" for q in ROWS)], rows)


def batch_steps(model, builds: dict, args: argparse.Namespace) -> None:
    """A decode step of ``args.batch`` sequences, each one new row behind ``context`` cached
    rows (nothing committed), per build, the builds taking turns."""
    batch, rows = args.batch, []
    for context in args.context:
        cache = model.new_cache(batch, context + 2)
        slots = torch.tensor([cache.allocate() for _ in range(batch)])
        gen = torch.Generator().manual_seed(0)
        for b in range(batch):
            prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen)
            model(prompt, torch.arange(context)[None], cache, slots[b : b + 1])
            cache.commit(int(slots[b]), torch.arange(context))
        tokens = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen)
        positions = torch.full((batch, 1), context)
        for round_ in range(args.rounds):
            for build, extension in builds.items():
                model.native = extension
                for _ in range(3):  # warm-up
                    model.logits(model(tokens, positions, cache, slots))
                start, steps = time.perf_counter(), 20
                for _ in range(steps):
                    model.logits(model(tokens, positions, cache, slots))
                ms = (time.perf_counter() - start) / steps * 1e3
                rows.append([context, round_, build, f"{ms:.2f}", f"{batch / ms * 1e3:.0f}"])
    print(f"\ndecode step of {batch} sequences, forward + LM head (threads {args.threads}):\n")
    print_table(["context", "round", "build", "ms / step", "tok/s"], rows)


def engine_decode(model, builds: dict, args: argparse.Namespace) -> None:
    """Decode-only tokens/s of whole engine runs per build and method, the builds taking
    turns (every native call, LM head and drafter layers included, on the build)."""
    from lyanna.drafters import make_drafter, tree_budget
    from lyanna.drafters.base import NoDrafter
    from lyanna.engine import EngineConfig, SpecEngine
    from lyanna.sampling import SamplingParams
    from lyanna.sequence import Sequence
    from lyanna.serving_model import eos_ids
    from lyanna.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(fetch_default_model())
    prompts = [question_prompt(tokenizer, q) for q in load_questions(per_category=1)]
    eos = eos_ids(tokenizer, model.config.eos_token_id)
    methods = args.engine.split(",")
    drafters = {
        m: NoDrafter() if m == "ar" else make_drafter(m, model, tree_budget(m, model))
        for m in methods
    }
    rows = []
    for round_ in range(args.rounds):
        for build, extension in builds.items():
            model.native = extension
            with mock.patch("lyanna.model.native.load_decoder", lambda ext=extension: ext):
                for method, drafter in drafters.items():
                    tokens = steps = 0
                    seconds = 0.0
                    for i, prompt in enumerate(prompts):
                        engine = SpecEngine(model, drafter, EngineConfig(1, 2048))
                        sequence = Sequence(
                            i, prompt, SamplingParams(max_tokens=args.max_tokens), eos
                        )
                        engine.submit(sequence)
                        engine.admit()
                        start = time.perf_counter()
                        steps += engine.run().num_steps
                        seconds += time.perf_counter() - start
                        tokens += len(sequence.output_ids) - 1  # the first came from prefill
                    rows.append([round_, build, method, f"{tokens / seconds:.1f}",
                                 f"{seconds / steps * 1e3:.3f}"])  # fmt: skip
    model.native = load_decoder()
    print(f"\nengine decoding, batch 1, {len(prompts)} prompts (threads {args.threads}):\n")
    print_table(["round", "build", "method", "decode tok/s", "ms / step"], rows)


if __name__ == "__main__":
    main()
