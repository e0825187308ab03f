"""The paged KV cache: rollouts token-identical to the dense cache's, pages that follow the tokens a row holds (shared
by a prompt's samples, given back on rollback and compaction), a full pool refused before anything changes, and
clear errors for bad settings."""
from __future__ import annotations

import pytest
import torch

from tltlib.kv.paged import KVCacheFull, KVConfig, PagedKVCache, make_cache
from tltlib.kv.pages import pages_for
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.drafter import Drafter, DrafterConfig
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.spec.strategy import SpecStrategy

CFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), pad_token_id=0, bos_token_id=1, max_position_embeddings=160)
PROMPTS = [[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9], [1, 10, 11, 12], [1, 13]]
PAGED = KVConfig(kind="paged", memory=1 << 26, page_size=4)
DENSE = KVConfig(kind="dense", memory=1 << 26)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    m = Transformer(CFG, init_std=0.4).eval()
    with torch.no_grad():
        m.embed.weight[2] *= 2.0                  # EOS likely enough that lengths vary
    return m


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    return Drafter(DrafterConfig.from_target(target.config), init_std=0.3).eval().attach(target)


def _engine(target, drafter, kv, temperature=0.0, **kw):
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=kw.pop("max_new_tokens", 40))
    return RolloutEngine(target, RolloutConfig(sampling, num_generations=3, compact_fraction=0.3, kv=kv, **kw),
                         drafter=drafter)


@pytest.mark.parametrize("strategy", [None, SpecStrategy("chain", 4), SpecStrategy("tree", 4, 3, 8)],
                         ids=["plain", "chain-4", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_paged_rollouts_equal_the_dense_caches_token_for_token(target, drafter, strategy, temperature):
    """Same seed, same tokens and log-probs: the paged cache gathers the same entries the dense one holds (greedy and
    sampled, plain and SD steps, with a prompt's samples sharing its pages)."""
    out = {}
    for kv in (DENSE, PAGED):
        gen = torch.Generator().manual_seed(5)
        out[kv.kind] = _engine(target, drafter, kv, temperature).generate(PROMPTS, gen, strategy=strategy)
    assert torch.equal(out["dense"].lengths, out["paged"].lengths)
    assert torch.equal(out["dense"].tokens, out["paged"].tokens)
    torch.testing.assert_close(out["dense"].logprobs, out["paged"].logprobs, atol=1e-4, rtol=0)


def _distinct_pages(cache):
    return {p for r in range(cache.rows) for p in cache.blocks.pages[r]}


def test_pages_follow_the_tokens_rows_hold(target, drafter):
    """After the prefill the G samples of a prompt hold the prompt's pages once; after every iteration each row holds
    exactly the pages its committed tokens need, and the pool holds nothing else (finished rows' pages are back
    once compacted)."""
    eng = _engine(target, drafter, PAGED, max_new_tokens=30)
    rollout = eng.start(PROMPTS, strategy=SpecStrategy("chain", 3))
    cache = rollout.cache
    assert cache.pool.used == sum(pages_for(len(p), 4) for p in PROMPTS)
    seen = []
    while rollout.iterate():
        lens = cache.lengths[: cache.rows].tolist()
        for r in range(cache.rows):
            assert len(cache.blocks.pages[r]) == pages_for(lens[r], 4)
            assert cache.blocks.lengths[r] == lens[r]
        assert cache.pool.used == len(_distinct_pages(cache))
        seen.append(cache.rows)
    assert min(seen) < len(PROMPTS) * 3                    # rows were compacted away
    held = cache.memory()
    assert held["peak_bytes"] >= held["used_bytes"] and held["pool_bytes"] > 0


def _cache(pages=6, size=4, rows=3, max_len=32):
    return PagedKVCache(num_layers=2, max_rows=rows, num_kv_heads=2, max_len=max_len, head_dim=8, num_pages=pages,
                        page_size=size)


def test_rollback_past_a_page_boundary_gives_pages_back():
    cache = _cache(pages=8)
    cache.prepare(6)
    cache.advance(6)                                       # 6 tokens: 2 pages of 4 per row
    assert cache.pool.used == 6
    cache.rollback(torch.tensor([1, 2, 5]))                # rows keep 5, 4, 1 tokens
    assert [len(cache.blocks.pages[r]) for r in range(3)] == [2, 1, 1]
    assert cache.pool.used == 4
    cache.select_rows(torch.tensor([0]))                   # rows 1 and 2 finished
    assert cache.pool.used == 2 and cache.pool.free == 6


def test_a_shared_page_is_copied_before_a_sample_writes_into_it():
    cache = _cache(pages=8)
    cache.rows = 1
    w = cache.prepare(3)
    k = torch.randn(1, 3, 2, 8)
    cache.write(0, w, k, k)
    cache.advance(3)
    cache.select_rows(torch.tensor([0, 0, 0]))             # three samples share the prompt's partial page
    assert cache.pool.used == 1
    w = cache.prepare(1)
    new = torch.randn(3, 1, 2, 8)
    kd, _ = cache.write(0, w, new, new)
    assert cache.pool.used == 3                            # two copies; the last holder writes in place
    torch.testing.assert_close(kd[:, :, :3], k.transpose(1, 2).expand(3, 2, 3, 8))
    torch.testing.assert_close(kd[:, :, 3], new[:, 0])


def test_a_full_pool_is_refused_before_anything_changes():
    cache = _cache(pages=3)
    cache.prepare(4)
    cache.advance(4)                                       # 3 rows x 1 full page: the pool is full
    before = ([list(p) for p in cache.blocks.pages], cache.pool.free, cache.table.clone())
    with pytest.raises(KVCacheFull, match="0 free page.*3 row"):
        cache.prepare(1)
    assert ([list(p) for p in cache.blocks.pages], cache.pool.free) == before[:2]
    assert torch.equal(cache.table, before[2])


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="power of two"):
        KVConfig(page_size=12)
    for bad in (0, -1, float("inf"), float("nan"), "0.5", True, None):     # each one line, never inside generate
        with pytest.raises(ValueError, match="KVConfig.memory must be a number: a share of free memory"):
            KVConfig(memory=bad)
    with pytest.raises(ValueError, match="kind must be one of"):
        KVConfig(kind="flat")
    per_page = 4 * 2 * CFG.num_layers * CFG.num_kv_heads * CFG.dim_head * 4
    with pytest.raises(ValueError, match=f"give it at least {per_page:,} bytes"):
        make_cache(CFG, 4, 64, PAGED, budget_bytes=per_page - 1)
    need = 4 * 64 * per_page // 4
    with pytest.raises(ValueError, match=f"needs {need:,} bytes.*kind='paged'"):
        make_cache(CFG, 4, 64, DENSE, budget_bytes=need - 1)


def test_the_pool_is_never_larger_than_the_dense_cache_of_the_same_rows():
    cache = make_cache(CFG, 4, 64, PAGED, budget_bytes=1 << 30)
    assert cache.pool.num_pages == 4 * pages_for(64, 4)


def test_a_prompt_the_budget_can_never_hold_is_refused_before_the_rollout(target):
    per_page = 4 * 2 * CFG.num_layers * CFG.num_kv_heads * CFG.dim_head * 4
    kv = KVConfig(memory=2 * per_page, page_size=4)                       # bytes: two pages
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(max_new_tokens=4), kv=kv))
    with pytest.raises(ValueError, match=f"a row of 14 tokens \\(its prompt, max_new_tokens and one more\\) needs 4 "
                                         f"pages of KV cache but its budget holds 2: "
                                         f".*at least {4 * per_page:,} bytes"):
        eng.generate([[1] * 9])
    out = eng.generate([[1] * 3])                                         # 3 + 4 + 1 tokens fit two pages of 4
    assert out.stats["rollout/kv_pool_bytes"] == 2 * per_page


def test_a_cpu_forwards_write_slots_from_the_host_lists_equal_the_block_tables(monkeypatch):
    """A few new entries' slots come from the host's page lists (one tensor, no small ops), more from the tensor ops
    over the block table: the same slots through rows of unequal lengths, pages shared by copies (and copied on
    write), an offset, several new tokens and a chunk's view; a wrong page or a missing head's offset fails."""
    import tltlib.kv.paged as P
    cache = _cache(pages=40, size=4, rows=4, max_len=48)
    cache.rows = 2
    w = cache.prepare(5)
    cache.advance(torch.tensor([5, 3]))
    cache.select_rows(torch.tensor([0, 1, 0, 1]))          # rows 2, 3 share rows 0's, 1's pages
    steps = [(1, 0), (1, 2), (3, 0), (2, 1), (7, 0), (1, 0)]
    for num_new, offset in steps:
        cache.make_room(offset + num_new)
        host = cache._host_slots(offset, num_new)
        tensor = cache._slots(offset + torch.arange(num_new)[None, :])
        assert host.shape == tensor.shape == (4, num_new, 2) and torch.equal(host, tensor), (num_new, offset)
        w = cache.prepare(num_new, offset=offset)          # prepare takes the host's (4 x 7 <= HOST_SLOTS_MAX)
        monkeypatch.setattr(P, "HOST_SLOTS_MAX", 0)
        assert torch.equal(cache.prepare(num_new, offset=offset).index, w.index)
        monkeypatch.setattr(P, "HOST_SLOTS_MAX", 256)
        cache.advance(torch.tensor([1, 0, 1, 1]) if num_new == 1 else 1)
    sub = cache.view(1, 3)                                 # a view's rows start at its row0
    sub.make_room(2)
    assert torch.equal(sub._host_slots(0, 2), sub._slots(torch.arange(2)[None, :]))
    assert torch.equal(sub._host_slots(0, 2), cache._slots(torch.arange(2)[None, :])[1:3])
