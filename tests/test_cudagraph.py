"""CUDA-graph bucketing: the bucket arithmetic, and the padded fixed-span calls graphs replay giving the eager
path's tokens (on CPU without capture; on CUDA with capture, in the gpu tier)."""
from __future__ import annotations

import pytest
import torch

from tltlib.kv.dense import KVCache
from tltlib.model.cudagraph import GraphConfig, GraphPool, Replay, row_bucket, span_bucket
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.drafter import Drafter, DrafterConfig
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine

CFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), pad_token_id=0, bos_token_id=1, max_position_embeddings=200)
PROMPTS = [[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9], [1, 10, 11, 12], [1, 13], [1, 4, 4]]


def test_row_buckets_are_powers_of_two_capped_at_the_cache_and_limit():
    assert [row_bucket(r, 48, 64) for r in (1, 2, 3, 5, 8, 9, 17, 33, 48)] == [1, 2, 4, 8, 8, 16, 32, 48, 48]
    assert row_bucket(65, 128, 64) is None and row_bucket(0, 8, 64) is None and row_bucket(9, 8, 64) is None


def test_span_buckets_double_from_the_minimum_and_stop_at_the_cache_length():
    assert [span_bucket(s, 1000, 256) for s in (1, 256, 257, 600, 1000)] == [256, 256, 512, 1000, 1000]
    with pytest.raises(ValueError, match="exceeds the cache length"):
        span_bucket(1001, 1000, 256)


def test_fixed_span_prepare_equals_the_used_span():
    torch.manual_seed(0)
    model = Transformer(CFG, init_std=0.4).eval()
    tokens = torch.randint(3, 24, (3, 5))
    outs = []
    for span in (None, 64):
        cache = model.new_cache(3, 100)
        with torch.no_grad():
            model.forward_cached(tokens[:, :3], cache)
            cache.advance(torch.tensor([3, 2, 1]))
            cache.fixed_span = span
            outs.append(model.forward_cached(tokens[:, 3:], cache)[0])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="span 4 must cover the 5 used slots"):
        cache.fixed_span = 4
        cache.prepare(2)


def test_pool_refuses_caches_of_different_row_counts():
    a, b = (KVCache(1, rows, 1, 16, 4) for rows in (4, 8))
    with pytest.raises(ValueError, match="different row counts"):
        GraphPool([a, b], capture=False)
    with pytest.raises(ValueError, match="needs caches on a CUDA device"):
        GraphPool([a], capture=True)


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    target = Transformer(CFG, init_std=0.4).eval()
    with torch.no_grad():
        target.embed.weight[2] *= 2.0
    torch.manual_seed(1)
    return target, Drafter(DrafterConfig.from_target(CFG), init_std=0.3).eval().attach(target)


def _run(engine, strategy, seed, pool_cfg=None):
    """A rollout; with ``pool_cfg`` every decode, verify and draft call goes through an uncaptured GraphPool."""
    g = torch.Generator().manual_seed(seed)
    r = engine.start(PROMPTS, g, strategy=strategy)
    pool = None
    if pool_cfg is not None:
        pool = GraphPool([r.cache, r.spec.cache], pool_cfg, capture=False)
        r.replay = r.spec.replay = Replay(pool)
    return r.finish(), pool


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("strategy", ["off", "chain-4", "tree-3x2-5", "tree-4x3-8", "ngram-3"])
def test_padded_fixed_span_calls_give_the_eager_tokens(pair, strategy, temperature):
    target, drafter = pair
    engine = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=60),
                                                 num_generations=3, compact_fraction=0.2), drafter=drafter)
    eager, _ = _run(engine, strategy, 5)
    padded, pool = _run(engine, strategy, 5, GraphConfig(max_rows=16, min_span=16))
    assert torch.equal(eager.lengths, padded.lengths)
    assert torch.equal(eager.tokens, padded.tokens)
    torch.testing.assert_close(eager.logprobs, padded.logprobs, atol=1e-4, rtol=0)
    buckets = {(k[1], k[2]) for k in pool._entries}   # 18 rows run unpadded (above max_rows), 9-16 padded to 16
    assert len(buckets) >= 3 and len({s for _, s in buckets}) >= 2 and max(b for b, _ in buckets) == 16
    assert pool.stats["eager"] > 0 and pool.stats["replays"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["off", "chain-4", "tree-4x3-8"])
def test_cuda_graph_replays_give_the_eager_tokens(pair, strategy):
    target, drafter = (m.to("cuda") for m in pair)
    drafter.attach(target)
    tokens = {}
    for graphs in (False, True):
        engine = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0.9, max_new_tokens=60),
                                                     num_generations=3, graphs=GraphConfig(enabled=graphs)),
                               drafter=drafter)
        for rep in range(2):                       # the second rollout replays the first one's graphs
            g = torch.Generator(device="cuda").manual_seed(5)
            res = engine.generate(PROMPTS, g, strategy=strategy)
            tokens[graphs, rep] = res.tokens.cpu()
            assert not graphs or res.stats["rollout/graph_fallbacks"] == 0      # every capture succeeded
        if graphs:
            assert res.stats["rollout/graph_replays"] > 0 and res.stats["rollout/graph_captures"] == 0
    assert torch.equal(tokens[False, 0], tokens[True, 0]) and torch.equal(tokens[True, 0], tokens[True, 1])


@pytest.fixture
def failing_capture(monkeypatch):
    """torch.cuda's capture API faked on a CPU: streams and pools that do nothing, a capture that fails at its end
    (as a host sync inside the captured function makes it), a graph that must never replay."""
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            raise AssertionError("a graph whose capture failed was replayed")

    @contextlib.contextmanager
    def graph(g, pool=None):
        yield
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    for name, fake in (("Stream", Stream), ("stream", lambda s: contextlib.nullcontext()), ("current_stream", Stream),
                       ("CUDAGraph", Graph), ("graph", graph), ("synchronize", lambda *a: None),
                       ("graph_pool_handle", lambda: "pool")):
        monkeypatch.setattr(torch.cuda, name, fake)


def _capturing(pool: GraphPool) -> GraphPool:
    """``pool`` (built over CPU caches) capturing through the faked torch.cuda API."""
    pool.capture, pool.pool = True, torch.cuda.graph_pool_handle()
    return pool


def test_a_failed_capture_is_counted_warned_and_runs_eagerly_with_the_right_outputs(failing_capture):
    import warnings
    cache = KVCache(1, 8, 1, 64, 4)
    pool = _capturing(GraphPool([cache], GraphConfig(max_rows=8, min_span=16), capture=False))
    fn = lambda x: (x * 2 + 1, x.sum(-1))                                    # noqa: E731
    x = torch.arange(15.0).reshape(5, 3)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture of 'affine' \\(8 rows\\) failed, running it eagerly"):
        a, s = pool.run("affine", fn, cache, 1, [x])
    assert torch.equal(a, x * 2 + 1) and torch.equal(s, x.sum(-1))
    assert (pool.stats["fallbacks"], pool.stats["captures"], pool.stats["replays"]) == (1, 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                       # the key is known: eager, no warning
        a, _ = pool.run("affine", fn, cache, 1, [x - 1])
    assert torch.equal(a, (x - 1) * 2 + 1) and pool.stats["fallbacks"] == 1 and pool.stats["eager"] == 2
    with pytest.warns(RuntimeWarning):
        pool.run("affine", fn, cache, 1, [x[:1]])                            # another row bucket: another capture
    assert pool.stats["fallbacks"] == 2
    from conftest import CAPTURE_FALLBACK_FAILS  # the gpu tier's filter: there a fallback is an error
    action, message, category = CAPTURE_FALLBACK_FAILS.split(":")
    assert category == "RuntimeWarning"
    with warnings.catch_warnings():
        warnings.filterwarnings(action, message, RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="CUDA graph capture of 'other'"):
            pool.run("other", fn, cache, 1, [x])


def test_a_rollouts_capture_fallbacks_reach_its_metrics_and_its_tokens_stay_right(pair, failing_capture):
    from tltlib.metrics import METRICS
    target, drafter = pair
    engine = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0.9, max_new_tokens=16),
                                                 num_generations=2), drafter=drafter)
    eager = engine.generate(PROMPTS[:3], torch.Generator().manual_seed(5), strategy="chain-4")
    r = engine.start(PROMPTS[:3], torch.Generator().manual_seed(5), strategy="chain-4")
    pool = _capturing(GraphPool([r.cache, r.spec.cache], GraphConfig(max_rows=16, min_span=64), capture=False))
    r.replay = r.spec.replay = Replay(pool)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture of"):
        res = r.finish()
    assert torch.equal(eager.tokens, res.tokens) and torch.equal(eager.lengths, res.lengths)
    assert res.stats["rollout/graph_fallbacks"] == pool.stats["fallbacks"] == len(pool._entries) > 0
    assert res.stats["rollout/graph_captures"] == 0 and "rollout/graph_fallbacks" in METRICS
