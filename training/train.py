"""The one training loop for every draft model (nanoGPT style): AdamW, linear warmup and
linear decay, gradient clipping, logging of loss and per-unrolled-step top-1/top-3 agreement
with the target, resumable checkpoints (safetensors only, no pickle) and a final fp16 export
with a manifest (sha256, configs, data recipe, metrics, the reproduce command).

The model is ``training.models.MODELS[config.model]``; data are the shards of
``training.prepare`` (see ``training.data``). The hot vocabulary is the ``hot_vocab_size`` most
frequent token ids of the training split.

    python -m training.train --data eagle-mix-v1 --run-name eagle-v1 --max-steps 1500
"""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lyanna.model import fetch_default_model, read_hf_dir
from lyanna.model.default import sha256_of
from training.config import TrainConfig, parse_overrides
from training.data import Sequence, iter_sequences, read_manifest
from training.losses import FrozenTarget, TrainBatch
from training.models import get_model_class

STATE = "state.safetensors"


def token_counts(sequences: list[Sequence], vocab_size: int, answers_only: bool) -> torch.Tensor:
    """How often each token id occurs (on answer tokens only: what a drafter must propose)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        tokens = seq.tokens[seq.loss_mask] if answers_only else seq.tokens
        counts += torch.bincount(tokens, minlength=vocab_size)
    return counts


def hot_vocabulary(
    sequences: list[Sequence], size: int, vocab_size: int, answers_only: bool = False
) -> torch.Tensor:
    """The ``size`` most frequent token ids (ties: lower id first)  # [size] int64"""
    return frequency_order(token_counts(sequences, vocab_size, answers_only))[:size]


def frequency_order(counts: torch.Tensor) -> torch.Tensor:  # [vocab] int64, most frequent first
    return counts.argsort(descending=True, stable=True)  # stable: ties keep the lower id first


def hot_coverage(
    train: list[Sequence], held_out: list[Sequence], vocab_size: int, sizes=(8192, 16384, 32768)
) -> dict[str, float]:
    """Share of held-out answer tokens inside the hot vocabulary counted on the training
    answers, per size: the ceiling a hot-set drafter's full-vocabulary top-1 can reach."""
    order = frequency_order(token_counts(train, vocab_size, answers_only=True))
    rank = torch.empty(vocab_size, dtype=torch.int64)
    rank[order] = torch.arange(vocab_size)
    answers = torch.cat([s.tokens[s.loss_mask] for s in held_out])
    return {str(n): round(float((rank[answers] < n).float().mean()), 4) for n in sizes}


def plan_batches(lengths: list[int], config: TrainConfig, epoch: int) -> list[list[int]]:
    """Batches of sequence indices for one epoch: shuffled, bucketed by length so padding is
    small, ``len(batch) * longest <= batch_tokens``; deterministic in (seed, epoch)."""
    rng = random.Random(config.seed * 7919 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    pool = 64 * max(1, config.batch_tokens // config.max_seq_len)
    for start in range(0, len(order), pool):
        group = sorted(order[start : start + pool], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in group:  # ascending length: the newest is the longest
            if batch and (len(batch) + 1) * lengths[i] > config.batch_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def collate(sequences: list[Sequence], config: TrainConfig) -> TrainBatch:
    T = max(min(s.tokens.shape[0], config.max_seq_len) for s in sequences)
    B, d = len(sequences), sequences[0].hidden.shape[1]
    cpu = torch.device("cpu")  # assembled on the CPU whatever the default device, then moved
    tokens = torch.zeros(B, T, dtype=torch.int64, device=cpu)
    hidden = torch.zeros(B, T, d, device=cpu)
    weight = torch.zeros(B, T, device=cpu)
    answer = torch.zeros(B, T, dtype=torch.bool, device=cpu)
    for b, s in enumerate(sequences):
        n = min(s.tokens.shape[0], T)
        tokens[b, :n] = s.tokens[:n]
        hidden[b, :n] = s.hidden[:n].float()
        answer[b, :n] = s.loss_mask[:n]
        weight[b, :n] = torch.where(s.loss_mask[:n], 1.0, config.prompt_weight)
    batch = TrainBatch(tokens=tokens, hidden=hidden, weight=weight, answer=answer)
    return batch.to(torch.device(config.device))


def save_state(path: Path, model, optimizer, step: int, config: TrainConfig) -> None:
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"opt.{names[id(p)]}.{key}"] = value.reshape(-1).cpu().contiguous()
    meta = {"step": str(step), "config": json.dumps(dataclasses.asdict(config))}
    partial = path.with_suffix(".partial")
    save_file(tensors, partial, metadata=meta)
    partial.replace(path)


def load_state(path: Path, model, optimizer, device: torch.device | str = "cpu") -> int:
    tensors = load_file(path, device=str(device))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    for name, p in model.named_parameters():
        state = {}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            value = tensors.get(f"opt.{name}.{key}")
            if value is not None:
                state[key] = value.reshape(()) if key == "step" else value.view_as(p)
        if state:
            optimizer.state[p] = state
    with safe_open(path, "pt") as f:
        return int(f.metadata()["step"])


@torch.no_grad()
def evaluate(model, batches: list[TrainBatch]) -> dict[str, float]:
    model.eval()
    totals: dict[str, float] = {}
    for batch in batches:
        _, metrics = model.loss(batch)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v / len(batches)
    model.train()
    return {k: round(v, 4) for k, v in totals.items()}


def export(model, config: TrainConfig, record: dict) -> Path:
    out = Path(config.export_dir) if config.export_dir else config.work_dir / "export"
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.cpu() for k, v in model.export().items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.config_dict(), indent=2) + "\n")
    data = {}
    for d in config.data_dirs:
        m = read_manifest(d)
        data[d.name] = {
            k: m[k] for k in ("config", "source", "model", "totals", "reproduce") if k in m
        }
    prepare_cmds = [
        m["reproduce"]
        if "reproduce" in m  # training.distill runs say how they were made
        else "python -m training.prepare "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in m["config"].items()
            if k not in ("out_dir",) and v != ""
        )
        for m in data.values()
    ]
    manifest = {
        "sha256": {"model.safetensors": sha256_of(out / "model.safetensors")},
        "config": model.config_dict(),
        "train_config": dataclasses.asdict(config),
        "data": data,
        "metrics": record,
        "reproduce": [*prepare_cmds, f"python -m {_entry_module()} " + shlex.join(sys.argv[1:])],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def _entry_module() -> str:
    """The module this process runs (``training.ablate`` calls ``train`` too): the reproduce
    command names the one whose arguments it repeats."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None and spec.name.startswith("training.") else "training.train"


def selection_score(val: dict[str, float]) -> float:
    """What ``keep_best`` maximises: held-out top-1 (hot vocabulary) averaged over the unrolled
    steps (EAGLE names them ``stepK_top1``, Lyanna ``top1_K``)."""
    scores = [v for k, v in val.items() if "top1" in k and "full" not in k]
    return sum(scores) / len(scores) if scores else 0.0


def train(config: TrainConfig) -> dict:
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    device = torch.device(config.device)
    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    target_config, state = read_hf_dir(fetch_default_model())
    sequences = list(iter_sequences(config.data_dirs))
    if config.val_dirs:
        train_seqs, val_seqs = sequences, list(iter_sequences(config.val_dirs))
    elif len(sequences) <= config.val_sequences:
        raise ValueError(f"only {len(sequences)} sequences in {config.data}")
    else:
        cut = len(sequences) - config.val_sequences
        train_seqs, val_seqs = sequences[:cut], sequences[cut:]
    answers_only = config.hot_vocab_tokens == "answers"
    init = load_file(Path(config.init_from) / "model.safetensors") if config.init_from else None
    if init is not None:  # the checkpoint's rows stay aligned with its own hot vocabulary
        hot = init["hot_vocab"] if "hot_vocab" in init else init["hot_ids"]
    else:
        hot = hot_vocabulary(train_seqs, config.hot_vocab_size, target_config.vocab_size,
                             answers_only)  # fmt: skip
    coverage = hot_coverage(train_seqs, val_seqs, target_config.vocab_size)
    print(json.dumps({"hot_coverage_of_held_out_answers": coverage}), flush=True)
    target = FrozenTarget.from_embedding(state["model.embed_tokens.weight"], hot).to(device)
    del state
    with device:  # tensors the model and its loss create (masks, positions) live there too
        record = _optimise(config, target, target_config, train_seqs, val_seqs, init, coverage)
    return record


def _optimise(config, target, target_config, train_seqs, val_seqs, init, coverage) -> dict:
    device, work = torch.device(config.device), config.work_dir
    model = get_model_class(config.model).build(target, target_config, config).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    step = load_state(work / STATE, model, optimizer, device) if (work / STATE).is_file() else 0
    if step == 0 and init is not None:
        model.load_export(init)
    lengths = [min(s.tokens.shape[0], config.max_seq_len) for s in train_seqs]
    val_lengths = [min(s.tokens.shape[0], config.max_seq_len) for s in val_seqs]
    val_batches = [
        collate([val_seqs[i] for i in b], config)
        for b in plan_batches(val_lengths, config, epoch=-1)
    ]
    epoch, plan = 0, plan_batches(lengths, config, 0)
    consumed = step
    while consumed >= len(plan):
        consumed -= len(plan)
        epoch += 1
        plan = plan_batches(lengths, config, epoch)
    log = (work / "log.jsonl").open("a")
    started = time.perf_counter()
    tokens_seen = 0
    last: dict[str, float] = {}
    best: tuple[float, int, dict[str, float], dict[str, torch.Tensor]] | None = None
    val: dict[str, float] | None = None
    model.train()
    while step < config.max_steps:
        if consumed >= len(plan):
            epoch, consumed = epoch + 1, 0
            plan = plan_batches(lengths, config, epoch)
        batch = collate([train_seqs[i] for i in plan[consumed]], config)
        consumed += 1
        elapsed = time.perf_counter() - started
        clock = elapsed / (60 * config.max_minutes) if config.max_minutes else 0.0
        lr = config.lr_at(step, clock)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, torch.bfloat16, enabled=config.amp == "bf16"):
            loss, metrics = model.loss(batch)
        last = {k: round(v, 4) for k, v in metrics.items()}
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.grad_clip))
        optimizer.step()
        step += 1
        tokens_seen += int((batch.weight > 0).sum())
        elapsed = time.perf_counter() - started
        if step % config.log_every == 0 or step == config.max_steps:
            entry = {"step": step, "epoch": epoch, "lr": lr, "grad_norm": round(grad_norm, 3)}
            entry |= {k: round(v, 4) for k, v in metrics.items()}
            entry["tok_per_s"] = round(tokens_seen / elapsed, 1)
            print(json.dumps(entry), flush=True)
            log.write(json.dumps(entry) + "\n")
        out_of_time = config.max_minutes and elapsed > 60 * config.max_minutes
        val = None  # the held-out metrics of this step's weights, once evaluated
        if step % config.eval_every == 0:
            val = evaluate(model, val_batches)
            print(json.dumps({"step": step, "val": val}), flush=True)
            log.write(json.dumps({"step": step, "val": val}) + "\n")
            if config.keep_best and (best is None or selection_score(val) > best[0]):
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                best = (selection_score(val), step, val, weights)
        if step % config.ckpt_every == 0 or step == config.max_steps or out_of_time:
            save_state(work / STATE, model, optimizer, step, config)
        if out_of_time:
            break
    if val is None:  # (the loop's last step may have been evaluated already)
        val = evaluate(model, val_batches)
    kept = {"step": step, "val": val}
    if best is not None and best[0] > selection_score(val):
        model.load_state_dict(best[3])
        kept = {"step": best[1], "val": best[2]}
    record = {
        "steps": step,
        "epochs": round(epoch + consumed / max(1, len(plan)), 2),
        "train_sequences": len(train_seqs),
        "train_tokens": sum(lengths),
        "val_sequences": len(val_seqs),
        "val_data": config.val_data or f"last {config.val_sequences} sequences",
        "hot_coverage_of_held_out_answers": coverage,
        "seconds_this_run": round(time.perf_counter() - started, 1),
        "train_last_batch": last,
        "val": kept["val"],
    }
    if config.keep_best:
        record |= {"exported_step": kept["step"], "val_last_step": val}
    log.write(json.dumps({"final": record}) + "\n")
    log.close()
    out = export(model, config, record)
    print(json.dumps({"export": str(out), **record}), flush=True)
    return record


def main(argv: list[str] | None = None) -> None:
    train(parse_overrides(argv))


if __name__ == "__main__":
    main()
