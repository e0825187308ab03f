"""The paged KV cache: the rollout engine's cache, with the dense cache's interface (issue 39, step 3).

Keys and values of every layer live in one pool of fixed-size pages, ``[layers, kv_heads, pages + 1, page_size,
head_dim]`` (head-major, so that one head's tokens of a page are contiguous: the decode kernel reads a row's pages
one KV head at a time; the last page is the *scratch page*: where a row without a page reads and writes, e.g. the padded
rows of a captured CUDA graph; no row's data is ever there). Each row has a block table
(:class:`tltlib.kv.pages.BlockTables` on the host, mirrored in :attr:`PagedKVCache.table` on the device): token ``t`` of
row ``r`` is token ``t % page_size`` of page ``table[r, t // page_size]``. So a row holds pages for the tokens it has,
not for the longest it could grow to:

* a forward's new tokens get pages as they are written (:meth:`PagedKVCache.prepare`; a row writing into a page
  another row still reads gets its own copy first), and the pages past what a row commits are given back
  (:meth:`~PagedKVCache.advance`, :meth:`~PagedKVCache.rollback`: SD's rejected tokens rolled back past a page
  boundary);
* compaction (:meth:`~PagedKVCache.select_rows`) moves block tables, not data: finished rows' pages go back to the
  pool, and ``select_rows(arange(P).repeat_interleave(G))`` gives the G samples of a prompt the prompt's pages
  (shared, reference-counted: no G-fold copy);
* attention reads through the block tables: on CUDA, decode and every forward of up to
  :data:`tltlib.kernels.triton_attention.MAX_NEW` new tokens per row (verifies, drafter levels) by a Triton kernel
  (:func:`tltlib.kernels.triton_attention.paged_attention`: the pages read in place, each row up to its own length
  on the device, split over the positions for few rows; capture-safe, so it also runs inside CUDA graphs at a
  fixed span); on a CPU, a decode step and a verify of up to
  :data:`tltlib.kv.paged_attention.MASKED_KERNEL_MAX_NEW` tokens by the C++ kernels
  (:func:`tltlib.kernels.ragged_attention.paged_ragged_attention`,
  :func:`~tltlib.kernels.ragged_attention.paged_masked_attention`, no copy; a row's pages are kept in runs,
  :class:`tltlib.kv.pages.PagePool`, which they read as one stretch); everything else (prefills, longer trees, CUDA
  without triton or with ``TLTLIB_TRITON_ATTENTION=0``) over the rows' pages gathered into a ``[rows, kv_heads,
  span, head_dim]`` block and the dense cache's masked kernels, which also runs under CUDA graphs (the gather has
  fixed shapes at a fixed span).

The pool is sized by a memory budget (:class:`KVConfig`: bytes, or a share of the memory free when the cache is
made), capped at what a dense cache of the same rows would take. When it runs out, :meth:`PagedKVCache.prepare`
raises :class:`KVCacheFull` before it changes anything.

Paper: TLT §5 runs its rollouts on SGLang, whose token pool is paged; vLLM's PagedAttention (Kwon et al., SOSP
2023) introduced block tables with copy-on-write sharing.

Departures: decode and short forwards read the pages in place (the Triton kernel on CUDA, the C++ kernels on a
CPU); prefills and longer forwards gather the rows' pages first (vLLM and SGLang read pages in place in every
kernel), which costs one copy of the pages they read, as does every CUDA forward where triton is missing. The
Triton kernel's speed against the gathered path on a GPU is measured by ``bench/triton_attention.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import BadInput, Refused
from ..kernels import triton_attention
from ..kernels.dispatch import cached_attention
from ..kernels.ragged_attention import paged_masked_attention, paged_ragged_attention, paged_rope_attention
from ..machine import available_bytes
from .dense import CacheWrite, KVCache, attention_mask, check_fixed_span
from .paged_attention import choose_kernel, kernel_mask, table_slots
from .pages import BlockTables, PagePool, check_page_size, kv_bytes_per_token, pages_for, pages_in_budget

KINDS = ("paged", "dense")

HOST_SLOTS_MAX = 256
"""Most new entries (rows x new tokens) a CPU forward's write slots are computed for on the host, from the block
tables' lists (:meth:`PagedKVCache._host_slots`; ~10 us for one row against ~95 us for the tensor ops, AMD EPYC);
more (prefills), or under a fixed span (a CUDA graph's padded rows): the tensor ops over the block table."""

@dataclass(frozen=True)
class KVConfig:
    """Which KV cache a rollout keeps, and how much memory it may take."""

    kind: str = "paged"
    """``paged`` (pages taken as rows grow; a prompt's pages shared by its samples) or ``dense`` (every row's slots
    for its maximum length allocated up front: benchmarks' reference)."""
    memory: float = 0.5
    """The paged pool's budget, shared by the target's and the drafter's caches: a share of the memory free when the
    rollout's buffers are made (``0 < memory <= 1``; the GPU's free memory, or the machine's available memory on a
    CPU), or bytes (``> 1``). Never more than a dense cache of the same rows would take."""
    page_size: int = 16
    """Token slots per page (a power of two)."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise BadInput(f"KVConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if isinstance(self.memory, bool) or not isinstance(self.memory, (int, float)) or \
                not 0 < self.memory < float("inf"):
            raise BadInput(f"KVConfig.memory must be a number: a share of free memory in (0, 1] or bytes > 1 (e.g. "
                           f"0.5 or 8e9), got {self.memory!r}")
        check_page_size(self.page_size)

    def budget_bytes(self, device: torch.device | str) -> int:
        """The budget in bytes on ``device`` (a share resolved against the memory free there now)."""
        return int(self.memory) if self.memory > 1 else int(self.memory * available_bytes(device))


def make_cache(config, rows: int, max_len: int, kv: KVConfig | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", num_layers: int | None = None,
               budget_bytes: int | None = None):
    """The KV cache ``kv`` asks for, shaped for a :class:`tltlib.model.decoder.ModelConfig` and ``rows`` rows of at most
    ``max_len`` tokens (``num_layers`` overrides the config's, e.g. 1 for a drafter).

    A paged cache's pool takes ``budget_bytes`` (default: ``kv``'s budget on ``device``), never more pages than a
    dense cache of these rows would hold. A dense cache that needs more than the budget is refused here, before any
    rollout, with the bytes."""
    kv = kv or KVConfig()
    layers = num_layers if num_layers is not None else config.num_layers
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = kv_bytes_per_token(layers, config.num_kv_heads, config.dim_head, elem)
    budget = kv.budget_bytes(device) if budget_bytes is None else int(budget_bytes)
    if kv.kind == "dense":
        need = rows * max_len * per_token
        if need > budget:
            raise BadInput(f"a dense KV cache of {rows} rows x {max_len} tokens needs {need:,} bytes but the KV "
                           f"budget is {budget:,} bytes (KVConfig.memory={kv.memory}): use KVConfig(kind='paged'), "
                           "fewer rows or a shorter max_new_tokens")
        return KVCache(layers, rows, config.num_kv_heads, max_len, config.dim_head, dtype, device)
    pages = min(pages_in_budget(budget, per_token, kv.page_size), rows * pages_for(max_len, kv.page_size))
    return PagedKVCache(layers, rows, config.num_kv_heads, max_len, config.dim_head, pages, kv.page_size, dtype,
                        device)


def kv_stats(caches) -> dict[str, float]:
    """``rollout/kv_peak_bytes`` and ``rollout/kv_pool_bytes`` summed over ``caches`` (paged or dense; None skipped):
    see their ``memory()``."""
    parts = [c.memory() for c in caches if c is not None]
    return {"rollout/kv_peak_bytes": float(sum(m["peak_bytes"] for m in parts)),
            "rollout/kv_pool_bytes": float(sum(m["pool_bytes"] for m in parts))}


class KVCacheFull(Refused):
    """The page pool cannot hold the next forward's tokens (nothing was changed): the caller waits, preempts a row,
    or gives the cache a larger budget."""


class PagedKVCache:
    """Paged per-row KV cache for a decoder with ``num_layers`` attention layers (see the module docstring); the
    interface of :class:`tltlib.kv.dense.KVCache`.

    Attributes:
        k, v: ``[layers, kv_heads, pages + 1, page_size, head_dim]`` storage (the last page: scratch).
        table: ``[max_rows, pages_for(max_len)]`` int64 block tables on the storage's device (scratch past a row's
            pages).
        lengths: ``[max_rows]`` int64 committed lengths (only the first :attr:`rows` entries are meaningful).
        rows, max_len, max_used, min_used, fixed_span: as :class:`~tltlib.kv.dense.KVCache`.
        blocks: the host-side :class:`~tltlib.kv.pages.BlockTables` (pages and committed length of every row).
    """

    def __init__(self, num_layers: int, max_rows: int, num_kv_heads: int, max_len: int, head_dim: int,
                 num_pages: int, page_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if max_rows < 1 or max_len < 1:
            raise BadInput(f"PagedKVCache needs max_rows >= 1 and max_len >= 1, got {max_rows} and {max_len}")
        self.blocks = BlockTables(PagePool(num_pages, page_size))
        for _ in range(max_rows):
            self.blocks.add_row()
        self.page_size = page_size
        self.scratch = num_pages
        shape = (num_layers, num_kv_heads, num_pages + 1, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)      # finite everywhere: masked reads stay finite
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        width = pages_for(max_len, page_size)
        self.table = torch.full((max_rows, width), num_pages, dtype=torch.long, device=device)
        self._host = self.table if self.table.device.type == "cpu" else self.table.cpu()
        self._dirty: set[int] = set()             # rows whose device table lags the host's (shared with views)
        self.lengths = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._root_table, self._root_host = self.table, self._host
        self.row0, self.rows, self.max_len = 0, max_rows, max_len
        self.max_used = self.min_used = 0
        self.fixed_span: int | None = None

    @property
    def capacity(self) -> int:
        """Rows the cache was made for (the most :attr:`rows` can be)."""
        return self.table.shape[0]

    @property
    def pool(self) -> PagePool:
        return self.blocks.pool

    @property
    def bytes_per_page(self) -> int:
        return self.k[:, :, 0].numel() * 2 * self.k.element_size()

    # ----------------------------------------------------------------------------------------------- pages
    def _short(self, tokens: int) -> tuple[list[int], int]:
        """The active rows that need pages to write ``tokens`` slots after their committed lengths, and the free
        pages they need in all (new pages, copies of shared ones)."""
        blocks, size, r0 = self.blocks, self.page_size, self.row0
        refs, lens, pages = blocks.pool.refs, blocks.lengths, blocks.pages
        need = []                                  # the decode loop's path: O(1) per row that needs nothing
        for r in range(r0, r0 + self.rows):        # (a row's shared pages are a prefix: check the first written)
            held, start = pages[r], lens[r]
            first = start // size
            if start + tokens > len(held) * size or (first < len(held) and refs[held[first]] > 1):
                need.append(r)
        return need, sum(blocks.pages_to_write(r, lens[r], tokens) for r in need)

    def pages_short(self, tokens: int, rows: int = 0, rows_tokens: int = 0) -> int:
        """Pages the pool lacks for every active row to write ``tokens`` more slots, plus ``rows`` new rows of
        ``rows_tokens`` tokens each (0: it fits). Admission by memory asks this before every iteration: while the
        pool has room for every row's worst case (a page more than the tokens span, each possibly a copy), that is
        all it costs; the rows are counted one by one only near full."""
        size, free = self.page_size, self.pool.free
        new_rows = rows * pages_for(rows_tokens + tokens, size)
        if self.rows * (pages_for(tokens, size) + 1) + new_rows <= free:
            return 0
        _, extra = self._short(tokens)
        return max(0, extra + new_rows - free)

    def add_rows(self, n: int) -> None:
        """``n`` empty rows after the active ones, holding no page (a rollout re-admitting preempted rows prefills
        them through :meth:`view`)."""
        if self.row0:
            raise BadInput("add_rows on a view: add rows to the cache the view was made from")
        if self.rows + n > self.capacity:
            raise BadInput(f"PagedKVCache.add_rows: {self.rows} + {n} rows exceed the {self.capacity} the cache "
                           "was made for")                # rows past the active ones hold no pages (select_rows)
        self.lengths[self.rows: self.rows + n] = 0
        self.rows += n
        self._refresh()

    def make_room(self, tokens: int) -> None:
        """Give every active row pages for ``tokens`` slots after its committed length, each a page of its own
        (copy-on-write of a page it shares); :class:`KVCacheFull`, with nothing taken, when the pool is short.

        :meth:`prepare` calls it; a captured graph's caller calls it before the replay (the graph cannot)."""
        blocks = self.blocks
        need, extra = self._short(tokens)
        if not need:
            return
        if extra > blocks.pool.free:
            raise KVCacheFull(f"the KV page pool has {blocks.pool.free} free page(s) of {blocks.pool.num_pages}, "
                              f"{len(need)} row(s) need {extra} more for {tokens} token(s) each: give the rollout a "
                              "larger budget (RolloutConfig.kv = KVConfig(memory=...)) or fewer rows")
        lens = blocks.lengths
        copies = []
        for r in need:
            pairs = blocks.writable(r, lens[r], tokens)
            copies += pairs
            self._mark(r)
        if copies:
            old = torch.tensor([p for p, _ in copies], device=self.k.device)
            new = torch.tensor([q for _, q in copies], device=self.k.device)
            for store in (self.k, self.v):
                store[:, :, new] = store[:, :, old]
        self._sync_table()

    def _mark(self, r: int) -> None:
        """Row ``r``'s pages changed: rewrite its host table now, the device's at the next :meth:`_sync_table`."""
        held = self.blocks.pages[r]
        row = self._root_host[r]
        row.fill_(self.scratch)
        if held:
            row[: len(held)] = torch.tensor(held, dtype=torch.long)
        if self._root_host is not self._root_table:
            self._dirty.add(r)

    def _sync_table(self) -> None:
        if self._dirty:
            rows = torch.tensor(sorted(self._dirty))
            self._root_table[rows.to(self.table.device)] = self._root_host[rows].to(self.table.device)
            self._dirty.clear()

    def _fit(self, r: int) -> None:
        """Row ``r`` holds pages for exactly its committed tokens (taking or giving back pages)."""
        blocks, length = self.blocks, self.blocks.lengths[r]
        held = len(blocks.pages[r])
        if held * self.page_size < length:
            if not blocks.reserve(r, length):
                raise KVCacheFull(f"the KV page pool has {blocks.pool.free} free page(s): row {r} cannot commit "
                                  f"{length} tokens")
            self._mark(r)
        elif held > pages_for(length, self.page_size):
            blocks.truncate(r, length)
            self._mark(r)

    # ----------------------------------------------------------------------------------------------- one forward
    def prepare(self, num_new: int, tree_mask: torch.Tensor | None = None, offset: int = 0) -> CacheWrite:
        """As :meth:`tltlib.kv.dense.KVCache.prepare`; takes the pages the new tokens need first (not under a fixed
        span: the graph's caller did, :meth:`make_room`)."""
        if self.max_used + offset + num_new > self.max_len:
            raise BadInput(f"KV cache overflow: {self.max_used} used + {offset + num_new} new > max_len "
                           f"{self.max_len}; make the cache with a larger max_len (prompt + max_new_tokens + "
                           "draft tokens)")
        fixed = check_fixed_span(self, offset + num_new)
        if not fixed:
            self.make_room(offset + num_new)
        lengths = self.lengths[: self.rows]
        span = self.fixed_span if fixed else self.max_used + offset + num_new
        host = not fixed and lengths.device.type == "cpu" and self.rows * num_new <= HOST_SLOTS_MAX
        index = (self._host_slots(offset, num_new) if host     # (a fixed span's padded rows hold no pages)
                 else self._slots(offset + torch.arange(num_new, device=lengths.device)[None, :]))
        write = attention_mask(index, lengths, span, num_new, tree_mask, offset, self.min_used, self.max_used, fixed)
        write.table = self.table[: self.rows, : pages_for(span, self.page_size)].contiguous()
        if not fixed and lengths.device.type == "cpu":
            write.ends = lengths + (offset + num_new)
        return write

    def write(self, layer: int, where: CacheWrite, k_new: torch.Tensor,
              v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k_new, v_new [rows, T, kv_heads, head_dim]`` at the prepared slots; return the rows' entries
        gathered from their pages, ``[rows, kv_heads, span, head_dim]`` (copies)."""
        self._store(layer, where, k_new, v_new)
        return self._gather(self.k[layer], where), self._gather(self.v[layer], where)

    def _store(self, layer, where, k_new, v_new) -> None:
        d = k_new.shape[-1]
        flat = where.index.view(-1)
        self.k[layer].view(-1, d).index_copy_(0, flat, k_new.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, flat, v_new.reshape(-1, d))

    @staticmethod
    def _gather(store: torch.Tensor, where: CacheWrite) -> torch.Tensor:
        rows, width = where.table.shape
        kvh, _, size, d = store.shape
        pages = store[:, where.table]                                 # [kv_heads, rows, width, page_size, d]
        return pages.transpose(0, 1).reshape(rows, kvh, width * size, d)[:, :, : where.span]

    def attend(self, layer: int, where: CacheWrite, q: torch.Tensor, k_new: torch.Tensor,
               v_new: torch.Tensor) -> torch.Tensor:
        """As :meth:`tltlib.kv.dense.KVCache.attend`. The paged kernels read the pages in place: on CUDA the Triton
        kernel for up to :data:`tltlib.kernels.triton_attention.MAX_NEW` new tokens per row (decode, verifies,
        drafter levels); on a CPU in float32 with the C++ kernel built, one new token per row (decode, chain
        drafting), or up to :data:`tltlib.kv.paged_attention.MASKED_KERNEL_MAX_NEW` under the forward's mask (chain
        and tree verifies, drafter tree levels), as :func:`tltlib.kv.paged_attention.choose_kernel` picks; other
        forwards (prefills) attend over the rows' gathered pages by :func:`tltlib.kernels.dispatch.cached_attention`."""
        self._store(layer, where, k_new, v_new)
        kind = self._chosen(q, where)
        if kind == "triton":
            out = triton_attention.cached_paged_attention(q, self.k[layer], self.v[layer], where.table,
                                                          self.lengths[: self.rows], where.mask, where.span,
                                                          where.memo)
            if out is not None:
                return out
            kind = where.memo["paged"] = "default"     # the kernel failed to build here (warned): gather instead
        if kind == "ragged":
            return paged_ragged_attention(q, self.k[layer], self.v[layer], where.table, where.limits)
        if kind == "masked":
            return paged_masked_attention(q, self.k[layer], self.v[layer], where.table, where.ends,
                                          kernel_mask(where), where.mask_from)
        k, v = self._gather(self.k[layer], where), self._gather(self.v[layer], where)
        return cached_attention(q, k, v, where.mask, where.mask_from, where.memo, where.limits)

    def attend_qkv(self, layer: int, where: CacheWrite, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   heads: int) -> torch.Tensor | None:
        """As :meth:`tltlib.kv.dense.KVCache.attend_qkv`: where :meth:`attend` would run the CPU's paged kernels
        (``ragged`` or ``masked``), the rotary, the write and the attention in one C++ call
        (:func:`tltlib.kernels.ragged_attention.paged_rope_attention`); None elsewhere (CUDA, prefills, another
        dtype), and the caller takes the PyTorch path. Intel Xeon, 2 threads, SmolLM2 decode: ~15 PyTorch calls per
        layer fewer (bench decode_breakdown)."""
        if torch.is_grad_enabled() and qkv.requires_grad:   # the C++ call would drop the gradient
            return None
        b, t, n = qkv.shape                            # q's shape for the first layer's choice: a view
        args = self.rope_kernel_args(where, qkv.view(b, t, n // self.k.shape[-1], -1).transpose(1, 2))
        if args is None or not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
            return None
        limit, mask, mask_from = args
        return paged_rope_attention(qkv, cos, sin, self.k[layer], self.v[layer], where.index, where.table, limit,
                                    heads, mask, mask_from)

    def rope_kernel_args(self, where: CacheWrite, q: torch.Tensor) -> tuple | None:
        """``(limit, mask, mask_from)`` for :func:`tltlib.kernels.ragged_attention.paged_rope_attention` where this
        forward (``where``; ``q``, any ``[B, heads, T, ...]`` tensor of its queries' dtype and device, for the
        first layer's choice) runs the CPU's paged kernels: ``ragged`` (the rows' limits, no mask) or ``masked``
        (their ends and the mask); None elsewhere."""
        kind = where.memo.get("paged") or self._chosen(q, where)
        if kind == "ragged":
            return where.limits, None, 0
        if kind == "masked":
            return where.ends, kernel_mask(where), where.mask_from
        return None

    def _chosen(self, q: torch.Tensor, where: CacheWrite) -> str:
        """The forward's attention kernel (:meth:`_kernel`), chosen on its first layer for its every layer."""
        kind = where.memo.get("paged")
        if kind is None:
            kind = where.memo["paged"] = choose_kernel(q, where)
        return kind

    # ------------------------------------------------------------------------------------------- bookkeeping
    def _refresh(self) -> None:
        live = self.blocks.lengths[self.row0: self.row0 + self.rows]
        self.max_used = max(live) if live else 0
        self.min_used = min(live) if live else 0

    def _set_lengths(self, host: list[int]) -> None:
        """The active rows' committed lengths are now ``host``: pages fitted to them, bounds refreshed."""
        lens, pages, size = self.blocks.lengths, self.blocks.pages, self.page_size
        for r, n in enumerate(host, self.row0):
            lens[r] = n
            if len(pages[r]) != -(-n // size):         # pages_for(n), inline: the decode loop's path
                self._fit(r)
        self._sync_table()
        self._refresh()

    def advance(self, n: torch.Tensor | int) -> None:
        """Commit ``n`` (int or ``[rows]`` tensor) of the entries written by the last forward; the pages past the
        committed tokens go back to the pool (a tensor costs one device sync, as on the dense cache)."""
        self.lengths[: self.rows] += n
        if isinstance(n, int):
            self._set_lengths([x + n for x in self.blocks.lengths[self.row0: self.row0 + self.rows]])
        else:
            self._set_lengths(self.lengths[: self.rows].tolist())

    def rollback(self, n: torch.Tensor | int) -> None:
        """Remove the last ``n`` committed entries of each row (``n`` int or ``[rows]`` tensor, ``<= lengths``);
        pages past the kept tokens go back to the pool."""
        if torch.any(self.lengths[: self.rows] < n):
            raise BadInput("PagedKVCache.rollback: cannot remove more entries than a row holds")
        self.advance(-n)

    def _slots(self, rel: torch.Tensor) -> torch.Tensor:
        """``[rows, m, kv_heads]`` flat storage index of entries ``lengths + rel`` (``rel [rows, m]`` or ``[1, m]``)
        per head, through the block tables (:func:`tltlib.kv.paged_attention.table_slots`)."""
        return table_slots(self.table[: self.rows], self.lengths[: self.rows], rel, self.page_size, self.k.shape[1],
                           self.k.shape[2] * self.page_size)

    def _host_slots(self, offset: int, num_new: int) -> torch.Tensor:
        """:meth:`_slots` of entries ``lengths + offset + arange(num_new)`` from the host's block tables and lengths
        (:meth:`tltlib.kv.pages.BlockTables.write_slots`: one tensor from a list instead of six small ops)."""
        kvh = self.k.shape[1]
        out = self.blocks.write_slots(range(self.row0, self.row0 + self.rows), offset, num_new, kvh,
                                      self.k.shape[2] * self.page_size)
        return torch.tensor(out, dtype=torch.long).view(self.rows, num_new, kvh)

    def gather_uncommitted(self, src: torch.Tensor) -> None:
        """As :meth:`tltlib.kv.dense.KVCache.gather_uncommitted` (entries found through the block tables)."""
        m = src.shape[1]
        frm = self._slots(src).reshape(-1)
        to = self._slots(torch.arange(m, device=src.device).expand_as(src)).reshape(-1)
        layers, d = self.k.shape[0], self.k.shape[-1]
        for store in (self.k, self.v):
            flat = store.view(layers, -1, d)
            flat.index_copy_(1, to, flat.index_select(1, frm))

    def select_rows(self, index: torch.Tensor) -> None:
        """As :meth:`tltlib.kv.dense.KVCache.select_rows`, moving block tables instead of data: a row dropped gives
        its pages back, a row repeated shares its pages with its copies (copy-on-write when one writes)."""
        if self.row0:
            raise BadInput("select_rows on a view: select on the cache the view was made from")
        n = int(index.numel())
        if n > self.capacity:
            raise BadInput(f"PagedKVCache.select_rows: {n} rows requested but the cache was made for "
                           f"{self.capacity}")
        picked = index.tolist()
        blocks = self.blocks
        before = self.rows
        blocks.select(picked, before)
        self.table[:n] = self.table[index]
        if self._host is not self.table:
            self._host[:n] = self._host[index.cpu()]
        self._host[n:before] = self.scratch
        self.table[n:before] = self.scratch
        self.lengths[:n] = self.lengths[index]
        self.lengths[n:before] = 0
        self.rows = n
        self._refresh()

    def view(self, start: int, stop: int) -> "PagedKVCache":
        """A cache over rows ``start .. stop-1`` sharing this one's storage, pages and tables (e.g. to prefill
        prompts in chunks). Call :meth:`sync_from_views` on the parent afterwards."""
        sub = object.__new__(PagedKVCache)
        sub.__dict__.update(self.__dict__)
        sub.table, sub._host = self.table[start:stop], self._host[start:stop]
        sub.lengths = self.lengths[start:stop]
        sub.row0, sub.rows, sub.fixed_span = self.row0 + start, stop - start, None
        sub._refresh()
        return sub

    def sync_from_views(self) -> None:
        """Recompute the host-side bounds after rows were written through :meth:`view`."""
        self._refresh()

    def reset(self, rows: int | None = None) -> None:
        """Forget everything (every page back to the pool); reuse the storage for ``rows`` rows (default: all)."""
        rows = self.capacity if rows is None else rows
        if rows > self.capacity:
            raise BadInput(f"PagedKVCache.reset: {rows} rows requested but the cache was made for {self.capacity}")
        for r in range(self.capacity):
            self.blocks.release(r)
        self.table.fill_(self.scratch)
        if self._host is not self.table:
            self._host.fill_(self.scratch)
        self._dirty.clear()
        self.lengths.zero_()
        self.rows = rows
        self.max_used = self.min_used = 0
        self.pool.peak = 0

    # ------------------------------------------------------------------------------------------- memory
    def held_tokens(self) -> int:
        """Committed tokens of the active rows, a shared page's tokens counted once: what the data needs."""
        return self.blocks.held_tokens()

    def check_holds(self, tokens: int, what: str = "", share: float = 1.0, name: str = "") -> None:
        """Refuse a rollout whose longest row (``tokens``: its prompt and every token it may generate; ``what``
        says so in the message) cannot fit the pool even alone, naming the budget it needs (this cache holds
        ``share`` of ``KVConfig.memory``; ``name``: whose cache, e.g. "the drafter's "): admission by memory can
        always finish a rollout by running its rows one at a time, as long as one fits."""
        need = pages_for(tokens, self.page_size)
        if need > self.pool.num_pages:
            raise BadInput(f"a row of {tokens:,} tokens{what} needs {need} pages of {name}KV cache but its budget "
                           f"holds {self.pool.num_pages}: {self._give(need, share)}, or shorten the prompt or "
                           "max_new_tokens")

    def _give(self, pages: int, share: float) -> str:
        """What to give the budget for ``pages`` pages when this cache holds ``share`` of it."""
        total = math.ceil(pages * self.bytes_per_page / min(share, 1.0))
        split = "" if share >= 1 else f" (this cache gets {share:.0%} of it, the rest goes to the other's)"
        return f"give RolloutConfig.kv = KVConfig(memory=...) at least {total:,} bytes{split}"

    def check_prefill(self, chunks: list[list[int]], share: float = 1.0, name: str = "") -> None:
        """Refuse a rollout whose prefill cannot fit: the prompts prefilled in ``chunks`` (their lengths, chunk by
        chunk), each chunk's rows padded to its longest while it runs, the earlier chunks at their own lengths (a
        prompt's samples share its pages), and one page for a first new token; naming the budget it needs (fewer
        prompts per rollout are the other way out; ``share``, ``name`` as :meth:`check_holds`). Samples that cannot
        get their own pages then wait (admission by memory)."""
        size, held, need = self.page_size, 0, 0
        for chunk in chunks:
            need = max(need, held + len(chunk) * pages_for(max(chunk), size))
            held += sum(pages_for(n, size) for n in chunk)
        need = max(need, held) + 1
        if need > self.pool.num_pages:
            prompts = sum(map(len, chunks))
            raise BadInput(f"the prefill of {prompts} prompts needs {need} pages of {name}KV cache but its budget "
                           f"holds {self.pool.num_pages}: {self._give(need, share)}, or fewer prompts per rollout")

    def memory(self) -> dict[str, int]:
        """``used_bytes`` (pages held now), ``peak_bytes`` (most pages held since the last reset), ``held_bytes``
        (:meth:`held_tokens` at this cache's bytes per token), ``pool_bytes`` (the pool, scratch page excluded)."""
        per_page = self.bytes_per_page
        return {"used_bytes": self.pool.used * per_page, "peak_bytes": self.pool.peak * per_page,
                "held_bytes": self.held_tokens() * per_page // self.page_size,
                "pool_bytes": self.pool.num_pages * per_page}
