"""Build the n-gram drafter's corpus store (``lyanna.drafters.ngram_store``) from self-distilled
token-id runs, evaluate it on a held-out run, and write the committed artefact.

    python -m training.ngram_store --data distill-v1 --val-data distill-heldout-v1 \\
        --out checkpoints/ngram-smollm2-135m

Only training-split runs feed the store (their prompts never include a held-out or an
evaluation prompt: ``training.distill``); the held-out run measures how often the store's
first continuation is the target's next answer token.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

from lyanna.drafters.checkpoint import checkpoint_dir
from lyanna.drafters.ngram_store import DEFAULT_STORE, NgramStore, StoreConfig
from training.distill_jobs import REPO
from training.id_shards import read_ids_shard

DATA_ROOT = REPO / "data" / "distill"
DEFAULTS = StoreConfig(min_count=3)  # 3: 42 % fewer contexts than 2 for 0.002 less top-1


def run_sequences(run: str) -> tuple[list[tuple[list[int], int]], dict]:
    """Every (tokens, prompt length) of a distill run, and its manifest."""
    directory = DATA_ROOT / run
    manifest = json.loads((directory / "manifest.json").read_text())
    sequences = []
    for shard in sorted(manifest["shards"]):
        sequences += read_ids_shard(directory / shard).sequences()
    return sequences, manifest


def top1_agreement(store: NgramStore, sequences: list[tuple[list[int], int]]) -> dict:
    """Over every answer token: how often the store knows a context (coverage) and how often
    its first continuation is the token (top-1, misses counted when it knows none)."""
    known = hits = total = 0
    for ids, answer_start in sequences:
        for i in range(max(answer_start, 1), len(ids)):
            total += 1
            found = store.continuations(ids[max(0, i - store.config.max_n) : i])
            if found is not None:
                known += 1
                hits += found[1][0] == ids[i]
    return {"answer_tokens": total, "coverage": known / total, "top1": hits / total}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", default=["distill-v1"], help="training runs")
    parser.add_argument("--val-data", default="distill-heldout-v1", help="held-out run")
    parser.add_argument("--out", default=str(checkpoint_dir(DEFAULT_STORE)))
    parser.add_argument("--max-n", type=int, default=DEFAULTS.max_n)
    parser.add_argument("--min-count", type=int, default=DEFAULTS.min_count)
    parser.add_argument("--top-k", type=int, default=DEFAULTS.top_k)
    parser.add_argument("--vocab-size", type=int, default=DEFAULTS.vocab_size)
    args = parser.parse_args(argv)
    config = StoreConfig(args.max_n, args.min_count, args.top_k, args.vocab_size)

    sequences, sources = [], {}
    for run in args.data:
        found, manifest = run_sequences(run)
        if manifest["config"].get("split") != "train":
            raise SystemExit(f"{run} is not a training-split run")
        sequences += found
        sources[run] = {
            "model": manifest["model"],
            "shards": {name: s["sha256"] for name, s in sorted(manifest["shards"].items())},
        }
    start = time.perf_counter()
    store = NgramStore.build(sequences, config)
    seconds = time.perf_counter() - start
    held_out, _ = run_sequences(args.val_data)
    metrics = {args.val_data: top1_agreement(store, held_out)}
    store.save(
        args.out,
        {
            "kind": "ngram-store",
            "data": sources,
            "num_sequences": len(sequences),
            "build_seconds": round(seconds, 1),
            "metrics": metrics,
            "reproduce": "python -m training.ngram_store "
            + shlex.join(sys.argv[1:] if argv is None else argv),
        },
    )
    print(f"{len(store)} contexts from {len(sequences)} sequences in {seconds:.1f} s -> {args.out}")
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
