"""The kernel table: which kernel computes a projection or a cached attention on *this* machine, by shape and band of
rows, chosen from timings taken here (:mod:`tltlib.kernels.search`), cached per machine and read by
:mod:`tltlib.kernels.dispatch` at every call.

Why a table: the fastest way to multiply a few rows by a weight on a CPU differs between CPUs of the same cloud kind.
SmolLM2-135M's projections for one row, two threads: on the AMD EPYC of the development VM one row padded to two and
run as ``weight @ x.T`` took half the time of ``F.linear``; on an Intel Xeon the same choice took 14.7 ms against
6.9 ms for ``F.linear`` and 5.0 ms for ``weight @ x.T`` unpadded, which made batch-1 decoding half as fast as
transformers there. A threshold measured on one CPU is a fact about that CPU, so it is measured on the one that runs.

What the table holds (one :class:`Timing` per cell: every candidate's median seconds and relative spread):

* **projections** (:func:`tltlib.kernels.dispatch.linear` in CPU float32 inference), keyed by the weight's shape ``(N,
  K)`` and the band of rows ``m`` (:func:`band`: 1, 2, 3-4, 5-8, ..., 257-512; more rows use the last band's choice).
  Candidates (:data:`LINEAR_KERNELS`): ``linear`` (``F.linear``, PyTorch's default), ``mm`` (``weight @ x.T``),
  ``mm-pad`` (one row run as two, ``weight @ x.T``; band 1 only), ``packed`` (oneDNN on a copy of the weight packed
  for it, inside a rollout that has one: :func:`tltlib.kernels.dispatch.packed_weights`), ``mkl-packed`` (MKL's
  packed SGEMM on a copy packed for it, likewise; where this torch has MKL). A cell measured before a candidate
  existed lacks it and is measured again by the next measurement (:func:`tltlib.kernels.search.missing_cells`);
  until then its old choice holds.
* **cached attention** (:func:`tltlib.kernels.dispatch.cached_attention` on a CPU in float32), keyed by (heads, KV
  heads, head dim), the band of new queries per row (1, 2, 3-4, ..., 17-32; more: PyTorch's SDPA), the band of rows (1
  ... 65-128; more rows use the last band's choice) and whether the rows differ in length (a mask) or not. Candidates
  (:data:`ATTENTION_KERNELS`): ``sdpa`` (PyTorch's, the default), ``matmul`` (two batched matmuls,
  :func:`tltlib.kernels.dispatch.gqa_attention`), ``ragged`` (the C++ kernel of :mod:`tltlib.kernels.ragged_attention`;
  one query per row).

A choice (:func:`choose`) is the fastest candidate available at the call, except that the **starting point** — what
the constants below, measured on the development VM, would pick — stays unless another is faster by more than
:data:`MIN_GAIN`: a near-tie never flips on noise. A cell without a table entry (no table, a shape never measured,
``TLTLIB_KERNELS=0``, a cell too noisy to decide) uses PyTorch's default (``F.linear``, SDPA).

Cache: ``$TLTLIB_CACHE/kernels/<cpu>-<threads>t.json`` (default ``~/.cache/tltlib/kernels``), one file per CPU model
and torch thread count, holding the :class:`tltlib.machine.Machine` it was measured on. A file whose machine differs
(other CPU flags under the same model name, another torch, other cores) or that this version cannot read is ignored
with one warning that says why; PyTorch's defaults until it is measured again (:func:`tltlib.kernels.search.ensure`).

Departures: none (kernel selection only; every candidate computes the same function up to float rounding).
"""
from __future__ import annotations

import math
import os
import threading
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BadInput
from ..fileio import atomic_write_text, cache_root, read_json
from ..machine import Machine, this_machine

SCHEMA = 1
"""Version of the table file's layout; a file of another version is ignored and measured again."""
ENV = "TLTLIB_KERNELS"
"""Environment variable (:func:`mode`): ``0``/``off`` = no table (PyTorch's default kernels, nothing read or
measured); unset or ``1``/``on``: the machine's table as measured (by ``python -m tltlib setup``, ``python -m tltlib
kernels`` or a notebook's set-up cell), PyTorch's defaults for cells it lacks; ``measure``: also measure what it lacks
when a rollout engine is made."""
MODES = {"0": "off", "off": "off", "false": "off", "no": "off", "1": "on", "on": "on", "true": "on", "yes": "on",
         "": "on", "measure": "measure"}

LINEAR_KERNELS = ("linear", "mm", "mm-pad", "packed", "mkl-packed", "stream")
PACKED = ("packed", "mkl-packed")
"""The projection candidates that need a packed copy of the weight at hand."""
ATTENTION_KERNELS = ("sdpa", "matmul", "ragged")
STREAM_MAX_BAND = 4
"""Projections: the ``stream`` kernel is a candidate up to this band of rows (9-16: a decode of 16 rows, a verify of
two rows' chains of 7 drafts); beyond, the GEMMs' reuse of each weight across rows wins. SmolLM2's five shapes on an
AMD EPYC (AVX2, 2 threads) once the kernel read several streams per thread: ``stream`` the fastest at 9-16 rows by
1.05-1.27x, at 17-32 rows oneDNN's packed GEMM or ``mm`` by 1.06-1.33x (it was a candidate up to 8 rows before)."""
MAX_ROW_BAND = 9
"""Projections: the last band of rows (257-512); more rows use its choice."""
MAX_ATTENTION_ROW_BAND = 7
"""Cached attention: the last band of rows (65-128); more rows use its choice."""
MAX_QUERY_BAND = 5
"""Cached attention: the last band of new queries per row measured (17-32); more (prefill) use SDPA."""
MIN_GAIN = 0.03
"""A candidate replaces the starting point only when its median is more than this share faster."""
MAX_SPREAD = 0.25
"""A choice whose timings (or the starting point's) spread more than this (interquartile range over median) is not
made: the machine was too busy to tell the candidates apart (PyTorch's default there; measured again)."""

# ---- the starting points: the choices measured on the 2-core development VM (AMD EPYC, torch 2.13.0), which the
# search keeps unless a candidate beats them here (the measurements behind each are in docs/results.md)
CPU_PACKED_MIN_ROWS = 3
"""Projections of at least this many rows used the packed weights (SmolLM2's 120 projections at 1 / 2 / 4 / 16 / 64
rows: 22 / 14 / 24 / 49 / 115 ms as ``weight @ x.T``, 25 / 21 / 16 / 25 / 78 ms packed)."""
CPU_MM_MAX_ROWS = 64
"""Projections of 1 to this many rows ran as ``weight @ x.T`` (1 row padded to 2; SmolLM2's 30 layers, 2 rows
94 -> 37 ms, 16 rows 113 -> 80, 64 rows 146 -> 119, 96 rows 176 -> 199 against ``F.linear``: beyond, the result's
transposing copy costs more than it saves)."""
CPU_MATMUL_ATTENTION_MIN_ROWS = 8
"""Cached attention: two matmuls from this many rows up (10-30% faster than PyTorch's CPU flash kernel there) ..."""
CPU_MATMUL_ATTENTION_MAX_QUERIES = 8
"""... for at most this many new queries per row (PyTorch's SDPA beyond, and below the rows)."""
CPU_RAGGED_UNIFORM_MAX_ROWS = 32
"""One query per row: the ragged C++ kernel whenever the rows differ in length, and up to this many rows of one
length (tiny reasoner at 1 / 8 / 32 / 64 / 128 rows of 300 positions 1.03 / 1.04 / 0.99 / 0.95 / 0.92x the matmuls;
spread over 150-450: 1.05 / 1.17 / 1.13 / 1.12 / 1.12x)."""


def band_kernels(band: int, packed: bool) -> tuple[str, ...]:
    """The projection kernels a band of rows may pick, in :data:`LINEAR_KERNELS`' order: ``mm-pad`` at one row only,
    the :data:`PACKED` ones where packed copies can be made, ``stream`` up to :data:`STREAM_MAX_BAND`."""
    return tuple(k for k in LINEAR_KERNELS if not (k == "mm-pad" and band) and (packed or k not in PACKED)
                 and not (k == "stream" and band > STREAM_MAX_BAND))


def band(n: int, last: int = MAX_ROW_BAND) -> int:
    """The band of a count (rows or queries): 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ..., at most ``last``."""
    return min((max(int(n), 1) - 1).bit_length(), last)


def band_size(b: int) -> int:
    """The largest count of band ``b`` (where a band is measured): 1, 2, 4, 8, ..."""
    return 1 << b


def linear_start(rows: int, packed: bool) -> str:
    """The projection kernel the development VM's constants pick for ``rows`` rows (``packed``: a packed copy of the
    weight is at hand)."""
    if packed and rows >= CPU_PACKED_MIN_ROWS:
        return "packed"
    if rows <= CPU_MM_MAX_ROWS:
        return "mm-pad" if rows == 1 else "mm"
    return "linear"


def attention_start(rows: int, queries: int, ragged: bool, kernel: bool) -> str:
    """The cached-attention kernel the development VM's constants pick (``ragged``: rows of unequal lengths;
    ``kernel``: the ragged C++ kernel is built)."""
    if queries == 1 and kernel and (ragged or rows <= CPU_RAGGED_UNIFORM_MAX_ROWS):
        return "ragged"
    if rows < CPU_MATMUL_ATTENTION_MIN_ROWS or queries > CPU_MATMUL_ATTENTION_MAX_QUERIES:
        return "sdpa"
    return "matmul"


def choose(timing: "Timing", available, start: str | None, min_gain: float = MIN_GAIN,
           max_spread: float = MAX_SPREAD) -> str | None:
    """The kernel to run: of the ``available`` candidates measured in ``timing``, the fastest by median, except that
    ``start`` (the starting point) is kept unless that one is faster by more than ``min_gain`` of its time. None
    (PyTorch's default) when no available candidate was measured, or when the one chosen or the starting point
    spread more than ``max_spread`` (the machine was too busy to tell them apart)."""
    timed = {k: v for k, v in timing.seconds.items() if k in available and math.isfinite(v)}
    if not timed:
        return None
    best = min(timed, key=timed.get)
    pick = start if start in timed and timed[best] >= timed[start] * (1 - min_gain) else best
    if max(timing.spread.get(pick, 0.0), timing.spread.get(start, 0.0) if start in timed else 0.0) > max_spread:
        return None
    return pick


@dataclass(frozen=True)
class Timing:
    """One cell of the table as measured: each candidate's median seconds and relative spread (interquartile range
    over median) over the interleaved rounds."""

    seconds: dict
    spread: dict

    def as_dict(self) -> dict:
        return {"ms": {k: round(v * 1e3, 5) for k, v in self.seconds.items()},
                "spread": {k: round(v, 4) for k, v in self.spread.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Timing":
        return cls({k: float(v) / 1e3 for k, v in d["ms"].items()}, {k: float(v) for k, v in d["spread"].items()})


def linear_key(n: int, k: int, b: int) -> str:
    return f"{n}x{k}/r{b}"


def attention_key(heads: int, kv_heads: int, dim: int, q: int, r: int, ragged: bool) -> str:
    return f"{heads}h{kv_heads}kv{dim}d/q{q}/r{r}/{'ragged' if ragged else 'uniform'}"


class KernelTable:
    """The measured cells of one machine and the choices they make (precomputed: a call looks one up in a dict).

    ``linear``: ``{linear_key(N, K, band): Timing}``; ``attention``: ``{attention_key(...): Timing}``."""

    def __init__(self, machine: Machine | None, linear: dict | None = None, attention: dict | None = None,
                 settings: dict | None = None):
        self.machine, self.settings = machine, dict(settings or {})
        self.linear, self.attention = dict(linear or {}), dict(attention or {})
        self._lin: dict[tuple, str | None] = {}
        self._att: dict[tuple, str | None] = {}
        self._noisy: set[str] = set()
        self._by_rows: dict[tuple, str | None] = {}
        for key, t in self.linear.items():
            shape, b = key.split("/r")
            n, k = map(int, shape.split("x"))
            for packed in (False, True):
                names = set(band_kernels(int(b), packed))
                self._decide(self._lin, (n, k, int(b), packed), key, t, names,
                             linear_start(band_size(int(b)), packed))
        for key, t in self.attention.items():
            shape, q, r, kind = key.split("/")
            heads, rest = shape.split("h")
            kv, dim = rest.removesuffix("d").split("kv")
            q, r = int(q[1:]), int(r[1:])
            for kernel in (False, True):
                names = set(ATTENTION_KERNELS) - (set() if kernel and q == 0 else {"ragged"})
                self._decide(self._att, (int(heads), int(kv), int(dim), q, r, kind == "ragged", kernel), key, t, names,
                             attention_start(band_size(r), band_size(q), kind == "ragged", kernel))

    def _decide(self, into: dict, lookup: tuple, key: str, timing: Timing, names: set, start: str) -> None:
        pick = choose(timing, names, start)
        if pick is None and any(n in timing.seconds for n in names):
            self._noisy.add(key)
        into[lookup] = pick

    @property
    def size(self) -> int:
        """Measured cells (0: no table, PyTorch's defaults everywhere)."""
        return len(self.linear) + len(self.attention)

    def linear_kernel(self, n: int, k: int, rows: int, packed: bool) -> str | None:
        """The projection kernel for ``rows`` rows by an ``[n, k]`` weight (``packed``: a packed copy is at hand);
        None: PyTorch's default. Called for every projection: the answer is memoised per exact row count."""
        key = (n, k, rows, packed)
        try:
            return self._by_rows[key]
        except KeyError:
            pick = self._by_rows[key] = self._lin.get((n, k, band(rows), packed))
            return pick

    def attention_kernel(self, heads: int, kv_heads: int, dim: int, queries: int, rows: int, ragged: bool,
                         kernel: bool) -> str | None:
        """The cached-attention kernel for ``rows`` rows of ``queries`` new queries (``ragged``: rows of unequal
        lengths; ``kernel``: the ragged C++ kernel is built); None: PyTorch's SDPA."""
        if queries > band_size(MAX_QUERY_BAND):
            return None
        return self._att.get((heads, kv_heads, dim, band(queries), band(rows, MAX_ATTENTION_ROW_BAND), ragged, kernel))

    def measured(self, key: str) -> bool:
        """Whether the cell ``key`` was measured on this machine (quiet enough to choose from or not)."""
        return key in self.linear or key in self.attention

    def decided(self, key: str) -> bool:
        """Whether the cell ``key`` is measured and was quiet enough to choose from."""
        return self.measured(key) and key not in self._noisy

    def noisy(self) -> list[tuple[str, float]]:
        """(key, largest spread) of the cells too noisy to choose from, worst first."""
        cells = {**self.linear, **self.attention}
        return sorted(((k, max(cells[k].spread.values())) for k in self._noisy), key=lambda kv: -kv[1])

    def merged(self, linear: dict, attention: dict, settings: dict | None = None) -> "KernelTable":
        """A new table with these cells added (replacing cells of the same keys)."""
        return KernelTable(self.machine, {**self.linear, **linear}, {**self.attention, **attention},
                           settings if settings is not None else self.settings)

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "machine": self.machine.as_dict() if self.machine else None,
                "settings": self.settings, "linear": {k: t.as_dict() for k, t in sorted(self.linear.items())},
                "attention": {k: t.as_dict() for k, t in sorted(self.attention.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> "KernelTable":
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            schema = d.get("schema") if isinstance(d, dict) else "?"
            raise BadInput(f"written by another tltlib version (schema {schema}, this one reads {SCHEMA})")
        return cls(Machine.from_dict(d["machine"]), {k: Timing.from_dict(v) for k, v in d["linear"].items()},
                   {k: Timing.from_dict(v) for k, v in d["attention"].items()}, d.get("settings"))


class Forced(KernelTable):
    """A table that picks one kernel wherever it can run (``linear``: a projection kernel; ``attention``: an
    attention kernel; None: PyTorch's default), whatever the shape: for tests and side-by-side benchmarks."""

    def __init__(self, linear: str | None = None, attention: str | None = None):
        super().__init__(None)
        if linear not in (None, *LINEAR_KERNELS) or attention not in (None, *ATTENTION_KERNELS):
            raise BadInput(f"Forced(linear={linear!r}, attention={attention!r}): choose among {LINEAR_KERNELS} "
                           f"and {ATTENTION_KERNELS}")
        self.forced_linear, self.forced_attention = linear, attention

    def linear_kernel(self, n: int, k: int, rows: int, packed: bool) -> str | None:
        if self.forced_linear in PACKED and not packed:
            return None
        return self.forced_linear

    def attention_kernel(self, heads: int, kv_heads: int, dim: int, queries: int, rows: int, ragged: bool,
                         kernel: bool) -> str | None:
        if self.forced_attention == "ragged" and not (kernel and queries == 1):
            return None
        return self.forced_attention


class StartingPoints(KernelTable):
    """The development VM's constants as a table (:func:`linear_start`, :func:`attention_start`): what tltlib chose
    on every machine before choices were measured; for side-by-side benchmarks."""

    def __init__(self):
        super().__init__(None)

    def linear_kernel(self, n: int, k: int, rows: int, packed: bool) -> str | None:
        return linear_start(rows, packed)

    def attention_kernel(self, heads: int, kv_heads: int, dim: int, queries: int, rows: int, ragged: bool,
                         kernel: bool) -> str | None:
        return attention_start(rows, queries, ragged, kernel)


EMPTY = KernelTable(None)
"""No table: PyTorch's default kernel everywhere."""


def mode() -> str:
    """``TLTLIB_KERNELS`` read (:data:`ENV`): "off", "on" (the default) or "measure"; anything else is refused."""
    text = os.environ.get(ENV, "1")
    try:
        return MODES[text.strip().lower()]
    except KeyError:
        raise BadInput(f"{ENV}={text!r} is not a setting: use 0 (or off: PyTorch's default kernels), 1 (or on, the "
                       "default: this machine's measured table) or measure (also measure missing cells when a "
                       "rollout engine is made)") from None


def enabled() -> bool:
    """False when ``TLTLIB_KERNELS`` is ``0``/``off``: PyTorch's defaults, nothing measured or read."""
    return mode() != "off"


def cache_dir() -> Path:
    """Where kernel tables live: ``$TLTLIB_CACHE/kernels`` or ``~/.cache/tltlib/kernels`` (never in the repo)."""
    return cache_root() / "kernels"


def cache_path(machine: Machine) -> Path:
    """The table file of ``machine``: one per CPU model and thread count."""
    return cache_dir() / f"{machine.slug}.json"


def load(path: str | os.PathLike, here: Machine) -> KernelTable | None:
    """The table in ``path`` if it was measured on ``here``; None when there is no file, and None with one warning
    when it is unreadable or from another machine (it is then measured again and replaced)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        table = KernelTable.from_dict(read_json(path))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:     # a file of the wrong shape
        why = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
        warnings.warn(f"tltlib: kernel table {path} ignored ({why}); PyTorch's default kernels until `python -m "
                      "tltlib kernels` measures this machine again (it replaces the file)", stacklevel=3)
        return None
    diff = table.machine.differences(here)
    if diff:
        warnings.warn(f"tltlib: kernel table {path} ignored: measured on another machine or torch ({'; '.join(diff)}"
                      "); PyTorch's default kernels until `python -m tltlib kernels` measures this one (it replaces "
                      "the file)", stacklevel=3)
        return None
    return table


def save(table: KernelTable, path: str | os.PathLike) -> Path:
    """Write ``table`` to ``path`` atomically (a reader never sees half a file)."""
    import json
    return atomic_write_text(path, json.dumps(table.as_dict(), indent=1, sort_keys=True) + "\n")


_OVERRIDE: ContextVar[KernelTable | None] = ContextVar("tltlib_kernel_table", default=None)
_lock = threading.Lock()
_tables: dict[int, KernelTable] = {}       # this process's table per torch thread count (read once, then updated)


def current() -> KernelTable:
    """The table the kernels use now: the one set by :func:`using`, else this machine's for torch's current thread
    count (read from the cache on first use; :data:`EMPTY` when there is none or ``TLTLIB_KERNELS=0``)."""
    table = _OVERRIDE.get()
    if table is not None:
        return table
    threads = torch.get_num_threads()
    table = _tables.get(threads)
    if table is None:
        with _lock:
            if threads not in _tables:
                here = this_machine()
                _tables[threads] = (load(cache_path(here), here) or KernelTable(here)) if enabled() else EMPTY
            table = _tables[threads]
    return table


def install(table: KernelTable) -> None:
    """Make ``table`` this process's table for its machine's thread count (after a measurement)."""
    with _lock:
        _tables[table.machine.threads] = table


@contextmanager
def using(table: KernelTable | None):
    """Within this block the kernels follow ``table`` (None or :data:`EMPTY`: PyTorch's defaults) instead of the
    machine's table: for tests and side-by-side benchmarks."""
    token = _OVERRIDE.set(table if table is not None else EMPTY)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)
