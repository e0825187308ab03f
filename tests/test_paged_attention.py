"""Attention read through block tables (tltlib.kv.paged_attention) equals attention over each row's own dense keys and
values: decode, a causal verify of several tokens, a draft tree, grouped-query heads, rows of different lengths on
pages in scattered order and pages shared by a prompt's samples."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tltlib.kv.paged_attention import paged_attention, slot_index, visible
from tltlib.kv.pages import BlockTables, PagePool


def _dense(q, keys, values, new, tree=None):
    """Each row on its own: its tokens' keys and values, the committed ones all seen, the new ones causally or by
    ``tree``; returns [rows, H, T, d]."""
    out = []
    for r, (k, v) in enumerate(zip(keys, values)):
        n = k.shape[0]
        allowed = torch.ones(new, n, dtype=torch.bool)
        sub = torch.tril(torch.ones(new, new, dtype=torch.bool)) if tree is None else tree[r].bool()
        allowed[:, n - new:] = sub
        heads, kvh = q.shape[1], k.shape[1]
        kk = k.permute(1, 0, 2).repeat_interleave(heads // kvh, 0)
        vv = v.permute(1, 0, 2).repeat_interleave(heads // kvh, 0)
        out.append(F.scaled_dot_product_attention(q[r:r + 1], kk[None], vv[None], attn_mask=allowed))
    return torch.cat(out)


def _paged(lengths, kv_heads, d, page_size, g, share_prompt=0):
    """Rows of ``lengths`` tokens written into a pool in interleaved order (so that their pages scatter); with
    ``share_prompt`` the rows after the first are forks of its first ``share_prompt`` tokens (copy-on-write past
    them). Returns (storage k, v, block table, per-row dense keys, values)."""
    t = BlockTables(PagePool(128, page_size))
    slots_total = 128 * page_size
    k_store = torch.zeros(slots_total, kv_heads, d)
    v_store = torch.zeros(slots_total, kv_heads, d)
    keys = [torch.randn(n, kv_heads, d, generator=g) for n in lengths]
    values = [torch.randn(n, kv_heads, d, generator=g) for n in lengths]
    if share_prompt:
        for r in range(1, len(lengths)):                                     # the samples' prompts are the first's
            keys[r][:share_prompt], values[r][:share_prompt] = keys[0][:share_prompt], values[0][:share_prompt]
        first = t.add_row()
        assert t.reserve(first, share_prompt)
        s = t.slots(first, 0, share_prompt)
        k_store[s], v_store[s] = keys[0][:share_prompt], values[0][:share_prompt]
        t.commit(first, share_prompt)
        t.fork(first, len(lengths) - 1)
        done = [share_prompt] * len(lengths)
    else:
        for _ in lengths:
            t.add_row()
        done = [0] * len(lengths)
    while any(d_ < n for d_, n in zip(done, lengths)):                        # a few tokens per row in turn
        for r, n in enumerate(lengths):
            step = min(3, n - done[r])
            if step <= 0:
                continue
            pairs = t.writable(r, done[r], step)
            assert pairs is not None
            for old, new_page in pairs:                                       # copy-on-write of a shared page
                a, b = old * page_size, new_page * page_size
                k_store[b:b + page_size], v_store[b:b + page_size] = k_store[a:a + page_size], v_store[a:a + page_size]
            s = t.slots(r, done[r], step)
            k_store[s], v_store[s] = keys[r][done[r]:done[r] + step], values[r][done[r]:done[r] + step]
            done[r] += step
            t.commit(r, done[r])
    return k_store, v_store, t.table(), keys, values


@pytest.mark.parametrize("new,heads,kv_heads,page_size", [(1, 4, 4, 4), (1, 6, 2, 16), (5, 4, 1, 8), (9, 2, 2, 1)])
def test_paged_attention_equals_each_rows_dense_attention(new, heads, kv_heads, page_size):
    g = torch.Generator().manual_seed(new * 100 + page_size)
    lengths = [new + 0, new + 7, new + 30, new + 13]
    k_store, v_store, table, keys, values = _paged(lengths, kv_heads, 8, page_size, g)
    q = torch.randn(len(lengths), heads, new, 8, generator=g)
    got = paged_attention(q, k_store, v_store, table, torch.tensor(lengths), page_size)
    torch.testing.assert_close(got, _dense(q, keys, values, new), atol=1e-5, rtol=1e-5)


def test_a_prompts_samples_read_its_shared_pages_and_their_own_copies():
    g = torch.Generator().manual_seed(7)
    lengths = [21, 26, 23]                                                    # one prompt of 10 tokens, 3 samples
    k_store, v_store, table, keys, values = _paged(lengths, 2, 8, 4, g, share_prompt=10)
    assert table[0, :2].tolist() == table[1, :2].tolist() == table[2, :2].tolist()   # the full prompt pages shared
    assert len({table[r, 2].item() for r in range(3)}) == 3                   # the page they diverge in: copied
    q = torch.randn(3, 4, 1, 8, generator=g)
    got = paged_attention(q, k_store, v_store, table, torch.tensor(lengths), 4)
    torch.testing.assert_close(got, _dense(q, keys, values, 1), atol=1e-5, rtol=1e-5)


def test_a_draft_tree_sees_its_ancestors_only():
    g = torch.Generator().manual_seed(3)
    lengths = [12, 17]
    k_store, v_store, table, keys, values = _paged(lengths, 2, 8, 4, g)
    # 4 nodes: 0 the root, 1 and 2 its children, 3 the child of 2 (each node its own ancestor)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool).expand(2, 4, 4)
    q = torch.randn(2, 2, 4, 8, generator=g)
    got = paged_attention(q, k_store, v_store, table, torch.tensor(lengths), 4, tree=tree)
    torch.testing.assert_close(got, _dense(q, keys, values, 4, tree), atol=1e-5, rtol=1e-5)


def test_slots_masks_and_errors():
    table = torch.tensor([[2, 0, -1], [1, -1, -1]], dtype=torch.int32)
    assert slot_index(table, 2, 5).tolist() == [[4, 5, 0, 1, 0], [2, 3, 0, 1, 0]]    # -1 pages read slot 0
    m = visible(torch.tensor([4, 2]), 2, 5)[:, 0]
    assert m[0].tolist() == [[True, True, True, False, False], [True, True, True, True, False]]
    assert m[1].tolist() == [[True, False, False, False, False], [True, True, False, False, False]]
    q = torch.zeros(1, 3, 1, 4)
    store = torch.zeros(8, 2, 4)
    with pytest.raises(ValueError, match="3 query heads cannot share 2 key/value heads evenly"):
        paged_attention(q, store, store, table[:1], torch.tensor([3]), 2)
    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="every row must hold its 4 new tokens .*a row holds 3"):
        paged_attention(q, store, store, table[:1], torch.tensor([3]), 2)
    with pytest.raises(ValueError, match="a row holds 7 tokens but the block table covers 6"):
        paged_attention(q, store, store, table[:1], torch.tensor([7]), 2)
