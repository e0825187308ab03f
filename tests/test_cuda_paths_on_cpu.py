"""The CUDA paths exercised on the CPU (issue 54, item 4): what a rollout on a GPU runs and the CPU path skips,
emulated here so that it cannot rot between GPU sessions.

* The paged cache's host/device block-table mirror (``_host`` a copy of ``table``: ``_mark``'s dirty rows,
  ``_sync_table``, the mirror in ``select_rows`` and ``reset``; on a CPU ``_host is table``, so none of it runs) and
  attention over the gathered pages by ``gqa_sdpa`` (``PagedKVCache.attend`` on CUDA) give the CPU path's tokens,
  eager and through the padded fixed-span calls of an uncaptured ``GraphPool``; a control whose device table is never
  synced gives other tokens.
* No host synchronisation, host-made tensor, data-dependent shape or random draw inside any function ``GraphPool``
  would capture (decode, verify, chain and tree drafts, n-gram verifies); a control proves the counter sees each kind.
* bfloat16 rollouts of the tiny reasoner (off, chain, tree, n-gram) and a bfloat16 ``bench e2e_grpo`` complete on the
  CPU, with finite log-probs and losses.

Every test here runs torch on one thread (restored afterwards): they check exact tokens and counts, never timing, and
on a shared two-core machine each tiny op of a two-thread torch waits ~10 ms for a busy second core (a 0.5 s rollout
took 9.5 s), which would put the file far beyond its time budget.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tltlib.kv.paged as paged_module
from tltlib.kernels.dispatch import gqa_sdpa
from tltlib.kv.paged import PagedKVCache
from tltlib.model.cudagraph import GraphConfig, GraphPool, Replay, row_bucket
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.drafter import Drafter, DrafterConfig
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine

ROOT = Path(__file__).resolve().parent.parent
CFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), pad_token_id=0, bos_token_id=1, max_position_embeddings=200)
PROMPTS = [[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9], [1, 10, 11, 12]]
POOL = GraphConfig(max_rows=16, min_span=16)       # every call padded: 12 rows at most, buckets 12, 8, 4 ...


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    target = Transformer(CFG, init_std=0.4).eval()
    with torch.no_grad():                          # EOS likely enough that rows finish at different times
        target.embed.weight[2] *= 2.0
    torch.manual_seed(1)
    return target, Drafter(DrafterConfig.from_target(CFG), init_std=0.3).eval().attach(target)


def _engine(pair, temperature, max_new=32):
    target, drafter = pair
    return RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new),
                                               num_generations=3, compact_fraction=0.2), drafter=drafter)


def _rollout(engine, strategy, seed, pool_cfg=None, hooks=(), prompts=PROMPTS):
    """One rollout; with ``pool_cfg`` its decode, verify and draft calls go through an uncaptured GraphPool over its
    caches, as the workspace builds it on CUDA (``tltlib.rollout.workspace``; the engine builds none on a CPU)."""
    r = engine.start(prompts, torch.Generator().manual_seed(seed), strategy=strategy, hooks=hooks)
    pool = None
    if pool_cfg is not None:
        pool = GraphPool([r.cache] + ([r.spec.cache] if r.spec.cache is not None else []), pool_cfg, capture=False)
        r.replay = r.spec.replay = Replay(pool)
    return r.finish(), pool


# ------------------------------------------------------------------------------- 1. the table mirror, the gather
class CudaEmulation:
    """While installed (by ``monkeypatch``): every PagedKVCache made keeps a host copy of its block tables as on CUDA
    (``_host`` and ``_root_host`` a clone of ``table``), and its attention gathers the pages (``_kernel`` says
    ``default``) and runs ``gqa_sdpa`` (``cached_attention``'s CUDA branch). ``broken_sync``: the control, where
    ``_sync_table`` forgets the dirty rows without copying them to the device table."""

    def __init__(self, monkeypatch, broken_sync: bool = False):
        self.caches: list[PagedKVCache] = []
        self.synced_rows = self.gathered = 0
        init, sync = PagedKVCache.__init__, PagedKVCache._sync_table
        emulation = self

        def mirrored_init(cache, *args, **kwargs):
            init(cache, *args, **kwargs)
            cache._host = cache._root_host = cache.table.clone()
            emulation.caches.append(cache)

        def counted_sync(cache):
            emulation.synced_rows += len(cache._dirty)
            if broken_sync:
                cache._dirty.clear()
            else:
                sync(cache)

        def gathered_sdpa(q, k, v, mask, mask_from=0, memo=None, limits=None):
            emulation.gathered += 1
            return gqa_sdpa(q, k, v, mask)

        monkeypatch.setattr(PagedKVCache, "__init__", mirrored_init)
        monkeypatch.setattr(PagedKVCache, "_sync_table", counted_sync)
        monkeypatch.setattr(paged_module, "choose_kernel", lambda q, where: "default")
        monkeypatch.setattr(paged_module, "cached_attention", gathered_sdpa)

    def mismatches(self) -> int:
        """Caches whose device table differs from the host's (checked after every decode iteration)."""
        return sum(not torch.equal(c._root_table, c._root_host) for c in self.caches)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("strategy", ["off", "chain-4", "tree-4x3-8"])
def test_the_block_table_mirror_and_sdpa_over_gathered_pages_give_the_cpu_paths_tokens(pair, strategy, temperature,
                                                                                        monkeypatch):
    """CUDA's paged-cache path on the CPU gives the CPU path's tokens and lengths exactly (log-probs to 1e-4),
    eager and through padded fixed-span calls (the second rollout reuses the first one's caches: ``reset``); the
    device table equals the host's after every decode iteration; rows were synced and pages gathered.

    Fails if ``_mark`` forgets a dirty row (checked by hand: an IndexError), ``_sync_table`` copies the wrong rows,
    ``select_rows`` moves the device table but not the host's (the hook sees them differ) or neither (other tokens),
    or the gathered path's masks (or the padded rows' scratch pages) differ from the CPU kernels'. ``reset``'s mirror
    runs but cannot change a token: every row a rollout reads is rewritten by ``_mark`` first. (The CPU path equals the
    padded calls: tests/test_cudagraph.py.)"""
    reference, _ = _rollout(_engine(pair, temperature), strategy, 5)
    emu = CudaEmulation(monkeypatch)
    engine = _engine(pair, temperature)           # caches made under the emulation
    bad = []
    for pool_cfg in (None, POOL):
        res, pool = _rollout(engine, strategy, 5, pool_cfg, hooks=[lambda r: bad.append(emu.mismatches())])
        assert torch.equal(reference.lengths, res.lengths) and torch.equal(reference.tokens, res.tokens), pool_cfg
        torch.testing.assert_close(reference.logprobs, res.logprobs, atol=1e-4, rtol=0)
    assert pool.stats["eager"] > 0 and len({k[2] for k in pool._entries}) >= 2     # padded calls, 2+ span buckets
    assert len(emu.caches) == 2 and bad and not any(bad)      # the target's cache and the drafter's, never out of sync
    assert emu.synced_rows > 0 and emu.gathered > 0


@pytest.mark.parametrize("strategy", ["off", "tree-4x3-8"])
def test_control_a_device_table_never_synced_gives_other_tokens(pair, strategy, monkeypatch):
    """The control of the test above: with ``_sync_table`` a no-op the device tables stay at the scratch page, the
    hook sees them differ from the host's, and the tokens differ from the CPU path's."""
    reference, _ = _rollout(_engine(pair, 0.0), strategy, 5)
    emu = CudaEmulation(monkeypatch, broken_sync=True)
    bad = []
    res, _ = _rollout(_engine(pair, 0.0), strategy, 5, hooks=[lambda r: bad.append(emu.mismatches())])
    assert emu.synced_rows > 0 and any(bad)
    assert not torch.equal(reference.tokens, res.tokens)


# --------------------------------------------------------------------- 2. no host sync inside a captured function
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
"""Tensor methods that read a (device) tensor's values on the host: each a device sync on CUDA, refused under
capture."""
HOST_MADE = ("tensor", "as_tensor", "from_numpy")
"""torch functions that make a tensor from host data: a copy to the device a graph would freeze, or refuse."""
ATEN_SYNCS = {
    "_local_scalar_dense": "scalar read",
    "lift_fresh": "host-made tensor",
    **dict.fromkeys(("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "bincount"),
                    "data-dependent shape"),
    **dict.fromkeys(("uniform_", "normal_", "bernoulli", "bernoulli_", "multinomial", "exponential_", "random_", "rand",
                     "randn", "randint", "randperm"), "random draw"),
}
"""The same seen at the dispatcher, where torch's own code cannot hide them: a scalar read (``item``, ``bool`` ...),
an op whose output shape depends on the data (``nonzero``, ``unique``, ``bincount``, ``repeat_interleave`` by a
tensor without ``output_size``, indexing with a boolean mask: each a sync on CUDA), a tensor made from host data, and
a random draw (the module docstring of tltlib.model.cudagraph: randomness stays outside a captured function; a replay
would repeat the captured draws)."""
MASK_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}

CPU_ONLY_READS = ("one_hot",)
"""torch.nn.functional ops whose scalar reads happen on a CPU only: ``one_hot(x, num_classes)`` checks
``x.min().item() >= 0`` and ``num_classes > x.max().item()`` on a CPU tensor, but on CUDA leaves both to scatter's
device assert "to avoid sync" (aten/src/ATen/native/Onehot.cpp), so its reads here are not counted."""


class _AtenWatch(TorchDispatchMode):
    def __init__(self, events: Counter, name: str, exempt: list):
        super().__init__()
        self.events, self.name, self.exempt = events, name, exempt

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket.__name__
        what = ATEN_SYNCS.get(op)
        if op == "_local_scalar_dense" and self.exempt:
            what = None
        if op in MASK_INDEXING and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                       for i in (args[1] if len(args) > 1 else ()) or ()):
            what = "boolean mask: data-dependent shape"
        if op == "repeat_interleave" and (kwargs or {}).get("output_size") is None:
            what = "data-dependent shape"
        if what:
            self.events[self.name, f"aten.{op} ({what})"] += 1
        return func(*args, **(kwargs or {}))


class HostSyncWatch:
    """Counts, per graph name, the calls of every function GraphPool would capture (the ``fn`` of a padded
    :meth:`GraphPool.run`; calls above ``max_rows`` run eagerly on CUDA too and are not watched) and the host reads,
    host-made tensors, data-dependent shapes and random draws while one runs."""

    def __init__(self, monkeypatch):
        self.calls: Counter = Counter()
        self.events: Counter = Counter()
        run, watch = GraphPool.run, self

        def watched_run(pool, name, fn, cache, new_slots, inputs):
            if row_bucket(int(inputs[0].shape[0]), pool.allocated, pool.config.max_rows) is None:
                return run(pool, name, fn, cache, new_slots, inputs)

            def watched(*x):
                watch.calls[name] += 1
                with watch.watching(name):
                    return fn(*x)
            return run(pool, name, watched, cache, new_slots, inputs)

        monkeypatch.setattr(GraphPool, "run", watched_run)

    @contextlib.contextmanager
    def watching(self, name: str):
        events = self.events

        def counted(owner, attr):
            real = getattr(owner, attr)

            def wrapper(*args, **kwargs):
                events[name, attr] += 1
                return real(*args, **kwargs)
            return mock.patch.object(owner, attr, wrapper)

        exempt = []

        def cpu_only(attr):
            real = getattr(torch.nn.functional, attr)

            def wrapper(*args, **kwargs):
                exempt.append(attr)
                try:
                    return real(*args, **kwargs)
                finally:
                    exempt.pop()
            return mock.patch.object(torch.nn.functional, attr, wrapper)

        with contextlib.ExitStack() as stack:
            for attr in HOST_READS:
                stack.enter_context(counted(torch.Tensor, attr))
            for attr in HOST_MADE:
                stack.enter_context(counted(torch, attr))
            for attr in CPU_ONLY_READS:
                stack.enter_context(cpu_only(attr))
            stack.enter_context(_AtenWatch(events, name, exempt))
            yield


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("strategy, names", [
    ("off", {"decode"}),
    ("chain-4", {"chain-4", "verify-chain"}),
    ("tree-4x3-8", {"tree-4x3-8", "verify-tree"}),
    ("ngram-3", {"verify-chain"}),
])
def test_no_host_sync_inside_the_functions_cuda_graphs_capture(pair, strategy, names, temperature, monkeypatch):
    """Every function a rollout's GraphPool would capture (on CUDA's paths: the table mirror and the gathered pages)
    runs without reading a tensor on the host, making one from host data, an op of data-dependent shape or a random
    draw: any of them fails capture on CUDA (the key then runs eagerly, with one warning) or, for a random draw,
    repeats the captured numbers at every replay. Each of the strategy's graphed functions ran."""
    CudaEmulation(monkeypatch)
    watch = HostSyncWatch(monkeypatch)
    res, pool = _rollout(_engine(pair, temperature), strategy, 5, GraphConfig(min_span=16))
    assert names <= set(watch.calls) and all(watch.calls[n] > 0 for n in names), watch.calls
    assert sum(watch.calls.values()) == pool.stats["eager"] and res.lengths.max() > 8
    assert not watch.events, dict(watch.events)


SYNCING = {
    "item": lambda x: x * x.sum().item(),
    "tolist": lambda x: x + len(x.tolist()),
    "cpu": lambda x: x.cpu() + 1,
    "numpy": lambda x: x + float(x.numpy().sum() > 0),
    "__bool__": lambda x: x + 1 if x.sum() > 0 else x,
    "__int__": lambda x: x + int(x[0, 0]),
    "__float__": lambda x: x + float(x[0, 0]),
    "__index__": lambda x: x + [1.0, 2.0][x[0, 0].long()],
    "tensor": lambda x: x + torch.tensor(1.0),
    "as_tensor": lambda x: x + torch.as_tensor([1.0, 2.0]),
    "from_numpy": lambda x: x + torch.from_numpy(np.ones(2, dtype=np.float32)),
    "aten._local_scalar_dense (scalar read)": lambda x: x.view(-1)[: x.new_ones((), dtype=torch.long) + 1],
    "aten.nonzero (data-dependent shape)": lambda x: x + torch.nonzero(x).sum(),
    "aten.index (boolean mask: data-dependent shape)": lambda x: x + x[x > 0].sum(),
    "aten.index_put_ (boolean mask: data-dependent shape)": lambda x: x.clone().index_put_((x > 1,), x.new_zeros(())),
    "aten.repeat_interleave (data-dependent shape)": lambda x: x.repeat_interleave(x[:, 0].long() * 0 + 1, 0),
    "aten.uniform_ (random draw)": lambda x: x + torch.empty_like(x).uniform_(),
    "aten.multinomial (random draw)": lambda x: x + torch.multinomial(x.abs() + 1, 1),
}
"""Functions that sync (or draw, or make a host tensor), each in the way its key names."""


@pytest.mark.parametrize("kind", sorted(SYNCING))
def test_control_the_watch_counts_a_function_that_syncs(kind, monkeypatch):
    """The control of the test above: a deliberately syncing function run through GraphPool.run is counted under the
    kind it uses, and one that does not sync (or whose only reads are one_hot's CPU-only checks) is not."""
    watch = HostSyncWatch(monkeypatch)
    cache = PagedKVCache(1, 4, 1, 32, 4, num_pages=8)
    pool = GraphPool([cache], GraphConfig(max_rows=4, min_span=16), capture=False)
    x = torch.tensor([[0.5, 1.0], [2.0, 3.0], [1.0, 1.0]])
    pool.run("clean", lambda t: t * 2 + torch.nn.functional.one_hot(t[:, 0].long().clamp(0, 1), 2), cache, 1, [x])
    assert watch.calls["clean"] == 1 and not watch.events
    pool.run("sync", SYNCING[kind], cache, 1, [x])
    assert watch.calls["sync"] == 1 and watch.events["sync", kind] >= 1, dict(watch.events)


# -------------------------------------------------------------------------------------- 3. bfloat16 rollouts
@pytest.fixture(scope="module")
def reasoner_bf16():
    from tltlib import load
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems
    from tltlib.tasks.prompts import encode_prompts
    if not (ROOT / "data" / "tiny-reasoner-drafter" / "drafter.safetensors").is_file():
        pytest.skip("data/tiny-reasoner-drafter not built")
    m = load(ROOT / "data" / "tiny-reasoner", ROOT / "data" / "tiny-reasoner-drafter", device="cpu",
             dtype="bfloat16")
    assert m.model.embed.weight.dtype == torch.bfloat16 and m.drafter.fc.weight.dtype == torch.bfloat16
    prompts = encode_prompts(generate_problems(ChainTaskConfig(), 6, seed=3), m.tokenizer)
    engine = RolloutEngine(m.model, RolloutConfig(SamplingConfig(temperature=0.0, max_new_tokens=96),
                                                  num_generations=2), drafter=m.drafter)
    plain, _ = _rollout(engine, "off", 1, prompts=prompts)          # plain bf16 decoding, eager
    return m.model, m.drafter, prompts, engine, plain


def _finite_logprobs(res) -> bool:
    valid = torch.arange(res.logprobs.shape[1])[None] < res.lengths[:, None]
    lp = res.logprobs[valid]
    return bool(torch.isfinite(lp).all() and (lp <= 0).all() and res.lengths.min() >= 1)


BF16_TIE = 0.25
"""The most two logits of one bf16 forward may differ and still be a near-tie that the verify forward (several
tokens at once) and the decode forward (one) may order differently: bf16 keeps 8 significant bits, so a logit near 16
is rounded to 0.0625, and the two forwards' matmuls round their sums differently over 8 layers."""


def _first_divergence_is_a_near_tie(model, prompt, a, b) -> bool:
    """Whether responses ``a`` and ``b`` (token lists) first differ where ``model`` (bf16) gives their two tokens
    logits within :data:`BF16_TIE` (and the shorter one is not a prefix cut short)."""
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        return len(a) == len(b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + a[:j]]))[0, -1].float()
    return abs(float(logits[a[j]] - logits[b[j]])) <= BF16_TIE


@pytest.mark.parametrize("strategy", ["chain-4", "tree-4x3-8", "ngram-3"])
def test_bf16_rollouts_complete_and_greedy_sd_keeps_plain_bf16_decodings_tokens(reasoner_bf16, strategy):
    """The tiny reasoner and its drafter in bfloat16 (what a GPU rollout runs), SD through the padded fixed-span calls
    CUDA graphs replay: at T=0 every response equals plain bf16 decoding's, except that a row may part from it at a
    near-tie of the bf16 logits (the verify forward reads several tokens at once, plain decoding one, and bf16 rounds
    their sums differently; on the development VM none parts); the drafter is accepted (its bf16 forward is right);
    at T=0.9 the rollout completes; log-probs are finite and <= 0 at both.

    Fails on a dtype error anywhere in the bf16 path (cache, drafter, verify, sampling), non-finite log-probs, or a
    divergence from plain decoding where the model was not torn between two tokens."""
    model, drafter, prompts, engine, plain = reasoner_bf16
    spec, pool = _rollout(engine, strategy, 1, GraphConfig(min_span=64), prompts=prompts)
    assert _finite_logprobs(plain) and _finite_logprobs(spec) and pool.stats["eager"] > 0
    assert spec.stats["spec/accept_len_mean"] > (1.0 if strategy.startswith("ngram") else 2.0)
    same = 0
    for i in range(spec.num_sequences):
        a, b = plain.response_ids(i), spec.response_ids(i)
        assert _first_divergence_is_a_near_tie(model, prompts[i // 2], a, b), i
        same += a == b
    assert same >= 1, "no response equal to plain decoding's"
    a = plain.response_ids(0)                     # the check's control: a confident token replaced is no near-tie
    with torch.no_grad():
        unlikely = int(model(torch.tensor([prompts[0] + a[:3]]))[0, -1].argmin())
    assert not _first_divergence_is_a_near_tie(model, prompts[0], a, a[:3] + [unlikely] + a[4:])
    hot = RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=0.9, max_new_tokens=48), num_generations=2),
                        drafter=drafter)
    sampled, _ = _rollout(hot, strategy, 2, GraphConfig(min_span=64), prompts=prompts)
    assert _finite_logprobs(sampled) and sampled.stats["spec/steps"] > 0


# -------------------------------------------------------------------------------- 4. a bfloat16 GRPO smoke
@pytest.mark.long
def test_bf16_e2e_grpo_runs_on_the_cpu_and_writes_its_results(tmp_path):
    """``bench e2e_grpo --dtype bfloat16`` at the tiniest sizes (one step of the baseline and of TLT with its online
    drafter) exits 0 and writes its JSON, with finite losses. Nothing about the weights moving: that is the fp32
    master weights' test."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    from _common import MALLOC
    env = {k: v for k, v in os.environ.items() if k not in MALLOC}
    env["TLTLIB_NO_VENV"] = "1"
    # threads waiting at a barrier yield their core instead of spinning: on a busy two-core machine the run took
    # 60-70 s with spinning threads, 15-22 s without (the same computation either way)
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, "-m", "tltlib", "bench", "e2e_grpo", "--device", "cpu", "--dtype",
                          "bfloat16", "--steps", "1", "--seeds", "1", "--prompts", "2", "--num-generations", "2",
                          "--max-new", "16", "--trl-steps", "0", "--held-out", "4", "--probe", "0",
                          "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads((tmp_path / "e2e_grpo-cpu-bfloat16.json").read_text())
    assert d["settings"]["dtype"] == "bfloat16" and d["settings"]["device"] == "cpu"
    for policy in ("baseline", "tlt"):
        (run,) = d["runs"][policy]
        (step,) = run["steps"]
        for key in ("rl/loss", "rl/kl", "rl/grad_norm", "rl/reward_mean", "time/step_s"):
            assert math.isfinite(step[key]), (policy, key, step[key])
        assert step["rollout/num_sequences"] == 4
    assert d["runs"]["tlt"][0]["steps"][0]["drafter/trained"] == 1 and math.isfinite(
        d["runs"]["tlt"][0]["steps"][0]["drafter/loss"])
