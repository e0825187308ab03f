"""A cached forward's whole stack of decoder layers in one C++ call on a CPU (the source:
:mod:`tltlib.kernels.decode_stack_cpp`).

Why: a decode step of a small model is mostly waiting on Python. SmolLM2-135M's one-row step spent 7.9 ms of 43.5
(Intel Xeon, 2 threads, ``bench decode_breakdown``) between its projections and its attention, in the ~10 Python
calls per layer that dispatch a layer's ops (the kernel table's lookup per projection included), not in the ops,
which at one row take a few microseconds each. Here the loop over the layers runs in C++: per layer the same ATen
calls and the same C++ small ops as the Python path (:meth:`tltlib.model.decoder.DecoderLayer.forward`), with the
kernel table's projection kernels resolved once per row count, so the hidden states equal the Python path's bit for
bit (tested for every projection kernel) and the residual add at a layer's end runs with the next layer's input
RMSNorm in one pass. ``torch.compile`` of the same stack (:mod:`tltlib.model.fused`) keeps the Python's dispatch
of the opaque projections and attention and measured slower than the eager layers at one and 16 rows.

Where: the target's and the drafter's decode and verify forwards of a rollout
(:class:`tltlib.rollout.config.RolloutConfig`'s ``native_layers``, on by default), inside :func:`native_layers`,
when everything the C++ loop does is what the Python path would do: a CPU, float32, no autograd recording, not
compiling, the CPU kernels built, a paged cache whose forward runs the CPU's one-call attention
(:meth:`tltlib.kv.paged.PagedKVCache.rope_kernel_args`: one new token per row, or up to
:data:`tltlib.kv.paged_attention.MASKED_KERNEL_MAX_NEW` under a mask: verifies, short prefills) and every layer alike.
Elsewhere the Python layers run, as before. A plan holds the weights by reference: in-place updates (GRPO's optimizer
steps) are read by the next forward; a packed copy made stale by one is refused as
:func:`tltlib.kernels.dispatch.linear` refuses it; a parameter replaced by another tensor is noticed on the next
forward (the plan is re-made). ``TLTLIB_NATIVE_LAYERS=0`` keeps it off.

Departures: none (the Python path's calls, made from C++).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..errors import Refused
from ..kernels import dispatch, layer_ops
from ..kernels import table as kernel_table
from ..kernels.decode_stack_cpp import KINDS, TENSORS_PER_LAYER
from ..kernels.ragged_attention import NO_MASK
from ..machine import env_switch

ENV = "TLTLIB_NATIVE_LAYERS"
"""``0``/``off``/``false``/``no``: the Python layers always; ``1``/``on``/``true``/``yes`` or unset: the C++ stack where
it is asked for and applies; another value: one error (:func:`tltlib.machine.env_switch`)."""

_EMPTY = torch.empty(0)
_ACTIVE: ContextVar["NativePlans | None"] = ContextVar("tltlib_native_plans", default=None)


def enabled() -> bool:
    """Whether :data:`ENV` allows the C++ stack."""
    return env_switch(ENV, "the Python layers always", "the layers in one C++ call where asked for")


class _Plan:
    """One C++ plan: its handle and the parameters it holds, as ``(owner's parameter dict, name, tensor)`` (checked
    by identity on every forward: a parameter replaced since makes the plan stale)."""

    __slots__ = ("handle", "model", "refs", "packed")

    def __init__(self, handle: int, model, refs: list, packed: list):
        self.handle, self.model, self.refs = handle, weakref.ref(model), refs
        self.packed = packed                           # (entry, weight) of the packed projections: the stale check

    def current(self, model) -> bool:
        return self.model() is model and all(params.get(name) is t for params, name, t in self.refs)


def _drop(module, handles: list[int]) -> None:
    for h in handles:
        module.drop_plan(h)
    handles.clear()


class NativePlans:
    """The C++ plans of one rollout (or any run of cached forwards): made on a forward's first use per model and row
    count, dropped with this object (or by :meth:`close`), so a plan never outlives what it was made for."""

    def __init__(self):
        self._plans: dict[tuple, _Plan | None] = {}
        self._handles: list[int] = []
        self._module = layer_ops._module()
        self._finalizer = (weakref.finalize(self, _drop, self._module, self._handles)
                           if self._module is not None else None)

    @property
    def module(self):
        """The CPU kernels' module (None where they cannot be built: then nothing runs here)."""
        return self._module

    def plan(self, model, stack: tuple, rows: int) -> _Plan | None:
        """The plan for ``model``'s forwards of ``rows`` rows x tokens over ``stack`` (:func:`run_layers`' layers,
        final norm and config; made on first use), or None where the C++ stack does not apply (layers unlike each
        other, a MKL product not yet checked at these rows)."""
        table = kernel_table.current()
        key = (id(model), id(table), id(dispatch.current_packs()), rows)
        plan = self._plans.get(key, False)
        if plan is False or (plan is not None and not plan.current(model)):
            if plan:                                   # a parameter was replaced: this plan's tensors are old
                self._module.drop_plan(plan.handle)
                self._handles.remove(plan.handle)
            made = _make_plan(self._module, model, *stack, table, rows)
            if made is None or isinstance(made, _Plan):
                self._plans[key] = made
                if made is not None:
                    self._handles.append(made.handle)
            plan = made if isinstance(made, _Plan) else None
        return plan

    def close(self) -> None:
        """Drop every plan now (the object stays usable: a later forward makes its plans again)."""
        self._plans.clear()
        if self._module is not None:
            _drop(self._module, self._handles)


@contextmanager
def native_layers(plans: NativePlans | None):
    """Within this block, a model's cached forwards on a CPU run their layers in one C++ call where it applies
    (:func:`run_layers`), with the plans of ``plans``; None (or ``TLTLIB_NATIVE_LAYERS=0``): the Python layers."""
    token = _ACTIVE.set(plans if plans is not None and plans.module is not None and enabled() else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _projections(layer) -> tuple:
    a, m = layer.attn, layer.mlp
    return a.qkv, a.o, m.gate_up, m.down


def _make_plan(module, model, layers, final_norm, cfg, table, rows: int):
    """A plan for ``rows`` rows (a :class:`_Plan`) over ``model``'s ``layers`` and ``final_norm`` (a module or None);
    None where the stack does not apply to them; ``"later"`` where it may on a later forward (an MKL product at these
    rows not yet checked against ``F.linear``: the Python path checks it first)."""
    first = _projections(layers[0])
    kinds = []
    for lin in first:
        n, k = lin.weight.shape
        entry = dispatch.packed_entry(lin.weight)
        kind = table.linear_kernel(n, k, rows, entry is not None) or "linear"
        if kind == "mkl-packed":
            ok = dispatch.mkl_checked(n, k, rows)
            if ok is None:
                return "later"
            kind = kind if ok else "linear"
        kinds.append(kind)
    tensors, refs, packed = [], [], []

    def hold(owner, name):
        t = owner._parameters[name]
        refs.append((owner._parameters, name, t))
        return _EMPTY if t is None else t

    for layer in layers:
        tensors.append(_EMPTY if layer.input_norm is None else hold(layer.input_norm, "weight"))
        for i, (lin, ref, kind) in enumerate(zip(_projections(layer), first, kinds)):
            w = lin.weight
            if w.shape != ref.weight.shape or (lin.bias is None) != (ref.bias is None):
                return None
            entry = dispatch.packed_entry(w)
            if kind in kernel_table.PACKED:
                if entry is None:
                    return None
                dispatch.refuse_stale(entry, w)
                pack = entry.onednn() if kind == "packed" else entry.mkl()
                packed.append((entry, w))
            else:
                pack = _EMPTY
            tensors += [hold(lin, "weight"), hold(lin, "bias"), pack]
            if i == 1:
                tensors.append(hold(layer.post_norm, "weight"))
    tensors.append(_EMPTY if final_norm is None else hold(final_norm, "weight"))
    assert len(tensors) == TENSORS_PER_LAYER * len(layers) + 1
    handle = module.stack_plan(tensors, [KINDS.index(k) for k in kinds], cfg.rms_norm_eps, cfg.dim_head ** -0.5,
                               cfg.num_heads)
    return _Plan(handle, model, refs, packed)


def run_layers(model, layers, final_norm, cfg, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
               write) -> torch.Tensor | None:
    """``layers`` (decoder layers of ``model``, whose config is ``cfg``) and ``final_norm`` (an RMSNorm module or
    None) of a cached forward in one C++ call, where it applies (see the module's text): x ``[B, T, H]`` the first
    layer's input, cos and sin the forward's rotary tables, ``cache`` and ``write`` its cache and
    :class:`tltlib.kv.dense.CacheWrite`. Returns the final hidden states ``[B, T, H]`` (after the final norm; without
    one, the last layer's output), or None: the caller runs the Python layers. The target's forward passes its
    layers and final norm; EAGLE's drafter its one layer (no input norm) and None."""
    plans = _ACTIVE.get()
    if plans is None or x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or layers[0].attn.qkv.weight.requires_grad):
        return None
    if torch.compiler.is_compiling() or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    args = cache.rope_kernel_args(write, x.unsqueeze(1))
    if args is None:
        return None
    plan = plans.plan(model, (layers, final_norm, cfg), x.shape[0] * x.shape[1])
    if plan is None:
        return None
    limit, mask, mask_from = args
    out = plans.module.decode_stack(plan.handle, x, cos, sin, cache.k, cache.v, write.index, write.table, limit,
                                    NO_MASK if mask is None else mask, mask_from)
    if out is None:                                  # a packed copy went stale: nothing was computed; say which
        for entry, weight in plan.packed:
            dispatch.refuse_stale(entry, weight)
        raise Refused("a packed weight changed in place during this rollout (its copy would be stale)")
    return out
