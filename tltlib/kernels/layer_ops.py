"""A decoder layer's small ops in one pass each on a CPU: RMSNorm, the residual add fused with the RMSNorm after it,
SwiGLU's SiLU-and-multiply, and greedy decoding's argmax with its log-probability (C++ in
:mod:`tltlib.kernels.layer_ops_cpp`, built with the CPU kernels of :mod:`tltlib.kernels.ragged_attention`).

Why: at decode sizes each of these is a few thousand floats, and PyTorch runs them as several dispatched ops that
each wake torch's threads: ``F.rms_norm`` in float32 is five ops (pow, mean, add, rsqrt, mul) at ~100 us per call on
16 rows of SmolLM2 (Intel Xeon, 2 threads: 2 calls per layer, 6.5 ms of an 87 ms step), SiLU-and-multiply two more at
~95 us. Here each is one pass over its rows, on one thread below 64 Ki floats (the source's ``SERIAL_FLOATS``:
threads cost more than they save there) and over torch's threads above. The same functions as PyTorch's up to
float rounding (the sum of squares in another order); greedy rollouts give identical tokens (tested).

Used by :mod:`tltlib.model.decoder` wherever :func:`usable` says so: float32 CPU tensors, no autograd recording, not
inside ``torch.compile`` (Inductor fuses these ops itself there), and the CPU kernels built
(``TLTLIB_RAGGED_ATTENTION=0`` or no compiler: PyTorch's ops, same results up to float rounding).

Departures: none (the same functions as PyTorch's ops, up to float rounding).
"""
from __future__ import annotations

import torch

from .ragged_attention import kernel

_built: list = []                                   # the built module, once known (the hot path's lookup)


def _module():
    """The CPU kernels' module (None where they cannot be built); once built, read from ``_built``."""
    if _built:
        return _built[0]
    module = kernel()
    if module is not None:
        _built.append(module)
    return module


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the C++ ops may compute on ``tensors``: contiguous float32 on a CPU, autograd not recording through
    them, not being traced by ``torch.compile``, and the CPU kernels built."""
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return not torch.compiler.is_compiling() and _module() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (H,), weight, eps)`` in one pass: x ``[..., H]``, weight ``[H]`` -> ``[..., H]``. Call where
    :func:`usable` (x, weight)."""
    return _module().rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + delta), x + delta)`` in one pass: x, delta ``[..., H]`` (same shape), weight ``[H]``. Call where
    :func:`usable` (x, delta, weight)."""
    return _module().add_rms_norm(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of gate_up ``[..., 2M]`` (gate its first M, up its last M) -> ``[..., M]``. Call where
    :func:`usable` (gate_up)."""
    return _module().silu_mul(gate_up)


def argmax_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding's pick of ``logits [B, V]``: ``(logits.argmax(-1), log_softmax(logits)`` at it) ``[B]`` each,
    in two passes over each row instead of torch's two reductions (SmolLM2's 49,152 logits: ~40 us against ~110 us
    per row, AMD EPYC). Tokens equal torch's (the first largest); log-probabilities equal up to float rounding (the
    sum of exponentials in another order). A row holding a NaN or an infinity: torch's ops for the whole call. Call
    where :func:`usable` (logits)."""
    return _module().argmax_logprob(logits)
