"""The C++ source of a cached forward's whole stack of decoder layers in one call (:mod:`tltlib.model.native` is its
Python side): built into the CPU kernels' extension by :mod:`tltlib.kernels.ragged_attention`, after the attention
kernels and the layer ops, whose functions it calls.

A **plan** (``stack_plan``) holds a model's layer weights, the packed copies the kernel table's choices read, and
the four projections' kernels (the table's names, :data:`KINDS` order) for one band of rows; ``decode_stack`` runs
every layer of one forward on it: per layer the input RMSNorm (fused with the previous layer's residual add), the
q/k/v projection, ``paged_rope_attention``, the output projection, the residual add with the post-attention RMSNorm,
the gate/up projection, SiLU-and-multiply and the down projection; after the last, the residual add with the final
RMSNorm. Each projection runs the same ATen call as :func:`tltlib.kernels.dispatch.linear_with`'s kernel of that
name (``F.linear``, ``weight @ x.T``, oneDNN's and MKL's packed products through PyTorch's dispatcher, the ``stream``
kernel of :mod:`tltlib.kernels.stream_linear_cpp`), each small op
the same function as the Python path's: the hidden states equal the Python layers' bit for bit.

Departures: none (the Python path's calls, made from C++).
"""
from __future__ import annotations

KINDS = ("linear", "mm", "mm-pad", "packed", "mkl-packed", "stream")
"""The projection kernels a plan runs, by their index in the source (the kernel table's names)."""

TENSORS_PER_LAYER = 14
"""A plan's tensors per layer, in this order: input norm, q/k/v (weight, bias, packed copy), output (weight, bias,
copy), post-attention norm, gate/up (weight, bias, copy), down (weight, bias, copy); an absent bias, copy or input
norm (EAGLE's drafter layer) is an empty tensor. The final norm's gain (empty: none) follows the last layer."""

SOURCE = r"""
// ---- a cached forward's stack of decoder layers in one call (tltlib/kernels/decode_stack_cpp.py)
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <map>
#include <memory>
#include <mutex>

enum ProjectionKind { K_LINEAR = 0, K_MM = 1, K_MM_PAD = 2, K_PACKED = 3, K_MKL = 4, K_STREAM = 5 };

struct Projection {
  torch::Tensor w, b, pack;                         // b, pack: empty when absent
  int64_t version = -1;                             // the weight's version when its copy was made (packed kinds)
};

struct StackLayer { torch::Tensor in_norm, post_norm; Projection qkv, o, gate_up, down; };

struct StackPlan {
  std::vector<StackLayer> layers;
  torch::Tensor final_norm;
  int64_t kinds[4];
  double eps, scale;
  int64_t heads;
};

static std::mutex plans_lock;
static std::map<int64_t, std::shared_ptr<StackPlan>> plans;
static int64_t next_plan = 1;

static const c10::OperatorHandle& onednn_linear() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

static const c10::OperatorHandle& mkl_linear() {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkl::_mkl_linear", "");
  return op;
}

static c10::IValue optional_tensor(const torch::Tensor& t) {
  return t.numel() ? c10::IValue(t) : c10::IValue();
}

// x [B, T, K] by the projection p (weight [N, K]) with the kernel `kind`, as dispatch.linear_with runs that kernel
// (the same ATen calls on the same shapes) -> [B, T, N].
static torch::Tensor project(const torch::Tensor& x, const Projection& p, int64_t kind) {
  const int64_t K = x.size(-1), rows = x.numel() / K, N = p.w.size(0);
  switch (kind) {
    case K_LINEAR:
      return at::linear(x, p.w, p.b.numel() ? c10::optional<torch::Tensor>(p.b) : c10::nullopt);
    case K_MM:
    case K_MM_PAD: {
      torch::Tensor out;
      if (kind == K_MM_PAD && rows == 1) {
        auto x2 = x.reshape({1, K});
        out = at::mm(p.w, at::cat({x2, x2}).t()).narrow(1, 0, 1).t().contiguous();
      } else {
        out = at::mm(p.w, x.reshape({rows, K}).t()).t().contiguous();
      }
      if (p.b.numel()) out.add_(p.b);
      return out.view({x.size(0), x.size(1), N});
    }
    case K_PACKED: {
      torch::jit::Stack s{x, p.pack, optional_tensor(p.b), std::string("none"),
                          c10::List<c10::optional<at::Scalar>>(), std::string("")};
      onednn_linear().callBoxed(&s);
      return s[0].toTensor();
    }
    case K_MKL: {
      torch::jit::Stack s{x.reshape({rows, K}), p.pack, p.w, optional_tensor(p.b), rows};
      mkl_linear().callBoxed(&s);
      return s[0].toTensor().view({x.size(0), x.size(1), N});
    }
    case K_STREAM:
      return stream_linear(x.reshape({rows, K}).contiguous(), p.w, p.b).view({x.size(0), x.size(1), N});
  }
  TORCH_CHECK(false, "decode_stack: unknown projection kind ", kind);
}

// A plan from `tensors` (TENSORS_PER_LAYER per layer, then the final norm's gain), the four projections' kinds
// (q/k/v, output, gate/up, down), the RMSNorms' eps, the attention's scale and query heads. Returns its handle.
int64_t stack_plan(std::vector<torch::Tensor> tensors, std::vector<int64_t> kinds, double eps, double scale,
                   int64_t heads) {
  const int64_t per = 14;                           // TENSORS_PER_LAYER
  TORCH_CHECK(tensors.size() % per == 1 && tensors.size() > 1 && kinds.size() == 4,
              "stack_plan: ", per, " tensors per layer and the final norm's gain, and 4 kinds");
  auto plan = std::make_shared<StackPlan>();
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(kinds[i] >= K_LINEAR && kinds[i] <= K_STREAM, "stack_plan: unknown projection kind ", kinds[i]);
    plan->kinds[i] = kinds[i];
  }
  auto proj = [&](size_t at, int64_t kind) {
    Projection p{tensors[at], tensors[at + 1], tensors[at + 2]};
    TORCH_CHECK(p.w.dim() == 2 && p.w.scalar_type() == at::kFloat && p.w.device().is_cpu(),
                "stack_plan: a projection's weight is not a 2-D float32 CPU tensor");
    if (kind == K_PACKED || kind == K_MKL) {
      TORCH_CHECK(p.pack.numel() > 0, "stack_plan: a packed kind without its packed copy");
      p.version = static_cast<int64_t>(p.w._version());
    }
    return p;
  };
  for (size_t at = 0; at + 1 < tensors.size(); at += per) {
    StackLayer l;
    l.in_norm = tensors[at];
    l.qkv = proj(at + 1, kinds[0]);
    l.o = proj(at + 4, kinds[1]);
    l.post_norm = tensors[at + 7];
    l.gate_up = proj(at + 8, kinds[2]);
    l.down = proj(at + 11, kinds[3]);
    plan->layers.push_back(std::move(l));
  }
  plan->final_norm = tensors.back();
  plan->eps = eps;
  plan->scale = scale;
  plan->heads = heads;
  std::lock_guard<std::mutex> g(plans_lock);
  plans[next_plan] = plan;
  return next_plan++;
}

// Forget a plan (its tensors are released); unknown handles are ignored.
void drop_plan(int64_t handle) {
  std::lock_guard<std::mutex> g(plans_lock);
  plans.erase(handle);
}

// Every layer of one cached forward on plan `handle`: x [B, T, hidden] (the embedded tokens), cos and sin, the
// paged cache's k and v storage ([layers, KVH, pages, page_size, d]), index, table, limit, mask and mask_from as
// paged_rope_attention takes them for every layer. Returns the final RMSNorm's output [B, T, hidden] (without a
// final norm: the last layer's output; a layer without an input norm reads its input as it is); an empty
// tensor, before anything is computed or written, when a packed projection's weight changed in place since its plan
// was made (its copy is stale: the caller refuses).
torch::Tensor decode_stack(int64_t handle, torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k,
                           torch::Tensor v, torch::Tensor index, torch::Tensor table, torch::Tensor limit,
                           torch::Tensor mask, int64_t mask_from) {
  std::shared_ptr<StackPlan> plan;
  {
    std::lock_guard<std::mutex> g(plans_lock);
    auto it = plans.find(handle);
    TORCH_CHECK(it != plans.end(), "decode_stack: no plan ", handle, " (dropped?)");
    plan = it->second;
  }
  const auto& layers = plan->layers;
  const int64_t L = static_cast<int64_t>(layers.size());
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "decode_stack: x [B, T, hidden] contiguous float32 on the CPU");
  TORCH_CHECK(k.dim() == 5 && k.size(0) == L && v.sizes() == k.sizes() && k.is_contiguous() && v.is_contiguous(),
              "decode_stack: k, v [", L, " layers, KVH, pages, page_size, d] contiguous");
  for (const auto& l : layers)
    for (const Projection* p : {&l.qkv, &l.o, &l.gate_up, &l.down})
      if (p->version >= 0 && static_cast<int64_t>(p->w._version()) != p->version) return torch::Tensor();
  const double eps = plan->eps;
  auto h = layers[0].in_norm.numel() ? rms_norm(x, layers[0].in_norm, eps) : x;
  for (int64_t i = 0; i < L; ++i) {
    const auto& l = layers[i];
    auto qkv = project(h, l.qkv, plan->kinds[0]);
    auto att = paged_rope_attention(qkv, cos, sin, k.select(0, i), v.select(0, i), index, table, limit, mask,
                                    mask_from, plan->heads, plan->scale);
    auto o = project(att, l.o, plan->kinds[1]);
    auto normed = add_rms_norm(x, o, l.post_norm, eps);
    auto act = silu_mul(project(std::get<0>(normed), l.gate_up, plan->kinds[2]));
    auto down = project(act, l.down, plan->kinds[3]);
    // the residual add fused with the next layer's input norm (after the last: the final norm); none: the sum
    const auto& norm = i + 1 < L ? layers[i + 1].in_norm : plan->final_norm;
    if (norm.numel()) {
      auto next = add_rms_norm(std::get<1>(normed), down, norm, eps);
      h = std::get<0>(next);
      x = std::get<1>(next);
    } else {
      x = std::get<1>(normed) + down;
      h = x;
    }
  }
  return h;
}
"""

FUNCTIONS = ("stack_plan", "drop_plan", "decode_stack")
"""The source's functions bound for Python."""
