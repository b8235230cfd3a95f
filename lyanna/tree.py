"""Token trees: the draft a verifier checks in one target forward.

This module owns the `TokenTree` (one sequence's draft, stored as parent pointers as in EAGLE and
SpecInfer), the `DraftScheme` that says how the drafter chose each node's children (the
acceptance rule must match it: see `lyanna.verify`), the attention mask and position ids of the
tree forward, pruning to a node budget by joint draft probability, and packing a batch of trees
into padded tensors for one forward. A drafter's candidate nodes are
`lyanna.draft_nodes.DraftNodes` (plain lists): drafters build, prune and merge those
(trie-union merging is verification fusion, `DraftNodes.merge` and `merge_trees` there; it
builds on this module, so this one never imports it) and make one `TokenTree` per proposal.

Conventions: node 0 is the root, the last committed token, whose KV is not yet in the target
cache; `parents[0] == -1` and `parents[i] < i`. The children of a node are listed in increasing
node index, and that order must be the order in which the drafter drew them (it matters for
sampling without replacement). Draft row i is the distribution node i's children were drawn
from, after the same temperature/top-p processing as the target (`lyanna.sampling`).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class DraftScheme(enum.Enum):
    """How a drafter chose the children of each node; it fixes which acceptance rules are
    lossless for the tree (the pairing lives in `lyanna.verify`, never in a comment)."""

    CHAIN_SAMPLED = "chain_sampled"  # one child per node, sampled from the draft row
    IID = "iid"  # children are i.i.d. samples from the draft row (duplicates possible)
    WITHOUT_REPLACEMENT = "without_replacement"  # distinct samples, listed in sampling order
    TOPK = "topk"  # any candidate set fixed without the target's randomness (top-k, n-gram)


@dataclass(frozen=True, slots=True, eq=False)
class TokenTree:
    """One sequence's draft tree (see the module docstring for the conventions).

    `draft_token_probs[i]` is the drafter's probability of node i's token (1 for the root);
    when only `draft_probs` is given it is read from the parent's row. `draft_probs` may be
    rows over a hot vocabulary, in which case `vocab_index[j]` is the full-vocabulary id of
    hot column j; `full_draft_probs` scatters them to full rows for the rules.
    """

    tokens: torch.Tensor  # [num_nodes] int64
    parents: torch.Tensor  # [num_nodes] int64, parents[0] == -1
    scheme: DraftScheme
    draft_token_probs: torch.Tensor | None = None  # [num_nodes] float
    draft_probs: torch.Tensor | None = None  # [num_nodes, vocab or num_hot] float
    vocab_index: torch.Tensor | None = None  # [num_hot] int64
    # structure as Python tuples, computed once (a verification walks these, not tensors)
    token_list: tuple[int, ...] = field(init=False, repr=False)
    parent_list: tuple[int, ...] = field(init=False, repr=False)
    depth_list: tuple[int, ...] = field(init=False, repr=False)  # root 0
    _paths: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # root .. node indices
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False)
    _depth_counts: tuple[int, ...] = field(init=False, repr=False)  # nodes at depth 1, 2, ...
    _tensors: dict[str, torch.Tensor] = field(init=False, repr=False)  # built on first use

    def __post_init__(self) -> None:
        tokens, parents = self.tokens, self.parents
        if tokens.dim() != 1 or tokens.dtype != torch.int64 or tokens.numel() == 0:
            raise ValueError("tokens must be a non-empty 1-D int64 tensor")
        if parents.shape != tokens.shape or parents.dtype != torch.int64:
            raise ValueError("parents must be an int64 tensor shaped like tokens")
        parent_list = parents.tolist()
        if parent_list[0] != -1:
            raise ValueError("node 0 is the root: parents[0] must be -1")
        if any(not 0 <= p < i for i, p in enumerate(parent_list) if i > 0):
            raise ValueError("parents must satisfy 0 <= parents[i] < i for every non-root node")
        n = len(parent_list)
        children: list[list[int]] = [[] for _ in range(n)]
        paths: list[tuple[int, ...]] = [(0,)]
        for i in range(1, n):
            children[parent_list[i]].append(i)
            paths.append((*paths[parent_list[i]], i))
        if self.scheme is DraftScheme.CHAIN_SAMPLED and any(len(c) > 1 for c in children):
            raise ValueError("a CHAIN_SAMPLED tree must be a chain (one child per node)")
        self._check_draft_fields(n)
        if self.draft_token_probs is None and self.draft_probs is not None:
            object.__setattr__(self, "draft_token_probs", self._token_probs_from_rows())
        depth = tuple(len(path) - 1 for path in paths)
        counts = [0] * (max(depth) + 1)
        for d in depth:
            counts[d] += 1
        object.__setattr__(self, "token_list", tuple(tokens.tolist()))
        object.__setattr__(self, "parent_list", tuple(parent_list))
        object.__setattr__(self, "depth_list", depth)
        object.__setattr__(self, "_paths", tuple(paths))
        object.__setattr__(self, "_children", tuple(tuple(c) for c in children))
        object.__setattr__(self, "_depth_counts", tuple(counts[1:]))
        object.__setattr__(self, "_tensors", {})

    @property
    def depths(self) -> torch.Tensor:  # [num_nodes] int64, root 0
        if "depths" not in self._tensors:
            self._tensors["depths"] = torch.tensor(self.depth_list, dtype=torch.int64)
        return self._tensors["depths"]

    @property
    def log_joint(self) -> torch.Tensor:  # [num_nodes] float64, root 0
        if "log_joint" not in self._tensors:
            log_joint = log_joint_of(list(self.parent_list), self.draft_token_probs)
            self._tensors["log_joint"] = torch.tensor(log_joint, dtype=torch.float64)
        return self._tensors["log_joint"]

    @property
    def _ancestors(self) -> torch.Tensor:  # [num_nodes, num_nodes] bool
        if "ancestors" not in self._tensors:
            self._tensors["ancestors"] = _ancestor_mask(list(self._paths))
        return self._tensors["ancestors"]

    def _check_draft_fields(self, n: int) -> None:
        if self.draft_token_probs is not None and self.draft_token_probs.shape != (n,):
            raise ValueError(f"draft_token_probs must have shape [{n}]")
        if self.draft_probs is not None and (
            self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n
        ):
            raise ValueError(f"draft_probs must have shape [{n}, vocab]")
        if self.vocab_index is not None:
            if self.draft_probs is None or self.vocab_index.shape != self.draft_probs.shape[1:]:
                raise ValueError("vocab_index needs draft_probs with one column per hot token")
            if self.vocab_index.dtype != torch.int64:
                raise ValueError("vocab_index must be int64")

    def _token_probs_from_rows(self) -> torch.Tensor:  # [num_nodes]
        rows = self.draft_probs[self.parents[1:]]  # [num_nodes - 1, num_cols]
        if self.vocab_index is None:
            picked = rows.gather(1, self.tokens[1:, None]).squeeze(1)
        else:
            hit = self.vocab_index[None, :] == self.tokens[1:, None]
            picked = (rows * hit).sum(dim=1)
        return torch.cat([torch.ones(1, dtype=rows.dtype), picked])

    # -- constructors --------------------------------------------------------------------

    @classmethod
    def from_parents(
        cls,
        tokens: Sequence[int] | torch.Tensor,  # [num_nodes]
        parents: Sequence[int] | torch.Tensor,  # [num_nodes]
        *,
        scheme: DraftScheme,
        draft_token_probs: torch.Tensor | None = None,  # [num_nodes]
        draft_probs: torch.Tensor | None = None,  # [num_nodes, vocab or num_hot]
        vocab_index: torch.Tensor | None = None,  # [num_hot] int64
    ) -> TokenTree:
        return cls(
            tokens=torch.as_tensor(tokens, dtype=torch.int64),
            parents=torch.as_tensor(parents, dtype=torch.int64),
            scheme=scheme,
            draft_token_probs=draft_token_probs,
            draft_probs=draft_probs,
            vocab_index=vocab_index,
        )

    @classmethod
    def chain(
        cls,
        root_token: int,
        draft_tokens: Sequence[int] | torch.Tensor,  # [num_drafted]
        *,
        scheme: DraftScheme = DraftScheme.CHAIN_SAMPLED,
        draft_token_probs: torch.Tensor | None = None,  # [num_drafted (+ 1)]
        draft_probs: torch.Tensor | None = None,  # [num_drafted (+ 1), vocab or num_hot]
        vocab_index: torch.Tensor | None = None,  # [num_hot] int64
    ) -> TokenTree:
        """A chain root -> x_1 -> ... -> x_g. Row i of `draft_probs` is the distribution
        x_{i+1} was drawn from; g rows are enough (a zero row is added for the leaf).
        `draft_token_probs` may likewise omit the root's entry."""
        draft = torch.as_tensor(draft_tokens, dtype=torch.int64).reshape(-1)
        tokens = torch.cat([torch.tensor([root_token], dtype=torch.int64), draft])
        g = draft.numel()
        if draft_probs is not None and draft_probs.dim() == 2 and draft_probs.shape[0] == g:
            draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(1, draft_probs.shape[1])])
        if draft_token_probs is not None and draft_token_probs.shape == (g,):
            draft_token_probs = torch.cat([draft_token_probs.new_ones(1), draft_token_probs])
        return cls(
            tokens=tokens,
            parents=torch.arange(-1, draft.numel(), dtype=torch.int64),
            scheme=scheme,
            draft_token_probs=draft_token_probs,
            draft_probs=draft_probs,
            vocab_index=vocab_index,
        )

    @classmethod
    def root_only(cls, root_token: int) -> TokenTree:
        """No draft: verifying it is one step of plain autoregressive decoding (built
        directly, not as an empty chain: plain decoding makes one per token)."""
        return cls(
            tokens=torch.tensor([root_token], dtype=torch.int64),
            parents=torch.tensor([-1], dtype=torch.int64),
            scheme=DraftScheme.TOPK,
        )

    # -- structure -----------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_drafted(self) -> int:
        return self.tokens.shape[0] - 1

    @property
    def max_depth(self) -> int:
        return len(self._depth_counts)

    @property
    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self._children)

    @property
    def joint_probs(self) -> torch.Tensor:  # [num_nodes] float64 (may underflow to 0)
        return self.log_joint.exp()

    def children(self, node: int) -> tuple[int, ...]:
        """Child node indices in sampling order."""
        return self._children[node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root (inclusive) to `node` (inclusive)."""
        return list(self._paths[node])

    def num_drafted_per_depth(self) -> list[int]:
        """Number of draft nodes at depth 1, 2, ..., max_depth."""
        return list(self._depth_counts)

    def attention_mask(self) -> torch.Tensor:  # [num_nodes, num_nodes] bool
        """mask[i, j] is True iff j is an ancestor of i or j == i."""
        return self._ancestors.clone()

    def positions(self, offset: int) -> torch.Tensor:  # [num_nodes] int64
        """Position ids of the tree forward: the root sits at `offset`."""
        return self.depths + offset

    def full_draft_probs(self, vocab_size: int) -> torch.Tensor:  # [num_nodes, vocab]
        """Draft rows over the full vocabulary (hot rows scattered, other tokens 0)."""
        if self.draft_probs is None:
            raise ValueError("this tree carries no draft distributions")
        if self.vocab_index is None:
            if self.draft_probs.shape[1] != vocab_size:
                raise ValueError(
                    f"draft rows have {self.draft_probs.shape[1]} columns, expected {vocab_size}"
                )
            return self.draft_probs
        full = self.draft_probs.new_zeros(self.num_nodes, vocab_size)
        return full.index_copy_(1, self.vocab_index, self.draft_probs)

    # -- transformations -----------------------------------------------------------------

    def prune(self, budget: int) -> TokenTree:
        """Keep at most `budget` draft nodes with the highest joint draft probability (ties:
        lower index first). A child never beats its parent, so the kept set is closed under
        ancestors. Pruning a non-chain tree selects candidates by their probabilities, so the
        children are no longer i.i.d. or without-replacement samples: the result is TOPK."""
        if budget >= self.num_drafted:
            return self
        keep = best_nodes(self.parents.tolist(), self.log_joint.tolist(), budget)
        scheme = self.scheme if self.is_chain else DraftScheme.TOPK
        return self._select(torch.tensor(keep, dtype=torch.int64), scheme)

    def _select(
        self,
        keep: torch.Tensor,  # [num_kept] int64, ascending node indices
        scheme: DraftScheme,
    ) -> TokenTree:
        remap = torch.full((self.num_nodes,), -1, dtype=torch.int64)
        remap[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)

        def pick(
            x: torch.Tensor | None,  # [num_nodes, ...]
        ) -> torch.Tensor | None:
            return None if x is None else x[keep]

        return TokenTree(
            tokens=self.tokens[keep],
            parents=parents,
            scheme=scheme,
            draft_token_probs=pick(self.draft_token_probs),
            draft_probs=pick(self.draft_probs),
            vocab_index=self.vocab_index,
        )


def log_joint_of(
    parents: list[int],
    token_probs: torch.Tensor | Sequence[float] | None,  # [num_nodes]
) -> list[float]:
    """Log joint draft probability of every node (0 without probabilities), summed root to
    node in float64 exactly as pruning has always ranked nodes. A drafter's candidate lists
    (``DraftNodes``) take ``math.log`` instead of a tensor round trip: on the few nodes of a
    step's tree the torch ops (a tensor, a clamp, a log, a copy back) cost more than the
    arithmetic (measured); the two logs may differ in the last bit, which can only reorder
    nodes whose joint probabilities tie to 1e-16."""
    log_joint = [0.0] * len(parents)
    if token_probs is None:
        return log_joint
    if isinstance(token_probs, torch.Tensor):
        log_q = token_probs.double().clamp(0.0, 1.0).log().tolist()
    else:
        log_q = [math.log(min(q, 1.0)) if q > 0.0 else -math.inf for q in token_probs]
    for i in range(1, len(parents)):
        log_joint[i] = log_joint[parents[i]] + log_q[i]
    return log_joint


def best_nodes(parents: list[int], log_joint: list[float], budget: int) -> list[int]:
    """Ascending indices of the root and the `budget` draft nodes with the highest joint
    draft probability (ties: lower index first), kept only under a kept parent."""
    if budget < 0:
        raise ValueError("budget must be >= 0")
    order = sorted(range(1, len(parents)), key=lambda i: (-log_joint[i], i))
    kept = {0}
    for node in order:
        if len(kept) > budget:
            break
        if parents[node] in kept:
            kept.add(node)
    return sorted(kept)


def _ancestor_mask(paths: list[tuple[int, ...]]) -> torch.Tensor:  # [n, n] bool
    """mask[i, j] iff j lies on the root-to-i path: one scatter, not one op per node."""
    n = len(paths)
    rows = [i for i, path in enumerate(paths) for _ in path]
    cols = [j for path in paths for j in path]
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[rows, cols] = True
    return mask


@functools.cache
def _causal(width: int) -> torch.Tensor:  # [width, width] bool, lower triangle (read-only)
    return torch.ones(width, width, dtype=torch.bool).tril_()


@dataclass(frozen=True, slots=True, eq=False)
class PackedTrees:
    """A batch of trees padded to one tree-forward. Padding nodes get token `pad_token`, the
    sequence's offset as position, and attend only to themselves."""

    tokens: torch.Tensor  # [batch, max_nodes] int64
    positions: torch.Tensor  # [batch, max_nodes] int64
    mask: torch.Tensor  # [batch, max_nodes, max_nodes] bool
    num_nodes: torch.Tensor  # [batch] int64

    def unpack(
        self,
        rows: torch.Tensor,  # [batch, max_nodes, ...]
    ) -> list[torch.Tensor]:
        """Split per-node outputs `rows` [batch, max_nodes, ...] into one [n_b, ...] each."""
        return [rows[b, :n] for b, n in enumerate(self.num_nodes.tolist())]


def pack_trees(
    trees: Sequence[TokenTree],
    offsets: Sequence[int] | torch.Tensor,  # [batch] position of each root
    pad_token: int = 0,
) -> PackedTrees:
    """Pad a batch of trees of different sizes into the tensors of one verification forward,
    built from the trees' Python structure: four tensors per batch, none per tree."""
    if len(trees) != len(offsets):
        raise ValueError("one offset per tree is required")
    if not trees:
        raise ValueError("cannot pack an empty batch")
    offsets = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    batch, width = len(trees), max(t.num_nodes for t in trees)
    if all(t.max_depth == width - 1 for t in trees):  # chains of one length (the 4-bit CPU
        # default: one draft token a step): the causal mask, no scatter to build
        tokens = [list(tree.token_list) for tree in trees]
        positions = [list(range(offset, offset + width)) for offset in offsets]
        mask = _causal(width).expand(batch, width, width).clone()
    else:
        tokens, positions, flat = [], [], []
        for b, (tree, offset) in enumerate(zip(trees, offsets, strict=True)):
            pad = width - tree.num_nodes
            tokens.append([*tree.token_list, *[pad_token] * pad])
            positions.append([offset + d for d in tree.depth_list] + [offset] * pad)
            base = b * width * width
            for i, path in enumerate(tree._paths):  # mask[b, i, j] for j on i's path
                row = base + i * width
                flat += [row + j for j in path]
            # padding nodes attend only to themselves
            flat += [base + i * (width + 1) for i in range(tree.num_nodes, width)]
        mask = torch.zeros(batch * width * width, dtype=torch.bool)
        mask[torch.tensor(flat, dtype=torch.int64)] = True  # one index tensor, not three
        mask = mask.view(batch, width, width)
    return PackedTrees(
        tokens=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        mask=mask,
        num_nodes=torch.tensor([t.num_nodes for t in trees], dtype=torch.int64),
    )
