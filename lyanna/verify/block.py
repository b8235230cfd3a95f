"""Block verification (Sun et al. 2024, arXiv 2403.10444) and Hierarchical Speculative Decoding
(Zhou et al., arXiv 2601.05724) on a chain, plus the lossy uncapped-HSD control.

Owns §4 and §5 of the verification design in the underflow-free form of §5.2: the capped
weight w_t = r_t / max(1, r_1..r_t) comes from a cumsum and a cummax of log ratios (joint
probabilities are never formed), each position t gets an acceptance probability h_t, one
uniform per position picks tau = the last t with u_t < h_t (h_0 = 1), and one token is drawn:
the bonus from p_{g+1} when tau = g, else the residual norm(max(w_tau p_{tau+1} - q_{tau+1}, 0)).
BV writes h_t = S_t / (S_t + (1 - w_t)); HSD writes h_t = D*(p,q) / D*(q,p) with the capped
branch divergences and h_g = min(1, r_g / max(1, r_1..r_{g-1})). The two are the same law
(§5.3); both are kept so that a test can show it. `LossyUncappedHSD` reproduces the public HSD
code's full-draft test min(1, r_g) (§5.4); it is lossy and is not registered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lyanna.tree import DraftScheme, TokenTree
from lyanna.verify.base import Branch, RuleBase, Verdict, draw_rows, make_verdict
from lyanna.verify.chain import ChainGroup, Workspace, group_chains, next_token_probs


def capped_log_weights(
    target_mass: torch.Tensor,  # [batch, g] p_i(x_i)
    draft_mass: torch.Tensor,  # [batch, g] q_i(x_i)
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [batch, g + 1] float64: log r_t, log max(1, r_1..r_t)
    """Prefix log-ratios and their running capped maximum (both 0 at t = 0). A zero draft
    mass is clamped to the smallest normal float, so the result is never NaN."""
    tiny = torch.finfo(torch.float64).tiny
    log_rho = target_mass.double().log() - draft_mass.double().clamp_min(tiny).log()
    zeros = torch.zeros(log_rho.shape[0], 1, dtype=torch.float64)
    log_ratio = torch.cat([zeros, log_rho.cumsum(dim=1)], dim=1)
    log_max = log_ratio.clamp_min(0.0).cummax(dim=1).values
    return log_ratio, log_max


class _BlockFamily(RuleBase):
    """Shared sampler, batching and exact law; subclasses define h_1..h_g."""

    needs_draft_probs = True
    needs_chain = True
    schemes = frozenset({DraftScheme.CHAIN_SAMPLED})

    def _branch_h(
        self,
        weighted: torch.Tensor,  # [batch, g, vocab] w_t p_{t+1} - q_{t+1}; may be overwritten
        one_minus_w: torch.Tensor,  # [batch, g] float64
        workspace: Workspace,
    ) -> torch.Tensor:  # [batch, g] float64 h_0..h_{g-1}
        raise NotImplementedError

    def _full_draft_h(
        self,
        log_ratio: torch.Tensor,  # [batch, g + 1] float64
        log_max: torch.Tensor,  # [batch, g + 1] float64
    ) -> torch.Tensor:  # [batch] float64 h_g
        raise NotImplementedError

    def _acceptance(
        self, group: ChainGroup, workspace: Workspace
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, g + 1] h, [batch, g + 1] float64 w
        g = group.length
        batch = len(group.indices)
        if g == 0:
            return torch.ones(batch, 1, dtype=torch.float64), torch.ones(batch, 1)
        log_ratio, log_max = capped_log_weights(*group.token_masses())
        log_w = log_ratio - log_max
        weights = log_w.exp()
        one_minus_w = -torch.expm1(log_w)  # accurate for w near 1 (§7.4)
        dtype = group.target_probs.dtype
        weighted = workspace.get("weighted", group.draft_probs.shape, dtype)
        torch.mul(group.target_probs[:, :g], weights[:, :g, None].to(dtype), out=weighted)
        weighted.sub_(group.draft_probs)  # [batch, g, vocab] w_t p_{t+1} - q_{t+1}
        h = torch.cat(
            [
                self._branch_h(weighted, one_minus_w[:, :g], workspace),
                self._full_draft_h(log_ratio, log_max)[:, None],
            ],
            dim=1,
        )
        h[:, 0] = 1.0
        return h, weights

    def acceptance_probabilities(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> torch.Tensor:  # [num_nodes] float64 h_0..h_g (h_0 = 1)
        self.check(tree, target_probs)
        (group,) = group_chains([tree], [target_probs])
        return self._acceptance(group, Workspace())[0][0]

    def _verify_batch(
        self,
        trees: Sequence[TokenTree],
        target_probs: Sequence[torch.Tensor],  # each [num_nodes_b, vocab]
        generator: torch.Generator | None,
    ) -> list[Verdict]:
        verdicts: list[Verdict | None] = [None] * len(trees)
        workspace = Workspace()
        for group in group_chains(trees, target_probs):
            h, weights = self._acceptance(group, workspace)
            g = group.length
            u = torch.rand(len(group.indices), g, generator=generator, dtype=torch.float64)
            success = u < h[:, 1:]  # [batch, g] one uniform per position, strict <
            num_accepted = torch.zeros(len(group.indices), dtype=torch.int64)
            if g > 0:  # tau = the last success (backward scan), 0 if none
                num_accepted = torch.where(success, torch.arange(1, g + 1), 0).amax(dim=1)
            probs, fallback = next_token_probs(
                group.target_probs, group.draft_probs, group.draft_tokens, num_accepted, weights
            )
            tokens = draw_rows(probs, generator)
            for row, i in enumerate(group.indices):
                tau = int(num_accepted[row])
                verdicts[i] = make_verdict(trees[i], range(tau + 1), tokens[row], fallback[row])
        return verdicts

    def _branches(
        self,
        tree: TokenTree,
        target_probs: torch.Tensor,  # [num_nodes, vocab]
    ) -> list[Branch]:
        (group,) = group_chains([tree], [target_probs])
        h, weights = self._acceptance(group, Workspace())
        g = group.length
        drafts = None if g == 0 else group.draft_probs.expand(g + 1, -1, -1)
        every_tau = torch.arange(g + 1)  # one row per possible outcome
        probs, _ = next_token_probs(
            group.target_probs.expand(g + 1, -1, -1),
            drafts,
            group.draft_tokens.expand(g + 1, -1),
            every_tau,
            weights.expand(g + 1, -1),
        )
        branches, none_later = [], 1.0
        for tau in range(g, -1, -1):
            stop = float(h[0, tau])
            branches.append(Branch(tuple(range(tau + 1)), none_later * stop, probs[tau]))
            none_later *= 1.0 - stop
        return branches


class BlockVerification(_BlockFamily):
    """Block verification of a sampled chain (Sun et al. 2024).

    Invariant: lossless, and optimal in E[num_accepted] among verifiers of the same draft
    (never below token-wise). Example: p = (1/3, 2/3), q = (2/3, 1/3) at every position, g = 2:
    E[num_accepted] = 11/9 against token-wise 10/9.
    """

    name = "block"

    def _branch_h(
        self,
        weighted: torch.Tensor,  # [batch, g, vocab] w_t p_{t+1} - q_{t+1}; may be overwritten
        one_minus_w: torch.Tensor,  # [batch, g] float64
        workspace: Workspace,
    ) -> torch.Tensor:
        total = weighted.clamp_min_(0.0).sum(dim=-1).double()  # S_t
        denominator = total + one_minus_w  # S + (1 - w), never (S + 1) - w (§7.4)
        return torch.where(denominator > 0, total / denominator.clamp_min(1e-300), 0.0)

    def _full_draft_h(
        self,
        log_ratio: torch.Tensor,  # [batch, g + 1] float64
        log_max: torch.Tensor,  # [batch, g + 1] float64
    ) -> torch.Tensor:
        return (log_ratio[:, -1] - log_max[:, -1]).exp()  # w_g


class HSD(_BlockFamily):
    """Capped Hierarchical Speculative Decoding (Zhou et al., Algorithm 2), per-branch form.

    Invariant: lossless; the same acceptance probabilities and residuals as block
    verification (§5.3). Example: p = (1/3, 2/3), q = (2/3, 1/3), draft BA: r_1 = 2, r_2 = 1,
    the full-draft test is min(1, r_2 / max(1, r_1)) = 1/2.
    """

    name = "hsd"

    def _branch_h(
        self,
        weighted: torch.Tensor,  # [batch, g, vocab] w_t p_{t+1} - q_{t+1}; may be overwritten
        one_minus_w: torch.Tensor,  # [batch, g] float64
        workspace: Workspace,
    ) -> torch.Tensor:
        positive = workspace.get("positive", weighted.shape, weighted.dtype)
        excess = torch.clamp_min(weighted, 0.0, out=positive).sum(dim=-1).double()  # D*(p,q)/q(X)
        deficit = weighted.neg_().clamp_min_(0.0).sum(dim=-1).double()  # D*(q,p)/q(X)
        larger = torch.maximum(excess, deficit)
        return torch.where(larger > 0, excess / larger.clamp_min(1e-300), 0.0)

    def _full_draft_h(
        self,
        log_ratio: torch.Tensor,  # [batch, g + 1] float64
        log_max: torch.Tensor,  # [batch, g + 1] float64
    ) -> torch.Tensor:
        return (log_ratio[:, -1] - log_max[:, -2]).exp().clamp_max(1.0)  # max excludes g


class LossyUncappedHSD(HSD):
    """NEGATIVE CONTROL, LOSSY: the public HSD code's uncapped full-draft test min(1, r_g).

    Invariant: none; it over-accepts. Example: p = (1/3, 2/3), q = (2/3, 1/3), draft BA has
    r_2 = 1 and is accepted with probability 1 instead of 1/2, so Pr(first two = BA) = 1/3
    against the target's 2/9. Kept out of `RULES`; exists so a test can prove it lossy.
    """

    name = "lossy_uncapped_hsd"

    def _full_draft_h(
        self,
        log_ratio: torch.Tensor,  # [batch, g + 1] float64
        log_max: torch.Tensor,  # [batch, g + 1] float64
    ) -> torch.Tensor:
        return log_ratio[:, -1].exp().clamp_max(1.0)
