"""The kernel search: time every candidate kernel for the shapes and bands of rows a model's rollout uses, on this
machine, and keep the fastest per cell in the machine's kernel table (:mod:`tltlib.kernels.table`).

:func:`ensure` measures at a moment the user chooses: ``python -m tltlib setup`` (the shipped tiny reasoner and its
drafter), ``python -m tltlib kernels --model PATH`` (any model), or a notebook's set-up cell: the cells of the model's
(and drafter's) shapes that this machine's table lacks are measured once, with a progress bar, and saved; later
processes read them (tiny reasoner and its drafter ~7 s, SmolLM2-135M 17-30 s, once per machine and thread count).
A rollout engine (and the cost model) only reads the table: cells it lacks run PyTorch's defaults, with one quiet
line per process naming the command, unless ``TLTLIB_KERNELS=measure``. ``python -m tltlib bench kernels``
measures afresh and writes a results table.

How a cell is measured (:func:`measure_cell`): every candidate once as a warm-up, then ``rounds`` interleaved rounds
(the order rotated each round, so a slow moment hits all alike), each timing a call repeated until ``sample_s`` has
passed (:class:`WallTimer`); the median per candidate and its spread (interquartile range over median). A cell
whose choice or starting point spread more than ``kernel_table.MAX_SPREAD`` is *noisy*: nothing is chosen from it
(:func:`ensure` keeps PyTorch's default there and says so in one quiet line, its progress bar's last; the cell
counts as measured, so later processes do not measure it again: a busy machine's table settles; ``python -m tltlib
bench kernels`` measures afresh, and refuses with "rerun on a quiet machine" when more than a few cells are noisy).
Inputs are what the rollout feeds: projections run over the model's own weights of that shape, cycled, plus copies
up to twice the last-level cache when the model is larger than the cache (so weights come from memory, as in a
forward); attention reads a cache of ``context`` positions per row, spread over half to 1.5x of it for rows of
unequal lengths.

Departures: none (measurement only).
"""
from __future__ import annotations

import itertools
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import BadInput
from ..machine import llc_bytes
from . import table as kt
from .dispatch import PackedWeight, attention_with, linear_with, mkl_packing_available
from .ragged_attention import kernel as ragged_kernel

Timer = Callable[[str, Callable[[], object]], float]
"""``timer(candidate name, call) -> seconds per call``: :class:`WallTimer`, or a fake one in tests."""


@dataclass(frozen=True)
class SearchConfig:
    """How the search measures."""

    rounds: int = 7
    """Interleaved rounds per cell (each candidate timed once per round)."""
    sample_s: float = 2e-3
    """One timing repeats the call until at least this long (short calls are timed in groups)."""
    retries: int = 2
    """A noisy cell is measured again up to this many times (the quietest measurement is kept)."""
    context: int = 512
    """Cached positions per row in the attention cells."""
    max_verify_queries: int = 2048
    """Attention cells of several queries per row are measured up to this many rows x queries (a verify forward's
    size; beyond, PyTorch's SDPA)."""

    def __post_init__(self):
        if self.rounds < 3:
            raise BadInput(f"SearchConfig.rounds must be >= 3 (a median and a spread need them), got {self.rounds}")
        if self.retries < 0:
            raise BadInput(f"SearchConfig.retries must be >= 0, got {self.retries}")
        if not self.sample_s > 0:
            raise BadInput(f"SearchConfig.sample_s must be > 0 seconds, got {self.sample_s}")
        if self.context < 8:
            raise BadInput(f"SearchConfig.context must be >= 8 cached positions, got {self.context}")


class WallTimer:
    """Seconds per call of ``fn``, repeated until ``sample_s`` has passed (one call when it takes longer)."""

    def __init__(self, sample_s: float = SearchConfig.sample_s):
        self.sample_s = sample_s

    def __call__(self, name: str, fn: Callable[[], object]) -> float:
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= self.sample_s:
                return elapsed / n


def spread(samples) -> float:
    """Interquartile range over median of ``samples`` (0 for a single value)."""
    x = np.asarray(samples, dtype=np.float64)
    q1, med, q3 = np.percentile(x, [25, 50, 75])
    return float((q3 - q1) / med) if med > 0 else math.inf


def measure_cell(candidates: dict[str, Callable[[], object]], timer: Timer, config: SearchConfig) -> kt.Timing:
    """Each candidate's median seconds and spread (:func:`spread`) over ``config.rounds`` interleaved rounds after a
    warm-up call; a cell whose largest spread exceeds ``kernel_table.MAX_SPREAD`` is measured again (up to
    ``config.retries`` times: a moment's disturbance passes, a busy machine stays noisy) and the quietest kept."""
    names = list(candidates)
    for name in names:
        candidates[name]()
    best = None
    for _ in range(1 + config.retries):
        samples = {name: [] for name in names}
        for r in range(config.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples[name].append(timer(name, candidates[name]))
        timing = kt.Timing({n: float(np.median(s)) for n, s in samples.items()},
                           {n: spread(s) for n, s in samples.items()})
        if best is None or max(timing.spread.values()) < max(best.spread.values()):
            best = timing
        if max(best.spread.values()) <= kt.MAX_SPREAD:
            break
    return best


# ---------------------------------------------------------------------------------------------- projections
def projection_weights(model, drafter=None) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The weights a rollout's projections multiply by, grouped by shape ``(N, K)``: every 2-D float32 parameter of
    ``model`` but an untied input embedding (tied: the embedding is the LM head), and of ``drafter`` (its own layer and
    fc; its draft-vocabulary head, a slice of the target's head, when it has one)."""
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    untied = getattr(model, "lm_head", None) is not None
    skip = {id(model.embed.weight)} if untied else set()
    for module in (model, drafter):
        if module is None:
            continue
        for p in module.parameters():
            if p.dim() == 2 and p.dtype == torch.float32 and p.device.type == "cpu" and id(p) not in skip:
                groups.setdefault(tuple(p.shape), []).append(p.detach())
    ids = getattr(drafter, "draft_ids", None) if drafter is not None else None
    if ids is not None:
        head = model.head_weight.detach().index_select(0, ids.to(model.head_weight.device))
        groups.setdefault(tuple(head.shape), []).append(head)
    return groups


def _pool(weights: list[torch.Tensor], cold_bytes: int) -> list[torch.Tensor]:
    """``weights``, extended with copies until they hold ``cold_bytes`` (0: as they are): cycled through, each call
    reads its weight from memory rather than from the cache, as in a forward of a model larger than the cache."""
    pool, i = list(weights), 0
    while sum(w.numel() * w.element_size() for w in pool) < cold_bytes:
        pool.append(weights[i % len(weights)].clone())
        i += 1
    return pool


def linear_candidates(pool: list[torch.Tensor], packs: list, rows: int, generator: torch.Generator) -> dict:
    """The projection candidates for ``rows`` rows over ``pool`` (cycled: each call the next weight)."""
    x = torch.randn(rows, pool[0].shape[1], generator=generator)

    def call(kind):
        turn = itertools.cycle(range(len(pool)))

        def run():
            i = next(turn)
            return linear_with(kind, x, pool[i], None, packs[i] if kind in kt.PACKED else None)
        return run
    return {name: call(name) for name in linear_names(kt.band(rows), bool(packs))}


def linear_names(band: int, packs: bool) -> list[str]:
    """The projection candidates measured for a band of rows here: what the band may pick
    (:func:`tltlib.kernels.table.band_kernels`; ``packs``: packed copies can be made) that this process has (MKL's
    packing where this torch has it, ``stream`` where the CPU kernels are built)."""
    built = {"mkl-packed": mkl_packing_available, "stream": lambda: ragged_kernel() is not None}
    return [k for k in kt.band_kernels(band, packs) if k not in built or built[k]()]


# ------------------------------------------------------------------------------------------------ attention
def attention_inputs(heads: int, kv_heads: int, dim: int, rows: int, queries: int, ragged: bool, context: int,
                     generator: torch.Generator) -> tuple:
    """(q, k, v, mask, mask_from, limits) as a rollout's cached forward passes them: ``rows`` rows of ``queries`` new
    tokens each after ``context`` cached ones (``ragged``: lengths spread evenly over half to 1.5x ``context``);
    the new tokens see each other causally."""
    if ragged and rows > 1:
        lengths = torch.linspace(context // 2, context * 3 // 2, rows).round().long()
    else:
        lengths = torch.full((rows,), context, dtype=torch.long)
    span = int(lengths.max()) + queries
    q = torch.randn(rows, heads, queries, dim, generator=generator)
    k, v = (torch.randn(rows, kv_heads, span, dim, generator=generator) for _ in range(2))
    limits = lengths + 1
    mask = None
    if ragged or queries > 1:
        pos = torch.arange(span)
        mask = (pos[None, None, :] <= lengths[:, None, None] + torch.arange(queries)[None, :, None])[:, None]
    return q, k, v, mask, int(lengths.min()), limits


def attention_candidates(inputs: list[tuple], queries: int) -> dict:
    """The attention candidates over ``inputs`` (one tuple per layer, cycled)."""
    names = ["sdpa", "matmul", *(["ragged"] if queries == 1 and ragged_kernel() is not None else [])]

    def call(kind):
        turn = itertools.cycle(range(len(inputs)))

        def run():
            q, k, v, mask, mask_from, limits = inputs[next(turn)]
            return attention_with(kind, q, k, v, mask, mask_from, {}, limits)
        return run
    return {name: call(name) for name in names}


def attention_cells(config: SearchConfig) -> list[tuple[int, int, bool]]:
    """The (query band, row band, ragged) cells measured: one query per row uniform and ragged, several queries
    (always masked) up to ``config.max_verify_queries`` rows x queries."""
    cells = []
    for q in range(kt.MAX_QUERY_BAND + 1):
        for r in range(kt.MAX_ATTENTION_ROW_BAND + 1):
            if q == 0:
                cells += [(0, r, False), (0, r, True)]
            elif kt.band_size(q) * kt.band_size(r) <= config.max_verify_queries:
                cells.append((q, r, True))
    return cells


# --------------------------------------------------------------------------------------------------- search
def _model_bytes(weights: dict) -> int:
    return sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)


def missing_cells(table: kt.KernelTable, model, drafter=None, config: SearchConfig = SearchConfig()) -> dict:
    """The cells of ``model``'s (and ``drafter``'s) shapes that ``table`` has not measured: ``{"linear": {(N, K):
    [bands]}, "attention": {(heads, kv, dim): [(q, r, ragged)]}}``."""
    packs = torch.backends.mkldnn.is_available()
    lin = {shape: [b for b in range(kt.MAX_ROW_BAND + 1)
                   if not table.measured(kt.linear_key(*shape, b))
                   or not set(linear_names(b, packs)) <= set(table.linear[kt.linear_key(*shape, b)].seconds)]
           for shape in projection_weights(model, drafter)}
    att = {}
    for m in (model, drafter):
        if m is None:
            continue
        c = getattr(m.config, "target", m.config)          # a drafter's layer has its target's attention shape
        shape = (c.num_heads, c.num_kv_heads, c.dim_head)
        att[shape] = [cell for cell in attention_cells(config)
                      if not table.measured(kt.attention_key(*shape, *cell))]
    return {"linear": {k: v for k, v in lin.items() if v}, "attention": {k: v for k, v in att.items() if v}}


def _bar(cells: dict, progress: bool, leave: bool = False):
    from tqdm.auto import tqdm
    total = sum(map(len, cells["linear"].values())) + sum(map(len, cells["attention"].values()))
    return tqdm(total=total, desc="tltlib: measuring this machine's kernels (once)", unit="cell", leave=leave,
                disable=not progress)


@torch.no_grad()
def search(model, drafter=None, cells: dict | None = None, timer: Timer | None = None,
           config: SearchConfig = SearchConfig(), progress: bool = True, bar=None) -> tuple[dict, dict]:
    """Measure ``cells`` (default: every cell of the model's and drafter's shapes, :func:`missing_cells` of an
    empty table): returns ``(linear, attention)`` timings keyed as the table keys them. ``bar``: a tqdm bar to
    advance (left open for its caller); else one of its own."""
    timer = timer or WallTimer(config.sample_s)
    cells = cells if cells is not None else missing_cells(kt.KernelTable(None), model, drafter, config)
    weights = projection_weights(model, drafter)
    cold = 2 * llc_bytes() if _model_bytes(weights) > llc_bytes() else 0
    g = torch.Generator().manual_seed(0)
    own = bar is None
    bar = _bar(cells, progress) if own else bar
    linear, attention = {}, {}
    try:
        for shape, bands in cells["linear"].items():
            pool = _pool(weights[shape], cold)
            packs = list(pack_weights_of(pool))
            for b in bands:
                linear[kt.linear_key(*shape, b)] = measure_cell(
                    linear_candidates(pool, packs, kt.band_size(b), g), timer, config)
                bar.update()
            del pool, packs
        for shape, shape_cells in cells["attention"].items():
            layers = model.config.num_layers
            for q, r, ragged in shape_cells:
                one = attention_inputs(*shape, kt.band_size(r), kt.band_size(q), ragged, config.context, g)
                size = sum(t.numel() * t.element_size() for t in one[1:3])
                copies = min(layers, max(1, math.ceil(cold / size))) if cold else 1
                inputs = [one] + [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in one)
                                  for _ in range(copies - 1)]
                attention[kt.attention_key(*shape, q, r, ragged)] = measure_cell(
                    attention_candidates(inputs, kt.band_size(q)), timer, config)
                bar.update()
    finally:
        if own:
            bar.close()
    return linear, attention


def pack_weights_of(weights: list[torch.Tensor]) -> list:
    """:func:`tltlib.kernels.dispatch.pack_weights`' entries for a list of weights, every layout packed now (a
    kernel's first call must not pay for it while it is timed); empty without oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return []
    entries = [PackedWeight(w) for w in weights]
    for e in entries:
        e.onednn()
        if mkl_packing_available():
            e.mkl()
    return entries


_attempted: set[tuple] = set()     # (machine, cell key) measured in this process (a table that could not be saved)


def ensure(model, drafter=None, config: SearchConfig = SearchConfig(), progress: bool = True,
           timer: Timer | None = None, measure: bool | None = True) -> kt.KernelTable:
    """This machine's kernel table for ``model``'s (and ``drafter``'s) shapes.

    ``measure=True`` (an explicit call: the set-up, ``python -m tltlib kernels``, a notebook's set-up cell): what
    the table lacks is measured now (once per machine, thread count and shape; a progress bar), saved and used by
    this process. ``measure=None`` (a rollout engine being made): measured only with ``TLTLIB_KERNELS=measure``;
    otherwise the cells it lacks use PyTorch's defaults and one quiet line per process says how to measure them.
    No effect on CUDA, for other dtypes than float32, or with ``TLTLIB_KERNELS=0``. A noisy cell is measured up to
    ``1 + config.retries`` times within the call; if it stays noisy it keeps PyTorch's default and counts as
    measured, so a busy machine's table settles instead of being measured again by every process (the bar's last
    line says how many; ``python -m tltlib bench kernels`` measures afresh, on a quiet machine)."""
    if (not kt.enabled() or model.device.type != "cpu" or model.embed.weight.dtype != torch.float32
            or kt._OVERRIDE.get() is not None):
        return kt.current()
    table = kt.current()
    missing = missing_cells(table, model, drafter, config)
    fresh = {"linear": {}, "attention": {}}
    for part, key_of in (("linear", kt.linear_key), ("attention", kt.attention_key)):
        for shape, cells in missing[part].items():
            todo = [c for c in cells if (table.machine, key_of(*shape, *_tuple(c))) not in _attempted]
            if todo:
                fresh[part][shape] = todo
    count = sum(map(len, fresh["linear"].values())) + sum(map(len, fresh["attention"].values()))
    if not count:
        return table
    if not (measure or (measure is None and kt.mode() == "measure")):
        said = (table.machine, "unmeasured")
        if said not in _attempted:
            _attempted.add(said)
            print(f"tltlib: this machine's kernel table lacks {count} cells of these shapes: PyTorch's default "
                  "kernels there; `python -m tltlib kernels` measures them once (~10-30 s), or set "
                  f"{kt.ENV}=measure", file=sys.stderr, flush=True)
        return table
    for part, key_of in (("linear", kt.linear_key), ("attention", kt.attention_key)):
        for shape, cells in fresh[part].items():
            _attempted.update((table.machine, key_of(*shape, *_tuple(c))) for c in cells)
    bar = _bar(fresh, progress, leave=True)
    try:
        linear, attention = search(model, drafter, fresh, timer, config, progress, bar)
        table = keep(linear, attention, config)
        bar.set_description_str(summary(table, set(linear) | set(attention)))
    finally:
        bar.close()
    return table


def summary(table: kt.KernelTable, keys: set[str]) -> str:
    """One line on the cells ``keys`` just measured: how many, and how many too noisy to choose from."""
    noisy = [(k, v) for k, v in table.noisy() if k in keys]
    if not noisy:
        return f"tltlib: measured this machine's kernels ({len(keys)} cells, kept in {kt.cache_path(table.machine)})"
    return (f"tltlib: measured this machine's kernels ({len(keys)} cells); {len(noisy)} too noisy to choose (the "
            "machine was busy): PyTorch's defaults there; `python -m tltlib bench kernels` on a quiet machine "
            "measures them again")


def keep(linear: dict, attention: dict, config: SearchConfig) -> kt.KernelTable:
    """This machine's table with the measured cells (:func:`search`'s) added, used by this process from now on and
    saved for the next ones (a cache that cannot be written: one warning, the table still used)."""
    table = kt.current().merged(linear, attention, {"search": asdict(config)})
    kt.install(table)
    try:
        kt.save(table, kt.cache_path(table.machine))
    except OSError as e:                                  # a read-only home: used here, measured again next time
        warnings.warn(f"tltlib: the kernel table could not be saved to {kt.cache_path(table.machine)} ({e}); this "
                      "process uses it, the next one measures again: set TLTLIB_CACHE to a writable folder",
                      stacklevel=3)
    return table


def _tuple(cell) -> tuple:
    return cell if isinstance(cell, tuple) else (cell,)
