"""``TrainConfig``: every knob of ``training.train`` in one frozen dataclass, with argparse
overrides (``--lr 3e-4``, ``--data mix-v1,self-v2``) generated from its fields."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from lyanna.model.default import cache_root


@dataclass(frozen=True, slots=True)
class TrainConfig:
    model: str = "eagle"  # key of training.models.MODELS
    data: str = "eagle-mix-v1"  # comma-separated run names under $LYANNA_CACHE/data
    run_name: str = "eagle-v1"  # work dir $LYANNA_CACHE/train/<run_name> (resume state)
    export_dir: str = ""  # where the final inference checkpoint goes ("" = work dir/export)
    # optimisation
    max_steps: int = 1000
    batch_tokens: int = 4096  # padded tokens per batch (sequences bucketed by length)
    max_seq_len: int = 512  # longer sequences are cut
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # linear decay from lr to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    # loss
    unroll_steps: int = 3  # training-time test: steps fed the drafter's own predictions
    # issue 41: per-step loss multipliers of the unrolled steps, comma-separated (e.g.
    # "0.5,1,1.5"), scaled to mean 1; "" weighs every step alike (both drafters follow it)
    step_weights: str = ""
    regression_weight: float = 1.0  # smooth-L1 on the next hidden state
    ce_weight: float = 0.2  # cross-entropy against the target's (hot-vocab) distribution
    prompt_weight: float = 0.25  # loss weight of prompt positions (answer positions: 1)
    hot_vocab_size: int = 8192
    student_layers: int = 3  # SPS: decoder layers of the distilled student
    token_info: bool = True  # Lyanna ablation "w/o token info" when False
    fuse_first_token: bool = True  # Lyanna ablation "w/o first token" when False
    # Lyanna: the parent token whose info biases step k >= 2: "teacher" (the true token) or
    # "drafted" (the drafter's own first choice at step k - 1, what a chain drafts from)
    info_parents: str = "teacher"
    # Lyanna's starts (issue 41): the draft layer from a random init (the default) or from the
    # target's last decoder layer; fc from nn.Linear's random init ("random", EAGLE's, the
    # default), "identity" (h0 + E(t1)) or "balanced" (h0 + c E(t1), c = rms(final norm
    # weight) / rms(embedding)). Both warm starts together (the recipe before the 25th
    # session) leave the predicted state with half the next-token knowledge of random starts
    # at equal budget (training/README.md, "Why Lyanna's state knew less"). Also: the
    # regression loss ("" = the drafter's own: MSE for Lyanna, smooth-L1 for EAGLE) and
    # Gaussian noise of this std on the target states the drafter reads (0 = none)
    init_from_target: bool = False
    fc_init: str = "random"
    out_norm: bool = True  # Lyanna ablation: False = no RMSNorm on the layer's output
    feed_residual: bool = False  # Lyanna ablation: chain steps read the raw layer output
    # Lyanna: weight of a second cross-entropy on the hidden state alone (logits without the
    # token-info bias), so the state itself must carry the next token (0 = off)
    state_ce_weight: float = 0.0
    # Lyanna's token-info embedding: the rank d of W1 W2 (free at serving time: the product
    # is collapsed to a [num_hot, num_hot] table) and the start of RMSNorm's weight (the
    # bias's scale; torch's default is 1.0)
    info_rank: int = 256
    info_scale_init: float = 0.1
    info_gate: bool = False  # the bias gated by the chain state (LyannaDraftConfig.info_gate)
    info_space: str = "logits"  # logits | state: where the token info joins (LyannaDraftConfig)
    info_copy: bool = False  # the parent's copy read of the context (LyannaDraftConfig.info_copy)
    regression_loss: str = ""
    feature_noise: float = 0.0
    # bookkeeping
    val_sequences: int = 64  # held-out sequences (the last ones of the data) without val_data
    val_data: str = ""  # comma-separated held-out runs (e.g. training.distill --split heldout)
    hot_vocab_tokens: str = "answers"  # count the hot vocabulary over: answers | all
    init_from: str = ""  # an exported checkpoint directory to start from (its hot vocabulary)
    amp: str = "none"  # none | bf16: autocast of the training forward (evaluation stays fp32)
    device: str = "cpu"  # cpu | cuda[:N]: where the draft model, batches and frozen target live
    keep_best: bool = False  # export the best evaluation's weights (train.selection_score)
    log_every: int = 10
    eval_every: int = 200
    ckpt_every: int = 100
    max_minutes: float = 0.0  # stop early (checkpointed) after this long; 0 = no limit
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        if self.unroll_steps < 1:
            raise ValueError("unroll_steps must be >= 1")
        self.step_weight_list()  # validates
        if self.max_steps < 1 or self.batch_tokens < self.max_seq_len:
            raise ValueError("need max_steps >= 1 and batch_tokens >= max_seq_len")
        if not 0.0 <= self.min_lr_ratio <= 1.0 or self.lr <= 0.0:
            raise ValueError("need lr > 0 and min_lr_ratio in [0, 1]")
        if self.regression_weight < 0 or self.ce_weight < 0 or self.prompt_weight < 0:
            raise ValueError("loss weights must be >= 0")
        if self.amp not in ("none", "bf16"):
            raise ValueError("amp must be none or bf16")
        if self.info_parents not in ("teacher", "drafted"):
            raise ValueError("info_parents must be teacher or drafted")
        if self.regression_loss not in ("", "mse", "smooth_l1"):
            raise ValueError("regression_loss must be '', mse or smooth_l1")
        if self.fc_init not in ("identity", "balanced", "random"):
            raise ValueError("fc_init must be identity, balanced or random")
        if self.info_rank < 1 or self.info_scale_init <= 0:
            raise ValueError("need info_rank >= 1 and info_scale_init > 0")
        if self.info_space not in ("logits", "state"):
            raise ValueError("info_space must be logits or state")
        if self.state_ce_weight < 0:
            raise ValueError("state_ce_weight must be >= 0")
        if self.feature_noise < 0:
            raise ValueError("feature_noise must be >= 0")
        if self.hot_vocab_tokens not in ("answers", "all"):
            raise ValueError("hot_vocab_tokens must be answers or all")

    @property
    def data_dirs(self) -> list[Path]:
        return [cache_root() / "data" / name for name in self.data.split(",") if name]

    @property
    def val_dirs(self) -> list[Path]:
        return [cache_root() / "data" / name for name in self.val_data.split(",") if name]

    @property
    def work_dir(self) -> Path:
        return cache_root() / "train" / self.run_name

    def step_weight_list(self) -> list[float]:
        """The loss multiplier of each unrolled step (mean 1; all 1.0 by default)."""
        if not self.step_weights:
            return [1.0] * self.unroll_steps
        weights = [float(w) for w in self.step_weights.split(",")]
        if len(weights) != self.unroll_steps or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError("step_weights needs unroll_steps non-negative numbers, not all 0")
        return [w * len(weights) / sum(weights) for w in weights]

    def lr_at(self, step: int, clock: float = 0.0) -> float:
        """Linear warmup, then linear decay to ``lr * min_lr_ratio`` at ``max_steps``, or
        earlier when ``clock`` (the share of ``max_minutes`` spent) runs ahead of the steps: a
        run stopped by the clock still ends its decay."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
        return self.lr * (1.0 - (1.0 - self.min_lr_ratio) * min(1.0, max(progress, clock)))


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


def parse_overrides(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(description="Train a draft model (see training/README.md)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, tuple):
            parser.add_argument(flag, type=float, nargs=len(f.default), default=f.default)
        elif isinstance(f.default, bool):
            parser.add_argument(flag, type=_boolean, default=f.default, metavar="{true,false}")
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    values = vars(parser.parse_args(argv))
    values["betas"] = tuple(values["betas"])
    return TrainConfig(**values)
