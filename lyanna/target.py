"""The target side of speculative decoding: the model, its KV cache and the acceptance rules.

``TargetRunner`` owns per-sequence target state (a KV slot, the sampling parameters, the
generator and the *next token*: the root of the next tree, decided but not yet in the KV). It
prefills a prompt (first token + prompt hidden states), verifies a batch of token trees in one
packed forward (one ``Verdict`` per sequence, accepted KV rows committed, hidden states of the
accepted path), and releases sequences. The in-process ``SpecEngine`` and the verifier service
both drive this one class, so the oracle and the service verify with the same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lyanna.model.native_layers import causal_mask
from lyanna.model.static_step import ROW_BUCKETS, StaticStep, window_inputs
from lyanna.model.transformer import Transformer
from lyanna.sampling import (
    SamplingParams,
    TokenLogprob,
    greedy_or_sample,
    logits_to_probs,
    path_counts,
    process_logits,
    token_counts,
    token_logprobs,
)
from lyanna.tree import TokenTree, pack_trees
from lyanna.verify import AcceptanceRule, Verdict, choose_rule, sampling_rule
from lyanna.verify.greedy import greedy_verdict


def prefill_prompt(
    model: Transformer, prompt_ids: list[int], cache, slot: int, decoded: list[int] | None = None
) -> torch.Tensor:  # [prompt_len + len(decoded), hidden]
    """Fill the slot with the prompt and commit it; returns the prompt's hidden states.
    ``decoded``: tokens already decoded after the prompt (a resumed sequence), run as one
    causal chain after it, which computes them exactly as decoding did (a prompt's own
    attention may round differently, see ``Transformer._native_forward``). Also
    ``lyanna.decode.prefill``."""
    device = model.embed_tokens.weight.device
    slots = torch.tensor([slot])
    hidden = []
    for start, ids in ((0, prompt_ids), (len(prompt_ids), decoded or [])):
        if not ids:
            continue
        tokens = torch.tensor([ids], dtype=torch.int64, device=device)
        positions = (start + torch.arange(len(ids), device=device))[None]
        chain = None if start == 0 else causal_mask(1, len(ids)).to(device)
        hidden.append(model(tokens, positions, cache, slots, chain)[0])
        cache.commit(slot, torch.arange(len(ids)))
    return torch.cat(hidden)


class UnknownSequenceError(KeyError):
    """The sequence id has no target state (never prefilled, or released)."""


class OutOfStepError(ValueError):
    """A caller's view of a sequence (committed length, next token) disagrees with ours."""


@dataclass(frozen=True, slots=True)
class TargetConfig:
    max_running: int = 8  # KV slots: sequences that can be in flight at once
    max_len: int = 4096  # KV rows per sequence (prompt + output + one tree)
    rule: str | None = None  # acceptance rule by name at temperature > 0 (never greedy);
    #                          None = the default lossless rule of each tree's draft scheme
    static_step: bool | None = None  # verify through ``lyanna.model.static_step`` (a CUDA
    #   graph per bucket on a GPU); None = whenever the model runs its generic forward (not
    #   the CPU's native decoder)

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_len < 2:
            raise ValueError("max_running must be >= 1 and max_len >= 2")
        if self.rule is not None:
            sampling_rule(self.rule)  # unknown: KeyError; greedy-only: LossyRuleError


@dataclass(frozen=True, slots=True, eq=False)
class Prefilled:
    first_token: int  # the first output token: root of the first tree
    hidden: torch.Tensor  # [prompt_len, hidden] final hidden states of the prompt
    num_committed: int  # tokens in the target KV (the prompt)
    logprobs: list[TokenLogprob] | None = None  # the first token's, when params.logprobs is set


@dataclass(frozen=True, slots=True, eq=False)
class Verified:
    verdict: Verdict
    committed: list[int]  # tokens that entered the KV this step: old root + accepted drafts
    hidden: torch.Tensor | None  # [len(committed), hidden] their final hidden states
    num_committed: int  # tokens in the target KV after the commit
    logprobs: list[TokenLogprob] | None = None  # one per verdict token (params.logprobs set)


@dataclass(slots=True, eq=False)
class _TargetSeq:
    slot: int
    params: SamplingParams
    generator: torch.Generator | None
    next_token: int
    counts: torch.Tensor | None = None  # [vocab] the committed output's tokens (penalties)


class TargetRunner:
    def __init__(self, model: Transformer, config: TargetConfig | None = None) -> None:
        self.model = model
        self.config = config or TargetConfig()
        static = self.config.static_step
        if static is None:
            static = model.native is None
        spare = ROW_BUCKETS[-1] if static else 0
        self.cache = model.new_cache(self.config.max_running, self.config.max_len, spare)
        self.static_step = StaticStep(model, self.cache) if static else None
        self._seqs: dict[int, _TargetSeq] = {}
        self.rule_seconds = 0.0  # cumulative: acceptance rules (with the rows' softmax) in verify

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def num_free_slots(self) -> int:
        return self.cache.num_free_slots

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def slot(self, seq_id: int) -> int:
        return self._state(seq_id).slot

    def num_committed(self, seq_id: int) -> int:
        return int(self.cache.lengths[self._state(seq_id).slot])

    def next_token(self, seq_id: int) -> int:
        return self._state(seq_id).next_token

    def prefill(
        self,
        seq_id: int,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        next_token: int | None = None,
        prompt_len: int = 0,
    ) -> Prefilled:
        """Fill a fresh slot with the prompt and decide the first token (``generator``
        defaults to one made from ``params``; the runner keeps it for later verifications).
        ``next_token`` resumes a sequence whose next token is already decided (a re-prefill of
        every committed token after a restart): it becomes the first token, nothing is drawn.
        ``prompt_len`` (resuming): the original prompt's length; the tokens after it were
        decoded and are re-run as decoding ran them, so the KV is what it was."""
        if seq_id in self._seqs:
            raise OutOfStepError(f"sequence {seq_id} is already prefilled")
        # (requests are checked at the edges: the HTTP intake, the gRPC codec)
        assert prompt_ids and 0 <= prompt_len <= len(prompt_ids), "an empty prompt"
        vocab = self.model.config.vocab_size
        assert all(token < vocab for token, _ in params.logit_bias), "logit_bias past the vocab"
        if generator is None and not params.greedy:
            generator = params.make_generator()
        split = prompt_len or len(prompt_ids)
        # the output so far: the decoded tokens a resumed sequence re-runs (none when fresh)
        counts = token_counts(prompt_ids[split:], vocab) if params.penalized else None
        slot = self.cache.allocate()
        try:
            hidden = prefill_prompt(  # [P, hidden]
                self.model, prompt_ids[:split], self.cache, slot, prompt_ids[split:]
            )
        except Exception:
            self.cache.release(slot)
            raise
        logprobs = None
        if next_token is None:
            last = self.model.logits(hidden[-1:])
            first = int(greedy_or_sample(last, params, generator, counts))
            if params.logprobs is not None:
                logprobs = token_logprobs(last, [first], params.logprobs)
        else:
            first = next_token
        self._seqs[seq_id] = _TargetSeq(slot, params, generator, first, counts)
        return Prefilled(first, hidden, len(prompt_ids), logprobs)

    def verify(
        self,
        seq_ids: list[int],
        trees: list[TokenTree],
        return_hidden: bool = False,
    ) -> list[Verified]:
        """One target forward over all trees, the acceptance rule per sequence, and the KV
        commit of each accepted path. Every tree's root must be the sequence's next token.
        Rules are chosen first, so a refused rule changes no sequence's state."""
        states = [self._state(s) for s in seq_ids]
        for seq_id, state, tree in zip(seq_ids, states, trees, strict=True):
            if int(tree.tokens[0]) != state.next_token:
                raise OutOfStepError(
                    f"sequence {seq_id}: tree root {int(tree.tokens[0])} is not the next "
                    f"token {state.next_token}"
                )
        rules = [self._rule(state.params, tree) for state, tree in zip(states, trees, strict=True)]
        # rows in slot order: when the slots form a run (a full batch always does, whatever
        # order sequences arrived in), every layer reads the KV as a view instead of a copy
        hidden, logits, best, row_of = self._forward(states, trees)
        rules_start = time.perf_counter()
        results = []
        for index, (state, tree, rule) in enumerate(zip(states, trees, rules, strict=True)):
            row = row_of[index]
            raw = logits[row, : tree.num_nodes]  # [num_nodes, vocab]
            rows = self._processed(state, tree, raw)
            if not state.params.greedy:  # the sampling rules draw on CPU generators and
                # meet the trees' CPU draft rows: a GPU model's rows go to the CPU first
                rows = logits_to_probs(rows.cpu(), state.params.temperature, state.params.top_p)
            if best is not None and rule.name == "greedy" and rows is raw:
                verdict = greedy_verdict(tree, best[row])  # the argmax the step computed
            else:
                verdict = rule(tree, rows, state.generator)
            self.cache.commit(state.slot, verdict.path)
            state.next_token = verdict.tokens[-1]
            committed = [tree.token_list[i] for i in verdict.path]
            if state.counts is not None:
                state.counts.index_add_(0, torch.tensor(committed), torch.ones(len(committed)))
            logprobs = None
            if state.params.logprobs is not None:
                logprobs = token_logprobs(raw[verdict.path], verdict.tokens, state.params.logprobs)
            results.append(
                Verified(
                    verdict=verdict,
                    committed=committed,
                    hidden=hidden[row, verdict.path] if return_hidden else None,
                    num_committed=int(self.cache.lengths[state.slot]),
                    logprobs=logprobs,
                )
            )
        self.rule_seconds += time.perf_counter() - rules_start
        return results

    def release(self, seq_id: int) -> bool:
        """Free the sequence's slot; False when it was not known."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return False
        self.cache.release(state.slot)
        return True

    def _forward(
        self, states: list[_TargetSeq], trees: list[TokenTree]
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]] | None, list[int]]:
        """One target forward over every tree: hidden states and float32 logits by row, the
        row of each tree, and (static step) every row's argmax, read back in one copy."""
        cache, step = self.cache, self.static_step
        if step is not None and max(t.num_nodes for t in trees) <= ROW_BUCKETS[-1]:
            slots = [state.slot for state in states]
            for slot, tree in zip(slots, trees, strict=True):
                cache.check_length(int(cache.lengths[slot]) + tree.num_nodes)
            key = step.key_for(max(slots), max(t.num_nodes for t in trees))
            inputs = window_inputs(
                key,
                cache.lengths,
                slots,
                [list(t.token_list) for t in trees],
                [list(t.depth_list) for t in trees],
                [t.attention_mask() for t in trees],
                self.model.config.max_position_embeddings - 1,
            )
            out = step.run(key, inputs)
            return out.hidden, out.logits, out.best.tolist(), slots
        # rows in slot order: when the slots form a run (a full batch always does, whatever
        # order sequences arrived in), every layer reads the KV as a view instead of a copy
        order = sorted(range(len(states)), key=lambda i: states[i].slot)
        slots_tensor = torch.tensor([states[i].slot for i in order])
        if all(tree.num_nodes == 1 for tree in trees):  # plain decoding: one row each, no
            # tree mask to build (the causal default is the same); the loop's hottest case
            tokens = torch.tensor([[trees[i].token_list[0]] for i in order])
            positions = cache.lengths[slots_tensor][:, None]
            hidden = self.model(tokens, positions, cache, slots_tensor)
        else:
            packed = pack_trees([trees[i] for i in order], cache.lengths[slots_tensor])
            hidden = self.model(packed.tokens, packed.positions, cache, slots_tensor, packed.mask)
        logits = self.model.logits(hidden)  # [B, n_max, vocab], rows in slot order
        row_of = [0] * len(order)
        for row, i in enumerate(order):
            row_of[i] = row
        return hidden, logits, None, row_of

    @staticmethod
    def _processed(state: _TargetSeq, tree: TokenTree, raw: torch.Tensor) -> torch.Tensor:
        """The tree's rows after the request's logits processors, each node with its own
        output history (committed output + its path: root and ancestors); the raw rows when
        none is on. This is the distribution speculation is lossless against."""
        params = state.params
        if not params.processed:
            return raw
        counts = None
        if state.counts is not None:
            paths = [tree.path_to(i) for i in range(tree.num_nodes)]
            counts = path_counts(state.counts, tree.token_list, paths)
        return process_logits(raw, params, counts)

    def _rule(self, params: SamplingParams, tree: TokenTree) -> AcceptanceRule:
        """Greedy at temperature 0, else the configured rule (refused with `LossyRuleError`
        unless lossless for this tree's scheme) or the scheme's default."""
        return choose_rule(tree, params.temperature, self.config.rule)

    def _state(self, seq_id: int) -> _TargetSeq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id}") from None
