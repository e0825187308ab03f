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

import torch


class KVCache:
    """Dense per-row KV cache for a decoder with ``num_layers`` attention layers.

    Attributes:
        k, v: ``[layers, max_rows, kv_heads, max_len, head_dim]`` storage.
        lengths: ``[max_rows]`` int64 committed lengths (only the first :attr:`rows` entries are meaningful).
        rows: number of active rows (rows ``0 .. rows-1``).
        max_used: host-side upper bound of ``lengths[:rows]``; bounds how much of the cache attention reads.
    """

    def __init__(self, num_layers: int, max_rows: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if max_rows < 1 or max_len < 1:
            raise ValueError(f"KVCache needs max_rows >= 1 and max_len >= 1, got {max_rows} and {max_len}")
        shape = (num_layers, max_rows, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.rows = max_rows
        self.max_len = max_len
        self.max_used = 0

    @classmethod
    def for_model(cls, config, rows: int, max_len: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", num_layers: int | None = None) -> "KVCache":
        """A cache shaped for a :class:`tltlib.model.ModelConfig` (``num_layers`` overrides, e.g. 1 for a drafter)."""
        return cls(num_layers if num_layers is not None else config.num_layers, rows, config.num_kv_heads, max_len,
                   config.dim_head, dtype, device)

    # ----------------------------------------------------------------------------------------------- one forward
    def step_mask(self, num_new: int, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention mask for ``num_new`` new tokens per row.

        Args:
            num_new: T, the number of new tokens each row writes (rows with fewer are right-padded).
            tree_mask: optional ``[rows, T, T]`` bool, ``tree_mask[r, i, j]`` = new token i may attend to new token j
                (must include i == j). Default: causal.
            num_valid: unused by the mask (padding queries attend like real ones and are ignored by the caller).

        Returns:
            ``[rows, 1, T, max_used + T]`` bool mask: committed slots ``< lengths[r]`` plus the allowed new slots.
        """
        if self.max_used + num_new > self.max_len:
            raise ValueError(f"KV cache overflow: {self.max_used} used + {num_new} new > max_len {self.max_len}; "
                             "allocate the cache with a larger max_len (prompt + max_new_tokens + draft budget)")
        rows = self.rows
        span = self.max_used + num_new
        lengths = self.lengths[:rows]
        slot = torch.arange(span, device=lengths.device)
        rel = slot[None, None, :] - lengths[:, None, None]               # [rows, 1, span]: index among new tokens
        query = torch.arange(num_new, device=lengths.device)[None, :, None]  # [1, T, 1]
        if tree_mask is None:
            new_ok = (rel >= 0) & (rel <= query)                          # causal over the new tokens
        else:
            idx = rel.clamp(0, num_new - 1).expand(rows, num_new, span)
            new_ok = (rel >= 0) & (rel < num_new) & torch.gather(tree_mask, 2, idx)
        return ((rel < 0) | new_ok).unsqueeze(1)

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k_new, v_new [rows, kv_heads, T, head_dim]`` at slots ``lengths + t``; return the readable views
        ``[rows, kv_heads, max_used + T, head_dim]``."""
        rows, _, t, _ = k_new.shape
        if t == 1:
            row_idx = torch.arange(rows, device=k_new.device)
            slots = self.lengths[:rows]
            self.k[layer, row_idx, :, slots] = k_new[:, :, 0]
            self.v[layer, row_idx, :, slots] = v_new[:, :, 0]
        else:
            row_idx = torch.arange(rows, device=k_new.device)[:, None]
            slots = self.lengths[:rows, None] + torch.arange(t, device=k_new.device)[None, :]
            self.k[layer, row_idx, :, slots] = k_new.transpose(1, 2)
            self.v[layer, row_idx, :, slots] = v_new.transpose(1, 2)
        span = self.max_used + t
        return self.k[layer, :rows, :, :span], self.v[layer, :rows, :, :span]

    # ------------------------------------------------------------------------------------------- bookkeeping
    def advance(self, n: torch.Tensor | int, max_n: int | None = None) -> None:
        """Commit ``n`` (int or ``[rows]`` tensor) of the entries written by the last forward.

        ``max_n`` is a host-side bound of ``n`` (saves a device sync when ``n`` is a tensor)."""
        self.lengths[: self.rows] += n
        if isinstance(n, int):
            self.max_used += n
        elif max_n is not None:
            self.max_used += max_n
        else:
            self.max_used = int(self.lengths[: self.rows].max()) if self.rows else 0

    def rollback(self, n: torch.Tensor | int) -> None:
        """Remove the last ``n`` committed entries of each row (``n`` int or ``[rows]`` tensor, ``<= lengths``)."""
        if torch.any(self.lengths[: self.rows] < n):
            raise ValueError("KVCache.rollback: cannot remove more entries than a row holds")
        self.lengths[: self.rows] -= n

    def select_rows(self, index: torch.Tensor) -> None:
        """Make row i of the cache a copy of current row ``index[i]``, for every i.

        ``index`` (``[n]`` int64, into the active rows) may drop rows (compaction after rows finish) and repeat them
        (``arange(P).repeat_interleave(G)`` turns P prefilled prompts into P x G sequences). Only the used span is
        copied."""
        n = int(index.numel())
        if n > self.k.shape[1]:
            raise ValueError(f"KVCache.select_rows: {n} rows requested but only {self.k.shape[1]} allocated")
        span = self.max_used
        if n and span:
            self.k[:, :n, :, :span] = self.k[:, index, :, :span]
            self.v[:, :n, :, :span] = self.v[:, index, :, :span]
        self.lengths[:n] = self.lengths[index]
        self.rows = n
        self.max_used = int(self.lengths[:n].max()) if n else 0

    def view(self, start: int, stop: int) -> "KVCache":
        """A cache over rows ``start .. stop-1`` sharing this one's storage (e.g. to prefill prompts in chunks).

        Call :meth:`sync_from_views` on the parent afterwards to refresh :attr:`max_used`."""
        sub = object.__new__(KVCache)
        sub.k, sub.v, sub.lengths = self.k[:, start:stop], self.v[:, start:stop], self.lengths[start:stop]
        sub.rows, sub.max_len = stop - start, self.max_len
        sub.max_used = int(sub.lengths.max()) if stop > start else 0
        return sub

    def sync_from_views(self) -> None:
        """Recompute :attr:`max_used` after rows were written through :meth:`view`."""
        self.max_used = int(self.lengths[: self.rows].max()) if self.rows else 0

    def reset(self, rows: int | None = None) -> None:
        """Forget everything; reuse the storage for ``rows`` rows (default: all)."""
        rows = self.k.shape[1] if rows is None else rows
        if rows > self.k.shape[1]:
            raise ValueError(f"KVCache.reset: {rows} rows requested but only {self.k.shape[1]} allocated")
        self.rows = rows
        self.lengths.zero_()
        self.max_used = 0
