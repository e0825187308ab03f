"""The CPU ragged-attention kernel (tltlib.kernels.ragged_attention): each row attends over its own cached length and
equals the masked matmul/SDPA attention; the rollout routes one-token forwards to it; a build failure or the switch
falls back to the matmul path with one warning."""
from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from tltlib.kernels import dispatch as kernels
from tltlib.kernels import ragged_attention as ra

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler: the kernel cannot be built here")


def _reference(q, k, v, limit):
    s = k.shape[2]
    mask = (torch.arange(s)[None, :] < limit[:, None])[:, None, None]      # [B, 1, 1, S]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@needs_compiler
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 8), (6, 3, 32), (9, 3, 64), (5, 1, 64), (6, 3, 16), (4, 2, 128),
                                              (3, 1, 48)])
def test_kernel_equals_masked_attention_over_each_rows_own_length(heads, kv_heads, d):
    """Head widths of the vector kernel (16, 32, 64, 128: query blocks of three, of two, a last block of one) and of
    the scalar loop (8, 48)."""
    assert ra.kernel() is not None, "the kernel did not build although a compiler is present"
    g = torch.Generator().manual_seed(heads)
    rows, span, max_len = 7, 23, 40
    store_k, store_v = (torch.randn(rows, kv_heads, max_len, d, generator=g) for _ in range(2))
    k, v = store_k[:, :, :span], store_v[:, :, :span]             # a cache view: strided like the real one
    q = torch.randn(rows, heads, 1, d, generator=g)
    limit = torch.tensor([1, span, 5, 12, span - 1, 2, 17])        # the edges: one position, the whole span
    out = ra.ragged_attention(q, k, v, limit)
    torch.testing.assert_close(out, _reference(q, k, v, limit), atol=1e-5, rtol=1e-5)
    wrong = ra.ragged_attention(q, k, v, limit + (limit < span).long())  # one more position changes rows
    assert not torch.allclose(wrong, out, atol=1e-4)


@needs_compiler
def test_the_kernel_on_several_threads_equals_masked_attention():
    """The tests run on one torch thread (conftest); the kernel's OpenMP loop over (row, KV head) runs where a score
    pass is big enough (PARALLEL_WORK): here on two threads, over rows of unequal lengths."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(5)
        rows, heads, kv_heads, span, d = 6, 8, 4, 1024, 64        # 2 x 1024 x 64 multiply-adds per (row, KV head)
        k, v = (torch.randn(rows, kv_heads, span, d, generator=g) for _ in range(2))
        q = torch.randn(rows, heads, 1, d, generator=g)
        limit = torch.tensor([1, span, 700, 1000, 3, span - 1])
        torch.testing.assert_close(ra.ragged_attention(q, k, v, limit), _reference(q, k, v, limit), atol=1e-5,
                                   rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@needs_compiler
def test_paged_kernel_reads_runs_of_pages_and_scattered_pages_alike():
    """Through block tables that mix runs of consecutive pages (read as one stretch), jumps, a page two rows share,
    a run that goes on past a row's limit and garbage past it: the paged kernel equals the kernel over each row's
    positions gathered into a dense cache."""
    assert ra.kernel() is not None
    g = torch.Generator().manual_seed(3)
    kv_heads, pages, ps, d, heads = 2, 40, 4, 16, 4
    k_pages, v_pages = (torch.randn(kv_heads, pages, ps, d, generator=g) for _ in range(2))
    scratch = pages - 1
    table = torch.tensor([[7, scratch, scratch, scratch, scratch, scratch],
                          [3, 4, 5, 6, 7, 8],                          # one run on past its limit (4 positions)
                          [10, 11, scratch, scratch, scratch, scratch],
                          [12, 13, 14, 20, 21, 2],                      # a run, a jump, a run, a jump
                          [12, 13, 30, 31, 32, 0],                      # shares rows 3's first two pages
                          [38, 37, 36, 35, 34, 33]])                    # backwards: every page a jump
    limit = torch.tensor([1, 4, 8, 23, 21, 24])
    q = torch.randn(len(limit), heads, 1, d, generator=g)
    dense = [store[:, table].transpose(0, 1).reshape(len(limit), kv_heads, -1, d) for store in (k_pages, v_pages)]
    out = ra.paged_ragged_attention(q, k_pages, v_pages, table, limit)
    torch.testing.assert_close(out, ra.ragged_attention(q, *dense, limit), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, _reference(q, *dense, limit), atol=1e-5, rtol=1e-5)
    k_pages[:, 4:7] = 1e3                                               # past row 1's limit: never read
    torch.testing.assert_close(ra.paged_ragged_attention(q, k_pages, v_pages, table, limit)[1], out[1])


@needs_compiler
@pytest.mark.parametrize("new,heads,d", [(2, 6, 8), (5, 6, 8), (2, 9, 64), (5, 9, 64), (3, 6, 32)])
def test_paged_masked_kernel_equals_masked_attention_over_gathered_pages(new, heads, d):
    """Several new tokens per row under a tree mask (each sees its row's committed positions, itself and a random
    set of the other new ones; columns before ``mask_from`` all seen): equal to SDPA over the gathered pages, and a
    hidden position is really hidden; by the scalar loop (d 8) and the vector kernel (d 32, 64)."""
    assert ra.kernel() is not None
    g = torch.Generator().manual_seed(new)
    kv_heads, pages, ps, rows, width = 3, 48, 4, 4, 8
    k_pages, v_pages = (torch.randn(kv_heads, pages, ps, d, generator=g) for _ in range(2))
    table = torch.randperm(pages - 1, generator=g)[: rows * width].view(rows, width).contiguous()
    committed = torch.tensor([3, 11, 4, 20])
    ends = committed + new
    span = int(ends.max())
    rel = torch.arange(span)[None, None, :] - committed[:, None, None]            # [rows, 1, span]
    tree = torch.rand(rows, new, new, generator=g) < 0.5
    tree |= torch.eye(new, dtype=torch.bool)
    seen = torch.gather(tree, 2, rel.clamp(0, new - 1).expand(rows, new, span))
    mask = ((rel < 0) | ((rel < new) & seen)).contiguous()                         # [rows, T, span]
    q = torch.randn(rows, heads, new, d, generator=g)
    dense = [store[:, table].transpose(0, 1).reshape(rows, kv_heads, -1, d)[:, :, :span] for store in (k_pages,
                                                                                                       v_pages)]
    want = torch.nn.functional.scaled_dot_product_attention(q, *dense, attn_mask=mask[:, None], enable_gqa=True)
    out = ra.paged_masked_attention(q, k_pages, v_pages, table, ends, mask, 0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ra.paged_masked_attention(q, k_pages, v_pages, table, ends, mask, 3), want,
                               atol=1e-5, rtol=1e-5)                               # 0 .. 2 committed: all seen
    hide = mask.clone()
    hide[3, new - 1, 5] = False
    assert not torch.allclose(ra.paged_masked_attention(q, k_pages, v_pages, table, ends, hide, 0)[3, :, new - 1],
                              out[3, :, new - 1], atol=1e-4)


@needs_compiler
def test_kernel_refuses_limits_outside_the_span():
    assert ra.kernel() is not None
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 5, 8)
    for bad in ([0, 3], [3, 6]):
        with pytest.raises(RuntimeError, match="limit must be in 1 .. 5"):
            ra.ragged_attention(q, k, k, torch.tensor(bad))


@needs_compiler
@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_one_token_forwards_use_the_kernel_and_give_the_matmul_paths_logits(monkeypatch, kind):
    """A decode forward over rows of unequal lengths where the table picks the kernel (on a paged cache: its twin
    reading the pages in place, called with the rotary and the write in one call): it is called once per layer and
    the logits equal the masked path's (the kernel off: the table's choice falls back); where the table picks the
    matmuls for many uniform rows, a dense cache does not call the kernel, a paged one still does (any other kernel
    would gather the pages first)."""
    from tltlib.kernels import table as kt
    from tltlib.kv import paged as paged_cache
    from tltlib.kv import paged_attention as paged_kernels
    from tltlib.model.decoder import ModelConfig, Transformer
    assert ra.kernel() is not None
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_position_embeddings=128)
    model = Transformer(cfg, init_std=0.2).eval()
    kv = paged_cache.KVConfig(kind=kind, memory=1 << 26, page_size=4)
    calls = []
    module, name = (kernels, "ragged_attention") if kind == "dense" else (paged_cache, "paged_rope_attention")
    chooser = kernels if kind == "dense" else paged_kernels                # where the kernel is looked up
    real = getattr(module, name)
    new_tokens = 2 if kind == "dense" else 1                     # q [B, H, T, d] (dense), qkv [B, T, n] (paged)
    monkeypatch.setattr(module, name, lambda *a: calls.append(a[0].shape[new_tokens]) or real(*a))
    lens = torch.tensor([3, 9, 1, 14, 6, 6, 11, 2, 8, 13])
    prompt = torch.randint(0, 61, (10, 14), generator=torch.Generator().manual_seed(1))
    step = torch.randint(0, 61, (10, 1), generator=torch.Generator().manual_seed(2))
    out = {}
    for on in (True, False):
        monkeypatch.setattr(chooser, "ragged_kernel", ra.kernel if on else lambda: None)
        cache = model.new_cache(10, 32, kv)
        with torch.no_grad(), kt.using(kt.Forced(attention="ragged")):
            model.forward_cached(prompt, cache, logits_at=lens - 1)
            cache.advance(lens)
            out[on] = model.forward_cached(step, cache)[0]
    assert calls == [1] * cfg.num_layers                          # the decode step's layers (the prefill: too long)
    torch.testing.assert_close(out[True], out[False], atol=1e-4, rtol=1e-5)
    calls.clear()
    monkeypatch.setattr(chooser, "ragged_kernel", ra.kernel)
    cache = model.new_cache(40, 32, kv)
    with torch.no_grad(), kt.using(kt.Forced(attention="matmul")):
        model.forward_cached(torch.randint(0, 61, (40, 5)), cache, logits_at=torch.full((40,), 4))
        cache.advance(5)
        model.forward_cached(torch.randint(0, 61, (40, 1)), cache)
    assert calls.count(1) == (0 if kind == "dense" else cfg.num_layers)   # the prefill's 5 tokens: the masked one


def test_a_kernel_that_cannot_be_built_falls_back_with_one_warning(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as ext
    monkeypatch.setenv("TLTLIB_CACHE", str(tmp_path))              # no kernel built there

    def broken(*a, **k):
        raise RuntimeError("Ninja is required to load C++ extensions")
    monkeypatch.setattr(ext, "load_inline", broken)
    monkeypatch.setattr(ra, "_state", {})
    with pytest.warns(UserWarning, match="could not be built.*Ninja is required.*TLTLIB_RAGGED_ATTENTION=0"):
        assert ra.kernel() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")                             # once: later calls are silent
        assert ra.kernel() is None
        q, k = torch.randn(9, 2, 1, 8), torch.randn(9, 1, 6, 8)
        mask = (torch.arange(6)[None, :] < torch.tensor([1, 2, 3, 4, 5, 6, 6, 2, 3])[:, None])[:, None, None]
        out = kernels.cached_attention(q, k, k, mask, 1, {}, torch.tensor([1, 2, 3, 4, 5, 6, 6, 2, 3]))
    torch.testing.assert_close(out, _reference(q, k, k, torch.tensor([1, 2, 3, 4, 5, 6, 6, 2, 3])), atol=1e-5,
                               rtol=0)


def test_the_switch_keeps_the_kernel_off_without_building(monkeypatch):
    import torch.utils.cpp_extension as ext
    monkeypatch.setattr(ext, "load_inline", lambda *a, **k: pytest.fail("built although switched off"))
    monkeypatch.setattr(ra, "_state", {})
    monkeypatch.setenv(ra.ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ra.kernel() is None


@needs_compiler
def test_the_one_call_attention_step_equals_the_pytorch_path(monkeypatch):
    """On a paged cache the rotary, the write and the attention of a decode (ragged) and of a chain and a tree verify
    (masked) run in one C++ call per layer: the logits and the cache's keys and values equal the PyTorch path's
    (rotary, index copies, the paged kernel)."""
    from tltlib.kv import paged as paged_cache
    from tltlib.model.decoder import ModelConfig, Transformer
    assert ra.kernel() is not None
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, hidden_size=96, intermediate_size=64, num_layers=2, num_heads=6, num_kv_heads=3,
                      max_position_embeddings=128)                   # head width 16: the vector kernel
    model = Transformer(cfg, init_std=0.2).eval()
    kv = paged_cache.KVConfig(kind="paged", memory=1 << 26, page_size=4)
    lens = torch.tensor([3, 9, 1, 7, 6])
    g = torch.Generator().manual_seed(1)
    prompt, step, chain = (torch.randint(0, 61, (5, t), generator=g) for t in (9, 1, 4))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool).expand(5, 4, 4)
    calls = []
    real = paged_cache.paged_rope_attention
    monkeypatch.setattr(paged_cache, "paged_rope_attention", lambda *a: calls.append(a[0].shape[1]) or real(*a))
    out = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(paged_cache.PagedKVCache, "attend_qkv", lambda self, *a: None)
        cache = model.new_cache(5, 32, kv)
        with torch.no_grad():
            model.forward_cached(prompt, cache, logits_at=lens - 1)
            cache.advance(lens)
            logits = [model.forward_cached(step, cache)[0]]
            cache.advance(1)
            logits.append(model.forward_cached(chain, cache)[0])
            logits.append(model.forward_cached(chain, cache, tree_mask=tree)[0])
        out[fused] = logits, cache.k.clone(), cache.v.clone()
    assert calls == [9] * 2 + [1] * 2 + [4] * 4                      # prefill (9 tokens), decode, chain, tree
    for got, want in zip(out[True][0], out[False][0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for fused, unfused in zip(out[True][1:], out[False][1:]):            # keys, values
        torch.testing.assert_close(fused, unfused, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[True][2][0], out[False][2][0])               # layer 0's values: copied, not computed


@needs_compiler
def test_the_one_call_attention_step_leaves_a_gradient_to_pytorch():
    """Where autograd records (a projection output that needs a gradient), the paged cache declines the C++ call,
    which would drop the gradient: the caller's PyTorch path runs. Without a gradient the call is taken."""
    from tltlib.kv import paged as paged_cache
    from tltlib.model.decoder import ModelConfig
    assert ra.kernel() is not None
    cfg = ModelConfig(vocab_size=11, hidden_size=16, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    kv = paged_cache.KVConfig(kind="paged", memory=1 << 22, page_size=4)
    cos, sin = torch.ones(2, 1, 1, 8), torch.zeros(2, 1, 1, 8)
    for grad in (True, False):
        cache = paged_cache.make_cache(cfg, 2, 16, kv)
        where = cache.prepare(1)
        qkv = torch.randn(2, 1, 4 * 8, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            out = cache.attend_qkv(0, where, qkv, cos, sin, 2)
        assert (out is None) == grad
