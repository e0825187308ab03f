"""Which kernel computes a projection or a cached attention, chosen by device, dtype and shape, with the thresholds
measured on the 2-core development machine. The model (:mod:`tltlib.model`) calls :func:`linear` and
:func:`cached_attention` and never branches on the device itself.

Choices (all return what the plain PyTorch call returns, up to float rounding: a different summation order):

* **projections** (:func:`linear`): inside :func:`packed_weights` (a rollout on a CPU, float32, no autograd) a
  weight packed by :func:`pack_weights` runs through oneDNN with the weight pre-laid-out once per rollout (what
  vLLM's CPU backend does): SmolLM2-135M's 30 layers at 1 / 16 / 64 rows 21 / 30 / 79 ms against 31 / 45 / 117 ms
  for ``weight @ x.T``, its LM head 4.7 against 10 ms. Otherwise CPU float32 inference with
  ``CPU_MM_MIN_ROWS``-``CPU_MM_MAX_ROWS`` rows runs as ``weight @ x.T`` (PyTorch's CPU ``x @ weight.T`` re-lays out
  the weight for a few rows; ``weight @ x.T`` streams it once): 1.5-2.7x faster for 2-16 rows, ~1.2x for one.
  Autograd (training), CUDA and other dtypes use ``F.linear``.
* **cached attention** (:func:`cached_attention`): on CUDA one fused ``scaled_dot_product_attention`` over the KV
  heads (:func:`gqa_sdpa`); on a CPU two matmuls (:func:`gqa_attention`) from ``CPU_MATMUL_ATTENTION_MIN_ROWS`` rows
  up for at most ``CPU_MATMUL_ATTENTION_MAX_QUERIES`` queries per row (decode, chain drafting, short verifies:
  10-30% faster than PyTorch's CPU flash kernel), PyTorch's SDPA elsewhere (long verifies, prefill, small batches).
  One new token per row in float32 on a CPU (decode, chain drafting) goes to the ragged C++ kernel
  (:mod:`tltlib.ragged_attention`, built once per machine) when the rows differ in length, or are few: it reads
  each row's own cached length, so rows that SD steps left hundreds of tokens apart do not all pay for the longest.

The thresholds are module globals so that a benchmark (``bench/verify_cost.py``) can move them; the library never
changes them.

Departures: none (kernel selection only; every path computes the same function).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from .ragged_attention import kernel as ragged_kernel
from .ragged_attention import ragged_attention

CPU_MATMUL_ATTENTION_MIN_ROWS = 8
"""CPU cached attention: two matmuls from this many rows up (PyTorch's SDPA below)."""
CPU_MATMUL_ATTENTION_MAX_QUERIES = 8
"""CPU cached attention: two matmuls for at most this many new queries per row."""
CPU_BIAS_MAX_SCORES = 1 << 17
"""CPU cached attention: a ragged mask up to this many scores per layer (rows x heads x queries x positions) is added
as a bias inside the first matmul; beyond, it is applied in place (see :func:`gqa_attention`)."""
CPU_RAGGED_UNIFORM_MAX_ROWS = 32
"""CPU float32, one new token per row: the ragged C++ kernel (:mod:`tltlib.ragged_attention`, when built) reads each
row's own cached length whenever the rows differ in length, and when they are equally long (no mask) up to this
many rows. Decode forwards, kernel against matmuls
(2-core machine, medians of 25 interleaved): tiny reasoner (head dim 32) at 1 / 8 / 32 / 64 / 128 rows of 300
positions 1.03 / 1.04 / 0.99 / 0.95 / 0.92x equal, 1.05 / 1.17 / 1.13 / 1.12 / 1.12x spread over 150-450;
SmolLM2-135M (head dim 64) at 1 / 16 / 64 rows of 400 1.03 / 1.07 / 1.09x equal, 1.05 / 1.17 / 1.26x spread."""
CPU_PACKED_MIN_ROWS = 3
"""Projections of at least this many rows use the packed weights when a rollout has them (for 1-2 rows ``weight @
x.T`` is as fast: SmolLM2's 120 projections at 1 / 2 / 4 / 16 / 64 rows took 22 / 14 / 24 / 49 / 115 ms that way
and 25 / 21 / 16 / 25 / 78 ms packed)."""
CPU_MM_MIN_ROWS = 1
"""CPU float32 inference: projections of at least this many rows run as ``weight @ x.T`` (1 row is padded to 2)."""
CPU_MM_MAX_ROWS = 64
"""... and at most this many (beyond, the result's transposing copy costs more than it saves: prefill keeps
``F.linear``)."""


_PACKED: ContextVar[dict | None] = ContextVar("tltlib_packed_weights", default=None)


def pack_weights(module: torch.nn.Module) -> dict[int, tuple[torch.Tensor, int, torch.Tensor]]:
    """oneDNN-packed copies of ``module``'s 2-D float32 CPU parameters (every projection and the LM head; an input
    embedding only when it is also the head), for :func:`packed_weights`: ``{id(weight): (weight, weight._version,
    packed)}``; empty when oneDNN is missing or the weights live elsewhere. Costs a second copy of those weights
    (SmolLM2-135M: 0.2 s, 540 MB)."""
    if not torch.backends.mkldnn.is_available():
        return {}
    with torch.no_grad():
        return {id(p): (p, p._version, torch.ops.mkldnn._reorder_linear_weight(p.detach(), 64))
                for p in _packable(module)}


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
    changed (one pass over the weights, ~30 ms for SmolLM2: catches writes through ``.data`` or fused optimizers,
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
            sums = [torch.mv(p, self._probe[p.shape[1]]) for p in params]
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
    """Grouped-query attention of new queries over a KV cache, by the fastest kernel for the device and shape.

    q ``[B, H, T, d]``; k, v ``[B, KVH, S, d]``; mask ``[B, 1, T, S]`` bool (True = may attend) or None;
    ``mask[..., :mask_from]`` known all True (:attr:`tltlib.kvcache.CacheWrite.mask_from`); ``memo``: a dict shared
    by the layers of one forward (:attr:`tltlib.kvcache.CacheWrite.memo`), where the kernel keeps the mask in its
    own layout after the first layer; ``limits``: for T = 1, ``[B]`` slots each row sees (the same as the mask's,
    :attr:`tltlib.kvcache.CacheWrite.limits`), which lets the CPU ragged kernel skip each row's padding. Returns
    ``[B, H, T, d]``."""
    b, h, t, _ = q.shape
    if q.is_cuda:
        return gqa_sdpa(q, k, v, mask)
    if limits is not None and t == 1 and q.dtype == torch.float32 and \
            (mask is not None or b <= CPU_RAGGED_UNIFORM_MAX_ROWS) and ragged_kernel() is not None:
        return ragged_attention(q, k, v, limits)
    if b < CPU_MATMUL_ATTENTION_MIN_ROWS or t > CPU_MATMUL_ATTENTION_MAX_QUERIES:
        if mask is not None and memo is not None:  # SDPA turns a bool mask into a float one per call: once here
            key = ("sdpa", q.dtype)
            if key not in memo:
                memo[key] = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            mask = memo[key]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != h)
    return gqa_attention(q, k, v, mask, mask_from, memo)


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
    """``F.linear(x, weight, bias)``; in CPU float32 inference with 1-64 rows computed as ``weight @ x.T``.

    x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` or None -> ``[..., N]``. PyTorch's CPU ``x @ weight.T`` for a few
    rows is much slower than a matrix-vector product per row would suggest (it re-lays out the weight), while
    ``weight @ x.T`` streams the weight once. Measured on the 2-core dev machine, SmolLM2-135M's 30 layers with weights
    read from memory (not cache), ms: 2 rows 94 -> 37, 5 rows 105 -> 52, 16 rows 113 -> 80, 64 rows 146 -> 119,
    96 rows 176 -> 199 (the result's transposing copy now costs more than it saves: prefill keeps ``F.linear``);
    its LM head (49152 x 576): 2 rows 27 -> 9, 5 rows 35 -> 12, 25 rows 54 -> 35. Even one row is faster as a
    two-column product (the row twice) than as PyTorch's matrix-vector product: 30 layers 48-51 -> 39-45 ms, the head
    14-16 -> 10 ms. Autograd (training) keeps ``F.linear``; so do CUDA and other dtypes (not measured). Results
    equal ``F.linear``'s up to float rounding (a different summation order)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or (
            torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    packs = _PACKED.get()
    entry = packs.get(id(weight)) if packs is not None and m >= CPU_PACKED_MIN_ROWS else None
    if entry is not None and entry[0] is weight:
        if weight._version != entry[1]:
            raise RuntimeError(f"a {tuple(weight.shape)} weight changed in place after it was packed for this rollout: "
                               "update weights between rollouts, not during one (its packed copy would be stale)")
        return torch.ops.mkldnn._linear_pointwise(x, entry[2], bias, "none", [], "")
    if not CPU_MM_MIN_ROWS <= m <= CPU_MM_MAX_ROWS:
        return F.linear(x, weight, bias)
    x2 = x.reshape(m, x.shape[-1])
    if m == 1:                                # one row, padded to two: faster than the matrix-vector product
        out = torch.mm(weight, torch.cat([x2, x2]).t())[:, :1].t().contiguous()
    else:
        out = torch.mm(weight, x2.t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])
