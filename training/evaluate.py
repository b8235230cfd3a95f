"""Held-out top-1 over the full vocabulary, per draft step, of exported drafter checkpoints,
every drafter scored on the same rows by the same rule.

    python -m training.evaluate --drafters eagle2,lyanna --json FILE
        [--data distill-heldout-v1] [--steps 5] [--checkpoint NAME=DIR] [--max-sequences N]

``eagle2`` and ``lyanna`` name the committed checkpoints (``checkpoints/eagle2-smollm2-135m``,
``checkpoints/lyanna-smollm2-135m``); ``--checkpoint NAME=DIR`` adds or replaces one (its
``config.json`` says which kind it is). The held-out hidden states are read from
``$LYANNA_CACHE/data/<data>``; where shards are missing they are rebuilt from the committed
ids first (``training.distill materialize``). The JSON is
``{"eagle2": {"top1": [s1, ..., s5], ...}, "lyanna": {...}}``.

**The rule.** Step k at anchor j is the drafter's first choice for the token at j + k + 1,
reading the committed context up to j and the sampled tokens up to j + k teacher-forced (EAGLE:
its own features from step 2 on, the true next token's embedding; Lyanna: its own hidden-state
chain, the true parent token's info bias), i.e. the conditional accuracy of a depth-k node
whose ancestors were right. It is a hit when it equals the target's argmax over the *full*
vocabulary at the state that decides that token (a hot set that lacks it is a miss). Rows are
the answer tokens of the held-out sequences whose anchor and predicted token both exist; step k
counts the rows with j >= 0 (a deeper step counts fewer rows only where an answer starts
within k tokens of its sequence's start).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lyanna.drafters.checkpoint import checkpoint_dir, read_checkpoint
from lyanna.drafters.heads import FULL_VOCAB_CHUNK
from lyanna.model import fetch_default_model, read_hf_dir
from lyanna.model.config import ModelConfig
from lyanna.model.default import cache_root, sha256_of
from training.config import TrainConfig
from training.data import iter_sequences, shard_path
from training.losses import FrozenTarget, TrainBatch

COMMITTED = {"eagle2": "eagle2-smollm2-135m", "lyanna": "lyanna-smollm2-135m"}
HELD_OUT = "distill-heldout-v1"
ROW_CHUNK = 1024  # rows per hot-vocabulary product


# -- the one scoring rule ----------------------------------------------------------------


def step_hits(
    first: torch.Tensor,  # [B, T] int64 the drafter's first choice decided at state s (-1: none)
    target_argmax: torch.Tensor,  # [B, T] int64 target argmax (full vocab) at state s
    answer: torch.Tensor,  # [B, T] bool answer tokens
    step: int,
) -> tuple[int, int]:
    """(hits, rows) of draft step ``step``: state s = j + step decides token s + 1, scored
    where the anchor exists (s >= step), token s + 1 exists and is an answer token."""
    B, T = answer.shape
    scored = torch.zeros(B, T, dtype=torch.bool, device=answer.device)
    scored[:, : T - 1] = answer[:, 1:]
    scored[:, :step] = False
    hits = (first == target_argmax) & scored
    return int(hits.sum()), int(scored.sum())


@torch.no_grad()
def full_vocab_argmax(hidden: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """[B, T, d] target states -> [B, T] argmax over the full (tied) LM head, in chunks."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.int64, device=hidden.device)
    for start in range(0, flat.shape[0], FULL_VOCAB_CHUNK):
        out[start : start + FULL_VOCAB_CHUNK] = (
            flat[start : start + FULL_VOCAB_CHUNK] @ embedding.T
        ).argmax(-1)
    return out.view(hidden.shape[:-1])


def _hot_argmax(rows: torch.Tensor, head: torch.Tensor, bias=None) -> torch.Tensor:
    """[R, d] -> [R] hot index of the largest logit, ``bias(slice)`` [r, num_hot] added."""
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
    for start in range(0, rows.shape[0], ROW_CHUNK):
        s = slice(start, start + ROW_CHUNK)
        logits = rows[s] @ head.T
        if bias is not None:
            logits = logits + bias(s)
        out[s] = logits.argmax(-1)
    return out


# -- each drafter's first choices --------------------------------------------------------


@torch.no_grad()
def eagle_first_choices(model, batch: TrainBatch, steps: int) -> list[torch.Tensor]:
    """``steps`` x [B, T]: EAGLE's first choice decided at state s (``training.eagle``: step k
    at position i = s - 1 predicts h_{i+1} from its own step-(k-1) features)."""
    B, T = batch.tokens.shape
    out = []
    for pred in model.unroll(batch.tokens, batch.hidden, steps):  # [B, T-1, d]
        first = torch.full((B, T), -1, dtype=torch.int64, device=pred.device)
        hot = _hot_argmax(pred.reshape(-1, pred.shape[-1]), model.target.hot_head)
        first[:, 1:] = model.target.hot_vocab[hot].view(B, T - 1)
        out.append(first)
    return out


@torch.no_grad()
def lyanna_first_choices(model, batch: TrainBatch, steps: int) -> list[torch.Tensor]:
    """``steps`` x [B, T]: Lyanna's first choice decided at state s (``LyannaDraftModel.
    unrolled``: step k at anchor j = s - k predicts hidden[s]; the bias is the token info of
    the parent token t_s)."""
    draft = model.draft
    B, T = batch.tokens.shape
    head = draft.hot_head
    out = []
    for k, y in enumerate(draft.unrolled(batch.hidden, batch.tokens, steps), start=1):
        first = torch.full((B, T), -1, dtype=torch.int64, device=y.device)
        states = y[:, : T - k]  # anchors 0 .. T-k-1 -> s = k .. T-1
        parents = batch.tokens[:, k:].reshape(-1)
        read = states
        if draft.copy is not None:  # the LM head reads the state and the parent's copy read
            read = states + draft.copy_read(batch.tokens[:, k:], states, batch.tokens, batch.hidden)
        rows = read.reshape(-1, y.shape[-1])
        states = states.reshape(-1, y.shape[-1])
        hot = _hot_argmax(rows, head, lambda s, p=parents, r=states: draft.token_info(p[s], r[s]))
        first[:, k:] = draft.hot_ids[hot].view(B, T - k)
        out.append(first)
    return out


# -- checkpoints ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Drafter:
    name: str
    kind: str  # eagle | lyanna
    path: Path


def resolve(names: list[str], overrides: dict[str, str]) -> list[Drafter]:
    out = []
    for name in names:
        path = Path(overrides[name]) if name in overrides else checkpoint_dir(COMMITTED[name])
        config = json.loads((path / "config.json").read_text())
        out.append(Drafter(name, "eagle" if config.get("kind") == "eagle" else "lyanna", path))
    return out


def load_drafter(drafter: Drafter, embedding: torch.Tensor, target_config: ModelConfig):
    """The training model of a checkpoint (its own hot vocabulary), in eval mode."""
    from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
    from training.eagle import EagleTrainModel
    from training.lyanna import LyannaTrainModel

    values, state = read_checkpoint(drafter.path, drafter.kind)
    hot = state["hot_vocab"] if "hot_vocab" in state else state["hot_ids"]
    target = FrozenTarget.from_embedding(embedding, hot)
    config = TrainConfig(model=drafter.kind, hot_vocab_size=hot.numel())
    if drafter.kind == "eagle":
        model = EagleTrainModel.build(target, target_config, config)
    else:
        draft_config = LyannaDraftConfig.from_dict(values)
        model = LyannaTrainModel(LyannaDraftModel(draft_config, target.embedding, hot), config)
    model.load_export(state)
    return model.eval()


FIRST_CHOICES = {"eagle": eagle_first_choices, "lyanna": lyanna_first_choices}


# -- data --------------------------------------------------------------------------------


def ensure_hidden_states(run: str, threads: int = 2, max_shards: int = 0) -> Path:
    """``$LYANNA_CACHE/data/<run>``, rebuilt from the committed ids where shards are missing
    (only the first ``max_shards`` of the run when it is not 0: a small budget's data)."""
    import shutil
    import tempfile

    from training.distill import DistillConfig, materialize
    from training.id_shards import shard_index

    config = DistillConfig(run_name=run, threads=threads)
    manifest = json.loads((config.id_dir / "manifest.json").read_text())
    names = sorted(manifest["shards"])[: max_shards or None]
    if all(shard_path(config.hidden_dir, shard_index(n)).is_file() for n in names):
        return config.hidden_dir
    print(f"rebuilding the hidden states of {run} ({len(names)} shards) from its committed ids",
          flush=True)  # fmt: skip
    if len(names) == len(manifest["shards"]):
        materialize(config)
        return config.hidden_dir
    subset = Path(tempfile.mkdtemp(prefix=f"ids-{run}-"))
    try:  # the first shards' ids under a manifest that lists only them
        for name in names:
            (subset / name).symlink_to((config.id_dir / name).resolve())
        part = dict(manifest, shards={n: manifest["shards"][n] for n in names})
        (subset / "manifest.json").write_text(json.dumps(part))
        materialize(dataclasses.replace(config, ids_dir=str(subset)))
    finally:
        shutil.rmtree(subset)
    return config.hidden_dir


def evaluation_batches(run_dirs: list[Path], max_sequences: int = 0,
                       batch_tokens: int = 4096) -> list[TrainBatch]:  # fmt: skip
    """Every held-out sequence, whole (nothing cut), in padded batches."""
    from training.train import collate, plan_batches

    sequences = list(iter_sequences(run_dirs))
    if max_sequences:
        sequences = sequences[:max_sequences]
    longest = max(s.tokens.shape[0] for s in sequences)
    config = TrainConfig(max_seq_len=longest, batch_tokens=max(batch_tokens, longest))
    lengths = [s.tokens.shape[0] for s in sequences]
    return [collate([sequences[i] for i in b], config)
            for b in plan_batches(lengths, config, epoch=-1)]  # fmt: skip


def probe_parser(description: str, checkpoints: str) -> argparse.ArgumentParser:
    """The command line the analysis probes share (``training.step1_probe``,
    ``training.chain_probe``): checkpoints, held-out run, how many sequences, threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("checkpoints", nargs="+", help=checkpoints)
    parser.add_argument("--data", default=HELD_OUT)
    parser.add_argument("--max-sequences", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    return parser


def probe_inputs(args: argparse.Namespace) -> tuple[ModelConfig, torch.Tensor, list[TrainBatch]]:
    """The default target's config and fp32 embedding (the tied LM head) and the first
    ``args.max_sequences`` sequences of ``args.data`` in batches, on ``args.threads``."""
    torch.set_num_threads(args.threads)
    target_config, state = read_hf_dir(fetch_default_model())
    embedding = state["model.embed_tokens.weight"].float()
    batches = evaluation_batches([cache_root() / "data" / args.data], args.max_sequences)
    return target_config, embedding, batches


def evaluate(drafters: list[Drafter], batches: list[TrainBatch], embedding: torch.Tensor,
             target_config: ModelConfig, steps: int = 5) -> dict[str, dict]:  # fmt: skip
    """Top-1 per step of each drafter over the same rows (see the module docstring)."""
    argmaxes = [full_vocab_argmax(b.hidden, embedding) for b in batches]
    results: dict[str, dict] = {}
    for drafter in drafters:
        started = time.perf_counter()
        model = load_drafter(drafter, embedding, target_config)
        hits, rows = [0] * steps, [0] * steps
        for batch, target_argmax in zip(batches, argmaxes, strict=True):
            for k, first in enumerate(FIRST_CHOICES[drafter.kind](model, batch, steps)):
                h, n = step_hits(first, target_argmax, batch.answer, k + 1)
                hits[k] += h
                rows[k] += n
        results[drafter.name] = {
            "top1": [round(h / n, 4) if n else 0.0 for h, n in zip(hits, rows, strict=True)],
            "rows": rows,
            "kind": drafter.kind,
            "checkpoint": str(drafter.path),
            "sha256": sha256_of(drafter.path / "model.safetensors"),
            "seconds": round(time.perf_counter() - started, 1),
        }
    return results


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", default="eagle2,lyanna")
    parser.add_argument("--checkpoint", action="append", default=[], help="NAME=DIR")
    parser.add_argument("--data", default=HELD_OUT, help="comma-separated held-out runs")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-sequences", type=int, default=0, help="0 = all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = dict(item.split("=", 1) for item in args.checkpoint)
    drafters = resolve(args.drafters.split(","), overrides)
    runs = [r for r in args.data.split(",") if r]
    run_dirs = [ensure_hidden_states(r, args.threads) for r in runs]
    target_config, state = read_hf_dir(fetch_default_model())
    embedding = state["model.embed_tokens.weight"].float()
    del state
    batches = evaluation_batches(run_dirs, args.max_sequences)
    results = evaluate(drafters, batches, embedding, target_config, args.steps)
    for name, r in results.items():
        r["data"] = args.data
        print(f"{name:10s} top-1 (full vocabulary) steps 1-{args.steps}: "
              + " / ".join(f"{t:.3f}" for t in r["top1"]) + f"  ({r['rows'][0]} rows)",
              flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
