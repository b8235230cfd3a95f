"""Preallocated per-sequence key/value cache with speculative rows and commit-by-gather.

Each sequence owns a *slot*: ``length`` committed rows, followed by whatever a forward pass
wrote after them (the speculative rows of a token tree). ``commit(slot, keep)`` gathers the
accepted rows to the end of the committed prefix and drops the rest; rows past ``length`` are
never read unless a forward writes them again, so rollback is free. Nothing is reallocated or
concatenated in the decode loop.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # lyanna.model imports this module: a runtime import would be circular
    from lyanna.model.config import ModelConfig


class CacheFullError(RuntimeError):
    """No free slot, or a sequence would grow past the slot's capacity."""


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        spare_rows: int = 0,
    ) -> None:
        """``spare_rows``: rows past ``max_len`` in every slot that a forward may write but no
        commit may keep: a captured step pads its trees to a fixed width and runs every slot of
        its window, so a full slot must still have somewhere harmless to write."""
        if num_slots < 1 or max_len < 1 or spare_rows < 0:
            raise ValueError("KVCache needs at least one slot of at least one row")
        rows = max_len + spare_rows
        shape = (config.num_layers, num_slots, config.num_kv_heads, rows, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, kv_heads, T, hd]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, kv_heads, T, hd]
        self.lengths = torch.zeros(num_slots, dtype=torch.int64)  # [S] committed rows per slot
        self.max_len = max_len
        self._free = list(range(num_slots))  # a min-heap: the lowest free slot goes first, so
        # running sequences stay packed at the front and a captured step's window stays small
        self._run_of: tuple[torch.Tensor | None, slice | None] = (None, None)

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot (empty prefix)."""
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV slots are in use")
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Give the slot back; its rows become garbage."""
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    def check_room(self, slots: torch.Tensor, num_new: int) -> None:
        """Raise unless every slot has room for ``num_new`` more rows."""
        self.check_length(int(self.lengths[slots].max()) + num_new)

    def check_length(self, rows: int) -> None:
        """Raise unless a sequence of ``rows`` KV rows fits a slot."""
        if rows > self.max_len:
            raise CacheFullError(f"sequence needs {rows} KV rows, capacity is {self.max_len}")

    def write(
        self,
        layer: int,
        slots: torch.Tensor,  # [B] int64
        rows: torch.Tensor,  # [B, q] int64 absolute row index per new token
        keys: torch.Tensor,  # [B, kv_heads, q, hd]
        values: torch.Tensor,  # [B, kv_heads, q, hd]
    ) -> None:
        """Store the new tokens' keys and values (speculative until committed)."""
        index = (slots[:, None], slice(None), rows)
        self.keys[layer][index] = keys.transpose(1, 2).to(self.keys.dtype)
        self.values[layer][index] = values.transpose(1, 2).to(self.values.dtype)

    @property
    def num_rows(self) -> int:
        """Rows per slot, spare rows included (what a forward may write)."""
        return self.keys.shape[3]

    def read(
        self, layer: int, slots: torch.Tensor | slice, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [B, kv_heads, kv_len, hd]
        """The first ``kv_len`` rows of each slot: a view when ``slots`` is a slice (a
        captured step's window, no host sync) or a run of consecutive slots."""
        if isinstance(slots, slice):
            return self.keys[layer, slots, :, :kv_len], self.values[layer, slots, :, :kv_len]
        run = self._contiguous_run(slots)
        if run is not None:
            return self.keys[layer, run, :, :kv_len], self.values[layer, run, :, :kv_len]
        return self.keys[layer, slots, :, :kv_len], self.values[layer, slots, :, :kv_len]

    def _contiguous_run(self, slots: torch.Tensor) -> slice | None:
        """``slots`` as a slice when they are consecutive; every layer of a forward passes the
        same tensor, so the answer is kept for it (one check per forward, not per layer)."""
        if slots is not self._run_of[0]:
            first = int(slots[0])
            consecutive = bool((slots == torch.arange(first, first + len(slots))).all())
            self._run_of = (slots, slice(first, first + len(slots)) if consecutive else None)
        return self._run_of[1]

    def commit(self, slot: int, keep: torch.Tensor | list[int]) -> None:
        """Append the speculative rows ``length + keep`` (ascending, relative to the first
        speculative row) to the committed prefix, in that order; drop everything else."""
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        start = int(self.lengths[slot])
        num_keep = len(keep)
        if num_keep and (max(keep) + start >= self.max_len or min(keep) < 0):
            raise CacheFullError("commit refers to rows outside the slot")
        if keep != list(range(num_keep)):  # a prefix is already where it belongs
            src = torch.tensor(keep, dtype=torch.int64, device=self.keys.device) + start
            self.keys[:, slot, :, start : start + num_keep] = self.keys[:, slot, :, src]
            self.values[:, slot, :, start : start + num_keep] = self.values[:, slot, :, src]
        self.lengths[slot] = start + num_keep

    def commit_prefix(self, slot: int, count: int) -> None:
        """``commit(slot, range(count))`` without its checks and tensors: the first ``count``
        speculative rows join the committed prefix where they already are (a drafter's
        own rows, every step)."""
        start = int(self.lengths[slot])
        if not 0 <= count <= self.max_len - start:
            raise CacheFullError("commit refers to rows outside the slot")
        self.lengths[slot] = start + count

    def advance(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """``commit_prefix`` for many slots at once: slot ``slots[i]`` keeps its first
        ``counts[i]`` speculative rows (a batch decoding in lockstep)."""
        grown = self.lengths[slots] + counts.to(torch.int64)
        if bool((counts < 0).any()) or int(grown.max()) > self.max_len:
            raise CacheFullError("commit refers to rows outside the slot")
        self.lengths[slots] = grown

    def truncate(self, slot: int, length: int) -> None:
        """Roll the committed prefix back to ``length`` rows."""
        if not 0 <= length <= int(self.lengths[slot]):
            raise ValueError(f"cannot truncate slot {slot} to {length}")
        self.lengths[slot] = length
