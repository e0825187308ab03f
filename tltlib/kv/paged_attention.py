"""Attention over a paged KV cache, read through the rows' block tables (issue 39, step 2: the reference path).

Keys and values live in flat slot storage, ``[slots, kv_heads, head_dim]`` per layer, where slot ``page * page_size
+ offset`` is token ``offset`` of that page (:mod:`tltlib.kv.pages`). A row's tokens are found through its block table:
token ``t`` at slot ``table[t // page_size] * page_size + t % page_size``. This module gathers each row's slots and
runs PyTorch's SDPA under a mask that lets every new query see its row's committed tokens, the new tokens before it
(causal) or its ancestors in a draft tree, and nothing past its row's length. It is the exact reference the faster
kernels (the CPU's ragged kernel, CUDA under graphs) are tested against, and the path for the shapes they do not
serve.

Shapes: ``rows`` rows, ``T`` new tokens per row (1 for decode, k+1 for a chain verify, the nodes of a tree), ``H``
query heads over ``Hkv`` key/value heads (grouped-query attention when ``Hkv < H``), head width ``d``.

Paper: none (vLLM's PagedAttention, Kwon et al., SOSP 2023, reads keys and values through block tables).

Also here, for :class:`tltlib.kv.paged.PagedKVCache`: which kernel a forward's attention over the pages runs
(:func:`choose_kernel`, with the masked kernel's mask layout, :func:`kernel_mask`) and where its new entries go
(:func:`table_slots`).

Departures: none.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import BadInput
from ..kernels import triton_attention
from ..kernels.ragged_attention import kernel as ragged_kernel
from .dense import CacheWrite

MASKED_KERNEL_MAX_NEW = 12
"""Most new tokens per row the CPU's masked paged kernel takes; longer forwards (prefills, big trees) gather the
pages and use BLAS. Between the crossover's sides measured on an AMD EPYC (2 threads, ``bench kv_cache
--attention``, bench/results/kv_attention-cpu-float32-amd-epyc-2t.md): the kernel 1.3-4.6x faster than gather +
the dense path at 2-9 tokens over 2-128 rows, 0.84-1.15x at 17, 0.66-0.74x at 33. A fact about that CPU: another
may cross elsewhere (rerun the bench there)."""


def choose_kernel(q: torch.Tensor, where: CacheWrite) -> str:
    """The kernel of a paged cache's forward (``q [B, heads, T, d]``, its :class:`~tltlib.kv.dense.CacheWrite`):
    ``triton`` on CUDA where the Triton kernel runs (triton imports, ``TLTLIB_TRITON_ATTENTION`` not ``0``) and the
    forward fits it (bfloat16, float16 or float32, up to :data:`tltlib.kernels.triton_attention.MAX_NEW` new tokens:
    :func:`tltlib.kernels.triton_attention.wanted`); on a CPU ``ragged`` (one new token per row) or ``masked`` (2 ..
    :data:`MASKED_KERNEL_MAX_NEW` under a mask) where the paged kernels can run (float32, the kernel built),
    whatever the kernel table says: its cells are measured on dense views, and here every other kernel pays a gather
    of the rows' pages first (AMD EPYC, 2 threads, ``bench kv_cache --attention``: the paged kernel 3.0-5.0x faster
    than gather + the dense path for one token at 2-128 rows, 1.3-4.6x for 2-9 tokens); else ``default``
    (:func:`tltlib.kernels.dispatch.cached_attention` decides over the gathered pages)."""
    if triton_attention.wanted(q, where.mask):
        return "triton"
    if q.dtype != torch.float32 or q.is_cuda or where.ends is None or ragged_kernel() is None:
        return "default"
    t = q.shape[2]
    if t == 1 and where.limits is not None:
        return "ragged"
    if 1 < t <= MASKED_KERNEL_MAX_NEW and where.mask is not None:
        return "masked"
    return "default"


def kernel_mask(where: CacheWrite) -> torch.Tensor:
    """The forward's mask in the masked paged kernel's layout (``[rows, T, span]`` contiguous), made once."""
    mask = where.memo.get("paged_mask")
    if mask is None:
        mask = where.memo["paged_mask"] = where.mask[:, 0].contiguous()
    return mask


def table_slots(table: torch.Tensor, lengths: torch.Tensor, rel: torch.Tensor, page_size: int, kv_heads: int,
                head_stride: int) -> torch.Tensor:
    """``[rows, m, kv_heads]`` flat storage index of each row's entries ``lengths + rel`` (``rel [rows, m]`` or
    ``[1, m]``), per KV head, through the block tables ``table [rows, width]`` (``lengths [rows]``): slot
    ``page * page_size + position % page_size`` of head 0, plus ``head_stride`` per head."""
    pos = lengths[:, None] + rel
    page = table.gather(1, torch.div(pos, page_size, rounding_mode="floor"))
    base = page * page_size + pos % page_size
    return base[:, :, None] + (torch.arange(kv_heads, device=rel.device) * head_stride)[None, None, :]


def slot_index(table: torch.Tensor, page_size: int, span: int) -> torch.Tensor:
    """``[rows, span]`` int64 slot of each row's tokens ``0 .. span - 1`` from its block table (``[rows, width]``
    int, ``-1`` past its pages; such slots read slot 0 and must be masked)."""
    t = torch.arange(span, device=table.device)
    pages = table.long()[:, t // page_size]
    return pages.clamp_min(0) * page_size + t % page_size


def visible(lengths: torch.Tensor, new: int, span: int, tree: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, 1, new, span]`` bool: which of its row's ``span`` slots each of the ``new`` queries sees. Row ``r``
    holds ``lengths[r]`` tokens, the last ``new`` of them this forward's (written already); query ``i`` sees the
    ``lengths[r] - new`` committed ones and new token ``j`` when ``j <= i`` (causal) or ``tree[r, i, j]``
    (``[rows, new, new]`` bool, a draft tree's ancestry, each node its own ancestor)."""
    rows = lengths.shape[0]
    pos = torch.arange(span, device=lengths.device)
    start = (lengths - new).view(rows, 1, 1)                                      # first new token's position
    committed = pos.view(1, 1, span) < start                                      # [rows, 1, span]
    j = pos.view(1, 1, span) - start                                              # new token index of a slot
    in_new = (j >= 0) & (j < new)
    if tree is None:
        i = torch.arange(new, device=lengths.device).view(1, new, 1)
        among_new = in_new & (j <= i)
    else:
        picked = tree.bool().gather(2, j.clamp(0, new - 1).expand(rows, new, span))
        among_new = in_new & picked
    return (committed | among_new).unsqueeze(1)


def paged_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, table: torch.Tensor,
                    lengths: torch.Tensor, page_size: int, tree: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """Attention of ``q`` (``[rows, H, T, d]``, the rows' T new tokens) over their rows' tokens in the paged storage
    ``k_store``, ``v_store`` (``[slots, Hkv, d]``; the new tokens' keys and values written already), found through
    ``table`` (``[rows, width]``) for the ``lengths[rows]`` tokens each row holds; causal among the new tokens, or
    by ``tree`` (``[rows, T, T]``). Returns ``[rows, H, T, d]``."""
    rows, heads, new, _ = q.shape
    kv_heads = k_store.shape[1]
    if heads % kv_heads:
        raise BadInput(f"{heads} query heads cannot share {kv_heads} key/value heads evenly")
    if int(lengths.min()) < new:
        raise BadInput(f"every row must hold its {new} new tokens (written before attention); a row holds "
                       f"{int(lengths.min())}")
    span = int(lengths.max())
    if span > table.shape[1] * page_size:
        raise BadInput(f"a row holds {span} tokens but the block table covers {table.shape[1] * page_size}")
    slots = slot_index(table, page_size, span)                                    # [rows, span]
    k = k_store[slots].permute(0, 2, 1, 3)                                        # [rows, Hkv, span, d]
    v = v_store[slots].permute(0, 2, 1, 3)
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    mask = visible(lengths, new, span, tree)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
