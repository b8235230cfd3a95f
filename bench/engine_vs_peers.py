"""This engine (fp32, q4 and q4a8 weights) beside what a user would pick instead: transformers
``generate`` and llama.cpp (optional extra ``peers``: ``pip install -e .[peers]``), on the same
Spec-Bench prompts, the same greedy tokens budget and the same thread count, in one run.

Prints end-to-end and decode-only tokens/s, prefill ms per prompt token, the forward cost for
q = 1, 2, 4, 8, 16 new tokens (decode steps), and the memory-bandwidth floor of one decode
step for each weight format, measured on this machine. Then the prefill of one long prompt
(``--long-prompt`` tokens of Spec-Bench text, 800 by default) in each engine.

    python -m bench.engine_vs_peers [--per-category 2] [--max-tokens 128] [--threads 2]
        [--long-prompt 800]

With ``--device`` (``cuda``, or ``cpu`` to rehearse) it compares instead this engine's decode
and verify steps with transformers' on random weights of the default model's shape, batches
1, 16 and 64 (``bench.device_peers``):

    python -m bench.engine_vs_peers --device cuda --dtype bf16 [--batches 1 16 64]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from bench import device_peers
from bench.common import load_questions, median_seconds, print_table, question_prompt
from bench.forward_latency import forward_table
from lyanna.decode import generate, prefill
from lyanna.model import fetch_default_model, load_model
from lyanna.model.default import gguf_path
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.serving_model import config_eos, eos_ids
from lyanna.tokenizer import load_tokenizer

NEW_TOKENS = (1, 2, 4, 8, 16)


@dataclass(slots=True)
class Tally:
    """Totals over prompts: output tokens, prompt tokens, seconds to first token, seconds."""

    output_tokens: int = 0
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0

    def add(self, prompt: int, output: int, prefill: float, total: float) -> None:
        self.prompt_tokens += prompt
        self.output_tokens += output
        self.prefill_seconds += prefill
        self.total_seconds += total

    def row(self, name: str) -> list[object]:
        decode = self.total_seconds - self.prefill_seconds
        # the first token comes out of the prefill; decode-only counts the rest
        n_decode = self.output_tokens - (self.output_tokens > 0)
        return [
            name,
            self.output_tokens / self.total_seconds,
            n_decode / max(decode, 1e-9),
            1e3 * self.prefill_seconds / max(self.prompt_tokens, 1),
        ]


def lean(model, prompts: list[list[int]], max_tokens: int, eos: frozenset[int]) -> Tally:
    tally = Tally()
    for i, ids in enumerate(prompts):
        seq = Sequence(i, ids, SamplingParams(max_tokens=max_tokens), eos)
        stats = generate(model, [seq])
        total = stats.prefill_seconds + stats.decode_seconds
        tally.add(len(ids), stats.num_output_tokens, stats.prefill_seconds, total)
    return tally


def transformers_tally(prompts: list[list[int]], max_tokens: int) -> Tally:
    from transformers import LlamaForCausalLM

    gguf = gguf_path()
    ref = LlamaForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tally = Tally()
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            start = time.perf_counter()
            ref(x)  # the prefill alone: what generate spends before its first token
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            out = ref.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False
            )
            total = time.perf_counter() - start
        tally.add(len(ids), out.shape[1] - x.shape[1], prefill, total)
    return tally


def llama_cpp_tally(
    prompts: list[list[int]], max_tokens: int, threads: int, eos: frozenset[int]
) -> Tally | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp: not installed (pip install -e .[peers]); skipped")
        return None
    llm = Llama(
        model_path=str(gguf_path()), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False
    )
    tally = Tally()
    for ids in prompts:
        llm.reset()
        start = time.perf_counter()
        prefill, produced = 0.0, 0
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            produced += 1
            if produced == 1:
                prefill = time.perf_counter() - start
            if token in eos or produced >= max_tokens:
                break
        tally.add(len(ids), produced, prefill, time.perf_counter() - start)
    return tally


def long_prompt_ids(tokenizer, length: int) -> list[int]:
    """``length`` tokens of Spec-Bench questions, one after another."""
    ids: list[int] = []
    for question in load_questions(per_category=8):
        ids += tokenizer.encode(question["turns"][0])
        if len(ids) >= length:
            return ids[:length]
    raise ValueError(f"Spec-Bench holds fewer than {length} tokens of questions")


def lean_prefill_seconds(model, ids: list[int]) -> float:
    """Median seconds of a fresh prompt's prefill (the KV slot released after each)."""
    cache = model.new_cache(1, len(ids) + 1)

    def run() -> None:
        slot = cache.allocate()
        prefill(model, ids, cache, slot)
        cache.release(slot)

    return median_seconds(run, repeats=3, warmup=1)


def peer_prefill_rows(ids: list[int], threads: int, skip: set[str]) -> list[list[object]]:
    rows = []
    if "transformers" not in skip:
        from transformers import LlamaForCausalLM

        gguf = gguf_path()
        ref = LlamaForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        x = torch.tensor([ids])
        with torch.no_grad():
            seconds = median_seconds(lambda: ref(x), repeats=3, warmup=1)
        rows.append(["transformers", 1e3 * seconds / len(ids)])
    if "llama.cpp" not in skip:
        try:
            from llama_cpp import Llama
        except ImportError:
            return rows
        llm = Llama(
            model_path=str(gguf_path()), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False
        )

        def run() -> None:
            llm.reset()
            llm.eval(ids)

        rows.append(["llama.cpp (Q4_1)", 1e3 * median_seconds(run, repeats=3, warmup=1) / len(ids)])
    return rows


def weight_bytes(model) -> int:
    """Bytes one decode step must read: every linear layer and the LM head (packed formats
    included), not the embedding (one row is gathered)."""
    total = 0
    for module in model.modules():
        for name in ("packed", "scales", "weight"):
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor) and module is not model.embed_tokens:
                total += t.numel() * t.element_size()
    return total


def bandwidth() -> float:
    """Streaming read rate (bytes/s) of a 1 GiB tensor with the current threads."""
    x = torch.ones(256 * 1024 * 1024)
    return x.numel() * 4 / median_seconds(x.sum, repeats=5, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma list of: transformers,llama.cpp")
    parser.add_argument("--long-prompt", type=int, default=800, help="0: no long-prompt table")
    parser.add_argument("--device", default=None, help="steps on a device, random weights")
    parser.add_argument("--dtype", default="bf16", help="with --device: bf16, fp16, float32")
    parser.add_argument("--shape", default="default", help="with --device: default or tiny")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    if args.device is not None:
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "float32": torch.float32}
        skip = frozenset(filter(None, args.skip.split(",")))
        device_peers.run(
            args.device,
            dtypes[args.dtype],
            args.shape,
            tuple(args.batches),
            64,
            args.max_tokens,
            skip,
        )
        return
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    model_dir = fetch_default_model()
    tokenizer = load_tokenizer(model_dir)
    eos = eos_ids(tokenizer, config_eos(model_dir))
    prompts = [
        question_prompt(tokenizer, q) for q in load_questions(per_category=args.per_category)
    ]
    print(
        f"{len(prompts)} Spec-Bench prompts, {args.max_tokens} new tokens, greedy, "
        f"{args.threads} threads"
    )
    rate = bandwidth()
    rows, costs, floors, long_rows = [], {}, [], []
    long_ids = long_prompt_ids(tokenizer, args.long_prompt) if args.long_prompt else []
    for weights in ("fp32", "q4", "q4a8"):
        model = load_model(model_dir, weights=weights)
        label = f"{weights}, native decoder" if model.native is not None else weights
        rows.append(lean(model, prompts, args.max_tokens, eos).row(f"lyanna AR ({label})"))
        costs[weights] = forward_table(model, NEW_TOKENS)
        nbytes = weight_bytes(model)
        floors.append([weights, nbytes / 1e6, 1e3 * nbytes / rate, 1e3 * costs[weights][1]])
        if long_ids:
            seconds = lean_prefill_seconds(model, long_ids)
            long_rows.append([f"lyanna ({label})", 1e3 * seconds / len(long_ids)])
        del model
    if "transformers" not in skip:
        rows.append(transformers_tally(prompts, args.max_tokens).row("transformers generate"))
    if "llama.cpp" not in skip:
        peer = llama_cpp_tally(prompts, args.max_tokens, args.threads, eos)
        if peer is not None:
            rows.append(peer.row("llama.cpp (Q4_1)"))
    print_table(["engine", "end-to-end tok/s", "decode-only tok/s", "prefill ms/token"], rows)
    print()
    print(f"streaming read: {rate / 1e9:.1f} GB/s")
    print_table(["weights", "MB read per step", "floor ms", "q=1 forward+head ms"], floors)
    print()
    header = ["weights", *(f"q={q} ms" for q in NEW_TOKENS)]
    header += [f"q={q} / q=1" for q in NEW_TOKENS[1:]]
    print_table(
        header,
        [
            [w, *(1e3 * c[q] for q in NEW_TOKENS), *(c[q] / c[1] for q in NEW_TOKENS[1:])]
            for w, c in costs.items()
        ],
    )
    if long_ids:
        long_rows += peer_prefill_rows(long_ids, args.threads, skip)
        print()
        print(f"prefill of one {len(long_ids)}-token prompt:")
        print_table(["engine", "prefill ms/token"], long_rows)


if __name__ == "__main__":
    main()
