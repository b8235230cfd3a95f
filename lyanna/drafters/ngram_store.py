"""A corpus n-gram store: what the target itself wrote after each short context, counted once
over its own answers (the self-distilled training data), so the n-gram drafter has something
to propose where the request's own text has no repeat (REST-style retrieval, without a
second model).

For each context of 1..``max_n`` tokens that preceded an answer token at least ``min_count``
times, the store keeps the ``top_k`` most frequent next tokens and their shares of those
occurrences. Contexts are 64-bit polynomial hashes (the context length seeds the hash, so a
2-gram never collides with a 3-gram by construction); a collision between two contexts of
one length would only propose a worse draft, which verification rejects, so the store can
never change what is generated.

Kept as a committed artefact (``checkpoints/ngram-smollm2-135m``: ``store.safetensors``,
``config.json``, ``manifest.json`` with its sha256, data recipe and metrics), built by
``python -m training.ngram_store``; it is tied to the tokenizer of the target that wrote the
data (``vocab_size`` is checked when a drafter loads it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from lyanna.drafters.checkpoint import checkpoint_dir, read_checkpoint
from lyanna.model.default import sha256_of

DEFAULT_STORE = "ngram-smollm2-135m"
STORE_FILE = "store.safetensors"
_MULTIPLIER = 0x9E3779B97F4A7C15  # odd: the hash is a bijection of the last token given the rest
_MASK = (1 << 64) - 1
_NONE16 = 0xFFFF  # an unused next-token slot in the saved 16-bit ids


@dataclass(frozen=True, slots=True)
class StoreConfig:
    max_n: int = 6  # longest context looked up
    min_count: int = 2  # occurrences a context needs to be kept
    top_k: int = 2  # next tokens kept per context
    vocab_size: int = 49152  # the target's vocabulary the token ids belong to

    def __post_init__(self) -> None:
        if self.max_n < 1 or self.min_count < 1 or self.top_k < 1 or self.vocab_size < 2:
            raise ValueError("max_n, min_count, top_k must be >= 1 and vocab_size >= 2")
        if self.vocab_size > _NONE16:
            raise ValueError("the store keeps token ids as 16-bit integers (below 65535)")


def context_hash(context: Sequence[int]) -> int:
    """The key of one context (what ``NgramStore.build`` computes for every n-gram)."""
    h = len(context)
    for token in context:
        h = (h * _MULTIPLIER + token + 1) & _MASK
    return h


class NgramStore:
    """Sorted context keys with the top next tokens and their shares (see the module)."""

    def __init__(
        self,
        config: StoreConfig,
        keys: np.ndarray,  # [E] uint64, ascending
        tokens: np.ndarray,  # [E, top_k] int64 (-1 = none)
        shares: np.ndarray,  # [E, top_k] float32
    ) -> None:
        if not (len(keys) == len(tokens) == len(shares)) or tokens.shape[1:] != (config.top_k,):
            raise ValueError("keys, tokens and shares must have one row per context")
        if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):
            raise ValueError("store keys must be strictly ascending")
        self.config = config
        self.keys, self.tokens, self.shares = keys, tokens, shares

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def build(
        cls, sequences: Iterable[tuple[Sequence[int], int]], config: StoreConfig
    ) -> NgramStore:
        """Count every (context, next token) over ``sequences`` of (token ids, index of the
        first answer token): contexts may reach into the prompt, next tokens are answer
        tokens only (what the target wrote, not what users wrote)."""
        chunks, targets = [], []
        offset = 0
        for ids, answer_start in sequences:
            ids = np.asarray(ids, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
                raise ValueError("token id out of the vocabulary")
            chunks.append(ids)
            # targets with a full context of at least one token inside this sequence
            targets.append(offset + np.arange(max(answer_start, 1), len(ids)))
            offset += len(ids)
        flat = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        target = np.concatenate(targets) if targets else np.zeros(0, np.int64)
        lengths = np.array([len(ids) for ids in chunks], np.int64)
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)  # each position's sequence start
        all_keys, all_next = [], []
        for n in range(1, config.max_n + 1):
            pos = target[target - n >= starts[target]]
            h = np.full(len(pos), n, dtype=np.uint64)
            for k in range(n):
                h = h * np.uint64(_MULTIPLIER) + (flat[pos - n + k] + 1).astype(np.uint64)
            all_keys.append(h)
            all_next.append(flat[pos])
        return cls._from_pairs(np.concatenate(all_keys), np.concatenate(all_next), config)

    @classmethod
    def _from_pairs(cls, keys: np.ndarray, nexts: np.ndarray, config: StoreConfig) -> NgramStore:
        order = np.lexsort((nexts, keys))
        keys, nexts = keys[order], nexts[order]
        # runs of one (key, next) pair -> its count
        new_pair = np.ones(len(keys), bool)
        new_pair[1:] = (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])
        first = np.flatnonzero(new_pair)
        counts = np.diff(np.append(first, len(keys)))
        pair_keys, pair_next = keys[first], nexts[first]
        # per key: total, and pairs ranked by count (ties: smaller token id)
        order = np.lexsort((pair_next, -counts, pair_keys))
        pair_keys, pair_next, counts = pair_keys[order], pair_next[order], counts[order]
        new_key = np.ones(len(pair_keys), bool)
        new_key[1:] = pair_keys[1:] != pair_keys[:-1]
        key_first = np.flatnonzero(new_key)
        group = np.cumsum(new_key) - 1
        totals = np.add.reduceat(counts, key_first) if len(key_first) else counts[:0]
        rank = np.arange(len(pair_keys)) - key_first[group]
        keep_key = totals >= config.min_count
        top = (rank < config.top_k) & keep_key[group]
        kept = np.flatnonzero(keep_key)
        row_of_group = np.full(len(key_first), -1)
        row_of_group[kept] = np.arange(len(kept))
        tokens = np.full((len(kept), config.top_k), -1, np.int64)
        shares = np.zeros((len(kept), config.top_k), np.float32)
        rows, cols = row_of_group[group[top]], rank[top]
        tokens[rows, cols] = pair_next[top]
        shares[rows, cols] = counts[top] / totals[group[top]]
        return cls(config, pair_keys[key_first[kept]], tokens, shares)

    def continuations(self, context: Sequence[int]) -> tuple[int, list[int], list[float]] | None:
        """(context length used, next tokens, their shares) for the longest suffix of
        ``context`` the store knows, best first; None when it knows none."""
        longest = min(self.config.max_n, len(context))
        if longest == 0 or not len(self.keys):
            return None
        wanted = np.array(
            [context_hash(context[len(context) - n :]) for n in range(longest, 0, -1)],
            dtype=np.uint64,
        )
        at = np.searchsorted(self.keys, wanted)
        for i, (row, key) in enumerate(zip(at.tolist(), wanted.tolist(), strict=True)):
            if row < len(self.keys) and int(self.keys[row]) == key:
                tokens = [t for t in self.tokens[row].tolist() if t >= 0]
                return longest - i, tokens, self.shares[row, : len(tokens)].tolist()
        return None

    # -- the committed artefact ----------------------------------------------------------

    def save(self, path: str | Path, manifest: dict | None = None) -> None:
        """``store.safetensors`` (keys as int64 bits, tokens as int16 bits, shares fp16),
        ``config.json`` and ``manifest.json`` (``manifest`` plus the store's sha256)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {
            "keys": torch.from_numpy(self.keys.view(np.int64).copy()),
            "tokens": torch.from_numpy(self.tokens.astype(np.uint16).view(np.int16).copy()),
            "shares": torch.from_numpy(self.shares).half(),
        }
        save_file(tensors, str(path / STORE_FILE))
        (path / "config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        manifest = dict(manifest or {})
        manifest["sha256"] = {STORE_FILE: sha256_of(path / STORE_FILE)}
        manifest["num_contexts"] = len(self)
        (path / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> NgramStore:
        """The store at ``path`` (``python -m training.ngram_store`` writes one); its sha256
        is checked against the manifest first."""
        settings, t = read_checkpoint(path, "n-gram store", STORE_FILE)
        config = StoreConfig(**settings)
        tokens = t["tokens"].numpy().view(np.uint16).astype(np.int64)
        tokens[tokens == _NONE16] = -1
        shares = t["shares"].float().numpy()
        return cls(config, t["keys"].numpy().view(np.uint64), tokens, shares)


@cache
def load_default_store(vocab_size: int) -> NgramStore | None:
    """The committed store when it exists and speaks ``vocab_size`` tokens, else None (the
    n-gram drafter then drafts from the request's own text only)."""
    path = checkpoint_dir(DEFAULT_STORE)
    if not (path / STORE_FILE).is_file():
        return None
    store = NgramStore.load(path)
    return store if store.config.vocab_size == vocab_size else None
