"""Token-wise speculative sampling on a chain (Leviathan et al. 2023; Chen et al. 2023).

Owns the classic rule of §1 of the verification design: accept x_i while
`u_i * q_i(x_i) < p_i(x_i)`, and at the first rejection emit a residual token from
`norm(max(p_i - q_i, 0))`; after g acceptances emit a bonus token from p_{g+1}. Batched over
chains of equal length: one uniform per draft token, one categorical draw per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify.base import (
    Branch,
    RuleBase,
    Verdict,
    accept_probability,
    accept_test,
    draw_rows,
    make_verdict,
)
from lyanna.verify.chain import ChainGroup, group_chains, next_token_probs


class TokenWise(RuleBase):
    """Leviathan/Chen speculative sampling of a sampled chain.

    Invariant: the emitted tokens follow the target's law when x_i was drawn from draft row
    i - 1. Example: p = (1/3, 2/3), q = (2/3, 1/3) for every position, chain [A]: accept with
    probability 1/2; on rejection the residual is norm(max(p - q, 0)) = (0, 1), so
    Pr(A) = 2/3 * 1/2 = 1/3 and E[num_accepted] = sum_v min(p, q) = 2/3.
    """

    name = "tokenwise"
    needs_draft_probs = True
    needs_chain = True
    schemes = frozenset({DraftScheme.CHAIN_SAMPLED})

    def _verify_batch(
        self,
        trees: Sequence[TokenTree],
        target_probs: Sequence[torch.Tensor],  # each [num_nodes_b, vocab]
        generator: torch.Generator | None,
    ) -> list[Verdict]:
        verdicts: list[Verdict | None] = [None] * len(trees)
        for group in group_chains(trees, target_probs):
            num_accepted = self._num_accepted(group, generator)
            next_probs, fallback = next_token_probs(
                group.target_probs, group.draft_probs, group.draft_tokens, num_accepted
            )
            tokens = draw_rows(next_probs, generator)
            for row, i in enumerate(group.indices):
                tau = int(num_accepted[row])
                verdicts[i] = make_verdict(trees[i], range(tau + 1), tokens[row], fallback[row])
        return verdicts

    @staticmethod
    def _num_accepted(
        group: ChainGroup, generator: torch.Generator | None
    ) -> torch.Tensor:  # [batch] int64
        if group.length == 0:
            return torch.zeros(len(group.indices), dtype=torch.int64)
        accepted = accept_test(*group.token_masses(), generator)  # [batch, g]
        return accepted.long().cumprod(dim=1).sum(dim=1)  # first rejection index

    def _branches(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> list[Branch]:
        (group,) = group_chains([tree], [target_probs])
        g = group.length
        accept = [] if g == 0 else accept_probability(*group.token_masses())[0].tolist()
        drafts = None if g == 0 else group.draft_probs.expand(g + 1, -1, -1)
        every_tau = torch.arange(g + 1)  # one row per possible outcome
        next_probs, _ = next_token_probs(
            group.target_probs.expand(g + 1, -1, -1),
            drafts,
            group.draft_tokens.expand(g + 1, -1),
            every_tau,
        )
        branches, survive = [], 1.0
        for tau in range(g + 1):
            stop = 1.0 - accept[tau] if tau < g else 1.0
            branches.append(Branch(tuple(range(tau + 1)), survive * stop, next_probs[tau]))
            if tau < g:
                survive *= accept[tau]
        return branches
