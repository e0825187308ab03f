"""The C++ source of the ``stream`` projection kernel (a few rows by a weight read once, from memory, at the speed
memory gives): built into the CPU kernels' extension by :mod:`tltlib.kernels.ragged_attention` after the attention
kernels, whose vector type it uses, and before :mod:`tltlib.kernels.decode_stack_cpp`, which calls it.

A decode step of one row (or a verify of one row's few drafts) multiplies every weight by a handful of rows: two
flops per weight read, so its time is the weights' bytes over the memory's bandwidth, if the kernel keeps the memory
busy. The BLAS kernels PyTorch reaches do not on every CPU: on an AMD EPYC (AVX2, 2 threads) SmolLM2's 30 layers'
projections at one row, weights read from memory, took 25.4 ms through oneDNN's packed GEMM (16.7 GB/s), 29.1 ms
through MKL's packed SGEMM, 34.1 ms through ``F.linear``, against a sum over a buffer of the same size at 31 GB/s;
this kernel took 16.7 ms (25.5 GB/s), and the 49,152 x 576 LM head 3.4 ms against ``F.linear``'s 8.0 ms. The kernel
table measures it beside the others for up to :data:`tltlib.kernels.table.STREAM_MAX_BAND`'s rows and picks it where
it wins.

How: the weight rows go to the threads in units of 8 (the one-row tile's height), evenly: a thread's share is
one contiguous range (one stream through memory per thread) within 8 rows of any other's. Whole blocks of 64 rows
split SmolLM2's 576-row projections 5:4 and its 960-row q/k/v 8:7, and the thread with the shorter share waited
for the other (a trace of a one-row rollout on an AMD EPYC, 2 threads: ~1.4 ms per token in all, of a ~23 ms
step). Within its range a thread goes 64 rows at a time; within those, R weight rows at a time are multiplied by up
to 4 input rows at a time, the R x M sums held in vector registers over K (each weight vector loaded once per 4
input rows, each input vector once per R weight rows), then reduced. Rows beyond 4 run in further passes over the
64 rows, still in cache.

Departures: none (``F.linear``'s function, up to float rounding: another summation order).
"""
from __future__ import annotations

FUNCTIONS = ("stream_linear", "stream_shares")
"""The source's functions bound for Python."""

SOURCE = r"""
// ---- the stream projection kernel (tltlib/kernels/stream_linear_cpp.py)
#include <algorithm>
#include <mutex>
static const int64_t STREAM_UNIT = 8;               // the threads' shares are whole units of this many weight rows
static const int64_t STREAM_BLOCK = 64;             // weight rows a thread multiplies at a time, within its share
static const int64_t STREAM_SERIAL = 1 << 15;       // below this many weights one thread runs the product

// out[m][n] = x[m] . w[n] for M input rows and R weight rows n0 .. n0 + R - 1 (K floats each; a scalar tail when K is
// not a multiple of the vector width). x rows are K apart, out rows N apart.
template <int M, int R>
static inline void stream_tile(const float* x, const float* w, float* out, int64_t n0, int64_t K, int64_t N) {
  vec_t acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vec_t{};
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    vec_t xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const vec_t wv = load(w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] += wv * xv[m];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t kk = k; kk < K; ++kk) s += w[(n0 + r) * K + kk] * x[m * K + kk];
      out[m * N + n0 + r] = s;
    }
}

// Weight rows n0 .. n1 - 1 for M input rows: R at a time (R x M sums: 8 for one row, 8 for two, 9 for three, 8 for
// four, with the M input vectors and one weight vector: at most 14 of AVX2's 16 registers), the rest one at a time.
template <int M, int R>
static void stream_rows(const float* x, const float* w, float* out, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) stream_tile<M, R>(x, w, out, n, K, N);
  for (; n < n1; ++n) stream_tile<M, 1>(x, w, out, n, K, N);
}

// Weight rows [0, N) of K columns handed to the threads: body(n0, n1) once per thread, on one contiguous range of
// whole units (at::parallel_for splits its range evenly), on one thread below STREAM_SERIAL weights.
template <typename F>
static void stream_split(int64_t N, int64_t K, const F& body) {
  const int64_t units = (N + STREAM_UNIT - 1) / STREAM_UNIT;
  const int64_t grain = std::max<int64_t>(1, STREAM_SERIAL / std::max<int64_t>(STREAM_UNIT * K, 1));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    body(u0 * STREAM_UNIT, std::min(N, u1 * STREAM_UNIT));
  });
}

// The weight rows each thread takes for an [N, K] weight, [threads, 2] (first, end), in range order: the split the
// kernel runs, for tests.
torch::Tensor stream_shares(int64_t N, int64_t K) {
  TORCH_CHECK(N >= 0 && K >= 0, "stream_shares: N and K at least 0");
  std::vector<std::pair<int64_t, int64_t>> shares;
  std::mutex lock;
  stream_split(N, K, [&](int64_t n0, int64_t n1) {
    std::lock_guard<std::mutex> hold(lock);
    shares.emplace_back(n0, n1);
  });
  std::sort(shares.begin(), shares.end());
  auto out = torch::empty({(int64_t)shares.size(), 2}, torch::kLong);
  for (size_t i = 0; i < shares.size(); ++i) {
    out[i][0] = shares[i].first;
    out[i][1] = shares[i].second;
  }
  return out;
}

// x [rows, K], w [N, K], bias [N] or empty: contiguous float32 CPU tensors. Returns x w^T + bias, [rows, N].
torch::Tensor stream_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "stream_linear: x [rows, K], w [N, K]");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && x.scalar_type() == torch::kFloat &&
              w.scalar_type() == torch::kFloat && x.is_contiguous() && w.is_contiguous(),
              "stream_linear: contiguous float32 CPU tensors");
  const int64_t rows = x.size(0), K = w.size(1), N = w.size(0);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == torch::kFloat),
              "stream_linear: bias [N] contiguous float32 or empty");
  auto out = torch::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  stream_split(N, K, [&](int64_t n0, int64_t n1) {
    for (int64_t s = n0; s < n1; s += STREAM_BLOCK) {    // a block at a time: its weights stay in cache over the rows
      const int64_t e = std::min(n1, s + STREAM_BLOCK);
      for (int64_t m = 0; m < rows; m += 4) {
        const float* xm = xp + m * K;
        float* om = op + m * N;
        switch (std::min<int64_t>(4, rows - m)) {
          case 1: stream_rows<1, 8>(xm, wp, om, s, e, K, N); break;
          case 2: stream_rows<2, 4>(xm, wp, om, s, e, K, N); break;
          case 3: stream_rows<3, 3>(xm, wp, om, s, e, K, N); break;
          default: stream_rows<4, 2>(xm, wp, om, s, e, K, N); break;
        }
      }
    }
  });
  if (bias.numel()) out.add_(bias);
  return out;
}
"""
