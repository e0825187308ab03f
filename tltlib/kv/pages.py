"""Pages of KV-cache slots and the rows' block tables: the bookkeeping of a paged KV cache (issue 39, step 1).

A paged cache keeps every layer's keys and values in one pool of fixed-size pages (``page_size`` token slots each)
instead of a dense ``rows x max_len`` block, and gives each row a block table: the pages that hold its tokens, in
order, so that token ``t`` of a row lives at slot ``table[t // page_size] * page_size + t % page_size``. Pages are
taken as a row grows and given back when it finishes or when rejected speculative tokens are rolled back past a
page boundary; the G samples of a prompt share the prompt's pages (reference-counted), and a row about to write into
a page that another row still reads gets its own copy first (copy-on-write: the caller copies the slots, this module
says which pages).

This module is only the bookkeeping, on the host, with no tensors of KV data: :class:`PagePool` (free pages and
reference counts) and :class:`BlockTables` (rows' pages and lengths). The cache that stores the data and the
attention that reads through the tables build on it.

Paper: TLT §5 runs its rollouts on SGLang, whose token pool is paged; vLLM's PagedAttention (Kwon et al., SOSP
2023) introduced block tables with copy-on-write sharing.

Departures: none (vLLM hands out any free block; keeping a row's pages in runs is this project's choice for its CPU
kernel, which reads a run as one stretch).
"""
from __future__ import annotations

import heapq

import torch

from ..errors import BadInput


def check_page_size(page_size: int) -> int:
    """``page_size`` if it is a positive power of two (token slots per page), else a ``ValueError`` naming the fix."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
        raise BadInput(f"page_size must be a positive power of two (e.g. 16), got {page_size!r}")
    return page_size


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` token slots."""
    return -(-tokens // page_size)


RUN = 8
"""Pages per run (:class:`PagePool`): a row that starts a run of fresh pages finds the next ``RUN - 1`` free for it."""


class PagePool:
    """``num_pages`` pages of ``page_size`` token slots: which are free, and how many rows hold each.

    A row's pages are kept contiguous where they can be, so that attention reads long runs instead of scattered
    pages (decode rows grow in lockstep: handed out lowest-first, the pages of 128 rows interleave, and the CPU's
    paged decode kernel ran ~1.3x slower than over pages in order). The pool is cut into runs of :data:`RUN`
    pages; ``take(n, after=p)`` gives the page after ``p`` (the row's last) when it is free and inside ``p``'s run,
    or when it starts a wholly free run; else the lowest wholly free run; else, when none is left, the lowest free
    page anywhere (a run's free pages are only preferred for its row, never withheld). Which pages a row gets never
    changes what is held: a take fails only when fewer than ``n`` pages are free."""

    def __init__(self, num_pages: int, page_size: int = 16, run: int = RUN):
        self.page_size = check_page_size(page_size)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise BadInput(f"a page pool needs at least one page, got num_pages={num_pages!r}")
        self.num_pages, self.run = num_pages, run
        self.refs = [0] * num_pages
        self._free_count = num_pages
        self._free = list(range(num_pages))                        # min-heaps with stale entries (checked on pop):
        runs = pages_for(num_pages, run)                           # free pages, and wholly free runs
        self._run_free = [min(run, num_pages - c * run) for c in range(runs)]
        self._free_runs = list(range(runs))
        self.peak = 0                                              # most pages held at once (reset by the owner)

    @classmethod
    def for_budget(cls, budget_bytes: int, bytes_per_token: int, page_size: int = 16,
                   min_tokens: int = 1) -> "PagePool":
        """The pool that ``budget_bytes`` hold at ``bytes_per_token`` (every layer's key and value of one token).
        Refused when it cannot hold ``min_tokens`` (e.g. one prompt's pages), naming the smallest budget that can."""
        return cls(pages_in_budget(budget_bytes, bytes_per_token, page_size, min_tokens), page_size)

    @property
    def free(self) -> int:
        """Pages no row holds."""
        return self._free_count

    @property
    def used(self) -> int:
        return self.num_pages - self._free_count

    def take(self, n: int, after: int | None = None) -> list[int] | None:
        """``n`` free pages, each now held once, in the order a row appends them after its last page ``after``
        (None: a row with no pages); None (and nothing taken) when fewer are free."""
        if n > self._free_count:
            return None
        pages = []
        for _ in range(n):
            after = self._next_page(after)
            self.refs[after] = 1
            self._free_count -= 1
            self._run_free[after // self.run] -= 1
            pages.append(after)
        self.peak = max(self.peak, self.used)
        return pages

    def _next_page(self, after: int | None) -> int:
        """The free page to append after page ``after`` (see the class); one exists."""
        if after is not None and after + 1 < self.num_pages and self.refs[after + 1] == 0:
            nxt = after + 1
            if nxt % self.run or self._whole(nxt // self.run):
                return nxt
        while self._free_runs:
            c = heapq.heappop(self._free_runs)
            if self._whole(c):
                return c * self.run
        while True:
            p = heapq.heappop(self._free)
            if self.refs[p] == 0:
                return p

    def _whole(self, c: int) -> bool:
        return self._run_free[c] == min(self.run, self.num_pages - c * self.run)

    def share(self, pages) -> None:
        """One more holder of each of ``pages`` (held already)."""
        for p in pages:
            if self.refs[p] < 1:
                raise BadInput(f"page {p} is free: only a held page can be shared")
            self.refs[p] += 1

    def give_back(self, pages) -> None:
        """One holder fewer of each of ``pages``; a page nobody holds any more is free again."""
        for p in pages:
            if self.refs[p] < 1:
                raise BadInput(f"page {p} is already free (given back twice)")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free_count += 1
                heapq.heappush(self._free, p)
                c = p // self.run
                self._run_free[c] += 1
                if self._whole(c):
                    heapq.heappush(self._free_runs, c)
        if len(self._free) > 4 * self.num_pages:                  # stale entries: rebuild
            self._free = [p for p in range(self.num_pages) if self.refs[p] == 0]
            self._free_runs = [c for c in range(len(self._run_free)) if self._whole(c)]


class BlockTables:
    """Every row's pages and committed length over one :class:`PagePool`.

    ``pages[r]`` are row ``r``'s pages in token order; ``lengths[r]`` its committed tokens (the pages hold at least
    that many slots, more while a forward's new tokens are written before they are committed)."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.pages: list[list[int]] = []
        self.lengths: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.pages)

    def add_row(self) -> int:
        """A new empty row; its index."""
        self.pages.append([])
        self.lengths.append(0)
        return self.rows - 1

    def reserve(self, row: int, tokens: int) -> bool:
        """Make row ``row`` hold at least ``tokens`` slots, taking pages as needed; False (nothing taken) when the
        pool has too few free pages: the caller waits or preempts."""
        extra = pages_for(tokens, self.pool.page_size) - len(self.pages[row])
        if extra <= 0:
            return True
        got = self.pool.take(extra, self.pages[row][-1] if self.pages[row] else None)
        if got is None:
            return False
        self.pages[row].extend(got)
        return True

    def write_slots(self, rows: range, offset: int, num_new: int, kv_heads: int, head_stride: int) -> list[int]:
        """The flat storage slots of entries ``lengths[r] + offset .. + num_new - 1`` of each row ``r`` in ``rows``
        (pages held for them), per KV head: ``[len(rows) * num_new * kv_heads]``, row-major, slot ``page * page_size
        + position % page_size`` of head 0 plus ``head_stride`` per head."""
        size, heads = self.pool.page_size, range(0, kv_heads * head_stride, head_stride)
        out = []
        for r in rows:
            held, start = self.pages[r], self.lengths[r] + offset
            for pos in range(start, start + num_new):
                base = held[pos // size] * size + pos % size
                out.extend([base + h for h in heads])
        return out

    def commit(self, row: int, length: int) -> None:
        """Row ``row`` now holds ``length`` committed tokens (within its reserved slots)."""
        if length > len(self.pages[row]) * self.pool.page_size:
            raise BadInput(f"row {row}: {length} tokens committed but only "
                           f"{len(self.pages[row]) * self.pool.page_size} slots reserved")
        self.lengths[row] = length

    def truncate(self, row: int, length: int) -> None:
        """Row ``row`` keeps its first ``length`` tokens (SD's rejected tokens rolled back, or a row reset): the
        pages past them are given back."""
        if length > self.lengths[row]:
            raise BadInput(f"row {row} holds {self.lengths[row]} tokens, cannot truncate to {length}")
        keep = pages_for(length, self.pool.page_size)
        self.pool.give_back(self.pages[row][keep:])
        del self.pages[row][keep:]
        self.lengths[row] = length

    def release(self, row: int) -> None:
        """Row ``row`` finished: all its pages given back (it stays as an empty row)."""
        self.pool.give_back(self.pages[row])
        self.pages[row], self.lengths[row] = [], 0

    def fork(self, row: int, copies: int) -> list[int]:
        """``copies`` new rows holding the same tokens as ``row`` on the same pages (no copy: each page held once
        more), as the G samples of a prompt after its prefill; their indices."""
        out = []
        for _ in range(copies):
            new = self.add_row()
            self.pages[new] = list(self.pages[row])
            self.lengths[new] = self.lengths[row]
            self.pool.share(self.pages[new])
            out.append(new)
        return out

    def select(self, rows: list[int], active: int) -> None:
        """Rows ``0 .. len(rows) - 1`` become what rows ``rows`` were (a row listed twice: its pages shared, no
        copy); the others of the first ``active`` rows are emptied (their pages given back unless still held)."""
        picked = [(list(self.pages[r]), self.lengths[r]) for r in rows]
        for pages, _ in picked:
            self.pool.share(pages)
        for r in range(active):
            self.pool.give_back(self.pages[r])
            self.pages[r], self.lengths[r] = [], 0
        for i, (pages, length) in enumerate(picked):
            self.pages[i], self.lengths[i] = pages, length

    def pages_to_write(self, row: int, start: int, tokens: int) -> int:
        """Free pages row ``row`` needs to write ``tokens`` slots from token ``start``: new pages past its last, and
        a copy of every page it writes into that another row also holds."""
        size, held = self.pool.page_size, self.pages[row]
        first, last = start // size, (start + tokens - 1) // size
        shared = sum(self.pool.refs[held[i]] > 1 for i in range(first, min(last + 1, len(held))))
        return max(0, last + 1 - len(held)) + shared

    def writable(self, row: int, start: int, tokens: int) -> list[tuple[int, int]] | None:
        """Prepare row ``row`` to write ``tokens`` slots from token ``start``: reserve the slots, and give the row
        its own copy of every page it writes into that another row also holds (copy-on-write). Returns the
        ``(shared page, its new copy)`` pairs whose slots the caller copies before writing, or None (nothing
        changed) when the pool has too few free pages (:meth:`pages_to_write`)."""
        if self.pool.free < self.pages_to_write(row, start, tokens):
            return None
        size = self.pool.page_size
        first, last = start // size, (start + tokens - 1) // size
        held = self.pages[row]
        shared = [i for i in range(first, min(last + 1, len(held))) if self.pool.refs[held[i]] > 1]
        self.reserve(row, start + tokens)
        fresh = self.pool.take(len(shared))
        pairs = []
        for i, new in zip(shared, fresh):
            old = self.pages[row][i]
            self.pool.give_back([old])
            self.pages[row][i] = new
            pairs.append((old, new))
        return pairs

    def slots(self, row: int, start: int, tokens: int) -> torch.Tensor:
        """``[tokens]`` int64 flat slot (``page * page_size + offset``) of tokens ``start .. start + tokens - 1`` of
        row ``row`` (reserved)."""
        size = self.pool.page_size
        if start + tokens > len(self.pages[row]) * size:
            raise BadInput(f"row {row}: slots up to token {start + tokens} asked, "
                           f"{len(self.pages[row]) * size} reserved")
        t = torch.arange(start, start + tokens)
        pages = torch.tensor(self.pages[row], dtype=torch.long)
        return pages[t // size] * size + t % size

    def table(self, rows=None, width: int | None = None) -> torch.Tensor:
        """``[len(rows), width]`` int32 block table of ``rows`` (default all), padded with -1; ``width`` default
        the longest row's page count."""
        rows = range(self.rows) if rows is None else rows
        width = max((len(self.pages[r]) for r in rows), default=0) if width is None else width
        out = torch.full((len(rows), width), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            if len(self.pages[r]) > width:
                raise BadInput(f"row {r} holds {len(self.pages[r])} pages, more than the table's width {width}")
            out[i, :len(self.pages[r])] = torch.tensor(self.pages[r], dtype=torch.int32)
        return out

    def held_tokens(self) -> int:
        """Committed tokens over all rows, each shared page's tokens counted once (what the data needs)."""
        size, seen, total = self.pool.page_size, set(), 0
        for pages, length in zip(self.pages, self.lengths):
            for i, p in enumerate(pages):
                if p not in seen and i * size < length:
                    seen.add(p)
                    total += min(size, length - i * size)
        return total


def pages_in_budget(budget_bytes: int, bytes_per_token: int, page_size: int = 16, min_tokens: int = 1) -> int:
    """Pages of ``page_size`` tokens that ``budget_bytes`` hold at ``bytes_per_token``; refused when they cannot hold
    ``min_tokens`` (e.g. one prompt's pages), naming the smallest budget that can."""
    check_page_size(page_size)
    if bytes_per_token < 1:
        raise BadInput(f"bytes_per_token must be >= 1, got {bytes_per_token}")
    page_bytes = page_size * bytes_per_token
    need = max(1, pages_for(min_tokens, page_size))
    pages = int(budget_bytes // page_bytes)
    if pages < need:
        raise BadInput(f"a KV memory budget of {budget_bytes:,} bytes holds {pages} page(s) of {page_size} "
                       f"tokens ({page_bytes:,} bytes each), but {min_tokens:,} tokens need {need}: give it at "
                       f"least {need * page_bytes:,} bytes")
    return pages


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes of one token's keys and values over every layer (``elem_bytes``: 4 for float32, 2 for bfloat16)."""
    return 2 * num_layers * num_kv_heads * head_dim * elem_bytes

