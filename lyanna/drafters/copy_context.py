"""Each drafting sequence's copy context (``LyannaDraftConfig.info_copy``): the copy keys of
its committed tokens and the target's states at them, in rows per draft-KV slot as a KV cache
keeps its rows. A batch's contexts are then a view (one sequence) or one gather on the host
loop, and the same two tensors on every replay of a captured device step
(``static_draft.lyanna_steps``), which reads the first ``kv_len`` rows of each window slot
under the mask of its slot's length.

Storage: with ``rows`` given (a captured step holds the tensors, so they never move) the rows
are fixed; without, they start small and double as the longest context grows (the host loop
on a CPU: memory as long as the contexts, not ``max_len``)."""

from __future__ import annotations

import torch


class CopyContexts:
    def __init__(
        self,
        num_slots: int,
        key_dim: int,
        value_dim: int,
        device: torch.device | str,
        rows: int | None = None,  # fixed rows per slot; None: grow by doubling
    ) -> None:
        self.fixed = rows is not None
        # float32 as training reads them (a bf16 target's states too): one rule everywhere
        self.keys = torch.zeros(num_slots, rows or 64, key_dim, device=device)
        self.values = torch.zeros(num_slots, rows or 64, value_dim, device=device)
        self.lengths = [0] * num_slots  # committed rows per slot (host bookkeeping)

    def reset(self, slot: int) -> None:
        """A new sequence in ``slot``: its context starts empty (old rows stay, masked)."""
        self.lengths[slot] = 0

    def append(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append rows (keys [m, dk], values [m, n]) to the slot's context."""
        start = self.lengths[slot]
        end = start + keys.shape[0]
        if end > self.keys.shape[1]:
            if self.fixed:
                raise ValueError(f"a copy context of {end} rows exceeds {self.keys.shape[1]}")
            self._grow(end)
        self.keys[slot, start:end] = keys
        self.values[slot, start:end] = values
        self.lengths[slot] = end

    def _grow(self, need: int) -> None:
        old = self.keys.shape[1]
        slots, rows = self.keys.shape[0], max(2 * need, 64)
        keys = self.keys.new_zeros(slots, rows, self.keys.shape[2])
        values = self.values.new_zeros(slots, rows, self.values.shape[2])
        keys[:, :old], values[:, :old] = self.keys, self.values
        self.keys, self.values = keys, values

    def padded(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The contexts of ``slots`` padded to the longest: keys [B, L, dk], values [B, L, n]
        and visible [B, L] bool (one sequence: views, nothing copied)."""
        lengths = [self.lengths[s] for s in slots]
        width = max(lengths)
        device = self.keys.device
        if len(slots) == 1:
            s = slots[0]
            visible = torch.ones(1, width, dtype=torch.bool, device=device)
            return self.keys[s : s + 1, :width], self.values[s : s + 1, :width], visible
        index = torch.tensor(slots, device=device)
        visible = torch.arange(width, device=device) < torch.tensor(lengths, device=device)[:, None]
        return self.keys[index, :width], self.values[index, :width], visible

    def window(
        self, batch: int, kv_len: int, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inside a device step: the first ``kv_len`` rows of window slots ``[0, batch)``,
        visible below each slot's ``lengths`` [batch] (a device tensor: no host read)."""
        visible = torch.arange(kv_len, device=lengths.device) < lengths[:, None]
        return self.keys[:batch, :kv_len], self.values[:batch, :kv_len], visible
