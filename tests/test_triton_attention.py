"""The Triton paged attention (tltlib.kernels.triton_attention) and its place in the paged cache.

Default tier (no triton needed): the paged cache picks the kernel only where it can run (triton importable,
``TLTLIB_TRITON_ATTENTION`` not ``0``, a forward it fits) and gathers otherwise, also when the kernel fails to build;
importing tltlib (and a CPU forward) never imports triton; the per-row bounds the kernel reads equal the CPU path's;
the launch plan depends on the shapes alone (what a CUDA graph needs).

``triton`` tier (``pytest -m triton``; needs triton, skipped without it): the kernel under Triton's interpreter on CPU
tensors against a float64 reference over the gathered pages (rows of different lengths at page boundaries, an empty
row on the scratch page, permuted and shared pages, GQA, decode, causal verifies of 2-12 tokens, draft trees, up to
``MAX_NEW`` tokens, float32 / bfloat16 / float16, one split and several); a small ``PagedKVCache`` attending through it
gives the gathered path's outputs; and the kernel compiled for sm_90 without a GPU, where ``ptxas`` reports no spills.

``gpu`` tier: the compiled kernel on CUDA against the gathered path, and replayed inside a CUDA graph.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tltlib.kernels import triton_attention as ta
from tltlib.kernels.dispatch import gqa_sdpa
from tltlib.kv.dense import attention_mask
from tltlib.kv.paged import PagedKVCache
from tltlib.kv.paged_attention import choose_kernel

ROOT = Path(__file__).resolve().parent.parent
NO_TRITON = "triton is not installed: .venv/bin/pip install triton==3.6.0 (the GPU machine's version) runs this tier"


# ----------------------------------------------------------------------------------------------- shared helpers
def _cache_write(rows=3, kvh=2, heads=4, d=16, page=4, new=1, dtype=torch.bfloat16, lengths=(5, 9, 2)):
    """A CPU paged cache with ragged rows and the CacheWrite of a ``new``-token forward, and its q."""
    cache = PagedKVCache(1, rows, kvh, 64, d, 60, page, dtype)
    cache.advance(torch.tensor(lengths[:rows]))
    where = cache.prepare(new)
    return cache, where, torch.randn(rows, heads, new, d).to(dtype)


def _force(monkeypatch, devices=("cuda", "cpu"), available=True):
    monkeypatch.setattr(ta, "DEVICES", devices)
    monkeypatch.setattr(ta, "available", lambda: available)


# ----------------------------------------------------------------------------------------------- default tier
def test_the_cache_picks_the_kernel_only_where_it_can_run(monkeypatch):
    cache, where, q = _cache_write(new=3)
    _force(monkeypatch)
    assert choose_kernel(q, where) == "triton"                       # the wiring, with the kernel made runnable
    _force(monkeypatch, available=False)                               # triton missing: the gathered path
    assert choose_kernel(q, where) == "default"
    _force(monkeypatch, devices=("cuda",))                             # a CPU tensor on the default devices
    assert choose_kernel(q, where) == "default"
    _force(monkeypatch)
    assert choose_kernel(q.double(), where) == "default"               # a dtype it does not take
    _, long_where, long_q = _cache_write(new=ta.MAX_NEW + 1)
    assert choose_kernel(long_q, long_where) == "default"              # a prefill longer than MAX_NEW


def test_the_switch_turns_the_kernel_off_without_importing_triton(monkeypatch):
    monkeypatch.setenv(ta.ENV, "0")
    monkeypatch.setattr(ta, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(ta, "_state", {})
    cache, where, q = _cache_write(new=2)
    assert ta.unavailable_reason() == f"{ta.ENV}=0" and not ta.available()
    assert choose_kernel(q, where) == "default" and "import" not in ta._state


def test_a_missing_triton_is_reported_and_the_cache_gathers(monkeypatch):
    monkeypatch.delenv(ta.ENV, raising=False)
    monkeypatch.setattr(ta, "_state", {})
    monkeypatch.setitem(sys.modules, "triton", None)                   # import triton raises ImportError
    monkeypatch.setattr(ta, "DEVICES", ("cuda", "cpu"))
    assert not ta.available() and "triton does not import" in ta.unavailable_reason()
    cache, where, q = _cache_write(new=1)
    assert choose_kernel(q, where) == "default"


def test_a_kernel_that_fails_to_build_falls_back_to_the_gathered_pages(monkeypatch):
    cache, where, q = _cache_write(new=2)
    k_new, v_new = (torch.randn(3, 2, 2, 16).to(torch.bfloat16) for _ in range(2))
    _force(monkeypatch)
    monkeypatch.setattr(ta, "cached_paged_attention", lambda *a, **k: None)
    out = cache.attend(0, where, q, k_new, v_new)
    k, v = cache._gather(cache.k[0], where), cache._gather(cache.v[0], where)
    torch.testing.assert_close(out, gqa_sdpa(q, k, v, where.mask))
    assert where.memo["paged"] == "default"


def test_importing_tltlib_and_a_cpu_forward_do_not_import_triton():
    code = ("import sys, torch, tltlib, tltlib.kernels.triton_attention, tltlib.model\n"
            "from tltlib.kv.paged import PagedKVCache\n"
            "c = PagedKVCache(1, 2, 1, 16, 8, 8, 4, torch.bfloat16)\n"
            "w = c.prepare(3)\n"
            "x = torch.zeros(2, 3, 1, 8, dtype=torch.bfloat16)\n"
            "c.attend(0, w, torch.zeros(2, 2, 3, 8, dtype=torch.bfloat16), x, x)\n"
            "assert sys.modules.get('triton') is None, 'triton was imported'\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("new, tree", [(1, False), (3, False), (4, True)])
def test_the_row_bounds_equal_the_cpu_paths_ends(new, tree):
    cache, where, _ = _cache_write(new=new, dtype=torch.float32)
    if tree:
        where = cache.prepare(new, _tree_mask(3, 0, new, torch.Generator().manual_seed(1)))
    lengths, ends, bits = ta.row_bounds(where.mask, cache.lengths[: cache.rows], where.span)
    assert torch.equal(ends, where.ends) and torch.equal(lengths, cache.lengths[:3])
    assert bits.dtype == torch.uint8 and torch.equal(bits.bool(), where.mask[:, 0])


def test_the_launch_plan_depends_on_the_shapes_alone():
    for tasks, span, block, sms in [(3, 2048, 64, 132), (192, 2048, 32, 132), (1, 100, 64, 4), (500, 512, 32, 132)]:
        splits, chunk = ta.plan_splits(tasks, span, block, sms)
        assert splits >= 1 and chunk % block == 0 and splits * chunk >= span > (splits - 1) * chunk
        assert chunk >= min(ta.MIN_SPLIT_POSITIONS, -(-span // block) * block)
        assert (splits, chunk) == ta.plan_splits(tasks, span, block, sms)
    assert ta.plan_splits(3, 2048, 64, 132)[0] > 1 and ta.plan_splits(500, 512, 32, 132)[0] == 1
    for dtype in ta.DTYPES:
        for d in (24, 64, 128, 256):
            cfg = ta.blocks(27, d, dtype, 9)
            assert cfg["BLOCK_D"] >= max(d, 16) and 16 <= cfg["BLOCK_M"] <= 64 and cfg["BLOCK_N"] in (32, 64)


def test_fits_names_what_the_kernel_takes():
    mask = torch.ones(2, 1, 4, 8, dtype=torch.bool)
    assert ta.fits(torch.zeros(2, 4, 4, 64, dtype=torch.bfloat16), mask)
    assert ta.fits(torch.zeros(2, 4, 1, 64, dtype=torch.float16), None)
    assert not ta.fits(torch.zeros(2, 4, 4, 64, dtype=torch.bfloat16), None)      # several tokens need a mask
    assert not ta.fits(torch.zeros(2, 4, 1, 512), None)                          # head dim past MAX_HEAD_DIM
    assert not ta.fits(torch.zeros(2, 4, 1, 64, dtype=torch.float64), None)


# ----------------------------------------------------------------------------------------------- the triton tier
def _tree_mask(rows, offset, new, g):
    """A random valid draft tree over ``offset + new`` uncommitted nodes per row (each node's parent earlier, or the
    committed prefix), as ``[rows, new, offset + new]``: node i sees its ancestors and itself."""
    width = offset + new
    out = torch.zeros(rows, width, width, dtype=torch.bool)
    for r in range(rows):
        for i in range(width):
            parent = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
            out[r, i, i] = True
            if parent >= 0:
                out[r, i] |= out[r, parent]
    return out[:, offset:]


def _paged_inputs(g, lengths, heads, kvh, d, page, new, dtype, tree=False, offset=0, pages=64):
    """Pages in permuted order (rows 1 and 2 sharing their first page, a row of length 0 on the scratch page only),
    a q, and the forward's mask as the cache builds it (tltlib.kv.dense.attention_mask)."""
    rows = len(lengths)
    lengths = torch.tensor(lengths)
    span = int(lengths.max()) + offset + new
    width = -(-span // page)
    k_pages, v_pages = (torch.randn(kvh, pages + 1, page, d, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(pages, generator=g)[: rows * width].view(rows, width).clone()
    if rows > 2:
        table[2, 0] = table[1, 0]                                     # a prompt's page shared by two samples
    table[lengths == 0] = pages                                       # an empty row reads only the scratch page
    q = torch.randn(rows, heads, new, d, generator=g).to(dtype)
    trees = _tree_mask(rows, offset, new, g) if tree else None
    write = attention_mask(torch.zeros(rows, new, kvh, dtype=torch.long), lengths, span, new, trees, offset,
                           int(lengths.min()), int(lengths.max()), fixed=False)
    return q, k_pages, v_pages, table.contiguous(), lengths, write.mask, span


def _reference(q, k_pages, v_pages, table, mask, span):
    """Float64 attention over each row's gathered pages under the forward's mask (the gathered path's maths)."""
    rows, kvh, d = table.shape[0], k_pages.shape[0], k_pages.shape[3]
    k, v = (p.double()[:, table].transpose(0, 1).reshape(rows, kvh, -1, d)[:, :, :span] for p in (k_pages, v_pages))
    return gqa_sdpa(q.double(), k, v, mask)


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
             torch.float16: dict(rtol=2e-3, atol=2e-3)}

CASES = [  # lengths (committed), heads, kv heads, head dim, page, new tokens, dtype, tree, offset, splits
    ((15, 16, 0, 31), 4, 2, 16, 16, 1, torch.float32, False, 0, 1),        # decode at page boundaries, empty row
    ((15, 16, 0, 31), 4, 2, 16, 16, 1, torch.float32, False, 0, 3),        # the same over three splits
    ((20, 20, 20), 6, 3, 32, 8, 1, torch.float32, False, 0, None),         # equal rows: no mask at all
    ((7, 12, 3), 4, 4, 16, 4, 2, torch.float32, False, 0, None),           # causal, no GQA
    ((9, 40, 0), 8, 2, 16, 8, 5, torch.float32, False, 0, 2),              # causal, 4 heads per KV head
    ((30, 17, 5), 4, 2, 24, 16, 12, torch.float32, False, 0, None),        # causal at MASKED_KERNEL_MAX_NEW, d=24
    ((33, 8, 16), 4, 2, 16, 16, 7, torch.float32, True, 0, 1),             # a draft tree
    ((12, 28, 1), 4, 1, 16, 8, 12, torch.float32, True, 3, 3),             # a tree level after 3 drafted nodes
    ((5, 22, 0), 6, 2, 16, 16, ta.MAX_NEW, torch.float32, True, 0, 2),     # MAX_NEW tokens: two query blocks
    ((15, 16, 0, 31), 4, 2, 32, 16, 1, torch.bfloat16, False, 0, 2),       # bfloat16 decode
    ((33, 8, 16), 6, 2, 32, 16, 9, torch.bfloat16, True, 0, None),         # bfloat16 tree verify of 9
    ((10, 3, 25), 4, 2, 16, 8, 4, torch.float16, False, 0, 1),             # float16 causal
]


@pytest.fixture(scope="module")
def interpreted():
    """triton imported for its interpreter in this process (``TRITON_INTERPRET=1`` before the import)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip(NO_TRITON)
    with pytest.MonkeyPatch.context() as mp:
        if "triton" not in sys.modules:
            mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv(ta.ENV, raising=False)
        if not ta.available():
            pytest.skip(f"the Triton kernel cannot run here: {ta.unavailable_reason()}")
        if not ta.interpreting():
            pytest.skip("triton was imported without its interpreter in this process: run this tier alone "
                        "(pytest -m triton tests/test_triton_attention.py)")
        _numpy_index_fix(mp)
        _bfloat16_dot_fix(mp)
        yield


def _numpy_index_fix(mp) -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with ``int(array of shape (1,))``, which numpy >= 2.4
    refuses (triton-lang/triton#9171); under such a numpy, read the one element instead."""
    import numpy as np
    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter
    patch = interpreter._patch_lang_tensor

    def fixed(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    mp.setattr(interpreter, "_patch_lang_tensor", fixed)


def _bfloat16_dot_fix(mp) -> None:
    """Triton's interpreter keeps bfloat16 as its uint16 bits and its ``tl.dot`` multiplies those bits (bfloat16 is
    unsupported there: triton-lang/triton#11584); widen bfloat16 operands to float32 first, as the GPU's bfloat16
    tensor cores multiply exactly into a float32 accumulator."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    dot = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype == tl.bfloat16 and x.data.dtype == np.uint16:
            return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return x

    def create_dot(self, a, b, d, *args, **kwargs):
        return dot(self, widen(a), widen(b), d, *args, **kwargs)
    mp.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[5]}-{str(c[6])[6:]}-{'tree' if c[7] else 'causal'}"
                                                     f"-splits{c[9]}")
def test_the_kernel_equals_attention_over_the_gathered_pages(interpreted, case):
    lengths, heads, kvh, d, page, new, dtype, tree, offset, splits = case
    g = torch.Generator().manual_seed(sum(lengths) + new)
    q, k_pages, v_pages, table, committed, mask, span = _paged_inputs(g, lengths, heads, kvh, d, page, new, dtype,
                                                                      tree, offset)
    lengths_, ends, bits = ta.row_bounds(mask, committed, span)
    out = ta.paged_attention(q, k_pages, v_pages, table, lengths_, ends, bits, splits=splits)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), _reference(q, k_pages, v_pages, table, mask, span), **TOLERANCE[dtype])


@pytest.mark.triton
def test_a_paged_cache_attending_by_the_kernel_gives_the_gathered_paths_outputs(interpreted, monkeypatch):
    monkeypatch.setattr(ta, "DEVICES", ("cuda", "cpu"))
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, 3, 2, 64, 16, 40, 4, torch.float32)
    step = lambda new, **kw: _attend_both(cache, g, new, **kw)
    step(6)                                                            # a prompt of 6 tokens per row
    cache.advance(torch.tensor([6, 3, 5]))
    cache.select_rows(torch.tensor([0, 1, 1]))                         # rows 1 and 2 share their pages
    step(1)                                                            # a ragged decode (copy-on-write of a page)
    cache.advance(1)
    step(5, tree=_tree_mask(3, 0, 5, g))                               # a tree verify
    cache.make_room(4)
    cache.fixed_span = 32                                              # as a captured graph runs it
    step(4)
    cache.fixed_span = None
    cache.reset()
    step(3)
    cache.advance(3)
    step(1)                                                            # equal rows: decode without a mask


def _attend_both(cache, g, new, tree=None):
    rows, kvh, d = cache.rows, cache.k.shape[1], cache.k.shape[-1]
    q = torch.randn(rows, 4, new, d, generator=g)
    k_new, v_new = (torch.randn(rows, new, kvh, d, generator=g) for _ in range(2))
    where = cache.prepare(new, tree)
    out = cache.attend(0, where, q, k_new, v_new)
    assert where.memo["paged"] == "triton"
    k, v = cache._gather(cache.k[0], where), cache._gather(cache.v[0], where)
    torch.testing.assert_close(out, gqa_sdpa(q, k, v, where.mask), rtol=1e-5, atol=1e-5)


def _ptxas_found() -> bool:
    return bool(shutil.which("ptxas") or any(Path("/usr/local").glob("cuda*/bin/ptxas")))


@pytest.mark.triton
@pytest.mark.skipif(not _ptxas_found(), reason="no ptxas (CUDA toolkit) found")
def test_the_kernel_compiles_for_sm90_without_spills(record_property):
    if importlib.util.find_spec("triton") is None:
        pytest.skip(NO_TRITON)
    code = "import json\nfrom tltlib.kernels import triton_attention as ta\nprint(json.dumps(ta.resource_report()))\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}      # compiled, not interpreted
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    record_property("ptxas", report)
    lines = [f"{r['dtype']} d={r['head_dim']} G={r['group']} T={r['new']} split={r['split']}: {r['registers']} "
             f"registers, spills {r['spill_stores']}/{r['spill_loads']} B, {r['shared_bytes']} B shared"
             for r in report]
    print("\n".join(lines))
    assert len(report) == 2 * len(ta.REPORT_CASES)
    assert all(r["arch"].startswith("sm_90") for r in report)
    spilled = [line for line, r in zip(lines, report) if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, "register spills:\n" + "\n".join(spilled)
    assert all(0 < r["registers"] <= 255 for r in report)


# ----------------------------------------------------------------------------------------------- the gpu tier
@pytest.mark.gpu
def test_the_compiled_kernel_on_cuda_equals_the_gathered_path_and_replays_in_a_graph(monkeypatch):
    monkeypatch.delenv(ta.ENV, raising=False)
    if not ta.available():
        pytest.skip(f"the Triton kernel cannot run here: {ta.unavailable_reason()}")
    if ta.interpreting():
        pytest.skip("triton was imported for its interpreter in this process: run the gpu tier on its own")
    g = torch.Generator().manual_seed(0)
    for new, tree in ((1, False), (9, True)):
        q, k_pages, v_pages, table, committed, mask, span = (
            x.cuda() if isinstance(x, torch.Tensor) else x
            for x in _paged_inputs(g, (300, 17, 0, 511), 9, 3, 64, 16, new, torch.bfloat16, tree, pages=256))
        bounds = ta.row_bounds(mask, committed, span)
        eager = ta.paged_attention(q, k_pages, v_pages, table, *bounds)
        torch.testing.assert_close(eager.double(), _reference(q, k_pages, v_pages, table, mask, span),
                                   **TOLERANCE[torch.bfloat16])
        graph, memo = torch.cuda.CUDAGraph(), {}
        ta.paged_attention(q, k_pages, v_pages, table, *bounds, memo=memo)          # compiled before the capture
        with torch.cuda.graph(graph):
            out = ta.paged_attention(q, k_pages, v_pages, table, *bounds, memo=memo)
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.testing.assert_close(out, ta.paged_attention(q, k_pages, v_pages, table, *bounds), rtol=0, atol=0)


def test_the_switch_reads_the_words_people_write(monkeypatch):
    # it read only "0" as off: TLTLIB_TRITON_ATTENTION=off ran the kernel anyway
    from tltlib.errors import BadInput
    from tltlib.kernels import triton_attention as ta
    monkeypatch.setenv(ta.ENV, "off")
    assert ta.unavailable_reason() == f"{ta.ENV}=0"
    monkeypatch.setenv(ta.ENV, "maybe")
    with pytest.raises(BadInput, match="TLTLIB_TRITON_ATTENTION='maybe': set it to 0"):
        ta.unavailable_reason()
