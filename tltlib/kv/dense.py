"""Slot KV cache with per-row lengths, for ragged batches that shrink and roll back.

Layout: keys and values are ``[layers, rows, kv_heads, max_len, head_dim]`` plus ``lengths[rows]`` (committed entries
per row). A forward writes its ``T`` new entries of row ``r`` at slots ``lengths[r] .. lengths[r] + T - 1`` and attends
to the committed prefix plus the new entries (causally, or through a tree mask); it does *not* advance ``lengths``:
the caller commits with :meth:`KVCache.advance` once it knows how many of the new entries to keep, so rejected
speculative tokens are dropped by simply not committing them, and :meth:`KVCache.rollback` removes committed ones.

Paper: TLT §5 (adaptive rollout engine) needs per-request KV rollback after verification and a running batch that
shrinks as requests finish.

Departures from the paper / reference implementation:
1. SGLang uses a paged token pool shared by all requests; we use one dense slot per row (rows × max_len), as gpt-fast
   does. It wastes memory on short rows but makes rollback a length update and needs no kernels beyond PyTorch's.
2. Finished rows are removed by compaction (:meth:`select_rows`), which moves the surviving rows to the front; the
   attention then runs on a smaller batch, which is the point of removing them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import BadInput
from ..kernels.dispatch import cached_attention


@dataclass
class CacheWrite:
    """Where one forward's new entries go, shared by all layers: computed once by :meth:`KVCache.prepare`.

    Attributes:
        index: ``[rows, T, kv_heads]`` flat slot of every new (row, token, head) entry in a layer's storage.
        mask: ``[rows, 1, T, span]`` bool attention mask, or None when no masking is needed (one new token per
            row and every row equally long).
        span: cache slots attention reads (``max_used + T``).
        mask_from: ``mask[..., :mask_from]`` is all True (slots every row's new tokens see: the shortest row's
            committed prefix), so a kernel need only mask the columns from there on; after SD steps rows differ by
            a few tokens, and masking only that tail keeps a ragged decode as cheap as a uniform one.
        memo: scratch shared by the layers of one forward: the attention kernel keeps the mask there in its own
            layout (:func:`tltlib.kernels.dispatch.cached_attention`), built on the first layer and reused by the
            others.
        limits: for one new token per row on a CPU (no tree mask): ``[rows]`` int64, the slots each row's query
            sees (``0 .. limits[r] - 1``: its committed entries, the uncommitted ones before it, itself), which the
            ragged kernel reads instead of the mask (:mod:`tltlib.kernels.ragged_attention`); else None.
    """

    index: torch.Tensor
    mask: torch.Tensor | None
    span: int
    mask_from: int = 0
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    limits: torch.Tensor | None = None
    table: torch.Tensor | None = None
    """A paged cache's ``[rows, pages]`` int64 block tables covering ``span`` (:class:`tltlib.kv.paged.PagedKVCache`);
    None for the dense cache."""
    ends: torch.Tensor | None = None
    """A paged cache's ``[rows]`` int64 slots each row holds once this forward has written (committed, uncommitted
    and new), which its CPU kernels read up to; None for the dense cache and on a captured graph's fixed span."""


def check_fixed_span(cache, new_slots: int) -> bool:
    """Whether ``cache.fixed_span`` is set; refused when it does not cover the used slots plus ``new_slots`` or
    exceeds ``cache.max_len``."""
    span = cache.fixed_span
    if span is None:
        return False
    if not cache.max_used + new_slots <= span <= cache.max_len:
        raise BadInput(f"{type(cache).__name__}.prepare: fixed_span {span} must cover the "
                       f"{cache.max_used + new_slots} used slots and fit max_len {cache.max_len}")
    return True


def attention_mask(index: torch.Tensor, lengths: torch.Tensor, span: int, num_new: int,
                   tree_mask: torch.Tensor | None, offset: int, min_used: int, max_used: int,
                   fixed: bool) -> CacheWrite:
    """The :class:`CacheWrite` of ``num_new`` new tokens per row written at ``index`` (``[rows, T, kv_heads]``) after
    each row's ``lengths[rows]`` committed entries and ``offset`` uncommitted ones, attending over ``span`` positions
    (per row, position = token index in the row, whatever the storage). ``min_used`` (exact, or -1 when unknown) and
    ``max_used`` bound the lengths on the host; ``fixed``: the span is fixed (a captured graph), so no host-side
    shortcut may depend on the lengths. See :meth:`KVCache.prepare` for ``tree_mask``."""
    rows, dev = lengths.shape[0], lengths.device
    known = min_used >= 0 and not fixed                                  # min_used exact: a common prefix
    if num_new == 1 and tree_mask is None:                              # decode / chain drafting: cheap mask
        uniform = min_used == max_used and not fixed
        mask = None if uniform else (torch.arange(span, device=dev) <= lengths[:, None] + offset)[:, None, None]
        limits = lengths + (offset + 1) if dev.type == "cpu" and not fixed else None
        return CacheWrite(index, mask, span, min_used + offset + 1 if known else 0, limits=limits)
    slot, new = torch.arange(span, device=dev), torch.arange(num_new, device=dev)
    rel = slot[None, None, :] - lengths[:, None, None]                   # [rows, 1, span]: index among uncommitted
    if tree_mask is None:
        new_ok = (rel >= 0) & (rel <= offset + new[None, :, None])       # causal over the uncommitted entries
    else:
        width = offset + num_new
        idx = rel.clamp(0, width - 1).expand(rows, num_new, span)
        new_ok = (rel >= 0) & (rel < width) & torch.gather(tree_mask, 2, idx)
    return CacheWrite(index, ((rel < 0) | new_ok).unsqueeze(1), span, min_used if known else 0)


class KVCache:
    """Dense per-row KV cache for a decoder with ``num_layers`` attention layers.

    Attributes:
        k, v: ``[layers, max_rows, kv_heads, max_len, head_dim]`` storage.
        lengths: ``[max_rows]`` int64 committed lengths (only the first :attr:`rows` entries are meaningful).
        rows: number of active rows (rows ``0 .. rows-1``).
        max_used: host-side upper bound of ``lengths[:rows]``; bounds how much of the cache attention reads.
        min_used: host-side exact minimum of ``lengths[:rows]`` when known, else -1 (all rows equally long when it
            equals ``max_used``, which lets single-token forwards skip the mask).
        fixed_span: None, or the number of slots every forward attends over, masked from the device-side lengths:
            the shapes then depend on it alone, not on the host-side bounds, which is what a captured CUDA graph
            needs. Set only by :class:`tltlib.model.cudagraph.GraphPool` around the calls it captures or replays.
    """

    def __init__(self, num_layers: int, max_rows: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if max_rows < 1 or max_len < 1:
            raise BadInput(f"KVCache needs max_rows >= 1 and max_len >= 1, got {max_rows} and {max_len}")
        shape = (num_layers, max_rows, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.rows = max_rows
        self.max_len = max_len
        self.max_used = self.min_used = 0
        self.fixed_span: int | None = None

    # ----------------------------------------------------------------------------------------------- one forward
    def prepare(self, num_new: int, tree_mask: torch.Tensor | None = None, offset: int = 0) -> CacheWrite:
        """Slots and attention mask for ``num_new`` new tokens per row (rows with fewer real tokens pad on the right;
        their padding queries attend like real ones and the caller ignores their outputs).

        Args:
            tree_mask: optional ``[rows, T, offset + T]`` bool: new token i may attend to uncommitted entry j
                (j < offset: written by earlier forwards of this round; j >= offset: new token j - offset; must
                include the token itself). Default: every earlier uncommitted entry and the new tokens causally.
            offset: uncommitted entries already written after ``lengths`` (a draft being extended level by
                level); the new tokens go after them.

        Attention reads the used span (``max_used + offset + num_new`` slots), or :attr:`fixed_span` slots when set.
        """
        if self.max_used + offset + num_new > self.max_len:
            raise BadInput(f"KV cache overflow: {self.max_used} used + {offset + num_new} new > max_len "
                           f"{self.max_len}; allocate the cache with a larger max_len (prompt + max_new_tokens + "
                           "draft tokens)")
        fixed = check_fixed_span(self, offset + num_new)
        rows, kvh, dev = self.rows, self.k.shape[2], self.lengths.device
        lengths = self.lengths[:rows]
        span = self.fixed_span if fixed else self.max_used + offset + num_new
        new = torch.arange(num_new, device=dev)
        base = torch.arange(rows, device=dev) * (kvh * self.max_len) + lengths + offset
        index = (base[:, None, None] + new[None, :, None]
                 + (torch.arange(kvh, device=dev) * self.max_len)[None, None, :])
        return attention_mask(index, lengths, span, num_new, tree_mask, offset, self.min_used, self.max_used, fixed)

    def write(self, layer: int, where: CacheWrite, k_new: torch.Tensor,
              v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k_new, v_new [rows, T, kv_heads, head_dim]`` at the prepared slots; return the readable views
        ``[rows, kv_heads, span, head_dim]``."""
        d = k_new.shape[-1]
        flat = where.index.view(-1)
        self.k[layer].view(-1, d).index_copy_(0, flat, k_new.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, flat, v_new.reshape(-1, d))
        return self.k[layer, : self.rows, :, : where.span], self.v[layer, : self.rows, :, : where.span]

    def attend(self, layer: int, where: CacheWrite, q: torch.Tensor, k_new: torch.Tensor,
               v_new: torch.Tensor) -> torch.Tensor:
        """Store the new entries (:meth:`write`) and return the attention of ``q [rows, H, T, head_dim]`` over each
        row's committed entries and the new ones, as :meth:`prepare` masked them: ``[rows, H, T, head_dim]``."""
        k, v = self.write(layer, where, k_new, v_new)
        return cached_attention(q, k, v, where.mask, where.mask_from, where.memo, where.limits)

    def attend_qkv(self, layer: int, where: CacheWrite, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   heads: int) -> torch.Tensor | None:
        """A layer's whole attention step from its fused projection's output ``qkv [rows, T, (heads + 2 kv_heads)
        head_dim]`` (rotary by ``cos``, ``sin``, the write, the attention) in one kernel call, ``[rows, T, heads *
        head_dim]``, where the cache has such a kernel for this forward; None where not (the caller rotates and calls
        :meth:`attend`): the dense cache never has (:meth:`tltlib.kv.paged.PagedKVCache.attend_qkv`)."""
        return None

    def rope_kernel_args(self, where: CacheWrite, q: torch.Tensor) -> tuple | None:
        """The arguments of the one-call attention step for this forward
        (:meth:`tltlib.kv.paged.PagedKVCache.rope_kernel_args`); the dense cache has none: None."""
        return None

    @property
    def capacity(self) -> int:
        """Rows the cache was allocated for (the most :attr:`rows` can be)."""
        return self.k.shape[1]

    def make_room(self, tokens: int) -> None:
        """Nothing to take: every row's slots up to ``max_len`` are allocated (the paged cache takes pages here)."""

    def pages_short(self, tokens: int, rows: int = 0, rows_tokens: int = 0) -> int:
        """0: nothing is ever short (see :meth:`tltlib.kv.paged.PagedKVCache.pages_short`)."""
        return 0

    def add_rows(self, n: int) -> None:
        """``n`` empty rows after the active ones (a rollout re-admitting preempted rows prefills them through
        :meth:`view`)."""
        if self.rows + n > self.capacity:
            raise BadInput(f"{type(self).__name__}.add_rows: {self.rows} + {n} rows exceed the {self.capacity} "
                           "the cache was made for")
        self.lengths[self.rows: self.rows + n] = 0
        self.rows += n
        self._refresh()

    def check_holds(self, tokens: int, what: str = "", share: float = 1.0, name: str = "") -> None:
        """Refuse a row of ``tokens`` tokens longer than the cache (the paged cache checks its pool)."""
        if tokens > self.max_len:
            raise BadInput(f"a row of {tokens:,} tokens{what} does not fit a KV cache of max_len {self.max_len}")

    def check_prefill(self, chunks: list[list[int]], share: float = 1.0, name: str = "") -> None:
        """Nothing to check: the allocation holds every row (the paged cache checks its pool)."""

    def memory(self) -> dict[str, int]:
        """As :meth:`tltlib.kv.paged.PagedKVCache.memory`: the allocation is used, peak and pool alike."""
        size = 2 * self.k.numel() * self.k.element_size()
        per_token = 2 * self.k[:, 0, :, 0].numel() * self.k.element_size()
        return {"used_bytes": size, "peak_bytes": size, "pool_bytes": size,
                "held_bytes": int(self.lengths[: self.rows].sum()) * per_token}

    # ------------------------------------------------------------------------------------------- bookkeeping
    def _refresh(self) -> None:
        live = self.lengths[: self.rows]
        self.max_used = int(live.max()) if self.rows else 0
        self.min_used = int(live.min()) if self.rows else 0

    def advance(self, n: torch.Tensor | int) -> None:
        """Commit ``n`` (int or ``[rows]`` tensor) of the entries written by the last forward (a tensor costs one
        device sync to keep the host-side bounds exact)."""
        self.lengths[: self.rows] += n
        if isinstance(n, int):
            self.max_used += n
            self.min_used = self.min_used + n if self.min_used >= 0 else -1
        else:
            self._refresh()

    def rollback(self, n: torch.Tensor | int) -> None:
        """Remove the last ``n`` committed entries of each row (``n`` int or ``[rows]`` tensor, ``<= lengths``)."""
        if torch.any(self.lengths[: self.rows] < n):
            raise BadInput("KVCache.rollback: cannot remove more entries than a row holds")
        self.lengths[: self.rows] -= n
        if isinstance(n, int):
            self.max_used -= n
            self.min_used = self.min_used - n if self.min_used >= 0 else -1
        else:
            self.min_used = -1

    def gather_uncommitted(self, src: torch.Tensor) -> None:
        """Move uncommitted entries into place before committing them: for every row r and j < M, the entry
        ``lengths[r] + j`` becomes a copy of entry ``lengths[r] + src[r, j]`` (all layers). Used after tree
        verification to line the accepted path up behind the committed prefix."""
        rows, m = src.shape
        layers, _, kvh, max_len, d = self.k.shape
        dev = src.device
        head = (torch.arange(rows, device=dev) * (kvh * max_len) + self.lengths[:rows])[:, None, None] \
            + (torch.arange(kvh, device=dev) * max_len)[None, None, :]
        frm = (head + src[:, :, None]).reshape(-1)
        to = (head + torch.arange(m, device=dev)[None, :, None]).reshape(-1)
        for store in (self.k, self.v):
            flat = store.view(layers, -1, d)
            flat.index_copy_(1, to, flat.index_select(1, frm))

    def select_rows(self, index: torch.Tensor) -> None:
        """Make row i of the cache a copy of current row ``index[i]``, for every i.

        ``index`` (``[n]`` int64, into the active rows) may drop rows (compaction after rows finish) and repeat them
        (``arange(P).repeat_interleave(G)`` turns P prefilled prompts into P x G sequences). Only the used span is
        copied."""
        n = int(index.numel())
        if n > self.k.shape[1]:
            raise BadInput(f"KVCache.select_rows: {n} rows requested but only {self.k.shape[1]} allocated")
        span = self.max_used
        if n and span:
            self.k[:, :n, :, :span] = self.k[:, index, :, :span]
            self.v[:, :n, :, :span] = self.v[:, index, :, :span]
        self.lengths[:n] = self.lengths[index]
        self.rows = n
        self._refresh()

    def view(self, start: int, stop: int) -> "KVCache":
        """A cache over rows ``start .. stop-1`` sharing this one's storage (e.g. to prefill prompts in chunks).

        Call :meth:`sync_from_views` on the parent afterwards."""
        sub = object.__new__(KVCache)
        sub.k, sub.v, sub.lengths = self.k[:, start:stop], self.v[:, start:stop], self.lengths[start:stop]
        sub.rows, sub.max_len, sub.fixed_span = stop - start, self.max_len, None
        sub._refresh()
        return sub

    def sync_from_views(self) -> None:
        """Recompute the host-side bounds after rows were written through :meth:`view`."""
        self._refresh()

    def reset(self, rows: int | None = None) -> None:
        """Forget everything; reuse the storage for ``rows`` rows (default: all)."""
        rows = self.k.shape[1] if rows is None else rows
        if rows > self.k.shape[1]:
            raise BadInput(f"KVCache.reset: {rows} rows requested but only {self.k.shape[1]} allocated")
        self.rows = rows
        self.lengths.zero_()
        self.max_used = self.min_used = 0
