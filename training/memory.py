"""Training memory per token of each drafter at one fixed batch, on the CPU.

    python -m training.memory [--models eagle,lyanna] [--batch 8 --seq-len 512]
        [--unroll-steps 3] [--hot-vocab 8192] [--amp none|bf16] [--json FILE]

Two numbers per drafter, for one training step (forward + backward) at the default model's
dimensions with random weights (memory does not depend on their values):

- ``saved_bytes``: the activations autograd keeps between forward and backward (every tensor
  saved for backward, counted once per storage, parameters and frozen buffers excluded). This
  is the quantity a chunked cross-entropy removes, and it is exact and repeatable.
- ``peak_rss_delta``: the process's peak resident memory during the step minus its resident
  memory just before it, in a fresh subprocess per drafter (the allocator's own peak, transient
  buffers included; noisier).

Both are divided by the batch's non-padding tokens (``per_token``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

from lyanna.drafters.checkpoint import checkpoint_dir
from lyanna.model.config import ModelConfig
from training.config import TrainConfig
from training.losses import FrozenTarget, TrainBatch


def target_config() -> ModelConfig:
    """SmolLM2-135M's dimensions, as the committed Lyanna checkpoint records them."""
    path = checkpoint_dir("lyanna-smollm2-135m") / "config.json"
    return ModelConfig(**json.loads(path.read_text())["target"])


def build_model(kind: str, config: TrainConfig, model_config: ModelConfig, seed: int = 0):
    """A random-weight training model of ``kind`` (no warm start from the target)."""
    from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
    from training.eagle import EagleTrainModel
    from training.lyanna import LyannaTrainModel

    gen = torch.Generator().manual_seed(seed)
    embedding = torch.randn(model_config.vocab_size, model_config.hidden_size, generator=gen)
    hot = torch.randperm(model_config.vocab_size, generator=gen)[: config.hot_vocab_size]
    target = FrozenTarget.from_embedding(embedding * 0.05, hot)
    if kind == "eagle":
        return EagleTrainModel.build(target, model_config, config)
    if kind == "lyanna":
        draft_config = LyannaDraftConfig(model_config, num_hot=hot.numel(),
                                         chain_steps=config.unroll_steps)  # fmt: skip
        return LyannaTrainModel(LyannaDraftModel(draft_config, target.embedding, hot), config)
    raise KeyError(f"unknown drafter {kind!r}: eagle or lyanna")


def random_batch(model_config: ModelConfig, batch: int, seq_len: int, prompt_len: int,
                 seed: int = 1) -> TrainBatch:  # fmt: skip
    """``batch`` full sequences: ``prompt_len`` prompt tokens (weight 0.25), then answers."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model_config.vocab_size, (batch, seq_len), generator=gen)
    hidden = torch.randn(batch, seq_len, model_config.hidden_size, generator=gen)
    answer = torch.zeros(batch, seq_len, dtype=torch.bool)
    answer[:, prompt_len:] = True
    weight = torch.where(answer, 1.0, 0.25)
    return TrainBatch(tokens=tokens, hidden=hidden, weight=weight, answer=answer)


def saved_bytes(model: torch.nn.Module, batch: TrainBatch, amp: str = "none") -> int:
    """Bytes of the tensors autograd saves for backward in one ``model.loss(batch)``."""
    frozen = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    target = getattr(model, "target", None)
    if target is not None:
        frozen |= {t.untyped_storage().data_ptr() for t in (target.embedding, target.hot_head)}
    draft = getattr(model, "draft", None)
    if draft is not None:
        frozen.add(draft.embedding.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in frozen and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return t

    model.train()
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", torch.bfloat16, enabled=amp == "bf16"):
        loss, _ = model.loss(batch)
    loss.backward()
    return sum(seen.values())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(kind: str, args: argparse.Namespace) -> dict:
    """Both measures for one drafter in this process (call it in a fresh one for the RSS)."""
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model_config = target_config()
    config = TrainConfig(model=kind, unroll_steps=args.unroll_steps,
                         hot_vocab_size=args.hot_vocab, max_seq_len=args.seq_len,
                         batch_tokens=args.batch * args.seq_len)  # fmt: skip
    model = build_model(kind, config, model_config)
    batch = random_batch(model_config, args.batch, args.seq_len, args.prompt_len)
    tokens = int((batch.weight > 0).sum())
    before = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.autocast("cpu", torch.bfloat16, enabled=args.amp == "bf16"):
        loss, _ = model.loss(batch)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model.zero_grad(set_to_none=True)
    saved = saved_bytes(model, batch, args.amp)
    return {
        "model": kind,
        "tokens": tokens,
        "saved_bytes": saved,
        "saved_bytes_per_token": round(saved / tokens),
        "peak_rss_delta": max(0, peak - max(before, peak_before)),
        "peak_rss_delta_per_token": round(max(0, peak - max(before, peak_before)) / tokens),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="eagle,lyanna")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--unroll-steps", type=int, default=3)
    parser.add_argument("--hot-vocab", type=int, default=8192)
    parser.add_argument("--amp", choices=("none", "bf16"), default="none")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    kinds = args.models.split(",")
    if args.in_process:
        print(json.dumps(measure(kinds[0], args)))
        return
    results = []
    for kind in kinds:  # one fresh process each: the peak RSS is the process's own
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
        cmd = [sys.executable, "-m", "training.memory", *forwarded, "--models", kind,
               "--in-process"]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    mb = 1024 * 1024
    print(f"{'drafter':8s} {'tokens':>7s} {'saved MB':>9s} {'saved B/tok':>12s} "
          f"{'peak RSS MB':>12s} {'peak B/tok':>11s}")  # fmt: skip
    for r in results:
        print(f"{r['model']:8s} {r['tokens']:7d} {r['saved_bytes'] / mb:9.1f} "
              f"{r['saved_bytes_per_token']:12d} {r['peak_rss_delta'] / mb:12.1f} "
              f"{r['peak_rss_delta_per_token']:11d}")  # fmt: skip
    if len(results) == 2:
        a, b = results
        print(f"{b['model']} / {a['model']}: saved {b['saved_bytes'] / a['saved_bytes']:.2f}x, "
              f"peak RSS {b['peak_rss_delta'] / max(1, a['peak_rss_delta']):.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
