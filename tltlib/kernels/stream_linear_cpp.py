"""The C++ source of the ``stream`` projection kernel (a few rows by a weight read once, from memory, at the speed
memory gives): built into the CPU kernels' extension by :mod:`tltlib.kernels.ragged_attention` after the attention
kernels, whose vector type it uses, and before :mod:`tltlib.kernels.decode_stack_cpp`, which calls it.

A decode step of one row (or a verify of one row's few drafts) multiplies every weight by a handful of rows: two
flops per weight read, so its time is the weights' bytes over the memory's bandwidth, if the kernel keeps the memory
busy. The BLAS kernels PyTorch reaches do not on every CPU: on an AMD EPYC (AVX2, 2 threads) SmolLM2's 30 layers'
projections at one row, weights read from memory, took 25.4 ms through oneDNN's packed GEMM (16.7 GB/s), 29.1 ms
through MKL's packed SGEMM, 34.1 ms through ``F.linear``, against a sum over a buffer of the same size at 31 GB/s;
this kernel's first form (8 adjacent rows side by side) 16.7 ms (25.5 GB/s), and the 49,152 x 576 LM head 3.4 ms
against ``F.linear``'s 8.0 ms; its present form reads faster than that sum (below). The kernel
table measures it beside the others for up to :data:`tltlib.kernels.table.STREAM_MAX_BAND`'s rows and picks it where
it wins.

How: the weight rows go to the threads in units of 8, evenly: a thread's share is one contiguous range within 8
rows of any other's (whole blocks of 64 rows split SmolLM2's 576-row projections 5:4 and its 960-row q/k/v 8:7, and
the thread with the shorter share waited for the other: ~1.4 ms per token of a ~23 ms one-row step on an AMD EPYC).
A thread reads its share as ``STREAM_STREAMS`` (4) streams through memory: the share cut into that many contiguous
parts, the next row of every part taken together (a group), each group's rows multiplied by up to 4 input rows at a
time, the R x M sums held in vector registers over K (each weight vector loaded once per 4 input rows, each input
vector once per R weight rows), then reduced; input rows beyond 4 run in further passes over the group's rows, still
in cache. Each output is one row's sum in one order, whichever thread or stream reads it: the shares start at
multiples of 8 rows, so the rows left over after the streams (taken one at a time, in another order under
``-ffast-math``) are the last N mod 4 in every split. Against the kernel before: the same bits on SmolLM2's five
shapes at 1-9 rows (checked), not on every shape (rows it took one at a time, this one in a group, or the reverse).

Why several long streams: a core keeps more reads in flight over several streams than over one, and each row a tile
reads must continue its own stream: the kernel before read 8 adjacent rows side by side, 8 streams of one row each
(2,304 bytes at SmolLM2's 576 columns), which the prefetcher barely picks up before they end. SmolLM2's 121 one-row
projections read from memory, interleaved over 31 rounds in one process (AMD EPYC, AVX2, 2 threads; a C++ probe
of the two loops): q/k/v, output, gate/up, down and the LM head at 29.9 / 29.1 / 30.9 / 39.8 / 31.1 GB/s that way
(the long rows of down fared best), at 42.2 / 39.9 / 43.1 / 43.5 / 45.4 GB/s as four streams (1.35x, paired median);
eight streams as four; two adjacent rows of each of four streams 1.17x. In a one-row SmolLM2 rollout, timed inside
the stack: the projections read at 30.7 -> 39.1 GB/s and the LM head at 32.0 -> 41.4, where a torch sum (one stream
per thread) read 38.5 and 37.6 GB/s in the same runs.

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
static const int64_t STREAM_STREAMS = 4;            // a thread reads its share as this many streams
static const int64_t STREAM_SERIAL = 1 << 15;       // below this many weights one thread runs the product

// out[m][n] = x[m] . w[n] for M input rows and the R weight rows rows[0 .. R - 1] (any rows; K floats each; a scalar
// tail when K is not a multiple of the vector width). x rows are K apart, out rows N apart.
template <int M, int R>
static inline void stream_tile(const float* x, const float* w, float* out, const int64_t* rows, int64_t K,
                               int64_t N) {
  const float* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + rows[r] * K;
  vec_t acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vec_t{};
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    vec_t xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const vec_t wv = load(wr[r] + k);
      for (int m = 0; m < M; ++m) acc[m][r] += wv * xv[m];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t kk = k; kk < K; ++kk) s += wr[r][kk] * x[m * K + kk];
      out[m * N + rows[r]] = s;
    }
}

// The cnt weight rows g[0 .. cnt - 1] (a group: one row of each stream) for M input rows: R at a time (R x M sums:
// 4 for one row, 8 for two, 6 for three, 8 for four, with the M input vectors and one weight vector: at most 13 of
// AVX2's 16 registers), the rest one at a time.
template <int M, int R>
static void stream_group(const float* x, const float* w, float* out, const int64_t* g, int64_t cnt, int64_t K,
                         int64_t N) {
  int64_t r = 0;
  for (; r + R <= cnt; r += R) stream_tile<M, R>(x, w, out, g + r, K, N);
  for (; r < cnt; ++r) stream_tile<M, 1>(x, w, out, g + r, K, N);
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
    // the share read as STREAM_STREAMS streams of S rows each: a group is the next row of every stream (its weights
    // stay in cache over the input rows); the rest of the share one row at a time
    const int64_t S = (n1 - n0) / STREAM_STREAMS;
    int64_t g[STREAM_STREAMS];
    auto run = [&](int64_t cnt) {
      for (int64_t m = 0; m < rows; m += 4) {
        const float* xm = xp + m * K;
        float* om = op + m * N;
        switch (std::min<int64_t>(4, rows - m)) {
          case 1: stream_group<1, 4>(xm, wp, om, g, cnt, K, N); break;
          case 2: stream_group<2, 4>(xm, wp, om, g, cnt, K, N); break;
          case 3: stream_group<3, 2>(xm, wp, om, g, cnt, K, N); break;
          default: stream_group<4, 2>(xm, wp, om, g, cnt, K, N); break;
        }
      }
    };
    for (int64_t i = 0; i < S; ++i) {
      for (int64_t j = 0; j < STREAM_STREAMS; ++j) g[j] = n0 + j * S + i;
      run(STREAM_STREAMS);
    }
    for (int64_t n = n0 + STREAM_STREAMS * S; n < n1; ++n) {
      g[0] = n;
      run(1);
    }
  });
  if (bias.numel()) out.add_(bias);
  return out;
}
"""
