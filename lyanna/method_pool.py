"""One ``SpecEngine`` for every method, each method's drafter built on first use and warmed
up on an engine of its own first, so a checkpoint for another model fails at build, not in
a client's request. A method that cannot start, or whose drafter failed, is ``broken``."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from lyanna.drafters import TARGET_ONLY, DraftBudget, DraftCapacity, make_drafter, tree_budget
from lyanna.drafters.base import Drafter, NoDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.model.transformer import Transformer
from lyanna.sampling import SamplingParams
from lyanna.scheduler import TREE_MARGIN
from lyanna.sequence import Sequence

logger = logging.getLogger(__name__)

BUILD_ERRORS = (OSError, ValueError, RuntimeError, KeyError)  # missing/mismatched checkpoint


def warm_up(model: Transformer, drafter: Drafter) -> None:
    """One short greedy request on a one-slot engine (a shared one's requests must not step
    meanwhile): a mismatched drafter fails here, and the kernels warm up."""
    prompt = [i % model.config.vocab_size for i in range(1, 9)]
    engine = SpecEngine(model, drafter, EngineConfig(1, len(prompt) + 4 + TREE_MARGIN))
    engine.submit(Sequence(0, prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    engine.run()


class MethodPool:
    def __init__(
        self, model: Transformer, config: EngineConfig, tree: str, budget: DraftBudget | None
    ) -> None:
        self.model, self.tree, self.budget = model, tree, budget
        self.capacity = DraftCapacity(config.max_running, config.max_len)
        self.engine = SpecEngine(model, NoDrafter(), config, method=TARGET_ONLY)
        warm_up(model, self.engine.drafter)
        self.broken: dict[str, str] = {}  # method -> why it cannot serve (logged in full)

    def serves(self, method: str) -> bool:
        if method in self.engine.drafters:
            return True
        if method in self.broken:
            return False
        try:
            budget = tree_budget(method, self.model, self.tree, self.budget)
            drafter = make_drafter(method, self.model, budget, self.capacity)
            warm_up(self.model, drafter)
            self.engine.add_method(method, drafter)
        except BUILD_ERRORS as err:
            self.broken[method] = f"{type(err).__name__}: {err}"
            logger.warning("method %r cannot start: %s", method, self.broken[method])
            return False
        logger.info("method %r ready", method)
        return True

    def first_serving(self, methods: Iterable[str]) -> str | None:
        """The first of ``methods`` that serves; falling past the first is logged."""
        methods = list(dict.fromkeys(methods))
        for method in methods:
            if self.serves(method):
                if method != methods[0]:
                    why = self.broken[methods[0]]
                    logger.warning("default %r: %s; serving %r", methods[0], why, method)
                return method
        return None

    def drop(self, method: str, why: str) -> None:
        """Stop serving ``method`` (its waiting and running sequences are aborted)."""
        self.broken[method] = why
        self.engine.remove_method(method)
