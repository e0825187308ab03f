"""Which kernel computes a projection (:func:`linear`) or a cached attention (:func:`cached_attention`): on a CPU in
float32 the one this machine's kernel table chose by measurement (:mod:`tltlib.kernels.table`, measured by
:mod:`tltlib.kernels.search` on first use); PyTorch's default where the table has no choice; on CUDA the fused paths.
The model (:mod:`tltlib.model.decoder`) calls these two and never branches on the device itself.

The candidates (each computes what the plain PyTorch call computes, up to float rounding: a different summation
order), run by name through :func:`linear_with` and :func:`attention_with`:

* **projections**: ``linear`` (``F.linear``); ``mm`` (``weight @ x.T``: PyTorch's CPU ``x @ weight.T`` re-lays out
  the weight for a few rows on some CPUs, ``weight @ x.T`` streams it once); ``mm-pad`` (one row run as two, which
  beat the matrix-vector product on the development VM); ``packed`` (oneDNN on a copy of the weight laid out for it
  once per rollout, :func:`pack_weights`, what vLLM's CPU backend does; only inside :func:`packed_weights`);
  ``mkl-packed`` (MKL's packed SGEMM, ``cblas_sgemm_pack``/``cblas_sgemm_compute`` as PyTorch exposes them, on a copy
  laid out for MKL, likewise; SmolLM2's layer projections on an Intel Xeon, two threads, 16 / 64 rows: 14% / 28%
  less time than oneDNN's, one row 1.6x more than ``F.linear``: the table decides); ``stream`` (a C++ kernel that
  reads the weight once at memory speed for a few rows, :mod:`tltlib.kernels.stream_linear_cpp`; measured for up to
  8 rows: on an AMD EPYC with AVX2 the BLAS kernels read a one-row step's weights at half the memory's bandwidth).
  Autograd (training), CUDA and other dtypes use ``F.linear``.
* **cached attention**: ``sdpa`` (PyTorch's ``scaled_dot_product_attention``, its bool mask turned into a float one
  once per forward); ``matmul`` (two batched matmuls, :func:`gqa_attention`); ``ragged`` (one new query per row over
  each row's own cached length, the C++ kernel of :mod:`tltlib.kernels.ragged_attention`, so rows that SD steps left
  hundreds of tokens apart do not all pay for the longest). On CUDA one fused SDPA over the KV heads
  (:func:`gqa_sdpa`).

Departures: none (kernel selection only; every path computes the same function).
"""
from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from ..errors import BadInput, Refused
from . import table as kernel_table
from .ragged_attention import kernel as ragged_kernel
from .ragged_attention import ragged_attention

CPU_BIAS_MAX_SCORES = 1 << 17
"""CPU ``matmul`` attention: a ragged mask up to this many scores per layer (rows x heads x queries x positions) is
added as a bias inside the first matmul; beyond, it is applied in place (see :func:`gqa_attention`)."""


_PACKED: ContextVar[dict | None] = ContextVar("tltlib_packed_weights", default=None)


MKL_PACK_ROWS = 64
"""The rows (``m``) MKL's copy of a weight is packed for. One copy serves every row count: PyTorch's ``_mkl_linear``
runs ``cblas_sgemm_compute`` on it with the call's own ``m``. MKL's documentation neither promises nor excludes that
a B matrix packed for one ``m`` serves another; measured with MKL as torch 2.13 ships it, the products equal those
of a copy packed for the call's own rows from 5 rows up, and equal ``F.linear``'s within float rounding below. The
first call of each shape and row count checks its product against ``F.linear`` (:func:`_mkl_packed`), so an MKL
that differs is caught, not trusted."""


def mkl_packing_available() -> bool:
    """Whether this torch has MKL's packed SGEMM (x86 builds; not ARM or macOS)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedWeight:
    """A weight's packed copies for the rollouts that use them, each made on its kernel's first call (only the
    layouts the kernel table picks cost memory: a copy is the size of the weight): :meth:`onednn` for ``packed``,
    :meth:`mkl` for ``mkl-packed``. ``version`` is the weight's autograd version when the entry was made: a weight
    updated in place since is refused by the kernels (its copies would be stale)."""

    __slots__ = ("weight", "version", "_onednn", "_mkl")

    def __init__(self, weight: torch.Tensor):
        self.weight, self.version = weight, weight._version
        self._onednn: torch.Tensor | None = None
        self._mkl: torch.Tensor | None = None

    def onednn(self) -> torch.Tensor:
        """The weight in oneDNN's layout for a linear of up to 64 rows (``torch.ops.mkldnn._reorder_linear_weight``)."""
        if self._onednn is None:
            with torch.no_grad():
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
        return self._onednn

    def mkl(self) -> torch.Tensor:
        """The weight in MKL's packed-SGEMM layout, packed for :data:`MKL_PACK_ROWS` rows."""
        if self._mkl is None:
            with torch.no_grad():
                self._mkl = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), MKL_PACK_ROWS)
        return self._mkl

    def stale(self) -> bool:
        return self.weight._version != self.version


def pack_weights(module: torch.nn.Module) -> dict[int, PackedWeight]:
    """Entries for packed copies of ``module``'s 2-D float32 CPU parameters (every projection and the LM head; an
    input embedding only when it is also the head), for :func:`packed_weights`: ``{id(weight): PackedWeight}``; empty
    when oneDNN is missing. A copy is made when a kernel first reads it (SmolLM2-135M: 0.2 s and 540 MB per layout
    used)."""
    if not torch.backends.mkldnn.is_available():
        return {}
    return {id(p): PackedWeight(p) for p in _packable(module)}


def _packable(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters :func:`pack_weights` packs: 2-D, float32, on a CPU, and not an untied input embedding (a
    module with ``embed`` and a separate ``lm_head``), which never goes through :func:`linear`."""
    untied = getattr(module, "embed", None) is not None and getattr(module, "lm_head", None) is not None
    skip = module.embed.weight if untied else None
    return [p for p in module.parameters() if p.dim() == 2 and p.dtype == torch.float32 and p.device.type == "cpu"
            and p is not skip]


class WeightPacks:
    """:func:`pack_weights` of one module, kept between rollouts and re-made when a weight changed.

    A weight counts as changed when it is another tensor, when autograd's version counter moved (optimizer steps,
    ``load_state_dict``, any in-place update of the parameter) or when its product with a fixed random vector
    changed (one pass over the weights, ~20 ms for SmolLM2: catches writes through ``.data`` or fused optimizers,
    which bypass the counter, wherever they land). Call :meth:`clear` to drop the copies. :meth:`of` gives every
    engine over one module the same packs (one copy of the weights, warm in the CPU's caches for all of them)."""

    _shared: "weakref.WeakKeyDictionary[torch.nn.Module, WeightPacks]" = weakref.WeakKeyDictionary()

    def __init__(self, module: torch.nn.Module):
        self._module = weakref.ref(module)          # not a strong reference: the shared registry must not keep it
        self.packs: dict = {}
        self._seen: tuple | None = None
        self._probe: dict[int, torch.Tensor] = {}

    @property
    def module(self) -> torch.nn.Module:
        return self._module()

    @classmethod
    def of(cls, module: torch.nn.Module) -> "WeightPacks":
        """The packs shared by every user of ``module`` (made on first use, dropped with the module)."""
        packs = cls._shared.get(module)
        if packs is None:
            packs = cls._shared[module] = cls(module)
        return packs

    def _fingerprint(self) -> tuple:
        params = _packable(self.module)
        with torch.no_grad():
            for p in params:
                if p.shape[1] not in self._probe:
                    g = torch.Generator().manual_seed(p.shape[1])
                    self._probe[p.shape[1]] = torch.rand(p.shape[1], generator=g) + 0.5
            # the stream kernel where built (SmolLM2's weights from memory in 22 ms against torch.mv's 47 on an AMD
            # EPYC, 2 threads), F.linear otherwise: within one process always the same way, so the same bits
            sums = [_stream(self._probe[p.shape[1]][None], p, None, None, 1)[0] for p in params]
        return tuple((id(p), p._version) for p in params), torch.cat(sums) if sums else torch.zeros(0)

    def current(self) -> dict:
        """The packs, re-made first if a weight changed since they were made."""
        seen = self._fingerprint()
        if self._seen is None or seen[0] != self._seen[0] or not torch.equal(seen[1], self._seen[1]):
            self.packs = {}                             # free the old copies before making new ones
            self.packs, self._seen = pack_weights(self.module), seen
        return self.packs

    def clear(self) -> None:
        self.packs, self._seen = {}, None


@contextmanager
def packed_weights(packs: dict | None):
    """Within this block, :func:`linear` without autograd uses the packed copies in ``packs`` (from
    :func:`pack_weights`; None or empty: no effect). The packs are valid only while their weights are unchanged: a
    weight updated in place through autograd's counter since packing stops :func:`linear` with an error instead of
    using stale values; writes that bypass the counter (``.data``, fused optimizers) are not seen within a block,
    only by :class:`WeightPacks` between rollouts."""
    token = _PACKED.set(packs or None)
    try:
        yield
    finally:
        _PACKED.reset(token)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     mask_from: int = 0, memo: dict | None = None, limits: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention of new queries over a KV cache, by the kernel the table chose for the shape.

    q ``[B, H, T, d]``; k, v ``[B, KVH, S, d]``; mask ``[B, 1, T, S]`` bool (True = may attend) or None;
    ``mask[..., :mask_from]`` known all True (:attr:`tltlib.kv.dense.CacheWrite.mask_from`); ``memo``: a dict shared
    by the layers of one forward (:attr:`tltlib.kv.dense.CacheWrite.memo`), where the kernel keeps the mask in its
    own layout after the first layer; ``limits``: for T = 1, ``[B]`` slots each row sees (the same as the mask's,
    :attr:`tltlib.kv.dense.CacheWrite.limits`), which lets the CPU ragged kernel skip each row's padding. Returns
    ``[B, H, T, d]``."""
    b, h, t, d = q.shape
    if q.is_cuda:
        return gqa_sdpa(q, k, v, mask)
    kind = None
    if q.dtype == torch.float32:
        built = t == 1 and limits is not None and ragged_kernel() is not None
        kind = kernel_table.current().attention_kernel(h, k.shape[1], d, t, b, mask is not None, built)
    return attention_with(kind or "sdpa", q, k, v, mask, mask_from, memo, limits)


def attention_with(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   mask_from: int = 0, memo: dict | None = None, limits: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`cached_attention` by the named candidate (``sdpa``, ``matmul``, ``ragged``; ``ragged`` needs one query
    per row, float32 and ``limits``, and the kernel built)."""
    if kind == "ragged":
        return ragged_attention(q, k, v, limits)
    if kind == "matmul":
        return gqa_attention(q, k, v, mask, mask_from, memo)
    if kind != "sdpa":
        raise BadInput(f"unknown attention kernel {kind!r}; choose one of {kernel_table.ATTENTION_KERNELS}")
    if mask is not None and memo is not None:      # SDPA turns a bool mask into a float one per call: once here
        key = ("sdpa", q.dtype)
        if key not in memo:
            memo[key] = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        mask = memo[key]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  mask_from: int = 0, memo: dict | None = None) -> torch.Tensor:
    """Attention of few queries over a cache with two matmuls (faster than PyTorch's CPU flash kernel for decode).

    q ``[B, H, T, d]``; k, v ``[B, KVH, S, d]`` (query head i reads kv head ``i // (H // KVH)``); mask
    ``[B, 1, T, S]`` bool or None, all True before column ``mask_from``; ``memo``: as :func:`cached_attention`.
    Returns ``[B, H, T, d]``. The scale goes on q (T x d values, not T x S scores). A ragged mask (rows of unequal
    lengths, e.g. after SD steps) costs a few small ops per layer, which for a small model is most of masking's
    cost: up to ``CPU_BIAS_MAX_SCORES`` scores the mask becomes an additive bias (0 / -inf) built once per forward
    and added inside the first matmul (``baddbmm``: as fast as no mask; 40 rows x 200 positions, 3 KV heads: 248
    us per layer against 293 us masking in place and 253 us unmasked); beyond, the mask is applied in place to the
    columns from ``mask_from`` on (over all S columns, at 128 rows x 600 cached positions, masking was ~15% of the
    attention's time). Per layer, 2 threads: 128 rows x 1 query x 600: 2.6 ms (SDPA 3.2); 128 x 17 x 600: 15.4 ms
    (SDPA 13.5)."""
    b, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    qs = (q * d ** -0.5).reshape(b * kvh, g * t, d)
    ks, vs = k.reshape(b * kvh, s, d), v.reshape(b * kvh, s, d)
    memo = {} if memo is None else memo
    if mask is None or mask_from >= s:
        scores = torch.bmm(qs, ks.transpose(1, 2))
    elif b * h * t * s <= CPU_BIAS_MAX_SCORES:
        key = ("bias", kvh, g, q.dtype)
        if key not in memo:                       # [B*KVH, G*T, S]: each KV head's G query heads x T queries
            bias = torch.zeros(b, 1, 1, t, s, dtype=q.dtype, device=q.device)
            bias.masked_fill_(~mask[:, :, None], float("-inf"))
            memo[key] = bias.expand(b, kvh, g, t, s).reshape(b * kvh, g * t, s)
        scores = torch.baddbmm(memo[key], qs, ks.transpose(1, 2))
    else:
        if "blocked" not in memo:                 # the columns no query of a row may see, from mask_from on
            memo["blocked"] = ~mask[:, :, None, :, mask_from:]
        scores = torch.bmm(qs, ks.transpose(1, 2))
        scores.view(b, kvh, g, t, s)[..., mask_from:].masked_fill_(memo["blocked"], float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), vs).view(b, h, t, d)


def gqa_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention as one ``scaled_dot_product_attention`` over the KV heads (the GPU path).

    Same contract as :func:`gqa_attention`: the query heads sharing a KV head become extra queries of it (``[B, KVH,
    G*T, d]``), so no K/V copy per query head is made and a masked call still runs a fused kernel (PyTorch's
    ``enable_gqa`` with a mask falls back to the unfused maths)."""
    b, h, t, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    if mask is not None and t > 1:
        mask = mask[:, :, None].expand(b, 1, g, t, mask.shape[-1]).reshape(b, 1, g * t, mask.shape[-1])
    out = F.scaled_dot_product_attention(q.reshape(b, kvh, g * t, d), k, v, attn_mask=mask)
    return out.reshape(b, h, t, d)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel the table chose for the weight's shape and the rows (CPU float32
    inference; ``F.linear`` elsewhere).

    x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` or None -> ``[..., N]``. Autograd (training) keeps ``F.linear``; so
    do CUDA and other dtypes. Results equal ``F.linear``'s up to float rounding (a different summation order)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or (
            torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not rows:
        return F.linear(x, weight, bias)
    packs = _PACKED.get()
    entry = packs.get(id(weight)) if packs is not None else None
    if entry is not None and entry.weight is not weight:
        entry = None
    kind = kernel_table.current().linear_kernel(weight.shape[0], weight.shape[1], rows, entry is not None)
    return _LINEAR[kind or "linear"](x, weight, bias, entry, rows)


def current_packs() -> dict | None:
    """The packs of the enclosing :func:`packed_weights` block (None outside one)."""
    return _PACKED.get()


def packed_entry(weight: torch.Tensor) -> PackedWeight | None:
    """``weight``'s entry in the packs of the enclosing :func:`packed_weights` block (None: none there), as
    :func:`linear` finds it."""
    packs = _PACKED.get()
    entry = packs.get(id(weight)) if packs is not None else None
    return entry if entry is not None and entry.weight is weight else None


def mkl_checked(n: int, k: int, rows: int) -> bool | None:
    """Whether MKL's packed product of an ``[n, k]`` weight at ``rows`` rows matched ``F.linear``'s on its first call
    in this process (:func:`_mkl_packed`); None: not called yet."""
    return _MKL_CHECKED.get((n, k, rows))


def refuse_stale(entry: PackedWeight, weight: torch.Tensor) -> None:
    """Raise :class:`tltlib.errors.Refused` when ``weight`` changed in place after ``entry`` was packed."""
    if entry.stale():
        raise Refused(f"a {tuple(weight.shape)} weight changed in place after it was packed for this rollout: "
                      "update weights between rollouts, not during one (its packed copy would be stale)")


def linear_with(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                packed: PackedWeight | None = None) -> torch.Tensor:
    """:func:`linear` by the named candidate (``linear``, ``mm``, ``mm-pad``, ``packed``, ``mkl-packed``, ``stream``;
    the packed ones need the weight's entry of :func:`pack_weights`)."""
    if kind not in _LINEAR:
        raise BadInput(f"unknown projection kernel {kind!r}; choose one of {kernel_table.LINEAR_KERNELS}")
    if kind in kernel_table.PACKED and (packed is None or packed.weight is not weight):
        raise BadInput(f"the {kind} kernel needs this weight's packed copy (pack_weights(module)[id(weight)])")
    if kind == "mkl-packed" and not mkl_packing_available():
        raise BadInput("the mkl-packed kernel needs a torch built with MKL (x86); choose packed, mm or linear")
    return _LINEAR[kind](x, weight, bias, packed, x.numel() // x.shape[-1])


def _f_linear(x, weight, bias, entry, rows):
    return F.linear(x, weight, bias)


def _mm(x, weight, bias, entry, rows):
    """``weight @ x.T`` (then the transposing copy back to ``[rows, N]``)."""
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _mm_pad(x, weight, bias, entry, rows):
    """One row run as two (``weight @ [x, x].T``); more rows as :func:`_mm`."""
    if rows != 1:
        return _mm(x, weight, bias, entry, rows)
    x2 = x.reshape(1, x.shape[-1])
    out = torch.mm(weight, torch.cat([x2, x2]).t())[:, :1].t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _packed(x, weight, bias, entry, rows):
    """oneDNN on the packed copy; refused when the weight changed in place after it was packed."""
    refuse_stale(entry, weight)
    return torch.ops.mkldnn._linear_pointwise(x, entry.onednn(), bias, "none", [], "")


_MKL_CHECKED: dict[tuple, bool] = {}
"""``(N, K, rows) -> whether MKL's packed product matched F.linear`` on the first such call of this process."""
MKL_CHECK_TOLERANCE = 1e-4
"""The first call per shape and row count: MKL's packed product must be within this share of the output's largest
magnitude of ``F.linear``'s (float rounding is ~1e-6 there; a copy MKL cannot use at these rows is off by ~1)."""


def _mkl_packed(x, weight, bias, entry, rows):
    """MKL's packed SGEMM on the copy packed for :data:`MKL_PACK_ROWS` rows, run at the call's own rows (``_mkl_linear``
    takes the packing's row count as an argument and falls back to a plain linear when it differs from the input's:
    the call's rows are passed, so the packed product runs). The first call per shape and row count is checked
    against ``F.linear``; where it differs (an MKL whose packing depends on the rows), that shape and row count run
    ``F.linear`` from then on, with one warning."""
    refuse_stale(entry, weight)
    key = (weight.shape[0], weight.shape[1], rows)
    ok = _MKL_CHECKED.get(key)
    if ok is False:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.ops.mkl._mkl_linear(flat, entry.mkl(), weight, bias, rows)
    if ok is None:
        want = F.linear(flat, weight, bias)
        ok = _MKL_CHECKED[key] = bool((out - want).abs().max() <= MKL_CHECK_TOLERANCE * want.abs().max())
        if not ok:
            warnings.warn(f"tltlib: MKL's packed product for a {tuple(weight.shape)} weight at {rows} rows differs "
                          "from F.linear's (this MKL's packing depends on the rows it was packed for): F.linear runs "
                          "there instead (the same function, without the packed copy's speed)", stacklevel=4)
            out = want
    return out.view(*x.shape[:-1], weight.shape[0])


def _stream(x, weight, bias, entry, rows):
    """The C++ ``stream`` kernel (:mod:`tltlib.kernels.stream_linear_cpp`); ``F.linear`` in a process where the CPU
    kernels are switched off or could not be built (the same function)."""
    module = ragged_kernel()
    if module is None or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    out = module.stream_linear(flat, weight, _NO_BIAS if bias is None else bias.contiguous())
    return out.view(*x.shape[:-1], weight.shape[0])


_NO_BIAS = torch.empty(0)
"""The C++ kernels' "no bias" (an empty tensor)."""

_LINEAR = {"linear": _f_linear, "mm": _mm, "mm-pad": _mm_pad, "packed": _packed, "mkl-packed": _mkl_packed,
           "stream": _stream}
