"""Grouping same-length chains so the chain rules (token-wise, block, HSD) run batched.

Owns only the gathering of a batch of chain trees into dense tensors: draft tokens, target rows
at every node, draft rows at every internal node, and the per-token masses p_i(x_i), q_i(x_i).
Chains of different lengths form separate groups, and a group is capped at `GROUP_BYTES` of
rows: on CPU, copying (and page-faulting) large stacked tensors costs more than the batching
saves, so with a full-size vocabulary each chain is its own group of views, with no copy.
Also owns the final-token row of a chain rule: the (weighted) residual at tau < g or the
bonus row at tau = g, with its fallback when the residual is empty in floating point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lyanna.tree import TokenTree
from lyanna.verify.base import draft_rows, positive_residual, without_tokens

GROUP_BYTES = 4 << 20  # stack chains into one group only while their rows fit in this budget


@dataclass(frozen=True, slots=True, eq=False)
class ChainGroup:
    """Chains of one length g; row t of the targets is the distribution after node t."""

    indices: list[int]  # positions of these chains in the caller's batch
    draft_tokens: torch.Tensor  # [batch, g] int64
    target_probs: torch.Tensor  # [batch, g + 1, vocab]
    draft_probs: torch.Tensor | None  # [batch, g, vocab]; None when g == 0

    @property
    def length(self) -> int:
        return self.draft_tokens.shape[1]

    def token_masses(self) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [batch, g]
        """(target mass, draft mass) of each drafted token under the row it was drawn from."""
        index = self.draft_tokens[..., None]
        target_mass = self.target_probs[:, : self.length].gather(2, index).squeeze(2)
        draft_mass = self.draft_probs.gather(2, index).squeeze(2)
        return target_mass, draft_mass


class Workspace:
    """Scratch tensors reused across the groups of one batch call. On CPU, a fresh multi-MB
    tensor per sequence costs more in page faults than the arithmetic done in it."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of this shape, the same one for the same request."""
        key = (name, tuple(shape), dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(key[1], dtype=dtype)
        return self._buffers[key]


def group_chains(
    trees: Sequence[TokenTree],
    target_probs: Sequence[torch.Tensor],  # each [g_b + 1, vocab]
) -> list[ChainGroup]:
    """Group chains by length (at most `GROUP_BYTES` of rows per group)."""
    by_length: dict[int, list[int]] = {}
    for i, tree in enumerate(trees):
        by_length.setdefault(tree.num_drafted, []).append(i)
    groups = []
    for g, indices in by_length.items():
        row_bytes = target_probs[indices[0]].element_size() * target_probs[indices[0]].shape[-1]
        size = max(1, GROUP_BYTES // (2 * (g + 1) * row_bytes))
        for start in range(0, len(indices), size):
            groups.append(_stack(trees, target_probs, indices[start : start + size], g))
    return groups


def _stack(
    trees: Sequence[TokenTree],
    target_probs: Sequence[torch.Tensor],  # each [num_nodes_b, vocab]
    indices: list[int],
    g: int,
) -> ChainGroup:
    def gather(
        tensors: list[torch.Tensor],  # each [rows, vocab]
    ) -> torch.Tensor:
        return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)  # view if alone

    targets = gather([target_probs[i] for i in indices])
    drafts = None
    if g > 0:
        drafts = gather([draft_rows(trees[i], target_probs[i])[:g] for i in indices])
    tokens = torch.stack([trees[i].tokens[1:] for i in indices])
    return ChainGroup(indices, tokens, targets, drafts)


def next_token_probs(
    target_probs: torch.Tensor,  # [batch, g + 1, vocab]
    draft_probs: torch.Tensor | None,  # [batch, g, vocab]; None when g == 0
    draft_tokens: torch.Tensor,  # [batch, g] int64
    num_accepted: torch.Tensor,  # [batch] int64 tau
    weights: torch.Tensor | None = None,  # [batch, g + 1] w_t; None = all ones (token-wise)
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, vocab], [batch] bool: fallback used
    """norm(max(w_tau p_{tau+1} - q_{tau+1}, 0)) where tau < g, the bonus row p_{g+1} where
    tau = g (rows are unnormalised only by rounding). A residual empty in floating point falls
    back to p_{tau+1} without the rejected draft token x_{tau+1}, so it is never emitted."""
    rows = torch.arange(num_accepted.shape[0])
    target_rows = target_probs[rows, num_accepted]  # [batch, vocab]
    if draft_probs is None:
        return target_rows, torch.zeros(rows.shape[0], dtype=torch.bool)
    g = draft_probs.shape[1]
    rejected = num_accepted < g  # [batch]
    at = num_accepted.clamp(max=g - 1)
    draft_at = draft_probs[rows, at] * rejected[:, None]
    weighted = target_rows
    if weights is not None:
        weight = torch.where(rejected, weights[rows, num_accepted], 1.0).to(target_rows.dtype)
        weighted = weight[:, None] * target_rows
    probs, mass = positive_residual(weighted, draft_at, target_rows)
    fallback = (mass <= 0) & rejected
    if bool(fallback.any()):  # probability zero in exact arithmetic (§7.3)
        kept = without_tokens(target_rows, draft_tokens[rows, at][:, None])
        probs = torch.where(fallback[:, None], kept, probs)
    return probs, fallback
