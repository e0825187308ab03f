"""A compact Llama/Qwen2-family decoder that loads a transformers model folder (config.json + safetensors).

The architecture (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, optional q/k/v bias, tied or untied
LM head) covers the models of the TLT paper (Qwen2.5-7B/32B, DeepSeek-R1-Distill-Qwen-7B, Llama-3.3-70B) and the tiny
reasoner shipped in ``data/``. Two forwards:

* :meth:`Transformer.forward` — training forward (autograd, no cache, causal), returns logits and optionally the
  final hidden states (the post-norm ``hidden_states[-1]`` of transformers, which the EAGLE drafter reads);
* :meth:`Transformer.forward_cached` — inference forward over a :class:`tltlib.kv.dense.KVCache` with per-row
  positions and an optional tree attention mask among the new tokens.

Departures from transformers' implementation:
1. q/k/v and gate/up projections are fused into one matrix each (fewer kernel launches per decode step, which is what
   bounds small-batch decoding on a CPU); :func:`load_model` / :func:`save_model` convert to and from the HF names.
   Projections and cached attention go through :mod:`tltlib.kernels.dispatch`, which picks the fastest kernel for the
   device and shape (same results up to float rounding).
2. Only the rotary variants the paper's models use are implemented: default, ``linear`` and ``llama3``; other
   ``rope_type`` values (YaRN, dynamic NTK, ...) raise an error instead of silently producing wrong logits.
3. Qwen2's sliding-window attention (``use_sliding_window: true``) is not implemented; such a config is refused.
"""
from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BadInput
from ..kernels import layer_ops
from ..kernels.dispatch import linear
from ..kv.dense import KVCache
from ..kv.paged import KVConfig, make_cache
from . import native

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_HF_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings")
_HF_FLOATS = ("rope_theta", "rms_norm_eps")
_HF_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
_KIND_NAME = {int: "an integer", float: "a number", bool: "true or false"}
_SUPPORTED_MSG = "tltlib supports Llama-family (LlamaForCausalLM) and Qwen2-family (Qwen2ForCausalLM) models"


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama/Qwen2-family decoder (mirrors the fields of a transformers config.json)."""

    vocab_size: int
    """Number of token ids (rows of the embedding)."""
    hidden_size: int
    """Residual stream width H."""
    intermediate_size: int
    """SwiGLU inner width."""
    num_layers: int
    """Number of decoder layers (``num_hidden_layers``)."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when smaller than ``num_heads``)."""
    architecture: str = "llama"
    """``"llama"`` or ``"qwen2"`` (Qwen2 always has q/k/v bias and never an output bias)."""
    head_dim: int = 0
    """Per-head width; 0 means ``hidden_size // num_heads``."""
    rope_theta: float = 10000.0
    """Rotary base."""
    rope_scaling: tuple = ()
    """Rotary scaling as sorted (key, value) pairs, e.g. ``(("factor", 8.0), ("rope_type", "llama3"), ...)``."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_position_embeddings: int = 2048
    """Longest context the model is meant for (prompt + response)."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """Llama only: bias on q, k, v and o projections."""
    mlp_bias: bool = False
    """Llama only: bias on the SwiGLU projections."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, if any."""
    eos_token_ids: tuple[int, ...] = ()
    """Ids that end a response."""
    pad_token_id: int | None = None
    """Padding id, if any."""

    def __post_init__(self):
        if self.architecture not in SUPPORTED:
            raise BadInput(f"architecture {self.architecture!r} is not supported: {_SUPPORTED_MSG}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise BadInput(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise BadInput(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.head_dim and self.hidden_size % self.num_heads:
            raise BadInput(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}), "
                           "or set head_dim explicitly")
        sc = dict(self.rope_scaling)
        kind = sc.get("rope_type", "default")
        if kind not in ("default", "linear", "llama3"):
            raise BadInput(f"rope_type {kind!r} is not implemented (supported: default, linear, llama3)")
        if kind != "default" and not isinstance(sc.get("factor"), (int, float)):
            raise BadInput(f"rope_type {kind!r} needs a numeric 'factor' in rope_scaling, got {sc.get('factor')!r}")

    @property
    def dim_head(self) -> int:
        """Effective per-head width."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.architecture == "llama" and self.attention_bias

    @property
    def num_parameters(self) -> int:
        """Parameter count (embedding and head counted once when tied)."""
        h, d = self.hidden_size, self.dim_head
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += d * (self.num_heads + 2 * self.num_kv_heads) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h) * self.mlp_bias
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * h) + h + emb

    # ----------------------------------------------------------------------------------------- HF conversion
    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        """Build from a transformers ``config.json`` dict (transformers 4.x and 5.x layouts).

        Everything that changes the maths and that this decoder does not implement is refused here, with the file
        named, rather than run with different numerics: another activation, quantised weights, sliding-window or
        other non-full attention layers, another model class."""
        kind = d.get("model_type")
        if kind not in SUPPORTED:
            raise BadInput(f"{source}: model_type {kind!r} (architectures {d.get('architectures')}) is not "
                           f"supported: {_SUPPORTED_MSG}. Convert the model or pick a supported one.")
        arch = d.get("architectures")
        if arch and SUPPORTED[kind] not in arch:
            raise BadInput(f"{source}: architectures {arch} is not a causal LM of this family: tltlib loads "
                           f"{SUPPORTED[kind]} models (a classification or reward head is not supported)")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise BadInput(f"{source}: hidden_act {act!r} is not implemented (tltlib's MLP is SwiGLU with SiLU, "
                           "the activation of every Llama/Qwen2 model); running it with SiLU would give "
                           "different logits, so it is refused")
        if d.get("quantization_config"):
            method = d["quantization_config"].get("quant_method", "?") if isinstance(
                d["quantization_config"], dict) else "?"
            raise BadInput(f"{source}: the weights are quantised ({method}); tltlib loads full-precision "
                           "weights: dequantise it with transformers and save it again (or use the "
                           "unquantised model)")
        if kind == "qwen2" and d.get("use_sliding_window"):
            raise BadInput(f"{source}: Qwen2 sliding-window attention is not implemented; set "
                           "use_sliding_window to false (the Qwen2.5 models ship it false)")
        other = sorted({t for t in d.get("layer_types") or () if t != "full_attention"})
        if other and not (kind == "qwen2" and not d.get("use_sliding_window")):
            raise BadInput(f"{source}: layer_types holds {other}; only full attention is implemented")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise BadInput(f"{source} lacks {missing}: is it a transformers config.json of a "
                           "Llama/Qwen2-family model?")
        for keys, want in ((_HF_INTS, int), (_HF_FLOATS, float), (_HF_BOOLS, bool)):
            for k in keys:
                v = d.get(k)
                ok = (v is None or (isinstance(v, bool) if want is bool else
                                    isinstance(v, (int, float) if want is float else int) and not isinstance(v, bool)))
                if not ok:
                    raise BadInput(f"{source}: {k} must be {_KIND_NAME[want]}, got {v!r} "
                                   f"({type(v).__name__}); fix the value")
        rope = dict(d.get("rope_parameters") or {})
        rope.update(d.get("rope_scaling") or {})
        if "rope_theta" in rope and "rope_theta" in d and float(rope["rope_theta"]) != float(d["rope_theta"]):
            raise BadInput(f"{source}: rope_theta is {d['rope_theta']} at the top level but "
                           f"{rope['rope_theta']} in rope_parameters; keep one value")
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        if "type" in rope:                                   # transformers 4.x spelling
            rope["rope_type"] = rope.pop("type")
        if rope.get("rope_type", "default") == "default":
            rope = {}
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        try:
            return cls(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                       intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
                       num_heads=d["num_attention_heads"], num_kv_heads=d.get("num_key_value_heads") or
                       d["num_attention_heads"], architecture=kind, head_dim=d.get("head_dim") or 0,
                       rope_theta=float(theta), rope_scaling=tuple(sorted(rope.items())),
                       rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                       max_position_embeddings=d.get("max_position_embeddings", 2048),
                       tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                       attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
                       bos_token_id=d.get("bos_token_id"), eos_token_ids=eos, pad_token_id=d.get("pad_token_id"))
        except ValueError as e:
            raise BadInput(f"{source}: {e}") from None

    def to_hf(self) -> dict:
        """A transformers-loadable ``config.json`` dict."""
        rope = {"rope_type": "default", **dict(self.rope_scaling), "rope_theta": self.rope_theta}
        d = {"architectures": [SUPPORTED[self.architecture]], "model_type": self.architecture,
             "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
             "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
             "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
             "head_dim": self.dim_head, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
             "max_position_embeddings": self.max_position_embeddings, "rope_theta": self.rope_theta,
             "rope_parameters": rope, "tie_word_embeddings": self.tie_word_embeddings,
             "bos_token_id": self.bos_token_id, "pad_token_id": self.pad_token_id,
             "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
             "torch_dtype": "float32", "use_cache": True}
        if self.architecture == "llama":
            d.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        else:
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        return d


# ------------------------------------------------------------------------------------------------ pure maths
def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse rotary frequencies ``[head_dim // 2]`` (float32), with linear or llama3 scaling applied."""
    d = cfg.dim_head
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    sc = dict(cfg.rope_scaling)
    kind = sc.get("rope_type", "default")
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sign-folded sin ``[B, T, 1, head_dim]`` for integer ``positions [B, T]`` (float32, then cast).

    The sin's first half is negated so that :func:`apply_rope` needs no separate negation."""
    freqs = positions[..., None].float() * inv_freq
    cos = freqs.cos()
    sin = freqs.sin()
    return (torch.cat((cos, cos), dim=-1)[:, :, None].to(dtype),
            torch.cat((-sin, sin), dim=-1)[:, :, None].to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, heads, head_dim]`` by cos and sign-folded sin ``[B, T, 1, head_dim]``.

    Equals transformers' ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as transformers does, cast back to the input dtype before the gain.

    For float32 input PyTorch's fused kernel computes exactly this (bit-identical) in one call instead of six; on a CPU
    without autograd, :mod:`tltlib.kernels.layer_ops`' one pass (the same up to float rounding)."""
    if layer_ops.usable(x, weight):
        return layer_ops.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)   # 4 kernels instead of 8


def qkv_projection(x: torch.Tensor, norm_w: torch.Tensor | None, eps: float, qkv_w: torch.Tensor,
                   qkv_b: torch.Tensor | None, lin=linear) -> torch.Tensor:
    """The input RMSNorm (none when ``norm_w`` is None) and the fused q/k/v projection: x ``[B, T, H]`` -> ``[B, T,
    (heads + 2 kv_heads) head_dim]``."""
    h = rms_norm(x, norm_w, eps) if norm_w is not None else x
    return lin(h, qkv_w, qkv_b)


def split_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output ``[B, T, (heads + 2 kv_heads) head_dim]`` split into q ``[B, heads, T, d]``,
    k and v ``[B, T, kv_heads, d]``, q and k rotated together (:func:`apply_rope`)."""
    b, t, _ = qkv.shape
    qkv = qkv.view(b, t, heads + 2 * kv_heads, head_dim)
    qk = apply_rope(qkv[:, :, : heads + kv_heads], cos, sin)
    return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:], qkv[:, :, heads + kv_heads:]


def post_attention(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                   norm_w: torch.Tensor, eps: float, gate_up_w: torch.Tensor, gate_up_b: torch.Tensor | None,
                   down_w: torch.Tensor, down_b: torch.Tensor | None, lin=linear) -> torch.Tensor:
    """A decoder layer after its attention: the output projection and residual, the post-attention RMSNorm, SwiGLU
    with the fused gate/up projection, the second residual; projections by ``lin``.

    x ``[B, T, H]`` (the layer's input), attn ``[B, heads, T, d]`` (or ``[B, T, heads * d]``, the output
    projection's input already). Returns the layer's output ``[B, T, H]``."""
    if attn.dim() == 4:
        b, _, t, _ = attn.shape
        attn = attn.transpose(1, 2).reshape(b, t, -1)
    out = lin(attn, o_w, o_b)
    if layer_ops.usable(x, out, norm_w):                     # a CPU's one-pass small ops (no autograd, not compiling)
        h, x = layer_ops.add_rms_norm(x, out, norm_w, eps)
    else:
        x = x + out
        h = rms_norm(x, norm_w, eps)
    return x + lin(silu_and_mul(lin(h, gate_up_w, gate_up_b)), down_w, down_b)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: ``silu(gate) * up`` of the fused projection's output ``[..., 2M]`` (gate its first M, up
    its last M) -> ``[..., M]``; one pass on a CPU without autograd (:mod:`tltlib.kernels.layer_ops`)."""
    if layer_ops.usable(gate_up):
        return layer_ops.silu_mul(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


_STACK: ContextVar[object | None] = ContextVar("tltlib_layer_stack", default=None)
"""What runs a cached forward's layers instead of the loop over them (set by
:func:`tltlib.model.fused.compiled_layers`): ``stack(model, x, cos, sin, cache, write) -> x``, or None: the loop."""


def use_stack(stack) -> object:
    """Set the cached forwards' layer stack (a callable or None); returns the token to reset with."""
    return _STACK.set(stack)


def reset_stack(token) -> None:
    _STACK.reset(token)


# ---------------------------------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query self-attention's weights: the fused q/k/v projection and the output projection (the maths is in
    :func:`qkv_projection`, :func:`split_rotate`, the cache's ``attend`` and :func:`post_attention`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.dim_head
        self.qkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=cfg.qkv_bias)
        self.o = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)


class MLP(nn.Module):
    """SwiGLU's weights: the fused gate/up projection and the down projection (the maths: :func:`post_attention`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.i = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * self.i, bias=cfg.mlp_bias)
        self.down = nn.Linear(self.i, cfg.hidden_size, bias=cfg.mlp_bias)


class DecoderLayer(nn.Module):
    """Pre-norm decoder block. ``input_norm=False`` drops the attention's input RMSNorm (EAGLE's drafter layer)."""

    def __init__(self, cfg: ModelConfig, input_norm: bool = True):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else None
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None, layer=0, write=None, attend=None, lin=None):
        """x ``[B, T, H]`` -> ``[B, T, H]``. Without a cache, causal attention over x (training); with one, the
        cache's ``attend(layer, write, q, k, v)``; ``attend(q, k, v, layer)`` given instead: that (the compiled
        stack's opaque attention, :mod:`tltlib.model.fused`). ``lin`` computes the projections (default: this
        module's ``linear``, looked up at call time)."""
        a, m = self.attn, self.mlp
        lin = lin or linear
        norm_w = self.input_norm.weight if self.input_norm is not None else None
        qkv = qkv_projection(x, norm_w, self.eps, a.qkv.weight, a.qkv.bias, lin=lin)
        out = cache.attend_qkv(layer, write, qkv, cos, sin, a.h) if cache is not None and attend is None else None
        if out is not None:                            # the cache's one-call kernel did the rest of the attention
            return post_attention(x, out, a.o.weight, a.o.bias, self.post_norm.weight, self.eps, m.gate_up.weight,
                                  m.gate_up.bias, m.down.weight, m.down.bias, lin=lin)
        q, k, v = split_rotate(qkv, cos, sin, a.h, a.kvh, a.d)
        if attend is not None:
            out = attend(q, k, v, layer)
        elif cache is None:
            out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                                 enable_gqa=a.kvh != a.h)
        else:
            out = cache.attend(layer, write, q, k, v)
        return post_attention(x, out, a.o.weight, a.o.bias, self.post_norm.weight, self.eps, m.gate_up.weight,
                              m.gate_up.bias, m.down.weight, m.down.bias, lin=lin)


class Transformer(nn.Module):
    """Llama/Qwen2-family causal LM. Build with :func:`load_model` or ``Transformer(config)`` (random init)."""

    def __init__(self, cfg: ModelConfig, init_std: float = 0.02):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if init_std and not any(p.is_meta for p in self.parameters()):
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.dim() > 1:
                    nn.init.normal_(p, std=init_std)

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed.weight.device

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` / ``.bfloat16()`` cast the weights; the rotary frequencies stay float32 (in bf16 they
        would be off by up to 0.4%, which turns positions of a few hundred into wrong angles)."""
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def _rope_cached(self, positions: torch.Tensor, top: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`rope_cos_sin` of a cached forward's ``positions [B, T]`` (all below ``top``). On a CPU read from a
        table of every position so far, made by :func:`rope_cos_sin` itself and doubled when a position passes its
        end: one index per forward instead of seven small ops (~50 us of a one-row step, AMD EPYC). Computed where
        ``top`` is None (positions the caller gave: their bound would cost a host sync, which a forward that CUDA
        graphs capture must not make) and off the CPU (a captured graph must not read a table a later forward
        replaces)."""
        dtype = self.embed.weight.dtype
        if top is None or positions.device.type != "cpu":
            return rope_cos_sin(self.inv_freq, positions, dtype)
        table = self.__dict__.get("_rope_table")
        if table is None or table[0] is not self.inv_freq or table[1] != dtype or table[2].shape[0] < top:
            n = max(top, 256, 2 * table[2].shape[0] if table is not None else 0)
            cos, sin = rope_cos_sin(self.inv_freq, torch.arange(n)[None], dtype)
            table = self.__dict__["_rope_table"] = (self.inv_freq, dtype, cos[0, :, 0], sin[0, :, 0])
        shape = (*positions.shape, 1, table[2].shape[-1])
        flat = positions.reshape(-1)
        return table[2].index_select(0, flat).view(shape), table[3].index_select(0, flat).view(shape)

    @property
    def head_weight(self) -> torch.Tensor:
        """The ``[vocab, H]`` LM-head matrix (the embedding when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head applied to final (post-norm) hidden states ``[..., H] -> [..., vocab]``."""
        return linear(hidden, self.head_weight)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Training forward without the head: ``tokens [B, T]`` (right-padded) -> final hidden ``[B, T, H]``.

        RL computes the log-probabilities of chosen tokens from these in chunks, never all ``[B, T, V]`` logits."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.embed.weight.dtype)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, return_hidden: bool = False):
        """Training forward: ``tokens [B, T]`` (right-padded) -> logits ``[B, T, V]`` (and hidden ``[B, T, H]``)."""
        hidden = self.hidden_states(tokens)
        logits = self.logits(hidden)
        return (logits, hidden) if return_hidden else logits

    def forward_cached(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                       tree_mask: torch.Tensor | None = None, logits_at: torch.Tensor | None = None,
                       offset: int = 0):
        """Inference forward over the cache's active rows; writes K/V but does not commit (see KVCache.advance).

        Args:
            tokens: ``[B, T]`` new tokens, B == ``cache.rows``; rows with fewer real tokens are right-padded.
            positions: ``[B, T]`` rotary positions; default ``lengths[:, None] + offset + arange(T)``.
            tree_mask: optional ``[B, T, offset + T]`` bool visibility among uncommitted entries (default causal).
            logits_at: optional ``[B]`` index into T: compute logits only there (``[B, V]``).
            offset: uncommitted entries already written this round (see KVCache.prepare).

        Returns:
            (logits ``[B, T, V]`` or ``[B, V]``, final hidden states ``[B, T, H]``).
        """
        b, t = tokens.shape
        if positions is None:
            positions = cache.lengths[:b, None] + (offset + torch.arange(t, device=tokens.device))
            top = cache.max_used + offset + t                  # the positions' bound, known on the host
        else:
            top = None
        cos, sin = self._rope_cached(positions, top)
        write = cache.prepare(t, tree_mask, offset)
        x = self.embed(tokens)
        stack = _STACK.get()
        hidden = (native.run_layers(self, self.layers, self.norm, self.config, x, cos, sin, cache, write)
                  if stack is None else None)
        if hidden is None:
            if stack is not None:
                x = stack(self, x, cos, sin, cache, write)
            else:
                for i, layer in enumerate(self.layers):
                    x = layer(x, cos, sin, cache, i, write)
            hidden = rms_norm(x, self.norm.weight, self.config.rms_norm_eps)
        if logits_at is not None:
            return self.logits(hidden[torch.arange(b, device=hidden.device), logits_at]), hidden
        return self.logits(hidden), hidden

    def new_cache(self, rows: int, max_len: int, kv: KVConfig | None = None, budget_bytes: int | None = None):
        """A KV cache for ``rows`` sequences of at most ``max_len`` tokens, on this model's device and dtype
        (:func:`tltlib.kv.paged.make_cache`: paged by default, its pool sized by ``kv``'s budget or
        ``budget_bytes``)."""
        w = self.embed.weight
        return make_cache(self.config, rows, max_len, kv, w.dtype, w.device, budget_bytes=budget_bytes)


PRESETS: dict[str, ModelConfig] = {
    # the shipped tiny reasoner (data/tiny-reasoner): 8 layers, ~3.3 M parameters, trains on 2 CPU cores
    "tiny-cpu": ModelConfig(vocab_size=74, hidden_size=192, intermediate_size=512, num_layers=8, num_heads=6,
                            num_kv_heads=3, max_position_embeddings=1024, tie_word_embeddings=True),
    # a 2-layer draft *model* (not an EAGLE head) for transformers' assisted generation, the SD peer in the benches
    "tiny-draft": ModelConfig(vocab_size=74, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                              num_kv_heads=2, max_position_embeddings=1024, tie_word_embeddings=True),
    # the GPU reasoner (train-reasoner --preset gpu-24l --device cuda): 24 layers, ~1.0 B parameters, the chain task's
    # vocabulary; trains on one H100 in minutes, large enough that batch-1 decoding is bound by weight reads
    "gpu-24l": ModelConfig(vocab_size=74, hidden_size=2048, intermediate_size=5632, num_layers=24, num_heads=16,
                           num_kv_heads=4, max_position_embeddings=1024, tie_word_embeddings=True),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, architecture="qwen2", rope_theta=1e6,
                              max_position_embeddings=32768),
    "qwen2.5-32b": ModelConfig(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                               num_heads=40, num_kv_heads=8, architecture="qwen2", rope_theta=1e6,
                               max_position_embeddings=32768),
    "llama-3.3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                                 num_heads=64, num_kv_heads=8, rope_theta=5e5, max_position_embeddings=131072,
                                 rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                               ("original_max_position_embeddings", 8192),
                                               ("rope_type", "llama3"))),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named :class:`ModelConfig` (``tiny-cpu``, ``qwen2.5-7b``, ...), optionally with fields replaced."""
    if name not in PRESETS:
        raise BadInput(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)
