"""Forward cost of the lean model vs the number of new tokens, and plain AR tokens/s of the lean
engine vs transformers ``generate``, measured side by side in one run on the default model.

    python -m bench.forward_latency [--per-category 1] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import load_questions, print_table, question_prompt
from lyanna.decode import generate
from lyanna.model.calibrate import forward_seconds
from lyanna.model.default import gguf_path
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.serving_model import load

CACHE_LEN = 256
NEW_TOKENS = (1, 2, 4, 8, 16, 32, 64)


def forward_table(model, new_tokens: tuple[int, ...] = NEW_TOKENS) -> dict[int, float]:
    """Median seconds of a verification forward (+ LM head on every row) over q new tokens,
    256 cached (``lyanna.model.calibrate.forward_seconds``, which the cost curve uses too)."""
    return forward_seconds(model, new_tokens, context=CACHE_LEN)


def lean_ar(model, prompts: list[list[int]], max_tokens: int, eos: frozenset[int]) -> float:
    seqs = [
        Sequence(i, p, SamplingParams(max_tokens=max_tokens), eos) for i, p in enumerate(prompts)
    ]
    stats = [generate(model, [s]) for s in seqs]
    return sum(s.num_output_tokens for s in stats) / sum(
        s.decode_seconds + s.prefill_seconds for s in stats
    )


def transformers_ar(prompts: list[list[int]], max_tokens: int) -> float:
    from transformers import LlamaForCausalLM

    gguf = gguf_path()
    ref = LlamaForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tokens, seconds = 0, 0.0
    for ids in prompts:
        x = torch.tensor([ids])
        start = time.perf_counter()
        with torch.no_grad():
            out = ref.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False
            )
        seconds += time.perf_counter() - start
        tokens += out.shape[1] - x.shape[1]
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    loaded = load(weights="fp32")
    model, tokenizer, eos = loaded.model, loaded.tokenizer, loaded.eos_token_ids
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    table = forward_table(model)
    print(f"\nForward over a {CACHE_LEN}-token cache (median, LM head on every new row):\n")
    print_table(
        ["new tokens", "ms", "x one decode step"],
        [[q, t * 1000, t / table[1]] for q, t in table.items()],
    )
    questions = load_questions(per_category=args.per_category)
    prompts = [question_prompt(tokenizer, q) for q in questions]
    lean = lean_ar(model, prompts, args.max_tokens, eos)
    ref = transformers_ar(prompts, args.max_tokens)
    print(
        f"\nGreedy AR, {len(prompts)} Spec-Bench prompts, "
        f"<= {args.max_tokens} new tokens, end-to-end:\n"
    )
    print_table(
        ["engine", "tokens/s", "vs transformers"],
        [["lean", lean, lean / ref], ["transformers", ref, 1.0]],
    )


if __name__ == "__main__":
    main()
