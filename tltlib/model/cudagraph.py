"""CUDA graphs for the rollout's small-batch forwards: capture once per bucket, replay with one launch.

At small batch a decode iteration is hundreds of kernels with a few microseconds of work each, so the GPU waits on
the Python host that launches them; SD makes it worse (a chain of drafter forwards per SD step). As in the paper's
engine (SGLang captures graphs per batch size and speculative strategy), :class:`GraphPool` captures any row-batched
function over KV caches — the target's decode forward, its verify forward, the drafter's chain or tree draft — once
per key and replays it afterwards. The key:

* the **row bucket**: the running rows padded up to 1, 2, 4, 8, ... (:func:`row_bucket`). Padded rows are dead cache
  rows (beyond :attr:`KVCache.rows`): their lengths are zeroed before the call, their inputs copy row 0's (always
  valid) and their outputs are dropped;
* the **span bucket**: attention reads a fixed number of cache slots, the used span rounded up to ``min_span`` times a
  power of two (:func:`span_bucket`), masked from the device-side lengths (the pool sets the cache's
  :attr:`~tltlib.kv.dense.KVCache.fixed_span` around the call, so the functions themselves know nothing of graphs);
* the inputs' shapes past the row dimension, their dtypes, and the function's name (which stands for its static
  arguments: strategy, offset, depth).

Outputs are copied out right after a replay, so all graphs can share one memory pool (a graph's output is never
read after another graph ran). Randomness stays outside: a captured function gets its uniforms as an input.

Every graphed forward of a rollout goes through one :class:`Replay` (``replay(name, fn, cache, new_slots,
*inputs)``): without a pool it is ``fn(*inputs)``; with one, the graph of the bucket. On a CPU (or with
``capture=False``) :meth:`GraphPool.run` executes the same padded, fixed-span call eagerly: the tests check that this
gives the eager path's results, which covers everything graph replay adds except the replay.

A key whose capture fails runs eagerly from then on, with a ``RuntimeWarning`` ("CUDA graph capture of ...") and a
count (``GraphPool.stats["fallbacks"]``, a rollout's ``rollout/graph_fallbacks``); the gpu test tier turns that
warning into an error.

Departure: the reference engine (SGLang) pads the batch inside a paged KV pool; here the dense cache's spare rows are
the padding, so a bucket never exceeds the rows the cache was allocated with (the top bucket is that row count).
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import BadInput
from ..kv.dense import KVCache


@dataclass(frozen=True)
class GraphConfig:
    """When and how the rollout replays CUDA graphs (no effect on a CPU)."""

    enabled: bool = True
    """Capture and replay CUDA graphs on CUDA devices."""
    max_rows: int = 64
    """Batches of more running rows run eagerly (their launches are amortised over many rows)."""
    min_span: int = 256
    """Smallest attention span bucket in cache slots; buckets double from there up to the cache length."""

    def __post_init__(self):
        if self.max_rows < 1:
            raise BadInput(f"GraphConfig.max_rows must be >= 1, got {self.max_rows}")
        if self.min_span < 1:
            raise BadInput(f"GraphConfig.min_span must be >= 1, got {self.min_span}")

    def active(self, device) -> bool:
        """Whether forwards on ``device`` (a ``torch.device`` or its name) replay graphs: enabled, on CUDA (the one
        rule of the rollout's workspace and of the cost model's measurement)."""
        return self.enabled and torch.device(device).type == "cuda"


def row_bucket(rows: int, allocated: int, max_rows: int) -> int | None:
    """The padded row count for ``rows`` running rows: the smallest power of two >= rows, capped at the
    ``allocated`` cache rows; None (run eagerly) when ``rows > max_rows`` or ``rows < 1``."""
    if rows < 1 or rows > max_rows or rows > allocated:
        return None
    return min(1 << (rows - 1).bit_length(), allocated)


def span_bucket(span: int, max_len: int, min_span: int) -> int:
    """Attention span for ``span`` used slots: ``min_span * 2**k >= span``, capped at ``max_len``."""
    if span > max_len:
        raise BadInput(f"span {span} exceeds the cache length {max_len}")
    b = min_span
    while b < span:
        b *= 2
    return min(b, max_len)


class GraphPool:
    """Captured graphs of row-batched functions over the given KV caches (see the module docstring).

    Args:
        caches: every cache the functions read or write (their spare rows are the padding); all must have the same
            allocated row count.
        config: buckets and the row limit.
        capture: capture CUDA graphs (default: when the caches are on a CUDA device); False runs the same padded,
            fixed-span calls eagerly.
    """

    def __init__(self, caches: Sequence[KVCache], config: GraphConfig | None = None, capture: bool | None = None):
        self.caches = list(caches)
        self.config = config or GraphConfig()
        allocated = {c.capacity for c in self.caches}
        if len(allocated) != 1:
            raise BadInput(f"GraphPool: the caches hold different row counts {sorted(allocated)}")
        self.allocated = allocated.pop()
        dev = self.caches[0].lengths.device
        self.capture = dev.type == "cuda" if capture is None else capture
        if self.capture and dev.type != "cuda":
            raise BadInput("GraphPool(capture=True) needs caches on a CUDA device")
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._entries: dict[tuple, tuple] = {}        # key -> (graph or None: eager, static inputs, static outputs)
        self.stats = {"captures": 0, "replays": 0, "eager": 0, "capture_s": 0.0, "fallbacks": 0}
        """``fallbacks``: keys whose capture failed and that run eagerly from then on (each also a warning)."""

    def run(self, name: str, fn: Callable, cache: KVCache, new_slots: int,
            inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``fn(*inputs)`` for the running rows (``inputs[0].shape[0]``), padded to the row bucket and run at a fixed
        attention span.

        Args:
            name: stands for ``fn``'s static arguments (two calls with one name and the same shapes must compute
                the same function).
            fn: returns a tensor or a tuple of tensors, each with the row dimension first.
            cache: the cache whose span is bucketed (its used slots plus ``new_slots``, the entries this call writes
                after them) and fixed while ``fn`` runs.
            inputs: tensors with the running rows first.

        Returns the outputs' first rows (copies). Rows beyond :attr:`GraphConfig.max_rows` run ``fn(*inputs)``
        unpadded at the used span."""
        rows = int(inputs[0].shape[0])
        bucket = row_bucket(rows, self.allocated, self.config.max_rows)
        if bucket is None:
            self.stats["eager"] += 1
            return _as_tuple(fn(*inputs))
        span = span_bucket(cache.max_used + new_slots, cache.max_len, self.config.min_span)
        key = (name, bucket, span, tuple((tuple(x.shape[1:]), x.dtype) for x in inputs))
        cache.make_room(new_slots)             # a paged cache's pages are taken on the host, before the graph runs
        saved = [c.rows for c in self.caches]
        for c in self.caches:                  # padded rows are dead rows: start them empty
            c.lengths[rows:bucket].zero_()
            c.rows = bucket
        cache.fixed_span = span
        try:
            entry = self._entries.get(key)
            if entry is None:
                statics = [x.new_empty((bucket, *x.shape[1:])) for x in inputs]
                _fill(statics, inputs, rows)
                entry = self._entries[key] = self._build(key, fn, statics)
            else:
                _fill(entry[1], inputs, rows)
            graph, _, outs = entry
            if graph is not None:
                graph.replay()
                self.stats["replays"] += 1
            else:
                outs = _as_tuple(fn(*entry[1]))
                self.stats["eager"] += 1
            return tuple(o[:rows].clone() for o in outs)
        finally:
            cache.fixed_span = None
            for c, r in zip(self.caches, saved):
                c.rows = r

    def _build(self, key, fn, statics):
        if not self.capture:
            return None, statics, None
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):           # warm-up off the capture (lazy init, autotuning)
            for _ in range(2):
                fn(*statics)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outs = _as_tuple(fn(*statics))
        except RuntimeError as e:                 # e.g. a host sync inside fn: this key runs eagerly from now on
            self.stats["fallbacks"] += 1
            warnings.warn(f"CUDA graph capture of {key[0]!r} ({key[1]} rows) failed, running it eagerly: {e}",
                          RuntimeWarning, stacklevel=3)
            return None, statics, None
        torch.cuda.synchronize()
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        return graph, statics, outs


class Replay:
    """The one door every graphed forward of a rollout goes through (decode, verify, chain and tree drafts; the
    prefill and the drafter's catch-up run eagerly: their widths vary too much to bucket).

    ``replay(name, fn, cache, new_slots, *inputs)`` is ``fn(*inputs)`` as a tuple; with a :class:`GraphPool` (a rollout
    on CUDA) it is the captured graph of the row and span bucket instead (see :meth:`GraphPool.run` for the
    arguments). Call sites look the same either way."""

    def __init__(self, pool: GraphPool | None = None):
        self.pool = pool

    def __call__(self, name: str, fn: Callable, cache: KVCache, new_slots: int,
                 *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.pool is None:
            return _as_tuple(fn(*inputs))
        return self.pool.run(name, fn, cache, new_slots, inputs)


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _fill(statics: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], rows: int) -> None:
    """Copy the inputs into the static buffers' first rows; the padded rows repeat row 0 (always a valid input)."""
    for s, x in zip(statics, inputs):
        s[:rows].copy_(x)
        if s.shape[0] > rows:
            s[rows:].copy_(x[:1].expand(s.shape[0] - rows, *x.shape[1:]))
