"""Fused decoder layers on a CPU: a model's whole stack of layers in a cached forward compiled by ``torch.compile``
(Inductor's C++/OpenMP CPU backend, as vLLM-cpu uses) into one graph, its small ops (RMSNorm, the rotary embedding,
residual adds, SiLU-and-multiply, the reshapes) fused into a few loops and the Python dispatch of some 15 ops per layer
gone, while the two things the machine's measurements choose stay opaque calls at run time:

* the **projections**: one custom op (``tltlib::linear``) that calls :func:`tltlib.kernels.dispatch.linear`, so the
  kernel table's choice per shape and band of rows, and the oneDNN-packed weights of a rollout, hold in the compiled
  graph as in the eager one; the weights stay inputs of the graph (never frozen into it as constants), so a GRPO step
  that updates them in place is seen by the next forward without a recompile;
* the **cached attention**: one custom op (``tltlib::attend``) that calls the cache's own ``attend`` (the paged C++
  kernels, the table's choice) for the forward being run (:data:`_ATTEND`), writing the new keys and values as the
  eager layer does.

Used within :func:`compiled_layers`; the model's cached forwards then run the compiled stack instead of the loop over
their layers (training forwards, drafters' layers and other devices never). One compiled function per model (its own
code object, so two models never share dynamo's recompile budget); the rows and new tokens are dynamic
(``dynamic=True``), so the rows of a rollout, which change every few steps, do not recompile (dynamo still
specialises a size of 1: one row, one new token, up to four graphs per model, about 30 s each for SmolLM2 on two
cores and a few seconds for the tiny reasoner).

Inductor keeps what it compiled in its cache folder: :func:`cache_folder` puts it under tltlib's own cache,
``~/.cache/tltlib/inductor/`` (or ``TORCHINDUCTOR_CACHE_DIR`` where the user set one), stamped with torch's version: a
later process of the same torch compiles from it in seconds; a folder another torch version made is cleared with
one line and rebuilt.

Where compilation is unavailable (no C++ compiler, an Inductor error on this machine, ``TLTLIB_COMPILE=0``), the
eager layers run and one warning says why (:func:`compiled_stack` returns None).

Departures: none (the same function; the fused small ops may round differently, as between any two kernels).
"""
from __future__ import annotations

import os
import shutil
import time
import warnings
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

from ..errors import TLTError
from ..fileio import atomic_write_text, cache_root
from ..kernels.dispatch import linear
from ..machine import env_switch
from .decoder import reset_stack, use_stack

ENV = "TLTLIB_COMPILE"
"""``0``/``off``/``false``/``no``: never compile (the eager layers); anything else: compile when asked."""

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Inductor's cache folder; tltlib sets it (to :func:`default_cache_folder`) only where the user has not."""

_USER_CACHE = os.environ.get(CACHE_ENV)
"""The user's ``TORCHINDUCTOR_CACHE_DIR`` as tltlib found it on import (Inductor sets one of its own when unset)."""

_STATE: dict = {}
"""This process's compile state: ``"unavailable"`` (why compilation is off), ``"seconds"`` (spent in compiling
calls), ``"compiled"`` (the shape families compiled, as ``(id(model), rows == 1, tokens == 1)``)."""

_OPS: dict = {}
"""The two custom ops, registered with torch's dispatcher on the first compile of the process (never at import)."""

_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()
"""Each model's compiled stack (made on first use, dropped with the model)."""

_ATTEND: ContextVar[tuple | None] = ContextVar("tltlib_fused_attend", default=None)
"""The forward being run by a compiled stack: ``(cache, write, calls)``, what ``tltlib::attend`` calls (``calls``:
the layers it attended so far, each of which wrote its keys and values into the cache)."""


def enabled() -> bool:
    """Whether ``TLTLIB_COMPILE`` allows compiling (unset: yes); a value it cannot read is one error."""
    return env_switch(ENV, "never compile decoder layers", "compile when asked")


# ------------------------------------------------------------------------------------------------ the cache folder
def default_cache_folder() -> Path:
    """``$TLTLIB_CACHE/inductor`` (default ``~/.cache/tltlib/inductor``)."""
    return cache_root() / "inductor"


def cache_folder(folder: Path | None = None, version: str | None = None, own: bool | None = None) -> Path:
    """Inductor's cache folder for this process, made ready for torch ``version`` (default: this torch's).

    ``folder`` (default ``TORCHINDUCTOR_CACHE_DIR`` where the user had set it when tltlib was imported, else
    :func:`default_cache_folder`, which is then set for Inductor). The folder carries a stamp, ``torch-version``. A
    folder stamped by another torch version (or holding files without a stamp) is answered with one warning: tltlib's
    own folder (``own``, default: when it is :func:`default_cache_folder`) is cleared; a folder of the user's is left as
    it is (Inductor's keys include torch's version, so it never loads another version's entries). Either way it is
    stamped anew and what this process compiles is built afresh."""
    version = version or torch.__version__
    if folder is None:
        folder = Path(_USER_CACHE) if _USER_CACHE else default_cache_folder()
        if not _USER_CACHE:
            os.environ[CACHE_ENV] = str(folder)
    folder = Path(folder)
    own = folder == default_cache_folder() if own is None else own
    stamp = folder / "torch-version"
    found = stamp.read_text().strip() if stamp.is_file() else None
    if found != version and folder.is_dir() and any(folder.iterdir()):
        what = "cleared" if own else "its entries are not used"
        warnings.warn(f"tltlib: the compile cache {folder} was made by torch {found or '(unknown)'}, this is torch "
                      f"{version}: {what}, compiling afresh", RuntimeWarning, stacklevel=2)
        if own:
            shutil.rmtree(folder)
    if found != version:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(stamp, version + "\n")
    return folder


# ------------------------------------------------------------------------------------------------ the opaque ops
def _ops() -> tuple:
    """``(linear, attend)``: the custom ops the compiled graph calls, registered once per process."""
    if not _OPS:
        @torch.library.custom_op("tltlib::linear", mutates_args=())
        def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return linear(x, weight, bias).contiguous()

        @linear_op.register_fake
        def _(x, weight, bias):
            return x.new_empty(*x.shape[:-1], weight.shape[0])

        @torch.library.custom_op("tltlib::attend", mutates_args=())
        def attend_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            cache, write, calls = _ATTEND.get()
            calls.append(layer)
            return cache.attend(layer, write, q, k, v).contiguous()

        @attend_op.register_fake
        def _(q, k, v, layer):
            return q.new_empty(q.shape)

        _OPS.update(linear=linear_op, attend=attend_op)
    return _OPS["linear"], _OPS["attend"]


def _stack_function(name: str, lin, attend):
    """A fresh function (its own code object, named ``name``) running a model's layers with the opaque ops."""
    def layers_fn(layers, x, cos, sin):
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, layer=i, attend=attend, lin=lin)
        return x

    layers_fn.__code__ = layers_fn.__code__.replace(co_name=name)
    return layers_fn


# ------------------------------------------------------------------------------------------------ the stack
def compiled_stack():
    """``stack(model, x, cos, sin, cache, write) -> x``: a cached forward's layers by the model's compiled stack;
    None where compilation is off or failed (the reason warned once per process). Compiles lazily: each model's first
    forward of a shape family compiles it."""
    if not enabled() or "unavailable" in _STATE:
        return None
    if "ops" not in _STATE:
        try:
            cache_folder()                      # before Inductor reads the variable
            import torch._inductor  # noqa: F401 - fails here on an install without Inductor
            _STATE["ops"] = _ops()
        except Exception as e:                  # pragma: no cover - every torch wheel we pin has it
            return _unavailable(f"torch.compile's Inductor is not usable here ({type(e).__name__}: {e})")
    return _run_stack


def _run_stack(model, x, cos, sin, cache, write):
    if "unavailable" in _STATE:                 # turned off earlier in this process: the eager loop
        return _eager(model, x, cos, sin, cache, write)
    fn = _COMPILED.get(model)
    if fn is None:
        fn = _COMPILED[model] = torch.compile(_stack_function(f"tltlib_layers_{id(model):x}", *_STATE["ops"]),
                                              dynamic=True)
    family = (id(model), x.shape[0] == 1, x.shape[1] == 1)
    first = family not in _STATE.get("compiled", set())
    calls: list[int] = []
    token = _ATTEND.set((cache, write, calls))
    t0 = time.perf_counter()
    try:
        out = fn(model.layers, x, cos, sin)
    except Exception as e:        # a C++ compiler missing or failing, an Inductor bug on this machine
        if calls or isinstance(e, TLTError):   # it failed while running, not compiling (the cache may hold some
            raise                               # of its keys), or a refusal of ours (a stale packed weight)
        _unavailable(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                     f"set {ENV}=0 to skip it")
        return _eager(model, x, cos, sin, cache, write)
    finally:
        _ATTEND.reset(token)
    if first:
        _STATE.setdefault("compiled", set()).add(family)
        _STATE["seconds"] = _STATE.get("seconds", 0.0) + time.perf_counter() - t0
    return out


def _eager(model, x, cos, sin, cache, write):
    for i, layer in enumerate(model.layers):
        x = layer(x, cos, sin, cache, i, write)
    return x


def _unavailable(why: str) -> None:
    _STATE["unavailable"] = why
    warnings.warn(f"tltlib: decoder layers run eagerly: {why}", RuntimeWarning, stacklevel=3)
    return None


def compile_seconds() -> float:
    """Seconds this process spent in compiling forwards (each model's first of each shape family) so far."""
    return _STATE.get("seconds", 0.0)


@contextmanager
def compiled_layers(on: bool = True):
    """Within this block the cached forwards of a target model (rollouts, SD verifies) run its compiled layer stack
    where compilation is available on this machine (else the eager layers). ``on=False``: no effect (what the block's
    caller already runs; a rollout without ``compile_layers`` pays nothing per iteration)."""
    if not on:
        yield
        return
    token = use_stack(compiled_stack())
    try:
        yield
    finally:
        reset_stack(token)
