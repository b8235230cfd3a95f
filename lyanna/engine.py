"""The in-process speculative engine: one loop for every method.

``step()`` = admit waiting sequences (prefill, ``drafter.start``) -> ``drafter.propose`` one
tree per running sequence -> one target forward over the packed trees -> the acceptance rule
per sequence -> commit the accepted KV rows, emit tokens -> ``drafter.on_verified`` -> retire
finished sequences. Plain autoregressive decoding is the same loop with ``NoDrafter``.
The services split this loop across processes; this module is the oracle they must match.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from lyanna.drafters.base import Drafter, NoDrafter, VerifiedStep
from lyanna.kv_cache import KVCache
from lyanna.model.transformer import Transformer
from lyanna.sequence import Sequence
from lyanna.stats import SpecStats
from lyanna.target import TargetConfig, TargetRunner
from lyanna.verify import Verdict, sampling_rule


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch: int = 8  # running sequences per step
    max_len: int = 4096  # KV rows per sequence (prompt + output + one tree)
    rule: str | None = None  # acceptance rule by name at T > 0 (never greedy); greedy is
    #                          always used at T=0; None = the drafter scheme's default rule

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_len < 2:
            raise ValueError("max_batch must be >= 1 and max_len >= 2")
        if self.rule is not None:
            sampling_rule(self.rule)  # refused here, before any model or drafter is built


@dataclass(frozen=True, slots=True, eq=False)
class Emitted:
    sequence: Sequence
    tokens: list[int]  # newly emitted output tokens (may be empty when EOS ended it)
    verdict: Verdict | None = None  # the verification behind them; None for the prefill token


class SpecEngine:
    def __init__(
        self,
        model: Transformer,
        drafter: Drafter | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.model = model
        self.drafter = drafter or NoDrafter()
        self.config = config or EngineConfig()
        if self.config.rule is not None and not isinstance(self.drafter, NoDrafter):
            sampling_rule(self.config.rule, self.drafter.scheme)  # not at every drafted tree
        self.target = TargetRunner(
            model, TargetConfig(self.config.max_batch, self.config.max_len, self.config.rule)
        )
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.stats = SpecStats()

    @property
    def cache(self) -> KVCache:
        return self.target.cache

    @property
    def slots(self) -> dict[int, int]:
        """Running sequence id -> its target KV slot."""
        return {seq_id: self.target.slot(seq_id) for seq_id in self.running}

    def submit(self, sequence: Sequence) -> None:
        longest = len(sequence.prompt_ids) + sequence.params.max_tokens + 64
        if longest > self.cache.max_len:
            raise ValueError(f"prompt + max_tokens needs {longest} KV rows > {self.cache.max_len}")
        self.waiting.append(sequence)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> SpecStats:
        """Step until every submitted sequence has finished."""
        while self.has_work:
            self.step()
        return self.stats

    def step(self) -> list[Emitted]:
        emitted = self._admit()
        if self.running:
            emitted += self._speculate()
        for seq_id in [s for s, seq in self.running.items() if seq.finished]:
            self._retire(seq_id)
        return emitted

    def admit(self) -> list[Emitted]:
        """Prefill waiting sequences now (each emits its first token) without a verification;
        a server streams those first tokens before the next ``step``."""
        return self._admit()

    def abort(self, seq_id: int) -> bool:
        """Drop a waiting or running sequence (its client went away): frees its KV slot and
        drafter state. Returns whether the sequence was known."""
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                return True
        if seq_id in self.running:
            self._retire(seq_id)
            return True
        return False

    def _admit(self) -> list[Emitted]:
        emitted = []
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting.popleft()
            start = time.perf_counter()
            prefilled = self.target.prefill(seq.seq_id, seq.prompt_ids, seq.params, seq.generator)
            first = prefilled.first_token
            self.stats.prefill_seconds += time.perf_counter() - start
            self.stats.num_prefill_tokens += len(seq.prompt_ids)
            self.running[seq.seq_id] = seq
            emitted.append(Emitted(seq, seq.append([first])))
            if not seq.finished:
                start = time.perf_counter()
                prompt_hidden = prefilled.hidden if self.drafter.needs_hidden else None
                self.drafter.start(seq.seq_id, seq.prompt_ids, prompt_hidden, first, seq.params)
                self.stats.draft_seconds += time.perf_counter() - start
        return emitted

    def _speculate(self) -> list[Emitted]:
        seq_ids = list(self.running)
        start = time.perf_counter()
        trees = self.drafter.propose(seq_ids)
        verify_start = time.perf_counter()
        results = self.target.verify(seq_ids, trees, return_hidden=self.drafter.needs_hidden)
        updates, emitted = [], []
        for seq_id, result in zip(seq_ids, results, strict=True):
            seq, verdict = self.running[seq_id], result.verdict
            self.stats.record(verdict)
            emitted.append(Emitted(seq, seq.append(verdict.tokens), verdict))
            updates.append(
                VerifiedStep(
                    seq_id=seq_id,
                    committed=result.committed,
                    hidden=result.hidden,
                    next_token=verdict.tokens[-1],
                    num_accepted=verdict.num_accepted,
                    num_committed=result.num_committed,
                )
            )
        feedback_start = time.perf_counter()
        self.drafter.on_verified([u for u in updates if not self.running[u.seq_id].finished])
        end = time.perf_counter()
        self.stats.draft_seconds += (verify_start - start) + (end - feedback_start)
        self.stats.verify_seconds += feedback_start - verify_start
        return emitted

    def _retire(self, seq_id: int) -> None:
        self.running.pop(seq_id)
        self.target.release(seq_id)
        self.drafter.release(seq_id)
