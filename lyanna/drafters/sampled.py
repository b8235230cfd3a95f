"""Sampling-mode draft trees, shared by every drafter that expands nodes from hot-vocabulary
rows (EAGLE-2 and SPS via ``dynamic_tree``, Lyanna via ``token_info_tree``).

At temperature > 0 a sequence's children are drawn without replacement (Gumbel-top-k) from the
draft row after the request's own temperature and top-p, instead of taken as the top-k; the
rows travel with the tree (``DraftScheme.WITHOUT_REPLACEMENT``), so traversal verification or
RRS without replacement accept a child with probability min(1, p/q) instead of the
deterministic rule's p(x). Greedy sequences in the same batch keep top-k children.

Every drafted child also gets a *gain* known before its draw (its parent's joint probability
times the parent row's j-th largest probability, j = its drawing position): pruning ranks
sampled nodes by it (``DraftNodes``), never by what the node itself drew.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lyanna.draft_nodes import DraftNodes
from lyanna.drafters.base import VerifiedStep
from lyanna.drafters.placement import to_host
from lyanna.drafters.scopes import LM_HEAD_SCOPE, SAMPLE_SCOPE, SOFTMAX_SCOPE, scope
from lyanna.sampling import SamplingParams, logits_to_probs, sample_distinct
from lyanna.tree import DraftScheme
from lyanna.tree_cost import GainCalibration


@dataclass(slots=True)
class DraftSampling:
    """How one sequence's children are drawn at temperature > 0: the request's processing and
    the drafter's own generator (seeded from the request's seed, so a seeded request drafts,
    and therefore decodes, the same way every time)."""

    temperature: float
    top_p: float
    generator: torch.Generator

    @classmethod
    def of(cls, params: SamplingParams | None, scale: float = 1.0) -> DraftSampling | None:
        """None for greedy (or unknown) requests: they draft top-k trees. ``scale`` multiplies
        the request's temperature for the draft rows (any draft row is lossless, since the
        tree carries the rows it was drawn from; a drafter over- or under-confident at the
        target's temperature may be accepted more often at another)."""
        if params is None or params.greedy:
            return None
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:  # a stream apart from the target's, which uses the seed itself
            generator.manual_seed((params.seed + 0x9E3779B97F4A7C15) % 2**64)
        return cls(params.temperature * scale, params.top_p, generator)


@dataclass(slots=True, eq=False)
class Children:
    """One expansion's children: [B, n, k] draft probabilities (or their logs) and hot columns,
    and for the sampled sequences (``sampled`` rows of the batch) the processed rows they were
    drawn from [S, n, num_hot] and each row's k largest probabilities [S, n, k]."""

    values: torch.Tensor
    columns: torch.Tensor
    sampled: list[int]
    rows: torch.Tensor | None = None
    top: torch.Tensor | None = None

    def to_host(self, force: bool = False) -> Children:
        """These children on the CPU, where trees are built: one device-to-host copy per
        expansion, whatever the batch (``placement.to_host``; CPU children are returned as
        they are unless ``force``)."""
        if not force and self.values.device.type == "cpu":
            return self  # the CPU path: every draft step, nothing to copy
        parts = [self.values, self.columns]
        if self.rows is not None:
            parts += [self.rows, self.top]
        values, columns, *sampled_rows = to_host(*parts, force=True)
        return Children(values, columns, self.sampled, *sampled_rows)


def draw_children(
    logits: torch.Tensor,  # [B, n, num_hot] raw draft logits of n nodes per sequence
    k: int,
    draws: list[DraftSampling | None],  # per sequence: None = top-k
    log_space: bool = True,  # values as log probabilities (else probabilities)
) -> Children:
    """Each node's k children: its top-k hot columns, or for a sampling sequence k columns
    drawn without replacement from its processed row. Computed where ``logits`` are (a GPU
    drafter's device); the draws use the sequences' CPU generators wherever that is. A batch
    whose every sequence samples skips the raw rows' top-k (all of it would be overwritten),
    and one request's settings process the rows in one call (measured in a one-token T = 1
    EAGLE-2 step: 0.23 ms of 0.77 before, 0.10 after)."""
    logits = logits.float()
    sampled = [b for b, draw in enumerate(draws) if draw is not None]
    if len(sampled) < len(draws):
        with scope(SOFTMAX_SCOPE):
            probs = logits.log_softmax(-1) if log_space else logits.softmax(-1)
        top = probs.topk(k, dim=-1)
        if not sampled:
            return Children(top.values, top.indices, sampled)
    with scope(SAMPLE_SCOPE):
        every = len(sampled) == len(draws)
        chosen = None if every else torch.tensor(sampled, device=logits.device)
        rows = _processed_rows(logits if every else logits[chosen], [draws[b] for b in sampled])
        picks = torch.stack(
            [sample_distinct(rows[i], k, draws[b].generator) for i, b in enumerate(sampled)]
        )  # [S, n, k] in drawing order
        drawn = rows.gather(-1, picks)
        drawn = drawn.log() if log_space else drawn
        largest = rows.amax(-1, keepdim=True) if k == 1 else rows.topk(k, dim=-1).values
        if every:
            return Children(drawn, picks, sampled, rows, largest)
        values, columns = top.values.clone(), top.indices.clone()
        values[chosen], columns[chosen] = drawn, picks
        return Children(values, columns, sampled, rows, largest)


def _processed_rows(
    logits: torch.Tensor,  # [S, n, num_hot] float32
    draws: list[DraftSampling],  # one per row block
) -> torch.Tensor:  # [S, n, num_hot]
    """Each sequence's rows after its own temperature and top-p: one call with plain numbers
    when the sequences agree (one request, or many alike), else per-row settings."""
    first = draws[0]
    if all(d.temperature == first.temperature and d.top_p == first.top_p for d in draws):
        return logits_to_probs(logits, first.temperature, first.top_p)
    device = logits.device  # per-row settings meet the rows there
    temperature = torch.tensor([d.temperature for d in draws], device=device)
    top_p = torch.tensor([d.top_p for d in draws], device=device)
    return logits_to_probs(logits, temperature[:, None, None], top_p[:, None, None])


def head_children(
    lm_head: torch.nn.Module,
    states: torch.Tensor,  # [B, n, d]
    k: int,
    draws: list[DraftSampling | None],
) -> Children:
    """``draw_children`` of the hot LM head's logits."""
    with scope(LM_HEAD_SCOPE):
        logits = lm_head(states).float()
    return draw_children(logits, k, draws)


class SampledTrees:
    """The sampled sequences' extra facts while a tree grows: which nodes were expanded, the
    processed rows their children were drawn from, and each child's gain."""

    def __init__(self, sampled: list[int]) -> None:
        self.batch = sampled  # batch rows that sample
        self.rows: list[torch.Tensor] = []  # per expansion: [S, n, num_hot]
        self.expanded: list[torch.Tensor] = []  # per expansion: [S, n] node indices
        self.child_gains: list[torch.Tensor] = [torch.zeros(len(sampled), 1)]  # root: 0

    def add(
        self,
        children: Children,
        expanded: torch.Tensor,  # [B, n] node index of each expanded node
        parent_log_joint: torch.Tensor,  # [B, n] their log joint probabilities
    ) -> None:
        """Record one expansion; the children are appended in [n, k] block order."""
        if not self.batch:
            return
        chosen = torch.tensor(self.batch)
        self.rows.append(children.rows)
        self.expanded.append(expanded[chosen])
        gains = parent_log_joint[chosen].double().exp()[:, :, None] * children.top
        self.child_gains.append(gains.reshape(len(self.batch), -1))

    def gains(self) -> torch.Tensor:  # [S, num_nodes] (root: 0)
        return torch.cat(self.child_gains, 1)

    def attach(self, nodes: list[DraftNodes], hot_ids: torch.Tensor) -> list[DraftNodes]:
        """``nodes`` (one per batch row) with the sampled sequences' rows and gains."""
        if not self.batch:
            return nodes
        gains = self.gains().double().tolist()
        rows = torch.cat(self.rows, 1)  # [S, expansions, num_hot]
        expanded = torch.cat(self.expanded, 1)  # [S, expansions]
        for i, b in enumerate(self.batch):
            node_rows = rows.new_zeros(len(nodes[b].tokens), rows.shape[-1])
            node_rows[expanded[i]] = rows[i]
            nodes[b] = replace(nodes[b], draft_rows=node_rows, vocab_index=hot_ids, gains=gains[i])
        return nodes


class SampledDrafting:
    """What a drafter that can sample keeps per sequence: how it draws (``DraftSampling``,
    only for sequences at temperature > 0) and a gain calibration per kind of tree, since
    sampled gains and top-k joint probabilities are worth different numbers of tokens."""

    sample_drafts: bool = True  # at T > 0: draw children without replacement (else top-k)
    draft_temperature_scale: float = 1.0  # draft rows at this multiple of the request's T
    calibration: GainCalibration  # top-k trees: what their predicted gains are worth
    sampled_calibration: GainCalibration  # the same for sampled trees
    _sampling: dict[int, DraftSampling]
    _awaiting: set[int]  # sequences whose step in flight this drafter proposed

    def _init_sampling(self, sample_drafts: bool) -> None:
        self.sample_drafts = sample_drafts
        self.calibration = GainCalibration()
        self.sampled_calibration = GainCalibration()
        self._sampling = {}
        self._awaiting = set()

    @property
    def scheme(self) -> DraftScheme:
        """How trees are drafted at temperature > 0 (greedy requests get top-k trees, which
        every rule verifies at temperature 0)."""
        return DraftScheme.WITHOUT_REPLACEMENT if self.sample_drafts else DraftScheme.TOPK

    def _start_sampling(self, seq_id: int, params: SamplingParams | None) -> None:
        scale = self.draft_temperature_scale
        draw = DraftSampling.of(params, scale) if self.sample_drafts else None
        if draw is not None:
            self._sampling[seq_id] = draw

    def _stop_sampling(self, seq_id: int) -> None:
        self._sampling.pop(seq_id, None)
        self._awaiting.discard(seq_id)

    def _draws(self, seq_ids: list[int]) -> list[DraftSampling | None]:
        return [self._sampling.get(s) for s in seq_ids]

    def _calibration_of(self, seq_id: int) -> GainCalibration:
        return self.sampled_calibration if seq_id in self._sampling else self.calibration

    def _calibrations_for(self, seq_ids: list[int]) -> list[GainCalibration]:
        """The calibration of each tree about to be proposed; their verifications will count."""
        self._awaiting.update(seq_ids)
        return [self._calibration_of(s) for s in seq_ids]

    def _learn_acceptance(self, steps: list[VerifiedStep]) -> None:
        """Tell each calibration how many of its trees' tokens were accepted. Only steps this
        drafter proposed count: behind a gate (``lyanna.drafters.gate``) it also learns the
        steps its n-gram fallback drafted or that were plain, whose accepted tokens its own
        predicted gains never covered (counting them inflated its scale)."""
        mine = [s for s in steps if s.seq_id in self._awaiting]
        self._awaiting.difference_update(s.seq_id for s in mine)
        for calibration in (self.calibration, self.sampled_calibration):
            own = [s.num_accepted for s in mine if self._calibration_of(s.seq_id) is calibration]
            if own:
                calibration.verified(sum(own))
