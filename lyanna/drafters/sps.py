"""Standalone draft model (SPS; Leviathan et al., 2023 / Chen et al., 2023): a small causal LM
with the target's tokenizer drafts from tokens alone, here on EAGLE-2's dynamic tree so every
drafter spends the same verification budget the same way.

No smaller SmolLM2 exists, so the default student is made from the target: its first
``num_layers`` decoder layers (``training.sps`` distils them against the target's next-token
distribution) plus the target's final norm, sharing the target's frozen embedding and scoring
only a hot vocabulary (the checkpoint stores the layers, the norm and the hot token ids).

Draft state per sequence: the student's KV cache holds every committed token *and the root*
(the root is committed whatever the verdict), so ``propose`` first runs the tokens committed
since the last call plus the new root as one causal catch-up forward; its last output is the
root state. Tree nodes are the student's ordinary tokens at their tree positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lyanna.drafters.base import DraftBudget, VerifiedStep
from lyanna.drafters.checkpoint import checkpoint_dir, read_checkpoint
from lyanna.drafters.dynamic_tree import DynamicTreeDrafter
from lyanna.drafters.heads import draft_weight_dtype, hot_lm_head, prepare_draft_layers
from lyanna.drafters.scopes import LAYER_SCOPE, scope
from lyanna.model.kv_cache import KVCache
from lyanna.model.quant import runs_q4
from lyanna.model.transformer import ForwardContext, Transformer, eager_context, rope_tables

DEFAULT_CHECKPOINT = checkpoint_dir("sps-smollm2-135m")


@dataclass(frozen=True, slots=True)
class SpsConfig:
    num_layers: int  # decoder layers of the student (the target's shape otherwise)
    hot_vocab_size: int

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.hot_vocab_size < 1:
            raise ValueError("num_layers and hot_vocab_size must be >= 1")

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "sps", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpsConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


def build_student(
    target: Transformer,
    num_layers: int,
    layer_state: dict[str, torch.Tensor],  # "layers.{i}.*" and "norm.weight" (lean names)
) -> Transformer:
    """A ``num_layers`` Transformer of the target's shape sharing the target's embedding."""
    config = dataclasses.replace(target.config, num_layers=num_layers)
    with torch.device("meta"):
        student = Transformer(config)
    state = {k: v.to(target.dtype) for k, v in layer_state.items()}
    state["embed_tokens.weight"] = target.embed_tokens.weight
    student.load_state_dict(state, strict=False, assign=True)
    student.lm_head.weight = student.embed_tokens.weight
    student.rope_cos, student.rope_sin = rope_tables(config)
    return student.eval()


def load_sps_student(
    target: Transformer, path: str | Path = DEFAULT_CHECKPOINT
) -> tuple[Transformer, torch.Tensor]:
    """(student, hot vocabulary [num_hot] int64) from a checkpoint directory."""
    values, state = read_checkpoint(path, "SPS")
    config = SpsConfig.from_dict(values)
    hot_vocab = state.pop("hot_vocab").long()
    return build_student(target, config.num_layers, state), hot_vocab


@dataclass(slots=True)
class _DraftState:
    slot: int
    root: int  # the next tree's root token (not yet in the student's KV)
    root_state: torch.Tensor | None = None  # [d] the student's output at the root
    pending_tokens: list[int] = field(default_factory=list)  # to run before the next tree


class SpsDrafter(DynamicTreeDrafter):
    needs_hidden = False

    def __init__(
        self,
        student: Transformer,
        hot_vocab: torch.Tensor,  # [num_hot] int64
        budget: DraftBudget | None = None,
        max_running: int = 16,
        max_len: int = 4096,
        sample_drafts: bool = True,  # at T > 0: children drawn without replacement
        weight_dtype: torch.dtype | None = None,  # e.g. bf16 (see heads.draft_weight_dtype)
        q4_layers: bool = False,  # 4-bit layers (next to a 4-bit target)
    ) -> None:
        self.student = student
        # once, in place: the student serves inference only
        prepare_draft_layers(student.layers, weight_dtype, q4_layers)
        self.budget = budget or DraftBudget()
        self._init_sampling(sample_drafts)
        self.hot_vocab = hot_vocab
        self.lm_head = hot_lm_head(student.embed_tokens.weight, hot_vocab, weight_dtype)
        self.rope_cos, self.rope_sin = student.rope_cos, student.rope_sin
        max_len = min(max_len, student.config.max_position_embeddings)
        self.cache = KVCache(student.config, max_running, max_len, torch.float32)
        self._seqs: dict[int, _DraftState] = {}

    @classmethod
    def from_checkpoint(
        cls, target: Transformer, path: str | Path = DEFAULT_CHECKPOINT, **kwargs
    ) -> SpsDrafter:
        student, hot_vocab = load_sps_student(target, path)
        kwargs.setdefault("weight_dtype", draft_weight_dtype(target))
        kwargs.setdefault("q4_layers", runs_q4(target))
        return cls(student, hot_vocab, **kwargs)

    # -- Drafter protocol --------------------------------------------------------------

    def start(self, seq_id, prompt_ids, prompt_hidden, first_token, params=None) -> None:
        self._start_sampling(seq_id, params)
        state = _DraftState(slot=self.cache.allocate(), root=first_token)
        state.pending_tokens = [*prompt_ids, first_token]
        self._seqs[seq_id] = state

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        self._learn_acceptance(steps)
        for step in steps:
            state = self._seqs[step.seq_id]
            state.pending_tokens += [*step.committed[1:], step.next_token]
            state.root = step.next_token
        return {}

    # -- student forwards --------------------------------------------------------------

    def _catch_up(self, states: list[_DraftState]) -> None:
        """Run the pending tokens (ending with the root) causally and commit them."""
        q = max(len(s.pending_tokens) for s in states)
        tokens = torch.zeros(len(states), q, dtype=torch.int64)
        for b, s in enumerate(states):
            tokens[b, : len(s.pending_tokens)] = torch.tensor(s.pending_tokens)
        slots = torch.tensor([s.slot for s in states])
        positions = self.cache.lengths[slots][:, None] + torch.arange(q)
        ctx = eager_context(self.cache, slots, positions, None, self.rope_cos, self.rope_sin)
        with scope(LAYER_SCOPE):
            out = self._layers(self.student.embed_tokens(tokens), ctx)
        for b, s in enumerate(states):
            n = len(s.pending_tokens)
            self.cache.commit_prefix(s.slot, n)
            s.root_state = out[b, n - 1]
            s.pending_tokens = []

    def _layers(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        for i, layer in enumerate(self.student.layers):
            x = layer(x, ctx, i)
        return self.student.norm(x)

    def _node_forward(
        self,
        ctx: ForwardContext,
        parent_states: torch.Tensor,  # [B, k, d] unused: the student reads tokens only
        tokens: torch.Tensor,  # [B, k]
    ) -> torch.Tensor:  # [B, k, d]
        return self._layers(self.student.embed_tokens(tokens), ctx)
