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

Departures: none.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import BadInput


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
