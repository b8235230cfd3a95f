"""Training the Lyanna draft model (``lyanna.drafters.lyanna_model``) with the shared loop:
every anchor of a sequence at once, the chain unrolled ``unroll_steps`` times on its own
outputs (no token enters the chain), loss ``alpha * MSE(h, H) + beta * CE(softmax(l'),
softmax(L))`` per step with teacher-forced parent tokens for the token-info bias.
The draft layer and ``fc`` start random (``TrainConfig.init_from_target`` / ``fc_init``).

The cross-entropy is ``training.hot_ce.fused_hot_ce``: chunked over rows, the token-info
bias fused in, so no ``[rows, num_hot]`` logits (draft, target or bias) are kept for backward
at any unrolled step (``python -m training.memory`` measures it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lyanna.drafters.heads import full_vocab_hits
from lyanna.drafters.lyanna_model import LyannaDraftConfig, LyannaDraftModel
from lyanna.model.config import ModelConfig
from training.config import TrainConfig
from training.hot_ce import TokenInfo, fused_hot_ce
from training.losses import FrozenTarget, TrainBatch, default_target_state


class LyannaTrainModel(nn.Module):
    def __init__(self, draft: LyannaDraftModel, config: TrainConfig) -> None:
        super().__init__()
        self.draft = draft
        self.train_config = config

    @classmethod
    def build(
        cls, target: FrozenTarget, target_config: ModelConfig, config: TrainConfig
    ) -> LyannaTrainModel:
        draft_config = LyannaDraftConfig(
            target_config,
            num_hot=target.hot_vocab.numel(),
            chain_steps=config.unroll_steps,
            use_token_info=config.token_info,
            fuse_first_token=config.fuse_first_token,
            out_norm=config.out_norm,
            info_rank=config.info_rank,
            feed_residual=config.feed_residual,
            info_gate=config.info_gate,
            info_space=config.info_space,
            info_copy=config.info_copy,
        )
        model = cls(LyannaDraftModel(draft_config, target.embedding, target.hot_vocab), config)
        state = default_target_state(target_config) if config.init_from_target else None
        if state is not None:
            model.init_from_target(state)
        if model.draft.info_norm is not None:
            with torch.no_grad():
                model.draft.info_norm.weight.fill_(config.info_scale_init)
        fc = model.draft.fc
        if config.fc_init == "random":
            fc.reset_parameters()
        elif config.fc_init == "balanced":
            norm = state["model.norm.weight"].float() if state is not None else None
            scale = 1.0 if norm is None else float(norm.pow(2).mean().sqrt())
            c = scale / float(target.embedding.pow(2).mean().sqrt())
            with torch.no_grad():
                eye = torch.eye(fc.weight.shape[0])
                fc.weight.copy_(torch.cat([eye, c * eye], dim=1))
        return model

    def init_from_target(self, target_state: dict[str, torch.Tensor]) -> None:
        """Copy the target's last decoder layer into the draft layer (a warm start)."""
        from lyanna.model.loader import build_model

        config = self.draft.config.target
        last = config.num_layers - 1
        prefix = f"model.layers.{last}."
        layer_state = {k: v for k, v in target_state.items() if k.startswith(prefix)}
        one_layer = ModelConfig(**{**config.as_dict(), "num_layers": 1})
        renamed = {k.replace(prefix, "model.layers.0."): v for k, v in layer_state.items()}
        shared = {k: target_state[k] for k in ("model.embed_tokens.weight", "model.norm.weight")}
        donor = build_model(one_layer, {**renamed, **shared}, prepack=False)
        self.draft.layer.load_state_dict(donor.layers[0].state_dict())
        self.draft.out_norm.weight.data.copy_(target_state["model.norm.weight"])

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return draft_loss(
            self.draft,
            batch.hidden,
            batch.tokens,
            batch.weight,
            alpha=self.train_config.regression_weight,
            beta=self.train_config.ce_weight,
            steps=self.train_config.unroll_steps,
            drafted_parents=self.train_config.info_parents == "drafted",
            regression=self.train_config.regression_loss or "mse",
            feature_noise=self.train_config.feature_noise if self.training else 0.0,
            state_ce=self.train_config.state_ce_weight,
            step_weights=self.train_config.step_weight_list(),
        )

    def export(self) -> dict[str, torch.Tensor]:
        state = self.draft.state_dict()
        return {
            k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in state.items()
        }

    def load_export(self, state: dict[str, torch.Tensor]) -> None:
        """Start from an exported checkpoint (the inverse of ``export``). A checkpoint without
        the token-info gate loads into a gated model with the gate at zero, one without a copy
        read into a copy model with its scale at zero: the same drafter, so ``--init-from`` a
        committed checkpoint with ``--info-gate true`` (``--info-copy true``) continues it."""
        missing, unexpected = self.draft.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False
        )
        new_parts = {"info_gate.weight"} | {k for k in missing if k.startswith("copy.")}
        if unexpected or set(missing) - new_parts:
            raise RuntimeError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
        if "info_gate.weight" in missing:
            torch.nn.init.zeros_(self.draft.info_gate.weight)
        if "copy.scale" in missing:  # a copy read that starts silent: the same drafter
            torch.nn.init.zeros_(self.draft.copy.scale)

    def config_dict(self) -> dict:
        return self.draft.config.to_dict()


def token_info_factors(
    model: LyannaDraftModel, parents: torch.Tensor, states: torch.Tensor | None = None
) -> TokenInfo:
    """The token-info bias of ``parents`` [R] (at chain ``states`` [R, n]) as ``fused_hot_ce``
    takes it: the same numbers as ``model.token_info(parents, states)`` without its
    ``[R, num_hot]`` rows."""
    a = model.info_factors(parents, states)  # [R, rank]
    norm = model.info_norm
    return TokenInfo(a, model.w2, norm.weight, model.info_keep(parents), norm.eps)


def draft_loss(
    model: LyannaDraftModel,
    hidden: torch.Tensor,  # [B, T, n] float32 target hidden states
    tokens: torch.Tensor,  # [B, T] int64
    loss_mask: torch.Tensor,  # [B, T] bool or float weight of each token as a prediction
    alpha: float = 1.0,
    beta: float = 0.1,
    steps: int | None = None,
    drafted_parents: bool = False,
    regression: str = "mse",
    feature_noise: float = 0.0,
    state_ce: float = 0.0,
    step_weights: list[float] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """alpha * MSE(h, H) + beta * CE(softmax(l'), softmax(L)) averaged over the chain steps.

    The token-info bias of step i reads the parent token t_{j+i}: the true one, or with
    ``drafted_parents`` (an ablation) from step 2 on the drafter's own first choice of step
    i - 1 at the same anchor (no gradient flows through that choice).

    MSE covers every weighted position; the cross-entropy (over the hot vocabulary, target
    renormalised on it) and the top-1/top-3 agreement with the target's argmax cover the
    full-weight (answer) positions only: the LM-head products dominate the training cost on
    a CPU and the answers are what the drafter must predict.

    Ablations: ``regression="smooth_l1"`` (EAGLE's) in place of the MSE; ``feature_noise``
    adds Gaussian noise of that std to the target states the chain reads (not its targets);
    ``state_ce`` weighs a second cross-entropy of the state alone (no token-info bias);
    ``step_weights`` multiplies each unrolled step's loss (default: all 1).

    With ``info_space="state"`` the token info is a correction of the state, so the MSE and
    the cross-entropy both read ``h + D(parent, h)`` (the chain still feeds ``h`` on). With
    ``info_copy`` the cross-entropy reads ``h`` plus the parent's copy read of the context
    (the MSE, the chain's state alone)."""
    steps = steps or model.config.chain_steps
    T = hidden.shape[1]
    weight = loss_mask.float()
    inputs = hidden + feature_noise * torch.randn_like(hidden) if feature_noise else hidden
    outputs = model.unrolled(inputs, tokens, steps)
    head = model.hot_head
    total = hidden.new_zeros(())
    metrics: dict[str, float] = {}
    all_parents = None  # [B, valid] with drafted_parents: step i's parent at each anchor
    state_info = model.info_up is not None  # info_space="state": the info corrects the state
    if drafted_parents and model.copy is not None:
        raise ValueError("drafted parents with a copy read are not implemented")
    for i, y in enumerate(outputs, start=1):
        valid = T - 1 - i  # anchors j with j + i + 1 < T (the token to predict exists)
        if valid <= 0:
            break
        pred = y[:, :valid]  # [B, valid, n]: predicts hidden[j + i]
        target_h = hidden[:, i : i + valid]
        w = weight[:, i + 1 : i + 1 + valid]  # weight of the token being predicted
        step_parents = tokens[:, i : i + valid]
        if drafted_parents and all_parents is not None:
            step_parents = all_parents[:, :valid]
        if drafted_parents:  # the next step's parents: this step's first choice everywhere
            all_parents = first_choices(model, pred.detach(), step_parents)
        alone = pred
        if state_info:  # the corrected state, what the LM head reads
            pred = pred + model.info_delta(step_parents, pred)
        if regression == "smooth_l1":
            err = F.smooth_l1_loss(pred, target_h, reduction="none").mean(-1)
        else:
            err = (pred - target_h).pow(2).mean(-1)
        mse = (err * w).sum() / w.sum().clamp_min(1.0)
        answer = w >= 1.0
        parents = step_parents[answer]
        rows, targets = pred[answer], target_h[answer]
        ones = torch.ones_like(parents, dtype=torch.float32)
        info = None if state_info else token_info_factors(model, parents, rows)
        if model.copy is not None:  # the LM head reads the state and the parent's copy read
            rows = rows + model.copy_read(step_parents, pred, tokens, hidden)[answer]
        out = fused_hot_ce(rows, head, targets, ones, info)
        ce = out.loss / max(1, rows.shape[0])
        step_loss = alpha * mse + beta * ce
        if state_ce:
            plain = fused_hot_ce(alone[answer], head, targets, ones)
            step_loss = step_loss + state_ce * plain.loss / max(1, rows.shape[0])
        total = total + (step_weights[i - 1] if step_weights else 1.0) * step_loss
        with torch.no_grad():
            best = out.target_argmax[:, None]
            metrics[f"mse{i}"] = float(mse.detach())
            metrics[f"ce{i}"] = float(ce.detach())
            metrics[f"top1_{i}"] = float((out.top3[:, :1] == best).float().mean())
            metrics[f"top3_{i}"] = float((out.top3 == best).any(-1).float().mean())
            if not model.training:  # evaluation: agreement over the full vocabulary
                draft_ids = model.hot_ids[out.top3[:, 0]]
                full = full_vocab_hits(draft_ids, targets, model.embedding)
                metrics[f"top1_full_{i}"] = float(full.mean()) if full.numel() else 0.0
    return total / len(outputs), metrics


@torch.no_grad()
def first_choices(model: LyannaDraftModel, pred: torch.Tensor, parents: torch.Tensor,
                  chunk: int = 1024) -> torch.Tensor:  # fmt: skip
    """The token id the drafter ranks first at each row of ``pred`` [B, V, n] with the info of
    ``parents`` [B, V]: [B, V] int64 (chunked: no [B * V, num_hot] logits at once)."""
    rows, flat = pred.reshape(-1, pred.shape[-1]), parents.reshape(-1)
    out = torch.empty(flat.shape[0], dtype=torch.int64, device=pred.device)
    head = model.hot_head
    for start in range(0, flat.shape[0], chunk):
        s = slice(start, start + chunk)
        logits = rows[s].float() @ head.T + model.token_info(flat[s], rows[s])
        out[s] = model.hot_ids[logits.argmax(-1)]
    return out.view(parents.shape)
