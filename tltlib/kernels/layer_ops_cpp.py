"""The C++ source of a decoder layer's small ops (:mod:`tltlib.kernels.layer_ops` is their Python side): apart so
that :mod:`tltlib.kernels.ragged_attention`, which builds it into the CPU kernels' extension, need not import
:mod:`tltlib.kernels.layer_ops`, which imports it for the built module.

Departures: none (the same functions as PyTorch's ops, up to float rounding).
"""
from __future__ import annotations

SOURCE = r"""
// ---- a decoder layer's small ops (tltlib/kernels/layer_ops.py)
#include <atomic>
#include <cstring>
#include <initializer_list>
#include <math.h>
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

// Whether a float is neither infinite nor NaN, read from its bits (-ffast-math folds std::isfinite to true).
static inline bool finite_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return (u & 0x7f800000u) != 0x7f800000u;
}

// Greedy decoding's pick of logits x [rows, V]: per row the first index of the largest logit and its log-probability
// under softmax(x), -log(sum_j exp(x_j - max)) (log_softmax at the argmax: its x - max is exactly 0). Two passes over
// a row (the max, then the sum of exponentials, vectorised by the C library's vector expf), one thread per row. A
// row that holds a NaN or an infinity gives torch.argmax's and torch.log_softmax's answer for every row instead.
std::tuple<torch::Tensor, torch::Tensor> argmax_logprob(torch::Tensor x) {
  check_inputs({x});
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_logprob: logits [rows, V] with V > 0");
  const int64_t B = x.size(0), V = x.size(1);
  auto tok = torch::empty({B}, x.options().dtype(torch::kLong));
  auto lp = torch::empty({B}, x.options());
  const float* xp = x.data_ptr<float>();
  int64_t* tp = tok.data_ptr<int64_t>();
  float* lpp = lp.data_ptr<float>();
  std::atomic<bool> odd{false};
  at::parallel_for(0, B, grain_rows(V), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = xp + r * V;
      float m[16];
      for (int j = 0; j < 16; ++j) m[j] = row[0];
      int64_t i = 0;
      for (; i + 16 <= V; i += 16)
        for (int j = 0; j < 16; ++j) m[j] = row[i + j] > m[j] ? row[i + j] : m[j];
      float mx = m[0];
      for (int j = 1; j < 16; ++j) mx = m[j] > mx ? m[j] : mx;
      for (; i < V; ++i) mx = row[i] > mx ? row[i] : mx;
      int64_t arg = 0;
      while (arg + 1 < V && row[arg] != mx) ++arg;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t q = 0; q < V; ++q) s += expf(row[q] - mx);
      if (!finite_bits(mx) || !finite_bits(s)) odd = true;
      tp[r] = arg;
      lpp[r] = -logf(s);
    }
  });
  if (odd) {                                        // NaN or infinity: torch's own ops decide what it means
    auto t = at::argmax(x, -1);
    return std::make_tuple(t, at::log_softmax(x, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1));
  }
  return std::make_tuple(tok, lp);
}
"""

FUNCTIONS = ("rms_norm", "add_rms_norm", "silu_mul", "argmax_logprob")
"""The source's functions bound for Python."""
