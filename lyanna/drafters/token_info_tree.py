"""Token-info tree sampling (Lyanna paper, Algorithm 1) and the re-sampled subtree
(Algorithm 2), as pure functions of a chain's raw logits and the collapsed token-info table.

For each chain step i, every frontier node gets ``softmax(l_i + T[node token])`` over the hot
vocabulary and proposes its top-k tokens as children (joint probability = parent joint x
child probability); the k children with the highest joint probability form the next
frontier. Every proposed child stays in the tree; the caller prunes it to the verification
budget by joint probability. Children are chosen deterministically, so the tree is a
``DraftScheme.TOPK`` candidate set (lossless with the deterministic-candidate rule).

Worked example (k = 2, two steps): root "model" -> children "training" (0.6), "inference"
(0.3); both are kept as frontier; step 2 gives "training" -> "server" (0.7 -> joint 0.42) and
"data" (0.2 -> 0.12), "inference" -> "speed" (0.8 -> 0.24), "cost" (0.1 -> 0.03); the next
frontier is {server, speed}.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from lyanna.drafters.scopes import SOFTMAX_SCOPE
from lyanna.tree import DraftScheme, TokenTree


def build_subtree(
    logits: torch.Tensor,  # [steps, num_hot] raw chain logits (no token info yet)
    root_token: int,
    top_k: int,
    info_table: torch.Tensor | None,  # [num_hot, num_hot] collapsed token info, or None
    hot_ids: torch.Tensor,  # [num_hot] full-vocabulary id of each hot column
    hot_index: torch.Tensor,  # [vocab] hot row of each token, -1 if not hot
) -> TokenTree:
    """BuildSubtree of Algorithm 1: a tree of depth ``len(logits)`` rooted at ``root_token``."""
    tokens, parents, probs = [root_token], [-1], [1.0]
    frontier = torch.tensor([0])  # node indices
    frontier_log_joint = torch.zeros(1, dtype=torch.float64)
    frontier_hot = hot_index[torch.tensor([root_token])]  # [f] hot rows of frontier tokens
    for step in range(logits.shape[0]):
        with record_function(SOFTMAX_SCOPE):
            rows = logits[step].expand(frontier.numel(), -1).float()
            if info_table is not None:
                known = frontier_hot >= 0
                if bool(known.any()):
                    rows = rows.clone()
                    rows[known] += info_table[frontier_hot[known]].float()
            probs_rows = torch.softmax(rows, dim=-1)
        child_probs, child_cols = probs_rows.topk(top_k, dim=-1)  # [f, k]
        child_log_joint = frontier_log_joint[:, None] + child_probs.double().log()
        first_new = len(tokens)
        child_tokens = hot_ids[child_cols].flatten().tolist()
        tokens += child_tokens
        parents += frontier.repeat_interleave(top_k).tolist()
        probs += child_probs.flatten().tolist()
        keep = child_log_joint.flatten().topk(min(top_k, child_log_joint.numel())).indices
        frontier = first_new + keep
        frontier_log_joint = child_log_joint.flatten()[keep]
        frontier_hot = child_cols.flatten()[keep]
    return TokenTree.from_parents(
        tokens,
        parents,
        scheme=DraftScheme.TOPK,
        draft_token_probs=torch.tensor(probs, dtype=torch.float64),
    )


def resample_subtree(
    logits: torch.Tensor,  # [N, num_hot] the previous chain's raw logits
    num_accepted: int,  # m: draft tokens accepted from that chain's tree
    bonus_token: int,  # the residual/bonus token: root of the new subtree
    min_remaining: int,  # r: build only if at least r chain steps remain
    top_k: int,
    info_table: torch.Tensor | None,
    hot_ids: torch.Tensor,
    hot_index: torch.Tensor,
) -> TokenTree | None:
    """Algorithm 2: the bonus token sits at depth m + 1 of the old chain, so the tokens after
    it are predicted by the remaining logits l(m+2..N) (rows m+1.. here), with the bonus
    token's token info on the first of them. None when fewer than r steps remain."""
    remaining = logits[num_accepted + 1 :]
    if remaining.shape[0] < max(min_remaining, 1):
        return None
    return build_subtree(remaining, bonus_token, top_k, info_table, hot_ids, hot_index)
