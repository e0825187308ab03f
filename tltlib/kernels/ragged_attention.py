"""Decode attention over each row's own cached length, on a CPU: a small C++ kernel built once per machine.

A dense KV cache read as one ``rows x span`` block makes every row pay for the longest: after SD steps the rows of a
rollout differ by hundreds of tokens, and every later decode step attends (and masks) over the padded span. On the
2-core development machine a plain decode step of the tiny reasoner at 64 rows spread over 200-600 cached positions
took 18.2 ms against 11.9 ms with all at 400. vLLM's CPU backend reads each request's own length in one C++ op per
layer; so does :func:`ragged_attention`, written here (read, not copied): per (row, KV head), on as many threads as
torch uses, the scores of the query heads sharing that KV head over positions ``< limit[row]``, a softmax, and the
weighted sum of the values. No padded positions are read, no mask is built, one op replaces ~6 per layer.

It is used (by :func:`tltlib.kernels.dispatch.cached_attention`) for one new token per row (decode, chain drafting) in
float32 on a CPU where this machine's kernel table chose it by measurement (on the development VM it beat the two
matmuls: ``kernel_table.CPU_RAGGED_UNIFORM_MAX_ROWS``); longer verifies keep the matmuls (a matrix product of
several queries, which BLAS does better than this loop). Its paged twin, :func:`paged_attention` in the source,
reads the rows' positions through block tables and takes a mask for several new tokens per row
(:func:`paged_ragged_attention`, :func:`paged_masked_attention`): the paged cache uses it for decode and short
verifies, where any other kernel would first gather the pages (:mod:`tltlib.kv.paged`).

Building: :mod:`tltlib.kernels.build` compiles the source with the machine's C++ compiler (``-march=native``) on
first use, never at import (~20 s on 2 cores), into a folder of its own per source, flags, compiler, CPU, torch and
venv (``$TLTLIB_CACHE/extensions``), one builder at a time with a bounded wait. Without a compiler, or with
``TLTLIB_RAGGED_ATTENTION=0``, the matmul path runs instead (same results up to float rounding) and one warning says
why; past the wait bound, one line.

Departures: none (the same function as the masked matmul path, up to float rounding).
"""
from __future__ import annotations

import sys
import threading
import warnings

import torch

from ..errors import TimedOut, TLTError
from ..machine import env_switch
from . import build, decode_stack_cpp, layer_ops_cpp, stream_linear_cpp

ENV = "TLTLIB_RAGGED_ATTENTION"
"""Environment variable: ``0`` keeps the kernel off (the matmul path), anything else or unset: on where built."""

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

static const int64_t PARALLEL_WORK = 1 << 18;        // multiply-adds of one score pass below which one thread runs

// Ask for the next run's first rows while this one is computed: a paged row's runs lie anywhere in the pool, where
// the hardware prefetcher loses the stream at every jump (scattered pages ran ~2x slower than in order without it).
static inline void prefetch_rows(const float* p, int64_t rows, int64_t step) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = rows * step * static_cast<int64_t>(sizeof(float));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// Softmax of each of the Q rows of n scores in s, in place (over the row's own positions).
static void softmax_rows(float* s, int64_t Q, int64_t n) {
  for (int64_t g = 0; g < Q; ++g) {
    float* sg = s + g * n;
    float m = sg[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, sg[j]);
    float z = 0.f;
#pragma omp simd reduction(+ : z)
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = std::exp(sg[j] - m);
      z += sg[j];
    }
    const float inv = 1.f / z;
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
}

// One (row, KV head): the Q queries at qb (d apart: the G query heads of the KV head, each with its T new tokens)
// attend to positions 0 .. n - 1, stored in runs: key(j0), value(j0) point at the key and value rows of position j0
// (the start of a run), the next ones step apart, and run(j0, n) is the length of the run from j0, at least up to n
// (a dense row: one run of n). hide(s, n) hides the positions a query may not see (s: its Q x n scores; a no-op
// where every query sees all n). The result goes to ob (d apart). s: scratch of at least Q * n floats. pf:
// positions of the next run to prefetch.
template <class Key, class Value, class Run, class Hide>
static void attend_one(const float* qb, float* ob, int64_t Q, int64_t d, int64_t n, float sc, float* s, int64_t pf,
                       int64_t kstep, int64_t vstep, Key key, Value value, Run run, Hide hide) {
  for (int64_t j0 = 0, cnt; j0 < n; j0 += cnt) {     // scores: each key read once for the Q queries
    const float* kb = key(j0);
    cnt = std::min(run(j0, n), n - j0);
    if (j0 + cnt < n) prefetch_rows(key(j0 + cnt), std::min(pf, n - j0 - cnt), kstep);
    for (int64_t o = 0; o < cnt; ++o) {
      const float* kj = kb + o * kstep;
      for (int64_t g = 0; g < Q; ++g) {
        const float* qg = qb + g * d;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < d; ++i) acc += qg[i] * kj[i];
        s[g * n + j0 + o] = acc * sc;
      }
    }
  }
  hide(s, n);
  softmax_rows(s, Q, n);
  std::fill(ob, ob + Q * d, 0.f);
  for (int64_t j0 = 0, cnt; j0 < n; j0 += cnt) {     // weighted values: each value read once for the Q queries
    const float* vb = value(j0);
    cnt = std::min(run(j0, n), n - j0);
    if (j0 + cnt < n) prefetch_rows(value(j0 + cnt), std::min(pf, n - j0 - cnt), vstep);
    for (int64_t o = 0; o < cnt; ++o) {
      const float* vj = vb + o * vstep;
      for (int64_t g = 0; g < Q; ++g) {
        const float p = s[g * n + j0 + o];
        float* og = ob + g * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) og[i] += p * vj[i];
      }
    }
  }
}

// The same for d = W * C, W floats the machine's vector register holds (16 with AVX-512, else 8), written with GCC's
// vector extensions so that the output of a block of GB queries stays in registers (the scalar loop above keeps it
// in memory: a load and a store per multiply-add). The score pass also asks for the value rows of the positions it
// reads (the value pass then finds them in cache while the memory streams the keys). Intel Xeon (AVX-512), 2
// threads, SmolLM2 decode (bench decode_breakdown): attention 44.9 -> 31.1 ms per step at 64 rows, 13.7 -> 7.4 ms at
// 16; the same source built for AVX2 (-march=haswell) on that machine: 38 -> 30 ms over 30 layers' pages read from
// memory at 64 rows (the scalar loop's 1.9x slower with the outputs in registers at 16 floats, hence W).
#ifdef __AVX512F__
static const int W = 16;
#else
static const int W = 8;
#endif
typedef float vec_t __attribute__((vector_size(4 * W), aligned(4), may_alias));

static inline float hsum(vec_t a) {
  float r = 0.f;
  for (int i = 0; i < W; ++i) r += a[i];
  return r;
}

static inline vec_t load(const float* p) { return *reinterpret_cast<const vec_t*>(p); }

template <int C, int GB, class Key, class Value, class Run, class Hide>
static void attend_vec(const float* qb, float* ob, int64_t Q, int64_t n, float sc, float* s, int64_t pf,
                       int64_t kstep, int64_t vstep, Key key, Value value, Run run, Hide hide) {
  const int64_t d = W * C;
  for (int64_t g0 = 0; g0 < Q; g0 += GB) {          // scores, GB queries at a time
    const int64_t gn = std::min<int64_t>(GB, Q - g0);
    const float* qg = qb + g0 * d;
    for (int64_t j0 = 0, cnt; j0 < n; j0 += cnt) {
      const float* kb = key(j0);
      const float* vb = value(j0);
      cnt = std::min(run(j0, n), n - j0);
      if (j0 + cnt < n) prefetch_rows(key(j0 + cnt), std::min(pf, n - j0 - cnt), kstep);
      for (int64_t o = 0; o < cnt; ++o) {
        const float* kj = kb + o * kstep;
        if (g0 == 0)
          for (int c = 0; c < C; ++c) __builtin_prefetch(vb + o * vstep + W * c);
        vec_t acc[GB];
        for (int g = 0; g < GB; ++g) acc[g] = vec_t{};
        for (int c = 0; c < C; ++c) {
          const vec_t k = load(kj + W * c);
          for (int g = 0; g < GB; ++g)
            if (g < gn) acc[g] += load(qg + g * d + W * c) * k;
        }
        for (int g = 0; g < GB; ++g)
          if (g < gn) s[(g0 + g) * n + j0 + o] = hsum(acc[g]) * sc;
      }
    }
  }
  hide(s, n);
  softmax_rows(s, Q, n);
  for (int64_t g0 = 0; g0 < Q; g0 += GB) {          // weighted values, the block's GB x C outputs in registers
    const int64_t gn = std::min<int64_t>(GB, Q - g0);
    vec_t acc[GB][C];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = vec_t{};
    for (int64_t j0 = 0, cnt; j0 < n; j0 += cnt) {
      const float* vb = value(j0);
      cnt = std::min(run(j0, n), n - j0);
      for (int64_t o = 0; o < cnt; ++o) {
        const float* vj = vb + o * vstep;
        float p[GB];
        for (int g = 0; g < GB; ++g) p[g] = g < gn ? s[(g0 + g) * n + j0 + o] : 0.f;
        for (int c = 0; c < C; ++c) {
          const vec_t v = load(vj + W * c);
          for (int g = 0; g < GB; ++g) acc[g][c] += p[g] * v;
        }
      }
    }
    for (int64_t g = 0; g < gn; ++g)
      for (int c = 0; c < C; ++c) *reinterpret_cast<vec_t*>(ob + (g0 + g) * d + W * c) = acc[g][c];
  }
}

// One task by the vector kernel where the head width is 1, 2, 4 or 8 vector registers (GB x C accumulators at most
// 12 of the 16 or 32 registers: query blocks of three where the task's queries come in threes, as with 3 query heads
// per KV head, else two; one for 8 registers), by the scalar loop otherwise.
template <class F>
static void attend_task(const float* qb, float* ob, int64_t Q, int64_t d, int64_t n, float sc, float* s, int64_t pf,
                        int64_t kstep, int64_t vstep, const F& f) {
  const auto& [key, value, run, hide] = f;
  const bool three = Q % 3 == 0;
  if (d == W) return three ? attend_vec<1, 3>(qb, ob, Q, n, sc, s, pf, kstep, vstep, key, value, run, hide)
                           : attend_vec<1, 2>(qb, ob, Q, n, sc, s, pf, kstep, vstep, key, value, run, hide);
  if (d == 2 * W) return three ? attend_vec<2, 3>(qb, ob, Q, n, sc, s, pf, kstep, vstep, key, value, run, hide)
                               : attend_vec<2, 2>(qb, ob, Q, n, sc, s, pf, kstep, vstep, key, value, run, hide);
  if (d == 4 * W) return three ? attend_vec<4, 3>(qb, ob, Q, n, sc, s, pf, kstep, vstep, key, value, run, hide)
                               : attend_vec<4, 2>(qb, ob, Q, n, sc, s, pf, kstep, vstep, key, value, run, hide);
  if (d == 8 * W) return attend_vec<8, 1>(qb, ob, Q, n, sc, s, pf, kstep, vstep, key, value, run, hide);
  attend_one(qb, ob, Q, d, n, sc, s, pf, kstep, vstep, key, value, run, hide);
}

// The checks and the loop over (row, KV head) tasks all kernels share; at(b, kh) returns that task's key, value,
// run and hide functions (attend_one). q [B, H, T, d]: the G = H / KVH heads of a KV head and their T tokens are
// contiguous, one task's G * T queries. Rows differ in length: tasks are handed out one at a time (a static split
// gives one thread the long rows); small calls stay on one thread, as torch's own ops do below their grain size (a
// parallel region's barrier costs little alone but a scheduler quantum when another process's threads hold the
// cores).
template <class At>
static torch::Tensor over_rows(torch::Tensor q, int64_t KVH, const int64_t* lp, int64_t max_limit, double scale,
                               int64_t pf, int64_t kstep, int64_t vstep, At at) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4, "ragged attention: q [B, H, T, d] float32");
  q = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3), Q = H / KVH * T;
  TORCH_CHECK(H % KVH == 0, "ragged attention: H a multiple of KVH");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_limit, "ragged attention: each limit must be in 1 .. ", max_limit);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += lp[b];
  work *= H * T * d;
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads()) if (work >= PARALLEL_WORK)
  for (int64_t task = 0; task < B * KVH; ++task) {
    thread_local std::vector<float> s;
    const int64_t b = task / KVH, kh = task % KVH, n = lp[b];
    if (static_cast<int64_t>(s.size()) < Q * n) s.resize(Q * n);
    attend_task(qp + (b * KVH + kh) * Q * d, op + (b * KVH + kh) * Q * d, Q, d, n, sc, s.data(), pf, kstep, vstep,
                at(b, kh));
  }
  return out;
}

static const int64_t* limits_of(const torch::Tensor& limit, int64_t B, const char* name) {
  TORCH_CHECK(limit.scalar_type() == at::kLong && limit.dim() == 1 && limit.is_contiguous() && limit.numel() == B,
              name, ": limit [B] contiguous int64");
  return limit.data_ptr<int64_t>();
}

// q [B, H, 1, d] float32; k, v [B, KVH, S, d] (any strides, the last dimension contiguous); limit [B] int64: row b
// attends to cached positions 0 .. limit[b] - 1. Query head h reads KV head h / (H / KVH). Returns [B, H, 1, d].
torch::Tensor ragged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                                      double scale) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 4 && v.dim() == 4,
              "ragged_decode_attention: k, v [B, KVH, S, d] float32");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "ragged_decode_attention: k, v need a contiguous last dimension");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "ragged_decode_attention: q [B, H, 1, d]");
  auto lim = limit.to(at::kLong).contiguous();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ksb = k.stride(0), ksh = k.stride(1), kss = k.stride(2);
  const int64_t vsb = v.stride(0), vsh = v.stride(1), vss = v.stride(2);
  return over_rows(q, k.size(1), limits_of(lim, q.size(0), "ragged_decode_attention"), k.size(2), scale, 0, kss, vss,
                   [=](int64_t b, int64_t kh) {
    const float* kb = kp + b * ksb + kh * ksh;
    const float* vb = vp + b * vsb + kh * vsh;
    return std::make_tuple([=](int64_t j) { return kb + j * kss; }, [=](int64_t j) { return vb + j * vss; },
                           [=](int64_t, int64_t n) { return n; }, [](float*, int64_t) {});
  });
}

// The same over a paged cache: k, v [KVH, pages, page_size, d] contiguous (head-major: a (row, KV head) task reads
// page_size x d contiguous floats per page; with the heads inside a page, 3 KV heads ran 1.5-2x slower); table
// [B, W] int64 contiguous: row b's position j is token j % page_size of page table[b][j / page_size] (page_size a
// power of two). Pages that follow each other in the pool are read as one run (tltlib.kv.pages keeps a row's pages
// contiguous where it can): over scattered pages the kernel ran ~1.3x slower than over pages in order. mask: an
// empty tensor (every query sees its row's limit[b] positions) or [B, T, S] bool contiguous: query t of row b sees
// position j < limit[b] when j < mask_from or mask[b][t][j] (S >= every limit). q [B, H, T, d]; returns its shape.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor table,
                              torch::Tensor limit, torch::Tensor mask, int64_t mask_from, double scale) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 4 && v.dim() == 4 &&
              k.is_contiguous() && v.is_contiguous(), "paged_attention: k, v [KVH, pages, page_size, d] "
              "contiguous float32");
  TORCH_CHECK(q.dim() == 4 && table.scalar_type() == at::kLong && table.dim() == 2 && table.is_contiguous() &&
              table.size(0) == q.size(0), "paged_attention: q [B, H, T, d], table [B, W] contiguous int64");
  const int64_t B = q.size(0), T = q.size(2), G = q.size(1) / k.size(0);
  const int64_t ps = k.size(2), d = k.size(3), W = table.size(1), pages = k.size(1);
  TORCH_CHECK(ps > 0 && (ps & (ps - 1)) == 0, "paged_attention: page_size must be a power of two");
  int64_t shift = 0;
  while ((int64_t(1) << shift) < ps) ++shift;
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = limits_of(limit, B, "paged_attention");
  for (int64_t b = 0; b < B; ++b)                         // the pages each row reads (its limit is checked later)
    for (int64_t i = 0, e = std::min(W, ((std::max<int64_t>(lp[b], 1) - 1) >> shift) + 1); i < e; ++i)
      TORCH_CHECK(tp[b * W + i] >= 0 && tp[b * W + i] < pages,
                  "paged_attention: a block table entry is outside the pool");
  int64_t S = W * ps;
  const bool* mp = nullptr;
  if (mask.numel() > 0) {
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 3 && mask.is_contiguous() && mask.size(0) == B &&
                mask.size(1) == T, "paged_attention: mask [B, T, S] contiguous bool");
    S = std::min(S, mask.size(2));
    mp = mask.data_ptr<bool>();
  } else {
    TORCH_CHECK(T == 1, "paged_attention: several new tokens per row need a mask");
  }
  const int64_t MS = mask.numel() > 0 ? mask.size(2) : 0, from = std::max<int64_t>(mask_from, 0);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t sh = k.stride(0), sp = k.stride(1);
  return over_rows(q, k.size(0), lp, S, scale, ps, d, d, [=](int64_t b, int64_t kh) {
    const int64_t* tb = tp + b * W;
    const float* kb = kp + kh * sh;
    const float* vb = vp + kh * sh;
    return std::make_tuple([=](int64_t j0) { return kb + tb[j0 >> shift] * sp; },
                           [=](int64_t j0) { return vb + tb[j0 >> shift] * sp; },
                           [=](int64_t j0, int64_t n) {  // positions in the run of pages from page j0 / ps
                             const int64_t w = j0 >> shift, last = (n - 1) >> shift;
                             int64_t k = 1;
                             while (w + k <= last && tb[w + k] == tb[w] + k) ++k;
                             return k << shift;
                           },
                           [=](float* s, int64_t n) {    // query g * T + t reads mask row t
                             if (!mp) return;
                             for (int64_t g = 0; g < G * T; ++g) {
                               const bool* mr = mp + (b * T + g % T) * MS;
                               float* sg = s + g * n;
                               for (int64_t j = from; j < n; ++j)
                                 if (!mr[j]) sg[j] = -1e30f;   // -ffast-math: no infinities
                             }
                           });
  });
}

// A decoder layer's whole attention step over the paged cache, from the fused q/k/v projection's output: qkv
// [B, T, (H + 2 KVH) d] float32 contiguous; cos, sin [B, T, d] contiguous (sin sign-folded as in
// tltlib.model.decoder.rope_cos_sin): q and k rotated (x cos + (x[half:], x[:half]) sin), k and v written at index
// ([B, T, KVH] int64: each entry's slot in a layer's KVH x pages x page_size storage), then paged_attention.
// Returns [B, T, H d], the output projection's input: one call where the PyTorch path makes ~15 (the rotary's
// multiplies, slices and concatenation, the cache's two index copies, the transposes and the output's copy).
torch::Tensor paged_rope_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k,
                                   torch::Tensor v, torch::Tensor index, torch::Tensor table, torch::Tensor limit,
                                   torch::Tensor mask, int64_t mask_from, int64_t H, double scale) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && k.dim() == 4 && k.is_contiguous() && v.sizes() == k.sizes() &&
              v.scalar_type() == at::kFloat && v.is_contiguous(), "paged_rope_attention: k, v [KVH, pages, "
              "page_size, d] contiguous float32");
  const int64_t KVH = k.size(0), d = k.size(3), half = d / 2, N = (H + 2 * KVH) * d;
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 3 && qkv.is_contiguous() && qkv.size(2) == N &&
              d % 2 == 0 && H > 0 && H % KVH == 0, "paged_rope_attention: qkv [B, T, (H + 2 KVH) d] contiguous "
              "float32 with H a multiple of KVH and d even");
  const int64_t B = qkv.size(0), T = qkv.size(1), slots = KVH * k.size(1) * k.size(2);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == B * T * d && sin.numel() == B * T * d,
              "paged_rope_attention: cos, sin [B, T, d] contiguous float32");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.is_contiguous() && index.numel() == B * T * KVH,
              "paged_rope_attention: index [B, T, KVH] contiguous int64");
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T * KVH; ++i)          // every slot checked before anything is written
    TORCH_CHECK(ip[i] >= 0 && ip[i] < slots, "paged_rope_attention: a write slot is outside the pool");
  auto q = torch::empty({B, H, T, d}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  auto rotate = [=](const float* x, const float* c, const float* s, float* out) {
    for (int64_t i = 0; i < half; ++i) {
      out[i] = x[i] * c[i] + x[i + half] * s[i];
      out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
    }
  };
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t b = bt / T, t = bt % T;
    const float* x = xp + bt * N;
    const float* c = cp + bt * d;
    const float* s = sp + bt * d;
    for (int64_t h = 0; h < H; ++h) rotate(x + h * d, c, s, qp + ((b * H + h) * T + t) * d);
    for (int64_t kh = 0; kh < KVH; ++kh) {
      const int64_t slot = ip[bt * KVH + kh];
      rotate(x + (H + kh) * d, c, s, kp + slot * d);
      std::copy(x + (H + KVH + kh) * d, x + (H + KVH + kh + 1) * d, vp + slot * d);
    }
  }
  auto out = paged_attention(q, k, v, table, limit, mask, mask_from, scale);
  return T == 1 ? out.view({B, 1, H * d}) : out.transpose(1, 2).reshape({B, T, H * d});
}
"""

EXTENSION = build.Extension(
    "tltlib_ragged_attention", _SOURCE + layer_ops_cpp.SOURCE + stream_linear_cpp.SOURCE + decode_stack_cpp.SOURCE,
    ("ragged_decode_attention", "paged_attention", "paged_rope_attention", *layer_ops_cpp.FUNCTIONS,
     *stream_linear_cpp.FUNCTIONS, *decode_stack_cpp.FUNCTIONS),
    cflags=("-O3", "-march=native", "-fopenmp", "-ffast-math"), ldflags=("-fopenmp",),
    what="the CPU attention and layer kernels")
"""The CPU kernels' build (:mod:`tltlib.kernels.build`: one folder per source, flags, compiler, CPU, torch and venv):
the attention kernels here, a decoder layer's small ops (:mod:`tltlib.kernels.layer_ops_cpp`, whose source uses this
one's includes), the ``stream`` projection (:mod:`tltlib.kernels.stream_linear_cpp`, which uses its vector type) and
the stack of layers in one call (:mod:`tltlib.kernels.decode_stack_cpp`)."""

_lock = threading.Lock()
_state: dict = {}                                   # "module" (built) or "error" (why not), once per process

def kernel():
    """The built extension module, building it on the first call; None when switched off (``TLTLIB_RAGGED_ATTENTION=0``)
    or when it cannot be built here (one warning names the reason)."""
    if "module" in _state or "error" in _state:
        return _state.get("module")
    with _lock:
        if "module" in _state or "error" in _state:
            return _state.get("module")
        if not env_switch(ENV, "the matmul path", "the C++ kernels where they build"):
            _state["error"] = f"{ENV}=0"
            return None
        try:
            _state["module"] = build.load(EXTENSION)
        except TimedOut as e:                       # another process still building after the bound
            _state["error"] = str(e)
            print(f"tltlib: {e}; decode attention uses the matmul path in this process (same results)",
                  file=sys.stderr, flush=True)
        except TLTError:
            raise                                   # a bad setting (TLTLIB_BUILD_WAIT_S): its own clear error
        except Exception as e:                      # no compiler, no ninja, a read-only cache, ...
            _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            warnings.warn(f"tltlib: the CPU ragged-attention kernel could not be built ({_state['error']}); decode "
                          f"attention uses the matmul path (same results, slower over rows of unequal lengths). "
                          f"Install a C++ compiler and ninja, or set {ENV}=0 to silence this.", stacklevel=2)
        return _state.get("module")


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Attention of one new query per row over the row's own cached positions (the C++ kernel; call only where
    :func:`kernel` returned a module).

    q ``[B, H, 1, d]`` float32 on a CPU; k, v ``[B, KVH, S, d]`` (a cache view: any strides, last dim contiguous);
    limit ``[B]`` int64: row b attends to positions ``0 .. limit[b] - 1`` (``1 <= limit <= S``). Returns
    ``[B, H, 1, d]``, equal to softmax(q k^T / sqrt(d)) v over those positions up to float rounding."""
    return _state["module"].ragged_decode_attention(q, k, v, limit, q.shape[-1] ** -0.5)


def paged_ragged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                           limit: torch.Tensor) -> torch.Tensor:
    """:func:`ragged_attention` read through block tables (the C++ kernel; call only where :func:`kernel` returned a
    module).

    q ``[B, H, 1, d]`` float32 on a CPU; k_pages, v_pages ``[KVH, pages, page_size, d]`` contiguous (one layer of a
    paged cache, head-major; ``page_size`` a power of two); table ``[B, W]`` int64 contiguous: row b's position j lives
    at token
    ``j % page_size`` of page ``table[b, j // page_size]``; limit ``[B]`` int64 (``1 <= limit <= W * page_size``).
    Returns ``[B, H, 1, d]``, equal to :func:`ragged_attention` over each row's positions gathered into a dense
    cache, up to float rounding."""
    return _state["module"].paged_attention(q, k_pages, v_pages, table, limit, NO_MASK, 0, q.shape[-1] ** -0.5)


NO_MASK = torch.empty(0, dtype=torch.bool)
"""The C++ kernels' "no mask" (an empty bool tensor): one new token per row, each row read to its limit."""


def paged_masked_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                           limit: torch.Tensor, mask: torch.Tensor, mask_from: int = 0) -> torch.Tensor:
    """Several new tokens per row (a chain or tree verify, drafter levels) read through block tables, masked (the
    C++ kernel; call only where :func:`kernel` returned a module).

    q ``[B, H, T, d]`` float32 on a CPU; k_pages, v_pages, table as :func:`paged_ragged_attention`; limit ``[B]``
    int64: row b reads positions ``0 .. limit[b] - 1`` (its committed entries and every uncommitted one written so
    far); mask ``[B, T, S]`` bool contiguous (``S >= limit``): query t of row b sees position j when ``j <
    mask_from`` or ``mask[b, t, j]``. Returns ``[B, H, T, d]``, equal to the masked attention over each row's
    positions gathered into a dense cache, up to float rounding."""
    return _state["module"].paged_attention(q, k_pages, v_pages, table, limit, mask, mask_from, q.shape[-1] ** -0.5)


def paged_rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pages: torch.Tensor,
                         v_pages: torch.Tensor, index: torch.Tensor, table: torch.Tensor, limit: torch.Tensor,
                         heads: int, mask: torch.Tensor | None = None, mask_from: int = 0) -> torch.Tensor:
    """A decoder layer's attention step in one call (the C++ kernel; call only where :func:`kernel` returned a
    module): rotates the new q and k of ``qkv`` (``[B, T, (heads + 2 KVH) d]`` float32 contiguous, the fused
    projection's output) by ``cos``, ``sin`` (``[B, T, 1, d]``, :func:`tltlib.model.decoder.rope_cos_sin`), writes k
    and v into ``k_pages``, ``v_pages`` (``[KVH, pages, page_size, d]``) at ``index`` (``[B, T, KVH]`` int64 flat
    slots, :attr:`tltlib.kv.dense.CacheWrite.index`), then attends as :func:`paged_ragged_attention` (``mask`` None:
    one new token per row) or :func:`paged_masked_attention`. Returns ``[B, T, heads * d]`` (the output projection's
    input), equal to the PyTorch path's up to float rounding."""
    return _state["module"].paged_rope_attention(qkv, cos, sin, k_pages, v_pages, index, table, limit,
                                                 NO_MASK if mask is None else mask, mask_from, heads,
                                                 k_pages.shape[-1] ** -0.5)
