"""A decoder layer's small ops in one pass each on a CPU: RMSNorm, the residual add fused with the RMSNorm after it,
and SwiGLU's SiLU-and-multiply (C++, built with the CPU kernels of :mod:`tltlib.kernels.ragged_attention`).

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

SOURCE = r"""
// ---- a decoder layer's small ops (tltlib/kernels/layer_ops.py)
#include <initializer_list>
static const int64_t SERIAL_FLOATS = 1 << 16;       // below this many floats one thread runs the op

static inline int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, SERIAL_FLOATS / std::max<int64_t>(width, 1));
}

// x * rsqrt(mean(x^2) + eps) * w over one row of n floats (F.rms_norm's order of the two products).
static inline void rms_row(const float* x, const float* w, float eps, float* out, int64_t n) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * x[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += x[i] * x[i];
  const float r = 1.f / std::sqrt(s / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] * r * w[j];
}

// The checks every op makes of its inputs: contiguous float32 on the CPU.
static void check_inputs(std::initializer_list<torch::Tensor> ts) {
  for (const auto& t : ts)
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous(),
                "tltlib layer ops take contiguous float32 CPU tensors");
}

// RMSNorm of x [rows, n] (contiguous) by the gain w [n].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_inputs({x, w});
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(w.numel() == n, "rms_norm: the gain has ", w.numel(), " values for rows of ", n);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_row(xp + r * n, wp, static_cast<float>(eps), op + r * n, n);
  });
  return out;
}

// (RMSNorm(x + delta) by w, x + delta): the residual add and the norm after it in one pass.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w,
                                                      double eps) {
  check_inputs({x, delta, w});
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(delta.sizes() == x.sizes() && w.numel() == n, "add_rms_norm: x, delta and the gain do not match");
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>(); const float* dp = delta.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* s = sp + r * n;
      for (int64_t j = 0; j < n; ++j) s[j] = xp[r * n + j] + dp[r * n + j];
      rms_row(s, wp, static_cast<float>(eps), op + r * n, n);
    }
  });
  return std::make_tuple(out, sum);
}

// silu(gate) * up of gu [rows, 2m] (gate the first m of a row, up the last m) -> [rows, m].
torch::Tensor silu_mul(torch::Tensor gu) {
  check_inputs({gu});
  const int64_t two = gu.size(-1), m = two / 2, rows = gu.numel() / std::max<int64_t>(two, 1);
  TORCH_CHECK(two % 2 == 0, "silu_mul: the last dimension (", two, ") must hold gate and up, an even size");
  auto sizes = gu.sizes().vec();
  sizes.back() = m;
  auto out = torch::empty(sizes, gu.options());
  const float* gp = gu.data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(two), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = gp + r * two; const float* u = g + m; float* o = op + r * m;
      for (int64_t j = 0; j < m; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
  });
  return out;
}
"""

FUNCTIONS = ("rms_norm", "add_rms_norm", "silu_mul")
"""The source's functions bound for Python."""

_built: list = []                                   # the built module, once known (the hot path's lookup)


def _module():
    """The CPU kernels' module (None where they cannot be built); once built, read from ``_built``."""
    if _built:
        return _built[0]
    from .ragged_attention import kernel
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
