"""Ragged KV caches (dense and paged): prefill of different prompt lengths, per-step append, rollback, compaction,
tree masks."""
from __future__ import annotations

import pytest
import torch

from tltlib.kv.dense import KVCache
from tltlib.kv.paged import KVConfig
from tltlib.model.decoder import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=128)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG, init_std=0.2).eval()


@pytest.fixture(params=["dense", "paged"])
def kv(request):
    """Both caches the engine can keep (pages of 4 tokens: rows cross page boundaries and share partial pages)."""
    return KVConfig(kind=request.param, memory=1 << 26, page_size=4)


def _full_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq]))[0]


def _pad(rows, value=0):
    out = torch.full((len(rows), max(map(len, rows))), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


@pytest.mark.parametrize("sizes", [(5, 11, 1, 8), (5, 11, 1, 8, 2, 3, 9, 4, 6, 7)])   # SDPA and matmul paths
def test_ragged_incremental_decoding_equals_full_forward_per_row(model, sizes, kv):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in sizes]
    cont = torch.randint(0, 61, (len(sizes), 9), generator=g)
    cache = model.new_cache(len(sizes), 32, kv)
    lens = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        first, _ = model.forward_cached(_pad(prompts), cache, logits_at=lens - 1)
        cache.advance(lens)
        steps = []
        for t in range(cont.shape[1]):
            logits, _ = model.forward_cached(cont[:, t:t + 1], cache)
            cache.advance(1)
            steps.append(logits[:, 0])
    for r, p in enumerate(prompts):
        ref = _full_logits(model, p + cont[r].tolist())
        torch.testing.assert_close(first[r], ref[len(p) - 1], atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(torch.stack([s[r] for s in steps]), ref[len(p):], atol=1e-4, rtol=1e-5)


def test_uncommitted_and_rolled_back_entries_are_replaced(model, kv):
    seq = list(range(3, 13))
    cache = model.new_cache(2, 32, kv)
    with torch.no_grad():
        model.forward_cached(torch.tensor([seq, seq]), cache)
        cache.advance(10)
        # row 0: write 3 speculative tokens but commit only 1; row 1: commit 3 then roll 2 back
        model.forward_cached(torch.tensor([[40, 41, 42], [50, 51, 52]]), cache)
        cache.advance(torch.tensor([1, 3]))
        cache.rollback(torch.tensor([0, 2]))
        assert cache.lengths[:2].tolist() == [11, 11]
        logits, _ = model.forward_cached(torch.tensor([[7], [8]]), cache)
    torch.testing.assert_close(logits[0, 0], _full_logits(model, seq + [40, 7])[-1], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logits[1, 0], _full_logits(model, seq + [50, 8])[-1], atol=1e-4, rtol=1e-5)


def test_select_rows_compacts_and_duplicates(model, kv):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    cache = model.new_cache(6, 32, kv)
    lens = torch.tensor([3, 5, 2])
    with torch.no_grad():
        model.forward_cached(_pad(prompts), cache.view(0, 3), logits_at=lens - 1)
        cache.view(0, 3).advance(lens)
        cache.rows = 3
        cache.sync_from_views()
        cache.select_rows(torch.tensor([0, 0, 2, 2, 2]))          # drop row 1, duplicate the others
        assert cache.rows == 5 and cache.lengths[:5].tolist() == [3, 3, 2, 2, 2]
        nxt = torch.tensor([[11], [12], [13], [14], [15]])
        logits, _ = model.forward_cached(nxt, cache)
        cache.advance(1)
        cache.select_rows(torch.tensor([1, 4]))
        logits2, _ = model.forward_cached(torch.tensor([[20], [21]]), cache)
    expect = [[1, 2, 3, 11], [1, 2, 3, 12], [9, 10, 13], [9, 10, 14], [9, 10, 15]]
    for r, s in enumerate(expect):
        torch.testing.assert_close(logits[r, 0], _full_logits(model, s)[-1], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logits2[0, 0], _full_logits(model, [1, 2, 3, 12, 20])[-1], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logits2[1, 0], _full_logits(model, [9, 10, 15, 21])[-1], atol=1e-4, rtol=1e-5)


def test_tree_mask_gives_each_branch_its_own_context(model, kv):
    # tree over 3 new tokens: 0 is the root, 1 and 2 are both its children (siblings must not see each other)
    prefix = [5, 6, 7]
    cache = model.new_cache(1, 16, kv)
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    with torch.no_grad():
        model.forward_cached(torch.tensor([prefix]), cache)
        cache.advance(3)
        positions = torch.tensor([[3, 4, 4]])
        logits, _ = model.forward_cached(torch.tensor([[8, 9, 10]]), cache, positions=positions, tree_mask=tree)
    torch.testing.assert_close(logits[0, 1], _full_logits(model, prefix + [8, 9])[-1], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logits[0, 2], _full_logits(model, prefix + [8, 10])[-1], atol=1e-4, rtol=1e-5)


def test_cache_errors():
    with pytest.raises(ValueError, match="max_rows >= 1"):
        KVCache(1, 0, 1, 4, 2)
    cache = KVCache(1, 2, 1, 4, 2)
    with pytest.raises(ValueError, match="overflow.*larger max_len"):
        cache.prepare(5)
    with pytest.raises(ValueError, match="cannot remove more"):
        cache.rollback(1)


@pytest.mark.parametrize("bias_max", [0, 1 << 30], ids=["mask-in-place", "bias-in-matmul"])
def test_matmul_attention_equals_sdpa_with_mask(monkeypatch, bias_max):
    """Both ways the CPU kernel applies a mask (added as a bias inside the first matmul for small score tensors,
    in place beyond), each with the per-forward memo the layers share: SDPA's result, and the memo built once."""
    from tltlib.kernels import dispatch as kernels
    from tltlib.kernels.dispatch import gqa_attention
    monkeypatch.setattr(kernels, "CPU_BIAS_MAX_SCORES", bias_max)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in [(3, 6, 4, 8), (3, 2, 10, 8), (3, 2, 10, 8)])
    mask = torch.rand(3, 1, 4, 10, generator=g) > 0.3
    mask[..., 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(gqa_attention(q, k, v, mask), ref, atol=1e-4, rtol=1e-5)
    memo = {}
    first = gqa_attention(q, k, v, mask, 0, memo)
    assert len(memo) == 1
    kept = next(iter(memo.values()))
    torch.testing.assert_close(first, ref, atol=1e-4, rtol=1e-5)
    assert torch.equal(gqa_attention(q, k, v, mask, 0, memo), first) and next(iter(memo.values())) is kept
    torch.testing.assert_close(gqa_attention(q, k, v, None),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                               atol=1e-4, rtol=1e-5)


def test_sdpa_path_keeps_the_mask_as_a_float_bias_per_forward():
    """Where the kernel table has no choice (here: none at all) the CPU kernel is PyTorch's SDPA; with a forward's
    memo it converts the bool mask once (SDPA would per layer): the same result as the bool mask, the memo built
    once."""
    from tltlib.kernels import table as kt
    from tltlib.kernels.dispatch import cached_attention
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, generator=g) for s in [(3, 6, 2, 8), (3, 2, 10, 8), (3, 2, 10, 8)])
    mask = torch.rand(3, 1, 2, 10, generator=g) > 0.3
    mask[..., 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    memo = {}
    with kt.using(kt.EMPTY):
        out = cached_attention(q, k, v, mask, 0, memo)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
        kept = memo[("sdpa", q.dtype)]
        assert kept.dtype == q.dtype and torch.equal(torch.isinf(kept), ~mask)
        assert torch.equal(cached_attention(q, k, v, mask, 0, memo), out) and memo[("sdpa", q.dtype)] is kept


def test_the_mask_is_all_true_before_mask_from_and_kernels_mask_only_the_tail(monkeypatch):
    """After SD steps rows differ in length: the shortest row's prefix is seen by every row, so the CPU kernel masks
    only the columns from ``mask_from`` on (the same result, exactly), and ``mask_from`` is as far as it can be."""
    from tltlib.kernels import dispatch as kernels
    from tltlib.kernels.dispatch import gqa_attention
    monkeypatch.setattr(kernels, "CPU_BIAS_MAX_SCORES", 0)           # the in-place path (the bias ignores it)
    cache = KVCache(1, 4, 2, 32, 8)
    cache.advance(torch.tensor([12, 9, 15, 10]))
    for num_new, offset, tree in ((1, 0, None), (1, 3, None), (4, 0, None), (3, 2, torch.ones(4, 3, 5, dtype=bool))):
        w = cache.prepare(num_new, tree, offset)
        assert w.mask[..., : w.mask_from].all() and 0 < w.mask_from < w.span
        if num_new == 1:
            assert not w.mask[..., w.mask_from].all()           # the shortest row's next column is masked
    g = torch.Generator().manual_seed(1)
    w = cache.prepare(1)
    q = torch.randn(4, 6, 1, 8, generator=g)
    k, v = (torch.randn(4, 2, w.span, 8, generator=g) for _ in range(2))
    assert torch.equal(gqa_attention(q, k, v, w.mask, w.mask_from), gqa_attention(q, k, v, w.mask))
    cache.rollback(torch.tensor([1, 0, 0, 2]))                # the minimum not tracked: no shortcut
    assert cache.prepare(1).mask_from == 0
