"""The target's decode / verify step over device-resident state of fixed shapes, captured once
per bucket as a CUDA graph on a GPU (nano-vllm's ``model_runner`` idea, for token trees).

A step runs a *window* of KV slots ``[0, batch)``: batch row b is slot b, so attention reads
each layer's cache as a view and nothing is gathered. Sequences of the window that are not in
this step ride along as inactive rows (one token attending to itself, written into rows past
their committed prefix, never kept). Every tree is padded to ``rows`` nodes (padding nodes see
only themselves), and attention reads ``kv_len`` rows per slot under a mask built on the
device from the committed lengths. ``(batch, rows, kv_len)`` is the bucket: the shapes, and
so the graph, depend on nothing else. The cache keeps ``ROW_BUCKETS[-1]`` spare rows per slot
(``KVCache(spare_rows=...)``), so a padded or inactive row always has somewhere to write.

The host fills four small input buffers (tokens, positions, lengths, tree masks), replays the
step, and reads back one tensor for greedy sequences: the argmax of every node. Prefills keep
the eager forward: their lengths vary and they run once per request.

The step function is plain PyTorch: the CPU tests run it eagerly, ``bench.graph_check``
traces it with ``torch.compile(fullgraph=True)``, and a GPU captures it. ``CapturedSteps``
(step functions by bucket key, a CUDA graph each on a GPU) and ``window_context`` (the
device-built mask over a window) also run the learned drafters' steps
(``lyanna.drafters.static_draft``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from lyanna.model.kv_cache import KVCache
from lyanna.model.transformer import ForwardContext, Transformer

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # nodes per tree, root included
KV_MIN_BUCKET = 128  # rows attention reads per slot: powers of two from here


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds ``n``; ``ValueError`` past the largest."""
    for size in buckets:
        if n <= size:
            return size
    raise ValueError(f"{n} is past the largest bucket {buckets[-1]}")


def kv_buckets(num_rows: int) -> tuple[int, ...]:
    """Powers of two from ``KV_MIN_BUCKET``, capped by the rows a slot has."""
    sizes, size = [], KV_MIN_BUCKET
    while size < num_rows:
        sizes.append(size)
        size *= 2
    return (*sizes, num_rows)


@dataclass(frozen=True, slots=True)
class StepKey:
    """One bucket: one set of shapes, one captured graph."""

    batch: int  # slots in the window [0, batch)
    rows: int  # nodes per tree after padding
    kv_len: int  # rows attention reads per slot


@dataclass(frozen=True, slots=True, eq=False)
class StepInputs:
    """What the host hands a step, on the host (copied into the bucket's device buffers)."""

    tokens: torch.Tensor  # [batch, rows] int64
    positions: torch.Tensor  # [batch, rows] int64
    lengths: torch.Tensor  # [batch] int64 committed rows of each slot
    tree_mask: torch.Tensor  # [batch, rows, rows] bool, True = may attend


@dataclass(frozen=True, slots=True, eq=False)
class StepOutputs:
    """On the model's device; a captured step's buffers are overwritten by its next replay."""

    hidden: torch.Tensor  # [batch, rows, hidden] final (post-norm) hidden states
    logits: torch.Tensor  # [batch, rows, vocab] float32
    best: torch.Tensor  # [batch, rows] int64 argmax of each row (lowest index on ties)


def step_forward(
    model: Transformer,
    cache: KVCache,
    window: torch.Tensor,  # [batch] int64 = arange(batch) on the cache's device
    kv_len: int,
    tokens: torch.Tensor,  # [batch, rows] int64
    positions: torch.Tensor,  # [batch, rows] int64
    lengths: torch.Tensor,  # [batch] int64
    tree_mask: torch.Tensor,  # [batch, rows, rows] bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # hidden, logits, best
    """One forward of the window with its logits and argmax: device tensors in, device
    tensors out, no host sync, shapes fixed by ``(batch, rows, kv_len)``."""
    B, q = tokens.shape
    rows = lengths[:, None] + torch.arange(q, device=tokens.device)  # [B, q] cache rows written
    ctx = window_context(
        cache,
        window,
        kv_len,
        lengths,
        rows,
        positions,
        tree_mask,
        model.rope_cos,
        model.rope_sin,
        model.attention_dtype,
    )
    x = model.embed_tokens(tokens)
    for i, layer in enumerate(model.layers):
        x = layer(x, ctx, i)
    hidden = model.norm(x)
    logits = model.lm_head(hidden).float()
    return hidden, logits, logits.argmax(dim=-1)


def window_context(
    cache: KVCache,
    window: torch.Tensor,  # [batch] int64 = arange(batch) on the cache's device
    kv_len: int,
    lengths: torch.Tensor,  # [batch] int64 committed rows of each slot
    rows: torch.Tensor,  # [batch, q] int64 the cache row each new token writes
    positions: torch.Tensor,  # [batch, q] int64
    visible: torch.Tensor,  # [batch, q, width] bool: the tree rows each new token sees
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    attention_dtype: torch.dtype | None = None,
) -> ForwardContext:
    """The context of a step over a window of slots, built on the device: new token i of
    slot b sees the slot's ``lengths[b]`` committed rows and the tree rows r (cache row
    ``lengths[b] + r``, ``r < width``) where ``visible[b, i, r]``. The target's verify step
    and the learned drafters' steps (``lyanna.drafters.static_draft``) share it."""
    B, q, width = visible.shape
    cols = torch.arange(kv_len, device=visible.device)
    relative = cols[None, None, :] - lengths[:, None, None]  # [B, 1, kv]: tree row, < 0: committed
    in_tree = visible.gather(2, relative.clamp(0, width - 1).expand(B, q, kv_len))
    mask = (relative < 0) | ((relative < width) & in_tree)
    return ForwardContext(
        cache=cache,
        slots=window,
        rows=rows,
        kv_len=kv_len,
        cos=cos_table[positions].unsqueeze(1),
        sin=sin_table[positions].unsqueeze(1),
        mask=mask.unsqueeze(1),
        read_slots=slice(0, B),
        attention_dtype=attention_dtype,
        static=True,
    )


StepFunction = Callable[..., tuple[torch.Tensor, ...]]


class _Captured:
    """One bucket's CUDA graph: static input buffers, the graph, its output buffers."""

    def __init__(
        self,
        fn: StepFunction,
        inputs: tuple[torch.Tensor, ...],
        device: torch.device,
        pool: object,
    ) -> None:
        # buffers of its own: an input already on the device (another step's output) is
        # copied, never aliased
        self.buffers = [t.to(device, copy=True) for t in inputs]
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm up (allocator, cuBLAS handles) off the graph
            for _ in range(2):
                fn(*self.buffers)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a drafter beside it) do not void the capture
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = fn(*self.buffers)

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for buffer, value in zip(self.buffers, inputs, strict=True):
            buffer.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.outputs


class CapturedSteps:
    """Step functions by bucket key, each made once by ``make(key)``: captured as a CUDA graph
    when ``capture`` (the default on a GPU: static input buffers that every run fills before
    it replays the graph), run eagerly otherwise, or through ``wrap`` (``bench.graph_check``
    passes ``torch.compile``). A step takes and returns device tensors whose shapes depend on
    its key alone. A captured step's outputs are its graph's buffers: the next run of the
    same key overwrites them (``capture`` tells a caller to clone what it keeps). The
    target's ``StaticStep`` and the learned drafters' steps (``lyanna.drafters.static_draft``)
    both run on it. ``keys_seen`` lists the buckets run so far, in first-use order."""

    def __init__(
        self,
        device: torch.device,
        make: Callable[[Hashable], StepFunction],
        capture: bool | None = None,
        wrap: Callable[[StepFunction], StepFunction] | None = None,
    ) -> None:
        self.device, self.make, self.wrap = device, make, wrap
        self.capture = device.type == "cuda" if capture is None else capture
        self.keys_seen: list[Hashable] = []
        self._functions: dict[Hashable, StepFunction] = {}
        self._graphs: dict[Hashable, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @torch.inference_mode()
    def run(self, key: Hashable, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        function = self._functions.get(key)
        if function is None:
            self.keys_seen.append(key)
            function = self.make(key)
            function = self._functions[key] = self.wrap(function) if self.wrap else function
        if not self.capture:
            return function(*(t.to(self.device) for t in inputs))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _Captured(function, inputs, self.device, self._pool)
        return graph.replay(inputs)


def _fields(inputs: StepInputs) -> tuple[torch.Tensor, ...]:
    return inputs.tokens, inputs.positions, inputs.lengths, inputs.tree_mask


class StaticStep:
    """Runs ``step_forward`` per bucket on ``CapturedSteps``: captured as a CUDA graph when
    ``capture`` (the default on a GPU), eagerly otherwise, or through ``wrap``
    (``bench.graph_check`` passes ``torch.compile``). ``keys_seen`` lists the buckets run so
    far, in first-use order."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        capture: bool | None = None,
        wrap: Callable[[StepFunction], StepFunction] | None = None,
    ) -> None:
        if cache.num_rows < cache.max_len + ROW_BUCKETS[-1]:
            raise ValueError("a static step needs a cache with ROW_BUCKETS[-1] spare rows")
        self.model, self.cache = model, cache
        self.device = cache.keys.device
        self.steps = CapturedSteps(self.device, self._function, capture, wrap)
        self.capture, self.wrap = self.steps.capture, wrap
        self.kv_buckets = kv_buckets(cache.num_rows)
        self.batch_buckets = window_buckets(cache.num_slots)
        self._window = torch.arange(cache.num_slots, device=self.device)

    @property
    def keys_seen(self) -> list[StepKey]:
        return self.steps.keys_seen  # type: ignore[return-value]

    @property
    def _graphs(self) -> dict:
        return self.steps._graphs

    def key_for(self, max_slot: int, max_nodes: int) -> StepKey:
        """The bucket of a step whose highest slot is ``max_slot`` and largest tree has
        ``max_nodes`` nodes (from the cache's CPU lengths: no device read)."""
        batch = bucket(max_slot + 1, self.batch_buckets)
        rows = bucket(max_nodes, ROW_BUCKETS)
        longest = int(self.cache.lengths[:batch].max())
        return StepKey(batch, rows, bucket(longest + rows, self.kv_buckets))

    def run(self, key: StepKey, inputs: StepInputs) -> StepOutputs:
        return StepOutputs(*self.steps.run(key, _fields(inputs)))

    def _function(self, key: StepKey) -> StepFunction:
        model, cache, window = self.model, self.cache, self._window[: key.batch]

        def step(tokens, positions, lengths, tree_mask):
            return step_forward(
                model, cache, window, key.kv_len, tokens, positions, lengths, tree_mask
            )

        return step


def window_buckets(num_slots: int) -> tuple[int, ...]:
    """``BATCH_BUCKETS`` below ``num_slots``, then ``num_slots``: the windows a cache has."""
    return tuple(b for b in BATCH_BUCKETS if b < num_slots) + (num_slots,)


def window_inputs(
    key: StepKey,
    lengths: torch.Tensor,  # [num_slots] int64, the cache's CPU lengths
    slots: list[int],
    tokens: list[list[int]],  # each sequence's tree tokens, root first
    depths: list[list[int]],  # each node's depth, root 0
    masks: list[torch.Tensor],  # each [n, n] bool: node i may attend to node j
    max_position: int,  # the model's last position (a full inactive slot's next is past it)
) -> StepInputs:
    """The host side of a step: trees placed at their slots' rows, everything else padding
    (inactive slots and padding nodes: token 0 at the slot's next position, seeing only
    itself)."""
    B, q = key.batch, key.rows
    window_lengths = lengths[:B].clone()
    token_grid = torch.zeros(B, q, dtype=torch.int64)
    position_grid = window_lengths.clamp(max=max_position)[:, None].repeat(1, q)
    mask_grid = torch.eye(q, dtype=torch.bool).repeat(B, 1, 1)
    for slot, ids, depth, mask in zip(slots, tokens, depths, masks, strict=True):
        n = len(ids)
        token_grid[slot, :n] = torch.tensor(ids, dtype=torch.int64)
        position_grid[slot, :n] += torch.tensor(depth, dtype=torch.int64)
        mask_grid[slot, :n, :n] = mask
    return StepInputs(token_grid, position_grid, window_lengths, mask_grid)
