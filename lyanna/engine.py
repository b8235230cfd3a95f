"""The in-process speculative engine: one loop for every method, and methods mixed in a batch.

``step()`` = schedule (admit waiting sequences: prefill, ``drafter.start``) -> run (each
method's drafter proposes trees for its sequences, then ONE target forward verifies every
tree of the batch, whatever drafted it) -> postprocess (the scheduler commits the verdicts
and counts them; each drafter learns its sequences' steps) -> retire finished sequences.
Plain autoregressive decoding is the same loop with ``NoDrafter``. The loop itself is
``StepLoop``: ``SpecEngine`` runs its model work in this process, ``remote_engine.RemoteEngine``
over the drafter and verifier services (which must match this oracle).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

from lyanna.drafters.base import Drafter, NoDrafter, VerifiedStep
from lyanna.drafters.gate import step_source
from lyanna.model.kv_cache import KVCache
from lyanna.model.transformer import Transformer
from lyanna.scheduler import Emitted, Scheduler, SchedulerConfig, StepTiming
from lyanna.sequence import Sequence
from lyanna.stats import SpecStats
from lyanna.target import TargetConfig, TargetRunner
from lyanna.verify import sampling_rule

__all__ = ["DEFAULT_METHOD", "DrafterError", "Emitted", "EngineConfig", "SpecEngine", "StepLoop"]

DEFAULT_METHOD = "default"  # the name of the drafter given to the constructor


class DrafterError(RuntimeError):
    """A method's drafter raised; ``method`` names it, so a server can stop serving it."""

    def __init__(self, method: str) -> None:
        super().__init__(f"the {method!r} drafter failed")
        self.method = method


@contextmanager
def _drafter_calls(method: str):
    try:
        yield
    except Exception as err:
        raise DrafterError(method) from err


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_running: int = 8  # sequences decoding at once (one target KV slot each)
    max_len: int = 4096  # KV rows per sequence (prompt + output + one tree)
    rule: str | None = None  # acceptance rule by name at T > 0 (never greedy); greedy is
    #                          always used at T=0; None = the drafter scheme's default rule

    def __post_init__(self) -> None:
        SchedulerConfig(self.max_running, self.max_len)  # validates the capacity
        if self.rule is not None:
            sampling_rule(self.rule)  # refused here, before any model or drafter is built


class StepLoop:
    """The step loop every driver shares (nano-vllm's): ``step()`` = schedule (admit waiting
    sequences: ``_prefill``) -> run (``_speculate`` the decode batch: draft, verify, the
    scheduler's ``postprocess``) -> ``retire`` (``_free`` the finished). A subclass owns the
    model work: ``SpecEngine`` in this process, ``remote_engine.RemoteEngine`` over the
    drafter and verifier services. Both stream through ``lyanna.async_engine``."""

    scheduler: Scheduler
    default_method: str

    # -- views ---------------------------------------------------------------------------

    @property
    def stats(self) -> SpecStats:
        return self.scheduler.stats

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> dict[int, Sequence]:
        return self.scheduler.running

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- driving -------------------------------------------------------------------------

    def submit(self, sequence: Sequence) -> None:
        sequence.method = sequence.method or self.default_method
        if not self.serves(sequence.method):
            raise ValueError(f"no drafter for method {sequence.method!r}")
        self.scheduler.add(sequence)

    def run(self) -> SpecStats:
        """Step until every submitted sequence has finished."""
        while self.has_work:
            self.step()
        return self.stats

    def step(self) -> list[Emitted]:
        emitted = self.admit() if self.waiting else []
        batch = self.scheduler.decode_batch()
        if batch:
            emitted += self._speculate(batch)
        self._free(self.scheduler.retire())
        return emitted

    def admit(self, limit: int | None = None) -> list[Emitted]:
        """Prefill up to ``limit`` waiting sequences now (each emits its first token) without
        a verification; a server streams those first tokens before the next ``step``."""
        return self._prefill(self.scheduler.schedule_prefill(limit))

    def abort(self, seq_id: int) -> bool:
        """Drop a waiting or running sequence (its client went away): frees its KV slot and
        drafter state. Returns whether the sequence was known."""
        sequence = self.running.get(seq_id)
        if sequence is not None:
            self._free([sequence])
        return self.scheduler.abort(seq_id)

    # -- the model work, per driver --------------------------------------------------------

    def serves(self, method: str) -> bool:
        raise NotImplementedError

    def _prefill(self, sequences: list[Sequence]) -> list[Emitted]:
        """Prefill admitted sequences; each emits its first token (``postprocess_prefill``)."""
        raise NotImplementedError

    def _speculate(self, batch: list[Sequence]) -> list[Emitted]:
        """One speculative step of the decode batch, committed by ``scheduler.postprocess``."""
        raise NotImplementedError

    def _free(self, sequences: list[Sequence]) -> None:
        """Free the KV slots and drafter state of sequences that left."""
        raise NotImplementedError


class SpecEngine(StepLoop):
    def __init__(
        self,
        model: Transformer,
        drafter: Drafter | None = None,
        config: EngineConfig | None = None,
        method: str = DEFAULT_METHOD,
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_running, self.config.max_len))
        self.target = TargetRunner(
            model, TargetConfig(self.config.max_running, self.config.max_len, self.config.rule)
        )
        self.default_method = method
        self.drafters: dict[str, Drafter] = {}
        self.add_method(method, drafter or NoDrafter())

    def add_method(self, method: str, drafter: Drafter) -> None:
        """Serve ``method`` with ``drafter`` from now on (its sequences share every target
        forward with the other methods' sequences)."""
        if self.config.rule is not None and not isinstance(drafter, NoDrafter):
            for scheme in getattr(drafter, "schemes", (drafter.scheme,)):
                sampling_rule(self.config.rule, scheme)  # not at every drafted tree
        self.drafters[method] = drafter

    def remove_method(self, method: str) -> list[Sequence]:
        """Stop serving ``method``: its waiting and running sequences are aborted (returned)."""
        dropped = [
            s
            for s in (*self.scheduler.waiting, *self.scheduler.running.values())
            if s.method == method
        ]
        for sequence in dropped:
            self.abort(sequence.seq_id)
        self.drafters.pop(method, None)
        return dropped

    # -- views ---------------------------------------------------------------------------

    @property
    def drafter(self) -> Drafter:
        """The default method's drafter."""
        return self.drafters[self.default_method]

    @property
    def cache(self) -> KVCache:
        return self.target.cache

    @property
    def slots(self) -> dict[int, int]:
        """Running sequence id -> its target KV slot."""
        return {seq_id: self.target.slot(seq_id) for seq_id in self.running}

    def serves(self, method: str) -> bool:
        return method in self.drafters

    # -- model work ----------------------------------------------------------------------

    def _prefill(self, sequences: list[Sequence]) -> list[Emitted]:
        return [self._prefill_one(s) for s in sequences]

    def _prefill_one(self, seq: Sequence) -> Emitted:
        stats = self.stats
        start = time.perf_counter()
        prefilled = self.target.prefill(seq.seq_id, seq.prompt_ids, seq.params, seq.generator)
        stats.prefill_seconds += time.perf_counter() - start
        stats.num_prefill_tokens += len(seq.prompt_ids)
        emitted = self.scheduler.postprocess_prefill(seq, prefilled.first_token)
        if prefilled.logprobs is not None:
            emitted.logprobs = prefilled.logprobs[: len(emitted.tokens)]
        if not seq.finished:
            drafter = self.drafters[seq.method]
            start = time.perf_counter()
            hidden = prefilled.hidden if drafter.needs_hidden else None
            with _drafter_calls(seq.method):
                drafter.start(seq.seq_id, seq.prompt_ids, hidden, prefilled.first_token, seq.params)
            stats.draft_seconds += time.perf_counter() - start
        return emitted

    def _speculate(self, batch: list[Sequence]) -> list[Emitted]:
        groups: dict[str, list[Sequence]] = {}
        for sequence in batch:
            groups.setdefault(sequence.method, []).append(sequence)
        batch = [s for group in groups.values() for s in group]  # in the order trees come
        trees, draft_seconds, sources = [], {}, {}
        for method, group in groups.items():
            start = time.perf_counter()
            with _drafter_calls(method):
                trees += self.drafters[method].propose([s.seq_id for s in group])
            draft_seconds[method] = time.perf_counter() - start
            sources |= {s.seq_id: step_source(self.drafters[method], s.seq_id) for s in group}
        needs_hidden = any(self.drafters[m].needs_hidden for m in groups)
        start = time.perf_counter()
        results = self.target.verify([s.seq_id for s in batch], trees, needs_hidden)
        verify_seconds = time.perf_counter() - start
        emitted = self.scheduler.postprocess(batch, [r.verdict for r in results])
        for item, result in zip(emitted, results, strict=True):
            if result.logprobs is not None:  # the emitted tokens are a prefix of the verdict's
                item.logprobs = result.logprobs[: len(item.tokens)]
        pairs = zip(batch, results, strict=True)
        steps = {s.seq_id: VerifiedStep.of(s.seq_id, r) for s, r in pairs}
        resampled: dict[int, int] = {}
        for method, group in groups.items():  # a sequence that just finished is not taught
            start = time.perf_counter()
            learn = [steps[s.seq_id] for s in group if not s.finished]
            with _drafter_calls(method):
                resampled |= self.drafters[method].on_verified(learn)
            draft_seconds[method] += time.perf_counter() - start
        self.scheduler.record_drafter_facts(emitted, resampled)
        self._record_time(draft_seconds, verify_seconds)
        for item in emitted:
            item.timing = StepTiming(draft_seconds[item.sequence.method], verify_seconds)
            item.source = sources[item.sequence.seq_id]
        return emitted

    def _record_time(self, draft_seconds: dict[str, float], verify_seconds: float) -> None:
        self.stats.draft_seconds += sum(draft_seconds.values())
        self.stats.verify_seconds += verify_seconds
        for method, seconds in draft_seconds.items():
            stats = self.scheduler.method_stats(method)
            stats.draft_seconds += seconds
            stats.verify_seconds += verify_seconds  # the shared forward, as its steps saw it

    def _free(self, sequences: list[Sequence]) -> None:
        for sequence in sequences:
            self.target.release(sequence.seq_id)
            drafter = self.drafters.get(sequence.method)
            if drafter is not None:
                drafter.release(sequence.seq_id)
