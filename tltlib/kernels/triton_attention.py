"""Attention through a paged KV cache's block tables on CUDA: a Triton kernel that reads the pages in place.

On CUDA the paged cache used to gather every row's pages into a dense ``[rows, kv_heads, span, head_dim]`` block
before SDPA (:meth:`tltlib.kv.paged.PagedKVCache._gather`): the pages read once, the block written and read again,
about 3x the KV traffic of a kernel that reads the pages where they are, and over the whole span bucket of a captured
graph rather than each row's own length. :func:`paged_attention` is that kernel, the CUDA twin of the CPU's C++
kernels (:func:`tltlib.kernels.ragged_attention.paged_masked_attention`, same semantics):

* **work**: one program per (row, KV head, block of queries) and per *split* of the positions. A KV head's queries are
  its ``G = H / KVH`` query heads times the ``T`` new tokens (``G * T`` rows of a ``tl.dot``: GQA shares each key
  and value read among them); a split is a stretch of ``chunk`` positions ("flash-decoding", Dao et al. 2023): with
  few rows a long span is cut into splits so that the GPU's SMs all work; each split writes its running maximum, sum
  and weighted values, and a second kernel combines them (one split: the first kernel writes the output).
* **pages**: a block of ``BLOCK_N`` positions finds its pages in the row's block table (``table[row, j // page]``)
  and loads their keys and values in place (``[kv_heads, pages, page_size, head_dim]`` per layer, head-major).
* **lengths and masks**: on the device only. A row reads positions ``0 .. ends[row] - 1`` (splits past its end do
  nothing); positions below its committed length ``lengths[row]`` are seen by every new token; from there on, the
  forward's mask says which of the uncommitted entries each token sees (causal, or a draft tree's ancestry:
  :attr:`tltlib.kv.dense.CacheWrite.mask`), read only over those few columns. :func:`row_bounds` derives ``ends``
  from the mask (the last new token sees its own slot, the row's last).
* **capture-safe**: no host reads, no tensor made from host data; the grid, the splits and the block sizes depend
  on the shapes and the span alone, so one call is one fixed pair of launches inside a CUDA graph at a fixed span
  bucket (:mod:`tltlib.model.cudagraph`: the graph's warm-up compiles the kernel before the capture).

Block sizes (:func:`blocks`) are chosen so that ``ptxas`` reports no register spills for sm_90 at the model shapes of
:data:`REPORT_CASES`; :func:`compile_ptx` and :func:`resource_report` compile the kernel for sm_90 without a GPU and
read ``ptxas -v`` (the tests and ``bench/triton_attention.py --compile-only``). Timings on a GPU: the bench.

Triton is imported on first use, never when tltlib is imported; where it is missing (or ``TLTLIB_TRITON_ATTENTION=0``)
:func:`available` says so and the paged cache keeps the gathered path. A specialisation whose first launch fails on
CUDA (a compile error, too little shared memory) turns the kernel off for the process with one warning
(:func:`paged_attention` then returns None and the caller gathers). CPU tensors run under Triton's interpreter where
triton was imported with ``TRITON_INTERPRET=1`` (a process runs one mode: :func:`interpreting`): the tests' checks,
never production.

Paper: vLLM's PagedAttention (Kwon et al., SOSP 2023) reads K/V through block tables; the online softmax is
FlashAttention's (Dao et al.). Departures: scores accumulate in float32 with ``exp2`` (the same function up to float
rounding); float32 inputs multiply in IEEE float32 (no TF32), so the kernel matches the float32 reference to ~1e-6.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
from typing import Any

import torch

from ..errors import BadInput, MissingDependency
from ..machine import env_switch

ENV = "TLTLIB_TRITON_ATTENTION"
"""Environment variable: ``0`` keeps the Triton kernel off (the gathered path), anything else or unset: on where
triton imports."""

MAX_NEW = 32
"""Most new tokens per row the kernel takes (decode, chain and tree verifies, drafter levels); longer forwards
(prefills) are compute-bound and keep gather + SDPA."""

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256
DEVICES = ("cuda",)
"""Device types on which :func:`wanted` picks the kernel (tests add ``cpu`` to run it under the interpreter)."""

MIN_TRITON = (3, 0)
MIN_SPLIT_POSITIONS = 128
"""Fewest positions a split reads: below, the combine pass costs more than the parallelism buys."""

triton: Any = None                    # the modules, imported by _import() on first use (never at tltlib's import)
tl: Any = None

_lock = threading.Lock()
_state: dict = {}                     # "import": None or why not; "failed": why the kernel was turned off
_kernels: dict = {}                   # "kernels": (attention kernel, combine kernel), decorated on first use
_launched: set = set()                # specialisations launched once (their compile errors are caught)
_sms: dict = {}


def _import() -> str | None:
    """Import triton into this module's globals (the kernels read ``tl`` from them); None, or why it cannot be."""
    global triton, tl
    try:
        import triton as _triton
        import triton.language as _tl
    except Exception as e:                           # missing, or a broken install
        return f"triton does not import ({type(e).__name__}: {e})"
    version = tuple(int(x) for x in re.findall(r"\d+", _triton.__version__)[:2])
    if version < MIN_TRITON:
        return f"triton {_triton.__version__} is older than {'.'.join(map(str, MIN_TRITON))}"
    triton, tl = _triton, _tl
    return None


def _imported() -> str | None:
    """Import triton once (whatever ``TLTLIB_TRITON_ATTENTION`` says); None, or why it does not import."""
    if "import" not in _state:
        with _lock:
            if "import" not in _state:
                _state["import"] = _import()
    return _state["import"]


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (``TLTLIB_TRITON_ATTENTION=0``, triton missing or too old, or it failed to
    compile once), or None when it can. Imports triton on the first call (not when switched off)."""
    if not env_switch(ENV, "gather the pages", "the Triton kernel where it fits"):
        return f"{ENV}=0"
    return _imported() or _state.get("failed")


def available() -> bool:
    """Whether the Triton paged attention can run (see :func:`unavailable_reason`)."""
    return unavailable_reason() is None


def fits(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a forward's attention is one the kernel takes: ``q [rows, H, T, d]`` in bfloat16, float16 or float32,
    ``T <= MAX_NEW``, ``d <= MAX_HEAD_DIM``, and a mask whenever ``T > 1``."""
    t, d = q.shape[2], q.shape[3]
    return q.dtype in DTYPES and 1 <= t <= MAX_NEW and d <= MAX_HEAD_DIM and (t == 1 or mask is not None)


def wanted(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the paged cache should attend by this kernel: ``q`` on one of :data:`DEVICES`, the forward
    :func:`fits`, and the kernel :func:`available`."""
    return q.device.type in DEVICES and fits(q, mask) and available()


def row_bounds(mask: torch.Tensor | None, lengths: torch.Tensor,
               span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the kernel reads of a forward, computed on the device (no host sync; made once per forward):
    ``(lengths, ends, bits)``: the rows' committed lengths ``[rows]``; ``ends [rows]`` int64, the slots each row
    reads (the last new token's last visible slot + 1: its own; ``span`` for every row without a mask); ``bits``
    ``[rows, T, span]`` uint8 view of ``mask [rows, 1, T, span]`` (None without one)."""
    if mask is None:
        return lengths, torch.full_like(lengths, span), None
    slots = torch.arange(1, span + 1, device=mask.device)
    ends = (mask[:, 0, -1] * slots).amax(-1)
    return lengths, ends, mask[:, 0].view(torch.uint8)


def cached_paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, mask: torch.Tensor | None, span: int,
                           memo: dict) -> torch.Tensor | None:
    """:func:`paged_attention` of one layer of a paged cache's forward: ``mask`` ``[rows, 1, T, span]`` bool or None
    (:attr:`tltlib.kv.dense.CacheWrite.mask`), ``lengths [rows]`` committed; ``memo`` (shared by the forward's
    layers) keeps :func:`row_bounds` and the split buffers. None when the kernel failed to build (warned once)."""
    if "triton" not in memo:
        memo["triton"] = row_bounds(mask, lengths, span)
    lengths, ends, bits = memo["triton"]
    return paged_attention(q, k_pages, v_pages, table, lengths, ends, bits, memo=memo)


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def blocks(queries: int, head_dim: int, dtype: torch.dtype, new: int = 1) -> dict:
    """The kernel's block sizes and launch settings for ``queries`` (``G * T``) queries per KV head, ``new`` (T) new
    tokens per row: ``BLOCK_M`` queries (16 .. 64; past head dim 64: 32, or 16 in float32), ``BLOCK_D`` (head dim,
    padded to a power of two >= 16), ``BLOCK_N`` positions per step: 64 on 4 warps for a decode's small tiles (16
    queries, head dim <= 64, 16-bit, no mask), else 32 on 8 warps; 2 pipeline stages (1 in float32). Chosen so that
    ``ptxas`` reports no spills for sm_90 over head dims 64 and 128, 1-32 new tokens, GQA groups 1-8 and every dtype
    (4 warps and 64 positions spilled up to ~900 bytes at head dim 128, in float32 or under a mask); not yet tuned
    by timings on a GPU."""
    block_d = max(16, _pow2(head_dim))
    top = 64 if block_d <= 64 else 16 if dtype == torch.float32 else 32
    block_m = min(top, max(16, _pow2(queries)))
    wide = dtype == torch.float32 or block_d > 64 or block_m > 16 or new > 1
    return {"BLOCK_M": block_m, "BLOCK_N": 32 if wide else 64, "BLOCK_D": block_d, "num_warps": 8 if wide else 4,
            "num_stages": 1 if dtype == torch.float32 else 2}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached; 4 elsewhere: the interpreter's nominal machine)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sms:
        _sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sms[idx]


def plan_splits(tasks: int, span: int, block_n: int, sms: int) -> tuple[int, int]:
    """``(splits, chunk)``: how many stretches of ``chunk`` positions (a multiple of ``block_n``) each of ``tasks``
    programs' ``span`` positions is cut into, so that about two programs per SM run; from the shapes alone."""
    steps = -(-span // block_n)
    want = max(1, -(-2 * sms // max(tasks, 1)))
    per = max(-(-MIN_SPLIT_POSITIONS // block_n), -(-steps // want))
    return -(-steps // per), per * block_n


def _attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, ends_ptr, mask_ptr, out_ptr, part_ptr, acc_ptr,
                      scale, kv_heads, new, queries, chunk, s_qb, s_qh, s_qt, s_kh, s_kp, s_tb, s_mb, s_mt, s_ob,
                      s_oh, s_ot, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr, SPLIT: tl.constexpr,
                      PRECISION: tl.constexpr, WIDE: tl.constexpr):
    """One (row, KV head, query block) over one split of its positions (see the module docstring). Query ``i`` of a
    KV head is head ``kh * G + i // new``, token ``i % new``; ``scale``: ``head_dim ** -0.5 * log2(e)``."""
    task, split = tl.program_id(0), tl.program_id(1)
    m_blocks = tl.cdiv(queries, BLOCK_M)
    row, kh, mb = task // (kv_heads * m_blocks), (task // m_blocks) % kv_heads, task % m_blocks
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < queries, offs_d < HEAD_DIM
    tok, head = offs_m % new, kh * (queries // new) + offs_m // new
    q = tl.load(q_ptr + row * s_qb + head[:, None] * s_qh + tok[:, None] * s_qt + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    committed = tl.load(lengths_ptr + row)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, tl.load(ends_ptr + row)).to(tl.int32)
    k_base = k_ptr + kh.to(tl.int64) * s_kh
    v_base = v_ptr + kh.to(tl.int64) * s_kh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        page = tl.load(table_ptr + row * s_tb + offs_n // PAGE, mask=n_ok, other=0)
        if not WIDE:                                 # a head's pages within 2**31 elements: 32-bit offsets
            page = page.to(tl.int32)
        slot = (page * s_kp + (offs_n % PAGE) * HEAD_DIM)[:, None] + offs_d[None, :]
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        seen = m_ok[:, None] & n_ok[None, :]
        if HAS_MASK:                                 # the mask is read only past the committed entries
            tail = seen & (offs_n >= committed)[None, :]
            bits = tl.load(mask_ptr + row * s_mb + tok[:, None] * s_mt + offs_n[None, :], mask=tail, other=1)
            seen = seen & (bits != 0)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a query that saw nothing yet adds nothing
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        v = tl.load(v_base + slot, mask=kv_ok, other=0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLIT:                                        # [tasks, splits, 2, BLOCK_M] and [tasks, splits, BLOCK_M, BLOCK_D]
        local = tl.arange(0, BLOCK_M)
        part = task * tl.num_programs(1) + split
        tl.store(part_ptr + part * 2 * BLOCK_M + local, m_i)
        tl.store(part_ptr + (part * 2 + 1) * BLOCK_M + local, l_i)
        tl.store(acc_ptr + part * BLOCK_M * BLOCK_D + local[:, None] * BLOCK_D + offs_d[None, :], acc)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + row * s_ob + head[:, None] * s_oh + tok[:, None] * s_ot + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _combine_kernel(part_ptr, acc_ptr, out_ptr, splits, kv_heads, new, queries, s_ob, s_oh, s_ot,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The splits of one (row, KV head, query block) combined: each split's sums rescaled to the largest maximum."""
    task = tl.program_id(0)
    m_blocks = tl.cdiv(queries, BLOCK_M)
    row, kh, mb = task // (kv_heads * m_blocks), (task // m_blocks) % kv_heads, task % m_blocks
    local, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    offs_m = mb * BLOCK_M + local
    m_tot = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_tot = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for split in range(0, splits):
        part = task * splits + split
        m_s = tl.load(part_ptr + part * 2 * BLOCK_M + local)
        l_s = tl.load(part_ptr + (part * 2 + 1) * BLOCK_M + local)
        a_s = tl.load(acc_ptr + part * BLOCK_M * BLOCK_D + local[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m_tot, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        old, add = tl.exp2(m_tot - m_safe), tl.exp2(m_s - m_safe)
        l_tot = l_tot * old + l_s * add
        acc = acc * old[:, None] + a_s * add[:, None]
        m_tot = m_new
    out = acc / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]
    tok, head = offs_m % new, kh * (queries // new) + offs_m // new
    tl.store(out_ptr + row * s_ob + head[:, None] * s_oh + tok[:, None] * s_ot + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_m < queries)[:, None] & (offs_d < HEAD_DIM)[None, :])


def interpreting() -> bool:
    """Whether triton was imported for its interpreter (``TRITON_INTERPRET=1`` then): its own library functions
    (``tl.sum``, ``tl.cdiv``) are made for one mode at import, so a process runs either compiled kernels (CUDA
    tensors) or interpreted ones (CPU tensors), never both."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.cdiv, InterpretedFunction)


def _jitted() -> tuple:
    """The two kernels decorated as triton's own functions were (compiled, or for the interpreter)."""
    if not _kernels:
        with _lock:
            if not _kernels:
                from triton.runtime.interpreter import InterpretedFunction
                from triton.runtime.jit import JITFunction
                make = InterpretedFunction if interpreting() else JITFunction
                _kernels["kernels"] = (make(_attention_kernel), make(_combine_kernel))
    return _kernels["kernels"]


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                    lengths: torch.Tensor, ends: torch.Tensor, mask: torch.Tensor | None = None,
                    splits: int | None = None, memo: dict | None = None) -> torch.Tensor | None:
    """Attention of ``T`` new tokens per row over a paged cache, read in place (call where :func:`available`).

    q ``[B, H, T, d]`` (bfloat16, float16 or float32; last dim contiguous); k_pages, v_pages ``[KVH, pages,
    page_size, d]`` of ``q``'s dtype, each head's pages contiguous (one layer of
    :class:`tltlib.kv.paged.PagedKVCache`); table ``[B, W]`` int64 (last dim contiguous): row b's position j is
    token ``j % page_size`` of page ``table[b, j // page_size]``; lengths ``[B]`` int64: committed positions, seen by
    every new token; ends ``[B]`` int64: row b reads positions ``0 .. ends[b] - 1`` (``<= W * page_size``); mask
    ``[B, T, S]`` bool or uint8 (last dim contiguous) or None (every token sees all ``ends[b]``; T = 1): token t sees
    position ``lengths[b] <= j < ends[b]`` when ``mask[b, t, j]``. ``splits``: positions cut into this many
    stretches (default: planned from the shapes and the GPU). ``memo``: keeps the split buffers between the layers
    of a forward. CUDA tensors run the compiled kernel, CPU tensors Triton's interpreter. Returns ``[B, H, T, d]``
    in q's dtype, equal to the masked attention over each row's gathered positions up to float rounding; None when
    the kernel failed to compile here (warned once; the caller falls back)."""
    _check(q, k_pages, v_pages, table, mask)
    b, h, t, d = q.shape
    kvh, page = k_pages.shape[0], k_pages.shape[2]
    cfg = blocks(h // kvh * t, d, q.dtype, t)
    tasks = b * kvh * -(-(h // kvh * t) // cfg["BLOCK_M"])
    span = table.shape[1] * page
    if splits is None:
        splits, chunk = plan_splits(tasks, span, cfg["BLOCK_N"], sm_count(q.device))
    else:
        splits = max(1, min(splits, -(-span // cfg["BLOCK_N"])))
        chunk = -(-span // (splits * cfg["BLOCK_N"])) * cfg["BLOCK_N"]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    part, acc = _split_buffers(tasks, splits, cfg, q.device, memo) if splits > 1 else (out, out)
    bits = ends if mask is None else (mask.view(torch.uint8) if mask.dtype == torch.bool else mask)
    key = (q.device, q.dtype, d, page, cfg["BLOCK_M"], mask is not None, splits > 1, k_pages.stride(0) >= 2**31)
    try:
        _launch(q if q.stride(-1) == 1 else q.contiguous(), k_pages, v_pages, table, lengths, ends, bits, out, part,
                acc, cfg, splits, chunk, mask is not None)
    except Exception as e:
        if key in _launched or q.device.type != "cuda":
            raise                                        # a launch that worked before, or the interpreter: a bug
        return _turn_off(e)
    _launched.add(key)
    return out


def _check(q, k_pages, v_pages, table, mask) -> None:
    """Refuse what the kernel cannot read (shapes and layouts only: nothing on the device is read)."""
    kvh, d = k_pages.shape[0], k_pages.shape[-1]
    b, h, t = q.shape[:3]
    pages_ok = all(x.stride(-1) == 1 and x.stride(-2) == d for x in (k_pages, v_pages))
    ok = (q.dim() == 4 and k_pages.dim() == 4 and k_pages.shape == v_pages.shape and q.shape[-1] == d
          and h % kvh == 0 and k_pages.dtype == v_pages.dtype == q.dtype and q.dtype in DTYPES and pages_ok
          and k_pages.stride() == v_pages.stride() and table.dtype == torch.long and table.stride(-1) == 1
          and table.shape[0] == b and (mask is None or (tuple(mask.shape[:2]) == (b, t) and mask.stride(-1) == 1)))
    if not ok:
        raise BadInput(f"triton paged_attention: q [B, H, T, d] {tuple(q.shape)} {q.dtype}, k/v pages [KVH, pages, "
                       f"page_size, d] {tuple(k_pages.shape)} {k_pages.dtype} (each head's pages contiguous), table "
                       f"[B, W] int64 {tuple(table.shape)} {table.dtype}, mask [B, T, S] "
                       f"{None if mask is None else tuple(mask.shape)}: give tensors of these shapes and dtypes")
    if _imported():
        raise MissingDependency(f"{_state['import']}: pip install triton (the GPU machine's version)")
    if q.device.type != "cuda" and not interpreting():
        raise MissingDependency("the Triton paged attention runs CPU tensors only under Triton's interpreter: set "
                                "TRITON_INTERPRET=1 before triton is first imported (a fresh process)")


def _launch(q, k_pages, v_pages, table, lengths, ends, bits, out, part, acc, cfg, splits, chunk, masked) -> None:
    """The attention kernel over ``(tasks, splits)`` programs, then the combine kernel when ``splits > 1``."""
    attend, combine = _jitted()
    b, h, t, d = q.shape
    kvh, queries = k_pages.shape[0], h // k_pages.shape[0] * t
    tasks = b * kvh * -(-queries // cfg["BLOCK_M"])
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    attend[(tasks, splits)](
        q, k_pages, v_pages, table, lengths, ends, bits, out, part, acc, d ** -0.5 * math.log2(math.e), kvh, t,
        queries, chunk, q.stride(0), q.stride(1), q.stride(2), k_pages.stride(0), k_pages.stride(1), table.stride(0),
        bits.stride(0) if masked else 0, bits.stride(1) if masked else 0, out.stride(0), out.stride(1),
        out.stride(2), PAGE=k_pages.shape[2], HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_D=cfg["BLOCK_D"], HAS_MASK=masked, SPLIT=splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WIDE=k_pages.stride(0) >= 2**31, **launch)
    if splits > 1:
        combine[(tasks,)](part, acc, out, splits, kvh, t, queries, out.stride(0), out.stride(1), out.stride(2),
                          HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"], **launch)


def _split_buffers(tasks: int, splits: int, cfg: dict, device: torch.device,
                   memo: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' maxima and sums ``[tasks, splits, 2, BLOCK_M]`` and weighted values ``[tasks, splits, BLOCK_M,
    BLOCK_D]`` (float32), kept in ``memo`` for the forward's other layers (they run one after another)."""
    shape = (tasks, splits, cfg["BLOCK_M"], cfg["BLOCK_D"])
    key = ("triton_splits", shape, device)
    if memo is not None and key in memo:
        return memo[key]
    bufs = (torch.empty(tasks, splits, 2, cfg["BLOCK_M"], device=device), torch.empty(shape, device=device))
    if memo is not None:
        memo[key] = bufs
    return bufs


def _turn_off(error: Exception) -> None:
    """The kernel failed to compile or launch here: off for this process, with one warning."""
    _state["failed"] = f"the Triton kernel failed here ({type(error).__name__}: {str(error).strip()[:300]})"
    warnings.warn(f"tltlib: {_state['failed']}; paged attention gathers the pages instead (set {ENV}=0 to silence "
                  "this, or report it with the triton and GPU versions)", RuntimeWarning, stacklevel=3)
    return None


SIGNATURE = {"q_ptr": "*{t}", "k_ptr": "*{t}", "v_ptr": "*{t}", "table_ptr": "*i64", "lengths_ptr": "*i64",
             "ends_ptr": "*i64", "mask_ptr": "*u8", "out_ptr": "*{t}", "part_ptr": "*fp32", "acc_ptr": "*fp32",
             "scale": "fp32", **{n: "i32" for n in ("kv_heads", "new", "queries", "chunk", "s_qb", "s_qh", "s_qt",
                                                  "s_kh", "s_kp", "s_tb", "s_mb", "s_mt", "s_ob", "s_oh", "s_ot")}}
"""The attention kernel's argument types for an ahead-of-time compile (``{t}``: the element type)."""

_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compile_ptx(dtype: torch.dtype = torch.bfloat16, head_dim: int = 64, queries: int = 1, new: int = 1,
                page: int = 16, split: bool = False, arch: int = 90, **overrides) -> dict:
    """The attention kernel compiled ahead of time for ``sm_<arch>`` without a GPU (``triton.compile`` with
    ``GPUTarget("cuda", arch, 32)``), at the block sizes :func:`paged_attention` would pick for ``queries`` queries
    per KV head (``overrides``: other block sizes or launch settings): ``{"ptx", "shared_bytes", "config"}``. Needs
    a process where triton was imported without its interpreter."""
    if _imported():
        raise MissingDependency(f"{_state['import']}: pip install triton (the GPU machine's version)")
    if interpreting():
        raise MissingDependency("compile_ptx needs triton imported without TRITON_INTERPRET (a fresh process)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    cfg = blocks(queries, head_dim, dtype, new) | overrides
    consts = dict(PAGE=page, HEAD_DIM=head_dim, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  BLOCK_D=cfg["BLOCK_D"], HAS_MASK=new > 1, SPLIT=split,
                  PRECISION="ieee" if dtype == torch.float32 else "tf32", WIDE=False)
    fn = JITFunction(_attention_kernel)
    sig = {n: t.format(t=_TRITON_TYPES[dtype]) for n, t in SIGNATURE.items()} | {n: "constexpr" for n in consts}
    aligned = [i for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n in ("s_kh", "s_kp")]
    src = ASTSource(fn, sig, consts, {(i,): [["tt.divisibility", 16]] for i in aligned})
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    return {"ptx": compiled.asm["ptx"], "shared_bytes": compiled.metadata.shared,
            "config": {**consts, **opts, "dtype": str(dtype).removeprefix("torch.")}}


def ptxas() -> str | None:
    """A ``ptxas`` to ask for resource use: on the PATH, under ``/usr/local/cuda*/bin``, or triton's own."""
    found = shutil.which("ptxas")
    if found:
        return found
    for base in sorted(os.listdir("/usr/local"), reverse=True) if os.path.isdir("/usr/local") else []:
        path = os.path.join("/usr/local", base, "bin", "ptxas")
        if base.startswith("cuda") and os.access(path, os.X_OK):
            return path
    if triton is not None:
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        if os.access(path, os.X_OK):
            return path
    return None


def ptx_resources(ptx: str, tool: str | None = None) -> dict:
    """``ptxas -arch=<the PTX's target> -v`` on ``ptx``: ``{"registers", "spill_stores", "spill_loads", "arch",
    "ptxas"}`` (bytes of spills; 0 and 0 is what a kernel should have; Triton's shared memory is dynamic, which
    ptxas does not see: :func:`compile_ptx` has it)."""
    tool = tool or ptxas()
    if tool is None:
        raise MissingDependency("no ptxas found: install the CUDA toolkit (or triton, which ships one)")
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run([tool, f"-arch={arch}", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True)
    if run.returncode != 0:
        raise MissingDependency(f"{tool} failed on the kernel's PTX: {run.stderr.strip()[-500:]}")
    log = run.stderr + run.stdout
    num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else 0
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "arch": arch, "ptxas": tool}


REPORT_CASES = (("bfloat16", 64, 3, 1), ("bfloat16", 64, 3, 9), ("bfloat16", 128, 6, 1), ("bfloat16", 128, 6, 9),
                ("bfloat16", 128, 4, 32), ("float16", 128, 8, 12), ("float32", 64, 3, 9), ("float32", 128, 4, 1))
"""(dtype, head dim, query heads per KV head, new tokens) of :func:`resource_report`: SmolLM2-135M's heads (64, 3),
Qwen2.5-1.5B's (128, 6), Llama-3-8B's (128, 4), decode, verifies of 9-12 tokens and ``MAX_NEW``, every dtype."""


def resource_report(cases=REPORT_CASES, arch: int = 90) -> list[dict]:
    """Registers, spills and shared memory of the attention kernel compiled for ``sm_<arch>`` (:func:`compile_ptx`,
    :func:`ptx_resources`) for each of ``cases`` (as :data:`REPORT_CASES`), with one split and with several."""
    out = []
    for dtype, head_dim, group, new in cases:
        for split in (False, True):
            c = compile_ptx(getattr(torch, dtype), head_dim, group * new, new, split=split, arch=arch)
            out.append({"dtype": dtype, "head_dim": head_dim, "group": group, "new": new, "split": split,
                        **ptx_resources(c["ptx"]), "shared_bytes": c["shared_bytes"], "config": c["config"]})
    return out
