"""Weights on transparent huge pages (Linux): one anonymous mapping advised with
``MADV_HUGEPAGE`` holds every weight tensor of a CPU model, moved there in place.

A decode step streams the whole model (about 100 MB for the 4-bit default) through 4 KB
pages: some 25,000 pages, far more than the TLB holds, so every step refills it, and the
Python and small torch ops that run between two forwards (drafting, the acceptance rule,
bookkeeping) start from an evicted TLB as well as evicted caches. On 2 MB pages the same bytes
are about 50 pages. Measured on Zen 5, 2 threads, batch 1 (docs/benchmarks.md): decode
tokens/s +1.3-1.9 % for AR and every speculative method over three alternating pairs of
Spec-Bench runs, +2-3 % in one process switching between the placements. Most Linux kernels ship
transparent huge pages in ``madvise`` mode, so the advice is what makes them huge; elsewhere
(``never``, another OS) the mapping is ordinary memory and nothing changes.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 4096  # each tensor starts on its own page (and well past any vector alignment)
MIN_BYTES = 4096  # smaller tensors (norm weights, biases) stay where they are
ENV = "LYANNA_HUGE_PAGES"  # "0": leave the weights where they were loaded (an A/B, a fallback)


class WeightArena:
    """The mapping the moved tensors live in; it must outlive them (the model keeps it)."""

    def __init__(self, nbytes: int) -> None:
        size = -(-(nbytes + HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE  # room to align the start
        self.mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
        if advice is not None:
            self.mapping.madvise(advice)
        self._buffer = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self._used = (-self._buffer.data_ptr()) % HUGE_PAGE
        self.nbytes = 0  # bytes of the tensors moved here

    def __deepcopy__(self, memo: dict) -> WeightArena:
        return self  # a copied model's tensors get storages of their own; sharing is harmless

    def __reduce__(self):  # a pickled model's tensors are copied out; the mapping is not
        return (_no_arena, ())

    def take(self, tensors: list[torch.Tensor]) -> None:
        """Copy one tensor's values here (``tensors``: every object that views them alike,
        contiguous, on the CPU) and point each object at the copy, in place."""
        first = tensors[0]
        n = first.numel() * first.element_size()
        view = self._buffer[self._used : self._used + n].view(first.dtype).view(first.shape)
        view.copy_(first)
        storage, offset = view.untyped_storage(), view.storage_offset()
        with torch.inference_mode():  # packed weights may be inference tensors
            for tensor in tensors:
                tensor.set_(storage, offset, view.shape, view.stride())
        self._used += -(-n // ALIGN) * ALIGN
        self.nbytes += n


def _no_arena() -> None:
    return None


def weight_tensors(modules: Iterable[nn.Module]) -> list[list[torch.Tensor]]:
    """Every CPU tensor of at least ``MIN_BYTES`` that ``modules`` hold (parameters, buffers,
    tensors kept as attributes or in lists: packed weights, the native decoder's per-layer
    lists), grouped by storage: each group is the objects that view one whole storage alike.
    A storage viewed in different ways is left alone, since its views could not all move."""
    objects: dict[int, dict[int, torch.Tensor]] = {}  # storage -> id -> tensor
    for module in modules:
        for sub in module.modules():
            values = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
            for value in vars(sub).values():
                if isinstance(value, torch.Tensor):
                    values.append(value)
                elif isinstance(value, list | tuple):
                    values += [v for v in value if isinstance(v, torch.Tensor)]
            for tensor in values:
                plain = tensor.layout == torch.strided and not tensor.is_mkldnn  # not opaque
                if plain and tensor.device.type == "cpu" and tensor.numel() > 0:
                    key = tensor.untyped_storage().data_ptr()
                    objects.setdefault(key, {})[id(tensor)] = tensor
    groups = []
    for found in objects.values():
        group = list(found.values())
        first = group[0]
        nbytes = first.numel() * first.element_size()
        views = {(t.storage_offset(), tuple(t.shape), t.stride(), t.dtype) for t in group}
        whole = first.untyped_storage().nbytes() == nbytes and first.is_contiguous()
        if len(views) == 1 and whole and nbytes >= MIN_BYTES:
            groups.append(group)
    return groups


def move_to_huge_pages(*modules: nn.Module) -> WeightArena | None:
    """Move the weights of ``modules`` into one huge-page arena; None when there is nothing
    to move. Inference only: the tensors keep their values, and training would not notice
    either, but nothing here is meant for parameters that change."""
    groups = weight_tensors(modules)
    if not groups or not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows: no anonymous mmap)
        return None
    sizes = [g[0].numel() * g[0].element_size() for g in groups]
    arena = WeightArena(sum(-(-n // ALIGN) * ALIGN for n in sizes))
    for group in groups:
        arena.take(group)
    return arena


def on_huge_pages(module: nn.Module) -> nn.Module:
    """``module`` with its weights moved to huge pages (unless ``LYANNA_HUGE_PAGES=0``); the
    arena rides on the module as ``weight_arena``, so it lives exactly as long."""
    if os.environ.get(ENV, "1") != "0":
        module.weight_arena = move_to_huge_pages(module)
    return module
