"""What the engine's loop costs plain decoding: the engine with method ``ar`` (what
``lyanna.decode.generate`` runs) against a minimal greedy loop, one model, one process.

The minimal loop is the pre-engine ``generate`` (7bc2fe8): one batched forward per step over
the last token of each sequence, the LM head, an argmax, a KV commit; nothing else. Both
decode the same Spec-Bench prompts greedily, taking turns prompt by prompt for ``--rounds``
rounds so a host whose speed drifts slows both alike; the outputs must be equal token for
token. ``--clock cpu`` times with the process's CPU time instead of the wall clock: on a host
shared with other jobs (use ``--threads 1`` then) it still shows the host work each loop
adds, where wall times swing by 2x. Prints decode-only tokens/s of each, the per-round ratio
and its median: the engine's host work per step is what separates them (the forward is the
same call).

    python -m bench.decode_overhead --rounds 6 --max-tokens 128 --threads 2
    python -m bench.decode_overhead --clock cpu --threads 1     # while other jobs run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import load_questions, print_table, question_prompt, set_threads
from lyanna.drafters import TARGET_ONLY
from lyanna.drafters.base import NoDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.scheduler import TREE_MARGIN
from lyanna.sequence import Sequence
from lyanna.serving_model import load
from lyanna.target import prefill_prompt

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


@torch.inference_mode()
def minimal_greedy(model: Transformer, prompt: list[int], max_tokens: int, eos: frozenset[int]):
    """The reference loop: (output ids, decode seconds)."""
    cache = model.new_cache(1, len(prompt) + max_tokens + 1)
    slot = cache.allocate()
    slots = torch.tensor([slot])
    hidden = prefill_prompt(model, prompt, cache, slot)
    out = [int(model.logits(hidden[-1:]).argmax(-1))]
    start = clock()
    while len(out) < max_tokens and out[-1] not in eos:
        tokens = torch.tensor([[out[-1]]])
        positions = cache.lengths[slots][:, None].clone()
        logits = model.logits(model(tokens, positions, cache, slots)[:, -1])
        cache.commit(slot, [0])
        out.append(int(logits[0].argmax()))
    return out, clock() - start


def engine_greedy(model: Transformer, prompt: list[int], max_tokens: int, eos: frozenset[int]):
    """``lyanna.decode.generate``'s engine, timed by ``clock`` around its decode steps."""
    sequence = Sequence(0, prompt, SamplingParams(max_tokens=max_tokens), eos)
    config = EngineConfig(max_running=1, max_len=len(prompt) + max_tokens + TREE_MARGIN)
    engine = SpecEngine(model, NoDrafter(), config, method=TARGET_ONLY)
    engine.submit(sequence)
    engine.admit()
    start = clock()
    engine.run()
    return sequence.output_ids, clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=6, help="the first N of those")
    parser.add_argument("--weights", default="q4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=CLOCKS, default="wall")
    args = parser.parse_args()
    set_threads(args.threads)
    global clock
    clock = CLOCKS[args.clock]

    loaded = load(weights=args.weights)
    model, tokenizer, eos = loaded.model, loaded.tokenizer, loaded.eos_token_ids
    questions = load_questions(per_category=args.per_category)[: args.prompts]
    prompts = [question_prompt(tokenizer, q) for q in questions]
    loops = {"minimal loop": minimal_greedy, "engine (ar)": engine_greedy}
    engine_greedy(model, prompts[0], 8, eos)  # warm both
    minimal_greedy(model, prompts[0], 8, eos)

    totals = {name: [0, 0.0] for name in loops}
    ratios, mismatches = [], 0
    for round_index in range(args.rounds):
        per_round = {name: [0, 0.0] for name in loops}
        for prompt in prompts:
            outputs = []
            names = list(loops) if round_index % 2 == 0 else list(reversed(loops))
            for name in names:
                ids, seconds = loops[name](model, prompt, args.max_tokens, eos)
                per_round[name][0] += len(ids) - 1  # the first token comes from the prefill
                per_round[name][1] += seconds
                outputs.append(ids)
            mismatches += outputs[0] != outputs[1]
        speeds = {name: n / s for name, (n, s) in per_round.items()}
        ratios.append(speeds["engine (ar)"] / speeds["minimal loop"])
        for name, (n, s) in per_round.items():
            totals[name][0] += n
            totals[name][1] += s
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{name} {speed:.1f} tok/s" for name, speed in speeds.items())
            + f", ratio {ratios[-1]:.3f}",
            flush=True,
        )
    rows = []
    for name, (n, s) in totals.items():
        rows.append([name, n, f"{n / s:.1f}", f"{1000 * s / n:.3f}"])
    print_table(["loop", "tokens", "decode tok/s", "ms/token"], rows)
    print(
        f"engine / minimal: median of rounds {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}); outputs differing: {mismatches}"
    )


if __name__ == "__main__":
    main()
