"""Draft only where drafting pays: a per-sequence gate in front of any drafter.

A speculative step costs the draft time D plus the extra verification rows, T(B + w) - T(B)
for w draft nodes next to the batch's B roots; it earns the draft tokens accepted. At the rate
plain decoding makes tokens (B / T(B)), a sequence is worth drafting for while

    accepted per drafted step * T(B) / B  >=  D + T(B + w) - T(B).

Acceptance comes in runs (a list, code, a quoted passage are easy to draft; free prose is
not), so each sequence keeps a running average of the tokens accepted per drafted step and
drafts only while it pays; a gated-off sequence re-measures by drafting once after a few
plain steps (then after twice as many while it still does not pay). A probe due at a batch
size where even a fully accepted draft could not pay is put off the same way. Where no
drafted token pays at all, as for a 4-bit target on a CPU whose second row costs 30 % of a
step, this is plain decoding with an occasional probe instead of a speculative method slower
than it.

A new sequence starts from what the drafter's earlier sequences of the same kind (greedy or
sampled) accepted, not from an optimistic constant: at T = 1, where nothing a drafter of
today proposes pays, each 64-token request used to spend its first steps drafting at a loss
before its own average fell. It also starts at the probe interval the last sequence of its
kind ended with, so where probes keep failing a new request does not pay for the short early
probes again (its first probe after 32 plain steps instead of after 4, 8 and 16); the first
probe that pays resets the interval for the sequences after it.

A gated-off sequence stays off until its probe is due, so the steps it will not draft are
known in advance (``quiet_steps``): a caller across a process boundary (the gateway in front
of the drafter service) verifies those steps root-only without asking, and hands the drafter
their verifications in order with the next call.

A gated-off step need not be a plain one: with a ``fallback`` drafter that costs no forward
(the n-gram drafter: the request's own text, then the target's corpus store), gated-off
sequences draft from it instead, its trees cut by the same cost curve. Where the learned
drafter does not pay, as on a CPU whose every verified row costs a fifth of a step, the
method then drafts what is free rather than nothing. Such steps are not quiet: they are
proposed like any other. The learned drafter must then beat the fallback, not plain steps:
each sequence also keeps the fallback's tokens per step it drafted, and only the learned
drafter's excess over it pays for the draft and its rows.

Across processes a drafted step also costs its route: the gateway sends it through the drafter
service, which calls the verifier, where a gated-off step goes to the verifier directly (and
several quiet steps ride in one call). The drafter service measures the hops (its own to
the verifier, and the gateway's to it as the gateway saw it) and hands the gate that route
time (``routed``); it raises the bar like draft time does. In
one process the route costs nothing. What a gated-off step yields is measured the same way
whoever drafted it (a ``fallback`` here, the verifier's own free drafts across processes, or
nothing): the learned drafter must beat that.

Which of the three drafted a step (``step_source``: the wrapped ``method``, its ``fallback``,
or ``plain``: a root-only tree) is a fact the caller reads per step, for its metrics.

Lossless by construction: a gated-off sequence verifies a root-only tree (a plain decode
step) or the fallback's tree with the rule of its own scheme, and the wrapped drafter still
sees every verified step (its state keeps up).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lyanna.drafters.base import Drafter, NoDrafter, VerifiedStep
from lyanna.tree import TokenTree
from lyanna.tree_cost import VerifyCost

# what drafted a step's tree: the wrapped drafter (every step of an ungated one), a gated-off
# step's free fallback, or nothing (gated off without a fallback: a root-only tree)
DRAFT_SOURCES = ("method", "fallback", "plain")


@dataclass(frozen=True, slots=True)
class GateConfig:
    alpha: float = 0.3  # weight of the newest drafted step in the running averages
    prior: float = 1.0  # a new sequence's expected accepted tokens per drafted step: draft
    probe_after: int = 4  # plain steps before a gated-off sequence drafts once to re-measure
    probe_max: int = 32  # the wait doubles after each probe that does not pay, up to this
    # weight of one drafted step in the average over all sequences of a kind (greedy or
    # sampled), which is where a new sequence of that kind starts (``prior`` before any)
    population_alpha: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1 or self.prior < 0 or not 0 <= self.population_alpha <= 1:
            raise ValueError("alpha must be in (0, 1], population_alpha in [0, 1], prior >= 0")
        if not 1 <= self.probe_after <= self.probe_max:
            raise ValueError("need 1 <= probe_after <= probe_max")


@dataclass(slots=True)
class _SeqGate:
    accepted: float  # running average of draft tokens accepted per drafted step
    fallback: float = 0.0  # ... per gated-off step (a free fallback's or the verifier's drafts)
    width: float = 1.0  # running average of draft nodes per drafted step
    waited: int = 0  # plain steps since the last drafted one
    probe_after: int = 0
    drafted: bool = False  # whether the step in flight was drafted
    sampled: bool = False  # temperature > 0: its own population average


class DraftGate:
    """The decision alone (no drafter, no tensors), so it is tested on its own."""

    def __init__(self, cost: VerifyCost, config: GateConfig | None = None) -> None:
        self.cost = cost
        self.config = config or GateConfig()
        self.draft_seconds = 0.0  # running average of draft seconds per drafted sequence
        # ... of the seconds a drafted sequence's route to the verifier costs over a gated-off
        # one's (0 in one process; see ``routed``)
        self.route_seconds = 0.0
        self._seqs: dict[int, _SeqGate] = {}
        # accepted tokens per drafted step over every sequence, greedy (False) and sampled
        self.population = {False: self.config.prior, True: self.config.prior}
        # ... per step drafted by a free fallback instead (0 without one)
        self.fallback_population = {False: 0.0, True: 0.0}
        # the probe interval the last released sequence of a kind had: where new ones start
        self.population_probe = {False: self.config.probe_after, True: self.config.probe_after}

    def start(self, seq_id: int, sampled: bool = False) -> None:
        self._seqs[seq_id] = _SeqGate(
            self.population[sampled],
            self.fallback_population[sampled],
            probe_after=self.population_probe[sampled],
            sampled=sampled,
        )

    def release(self, seq_id: int) -> None:
        gate = self._seqs.pop(seq_id, None)
        if gate is not None:
            self.population_probe[gate.sampled] = gate.probe_after

    def pays(self, seq_id: int, batch: int, accepted: float | None = None) -> bool:
        """Whether drafting ``seq_id`` raises the step's expected tokens per second over what
        a gated-off step yields (nothing, or a free fallback's drafts), if a drafted step
        accepts ``accepted`` tokens (default: the sequence's running average)."""
        gate = self._seqs[seq_id]
        width = max(1, round(gate.width))
        accepted = gate.accepted if accepted is None else accepted
        step = self.cost.forward_seconds(batch)
        rows = self.cost.forward_seconds(batch + width) - step
        spent = self.draft_seconds + self.route_seconds + rows
        return (accepted - gate.fallback) * step / batch >= spent

    def could_pay(self, seq_id: int, batch: int) -> bool:
        """Whether a drafted step could pay at this batch size even if every drafted node
        were accepted. A probe that cannot is put off: it would cost its step (and across
        processes a round trip through the drafter) and could only confirm the gate."""
        return self.pays(seq_id, batch, accepted=max(1.0, self._seqs[seq_id].width))

    def choose(self, seq_ids: list[int]) -> list[bool]:
        """Which of this step's sequences draft: those whose last drafted step still pays, and
        gated-off ones whose probe is due (until then they stay off: see ``quiet_steps``)."""
        chosen = []
        for seq_id in seq_ids:
            gate = self._seqs[seq_id]
            if gate.waited == 0:  # drafted last step (or new): draft on while it pays
                gate.drafted = self.pays(seq_id, len(seq_ids))
            elif gate.waited < gate.probe_after:
                gate.drafted = False
            elif self.could_pay(seq_id, len(seq_ids)):
                gate.drafted = True  # a probe
            else:  # put off, as after a probe that failed
                gate.drafted, gate.waited = False, 0
                gate.probe_after = min(2 * gate.probe_after, self.config.probe_max)
            chosen.append(gate.drafted)
        return chosen

    def quiet_steps(self, seq_id: int) -> int:
        """After ``choose``: how many of the sequence's next steps certainly draft nothing
        (0 while it drafts: whether the next step pays is decided then)."""
        gate = self._seqs[seq_id]
        if gate.drafted:
            return 0
        return max(0, gate.probe_after - gate.waited - 1)

    def drafted(self, seconds: float, widths: dict[int, int]) -> None:
        """A propose call took ``seconds`` for the sequences in ``widths`` (draft nodes each)."""
        alpha = self.config.alpha
        if widths:
            per_seq = seconds / len(widths)
            self.draft_seconds += alpha * (per_seq - self.draft_seconds)
        for seq_id, width in widths.items():
            gate = self._seqs[seq_id]
            gate.width += alpha * (width - gate.width)

    def routed(self, seconds: float, num_drafted: int) -> None:
        """A step that drafted ``num_drafted`` sequences spent ``seconds`` more on its way to
        the verifier than a gated-off step would have (hops between processes)."""
        if num_drafted > 0:
            per_seq = max(0.0, seconds) / num_drafted
            self.route_seconds += self.config.alpha * (per_seq - self.route_seconds)

    def drafting(self, seq_id: int) -> bool:
        """Whether the sequence's step in flight was drafted."""
        return self._seqs[seq_id].drafted

    def fallback_verified(self, seq_id: int, num_accepted: int) -> None:
        """A gated-off step accepted ``num_accepted`` tokens (drafted by a free fallback, by
        the verifier's free drafts, or by nothing: then 0)."""
        gate = self._seqs[seq_id]
        gate.fallback += self.config.alpha * (num_accepted - gate.fallback)
        population = self.fallback_population[gate.sampled]
        population += self.config.population_alpha * (num_accepted - population)
        self.fallback_population[gate.sampled] = population

    def verified(self, seq_id: int, num_accepted: int) -> None:
        gate = self._seqs[seq_id]
        if not gate.drafted:
            gate.waited += 1
            return
        gate.accepted += self.config.alpha * (num_accepted - gate.accepted)
        population = self.population[gate.sampled]
        population += self.config.population_alpha * (num_accepted - population)
        self.population[gate.sampled] = population
        was_probe, gate.waited = gate.waited > 0, 0
        if self.pays(seq_id, 1):
            gate.probe_after = self.config.probe_after
        elif was_probe:
            gate.probe_after = min(2 * gate.probe_after, self.config.probe_max)


class GatedDrafter:
    """``inner`` drafting only for the sequences its ``DraftGate`` lets through; the others
    get root-only trees, or ``fallback``'s (a drafter that runs no model). Every other
    attribute is the inner drafter's."""

    def __init__(self, inner: Drafter, gate: DraftGate, fallback: Drafter | None = None) -> None:
        self.inner = inner
        self.gate = gate
        self.scheme = inner.scheme
        # every scheme its drafted trees may have (a configured rule must suit each; a
        # root-only tree drafts nothing, which any rule verifies)
        self.schemes = frozenset({inner.scheme, *([fallback.scheme] if fallback else [])})
        self.needs_hidden = inner.needs_hidden
        self.plain = fallback or NoDrafter()  # the trees of gated-off sequences
        self.drafts_when_gated = fallback is not None
        self.num_gated_steps = 0  # sequence-steps the inner drafter skipped (quiet included)

    def __getattr__(self, name: str):  # only called for names not found on the wrapper
        return getattr(self.__dict__["inner"], name)

    def start(self, seq_id, prompt_ids, prompt_hidden, first_token, params=None) -> None:
        self.inner.start(seq_id, prompt_ids, prompt_hidden, first_token, params)
        self.gate.start(seq_id, sampled=params is not None and not params.greedy)
        self.plain.start(seq_id, prompt_ids, None, first_token, params)

    def propose(self, seq_ids: list[int]) -> list[TokenTree]:
        chosen = self.gate.choose(seq_ids)
        drafting = [s for s, c in zip(seq_ids, chosen, strict=True) if c]
        trees: dict[int, TokenTree] = {}
        if drafting:
            start = time.perf_counter()
            trees = dict(zip(drafting, self.inner.propose(drafting), strict=True))
            widths = {s: tree.num_drafted for s, tree in trees.items()}
            self.gate.drafted(time.perf_counter() - start, widths)
        plain = [s for s in seq_ids if s not in trees]
        trees.update(zip(plain, self.plain.propose(plain), strict=True))
        return [trees[s] for s in seq_ids]

    def routed(self, seconds: float, seq_ids: list[int]) -> None:
        """A step of ``seq_ids`` spent ``seconds`` on hops a gated-off step skips: shared by
        those this drafter drafted (``DraftGate.routed``)."""
        self.gate.routed(seconds, sum(self.gate.drafting(seq_id) for seq_id in seq_ids))

    def quiet_steps(self, seq_id: int) -> int:
        """Steps after the last ``propose`` on which ``seq_id`` certainly gets a root-only tree:
        the caller may verify those without proposing, then pass their verifications to
        ``on_verified`` in order before the next ``propose``. None with a fallback: a
        gated-off step drafts from it."""
        return 0 if self.drafts_when_gated else self.gate.quiet_steps(seq_id)

    def source(self, seq_id: int) -> str:
        """What drafted the sequence's step in flight (the last ``propose``'s, or a quiet step
        after it; still so after its ``on_verified``): one of ``DRAFT_SOURCES``."""
        if self.gate.drafting(seq_id):
            return "method"
        return "fallback" if self.drafts_when_gated else "plain"

    def on_verified(self, steps: list[VerifiedStep]) -> dict[int, int]:
        resampled = self.inner.on_verified(steps)
        self.plain.on_verified(steps)
        for step in steps:
            gated = not self.gate.drafting(step.seq_id)
            self.num_gated_steps += gated
            if gated:  # what not drafting yields, whoever drafted the step (see the top)
                self.gate.fallback_verified(step.seq_id, step.num_accepted)
            self.gate.verified(step.seq_id, step.num_accepted)
        return resampled

    def release(self, seq_id: int) -> None:
        self.inner.release(seq_id)
        self.gate.release(seq_id)
        self.plain.release(seq_id)


def step_source(drafter: Drafter, seq_id: int) -> str:
    """What drafted ``seq_id``'s step in flight (``DRAFT_SOURCES``), so a caller can count the
    gate's choices without reaching into it: a drafter without a gate drafts every step."""
    return drafter.source(seq_id) if isinstance(drafter, GatedDrafter) else "method"
