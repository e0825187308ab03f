"""What a forward costs, for the simulator (:mod:`tltlib.simulate`): from the roofline of a device, or from times
measured on this machine.

* :class:`Hardware` — a device and how devices connect (bandwidths, peak FLOPs, memory), with the achieved shares
  of the peaks and fixed costs; presets for the H100, A100, B200 and this project's 2-core CPU.
* :class:`ModelShape` — the bytes and FLOPs a model's forward reads and does (from its :class:`ModelConfig`).
* :func:`forward_time` / :class:`Roofline` — one forward over ``rows`` x ``tokens`` new tokens after ``context``
  cached ones on a tensor-parallel group of ``tp`` devices::

      max(bytes / (mem_bw x bw_eff), flops / (peak_flops x flops_eff)) + 2 layers x TP all-reduce + iteration_s

  with bytes = the weights read once (/ tp) + the rows' KV cache read, flops = 2 x parameters x new tokens + the
  attention over the cache. The H100 preset reproduces the paper's Qwen2.5-7B decode rates (Tables 2 and 7).
* :class:`MeasuredCosts` — the same costs as measured here (:func:`tltlib.measured_costs.measure_costs`), interpolated.
* :func:`iteration_time` — one decode iteration: a plain forward, or an SD step (``depth`` draft levels, then one
  verify forward).

Paper: TLT §6-7 (the H100 setting: SD pays at small batches, less as verification turns compute-bound).
Departures: a roofline, not a kernel-level model: attention, MLP and the LM head are one memory/compute total.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .model import ModelConfig
from .physical import CalibrationError, monotone
from .speculative import SpecStrategy

GB = 1e9


# ------------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Hardware:
    """One device and how devices connect. Efficiencies are the achieved shares of the peaks."""

    name: str
    mem_bw: float
    """Device memory bandwidth, bytes/s."""
    peak_flops: float
    """Dense matmul FLOP/s at the model's dtype."""
    memory: float
    """Device memory, bytes."""
    link_bw: float
    """Bytes/s between the devices of a node, per direction (tensor-parallel all-reduces)."""
    net_bw: float
    """Bytes/s between nodes per device (the data-parallel gradient all-reduce across nodes)."""
    devices_per_node: int = 8
    mem_util: float = 0.9
    """Share of ``memory`` a run can fill (the rest: the framework, fragmentation)."""
    bw_eff: float = 0.7
    """Achieved share of ``mem_bw`` by a decode forward."""
    flops_eff: float = 0.6
    """Achieved share of ``peak_flops`` by a compute-bound forward."""
    train_eff: float = 0.35
    """Model FLOPs utilisation of the update (forward + backward)."""
    iteration_s: float = 1e-4
    """Fixed cost of one forward (kernel launches, scheduling): CUDA graphs keep it small."""
    collective_s: float = 1.8e-5
    """Latency of one tensor-parallel all-reduce."""
    draft_level_s: float = 5e-4
    """Fixed cost of one SD draft level beyond its forward (top-k, tree bookkeeping, sampling): with it an SD step of
    Qwen2.5-7B at TP 2 on an H100 costs the 12 ms the paper's Table 7 implies (accept length 6.53 at 542 tok/s)."""

    def __post_init__(self):
        for k in ("mem_bw", "peak_flops", "memory", "link_bw", "net_bw"):
            if not getattr(self, k) > 0:
                raise ValueError(f"Hardware {self.name!r}: {k} must be > 0, got {getattr(self, k)}")
        for k in ("bw_eff", "flops_eff", "train_eff", "mem_util"):
            if not 0 < getattr(self, k) <= 1:
                raise ValueError(f"Hardware {self.name!r}: {k} is a share of the peak, in (0, 1]; got "
                                 f"{getattr(self, k)}")
        if self.devices_per_node < 1 or min(self.iteration_s, self.collective_s, self.draft_level_s) < 0:
            raise ValueError(f"Hardware {self.name!r}: devices_per_node >= 1; iteration_s, collective_s and "
                             "draft_level_s >= 0")


HARDWARE: dict[str, Hardware] = {
    # bf16 dense peaks; memory bandwidth of the SXM parts; NVLink per direction; one 400/200 Gb/s NIC per GPU
    "h100": Hardware("h100", 3.35e12, 989e12, 80 * GB, 450 * GB, 50 * GB),
    "a100": Hardware("a100", 2.04e12, 312e12, 80 * GB, 300 * GB, 25 * GB),
    "b200": Hardware("b200", 8.0e12, 2250e12, 180 * GB, 900 * GB, 50 * GB),
    # this project's 2-core CPU VM, float32 (calibrate with `simulate --validate`): one "device" per machine
    "cpu": Hardware("cpu", 10 * GB, 100e9, 24 * GB, 5 * GB, 5 * GB, devices_per_node=1, bw_eff=1.0, flops_eff=0.5,
                    train_eff=0.3, iteration_s=5e-4, collective_s=1e-4, draft_level_s=2e-4),
}


def hardware(name: str | Hardware) -> Hardware:
    """A preset by name (``h100``, ``a100``, ``b200``, ``cpu``), or a :class:`Hardware` as it is."""
    if isinstance(name, Hardware):
        return name
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware preset {name!r}; choose one of {', '.join(HARDWARE)} or pass a Hardware")
    return HARDWARE[name]


@dataclass(frozen=True)
class ModelShape:
    """What the costs need of a model: its config and the bytes per value of its dtype (2: bf16)."""

    config: ModelConfig
    dtype_bytes: int = 2

    @property
    def params(self) -> int:
        return self.config.num_parameters

    @property
    def decode_bytes(self) -> float:
        """Weight bytes one forward reads: every layer and the LM head (an untied embedding is only gathered)."""
        c = self.config
        untied_embedding = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        return (self.params - untied_embedding) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.dim_head * self.dtype_bytes

    @property
    def drafter_bytes(self) -> float:
        """Weight bytes one forward of a one-layer EAGLE drafter reads: its layer, its fc and the LM head."""
        c = self.config
        layer = (self.params - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)) / c.num_layers
        return (layer + 2 * c.hidden_size ** 2 + c.vocab_size * c.hidden_size) * self.dtype_bytes

    def check_tp(self, tp: int) -> None:
        c = self.config
        if tp < 1 or c.num_heads % tp:
            raise ValueError(f"tensor parallelism {tp} does not divide the model's {c.num_heads} attention heads; "
                             f"use one of {[d for d in range(1, c.num_heads + 1) if c.num_heads % d == 0]}")


# ---------------------------------------------------------------------------------------------- the costs
def forward_time(shape: ModelShape, hw: Hardware, tp: int, rows: int, context: float, tokens: int,
                 weight_bytes: float | None = None, layers: int | None = None) -> float:
    """Seconds of one forward over ``rows`` x ``tokens`` new tokens with ``context`` cached tokens per row, on a
    tensor-parallel group of ``tp`` devices (the roofline: the larger of memory and compute time, plus the TP
    all-reduces and the fixed cost). ``weight_bytes`` / ``layers``: a drafter's instead of the target's."""
    c = shape.config
    w = shape.decode_bytes if weight_bytes is None else weight_bytes
    n_layers = c.num_layers if layers is None else layers
    kv = rows * context * shape.kv_bytes_per_token * n_layers / c.num_layers
    new = rows * tokens
    flops = 2 * (w / shape.dtype_bytes) * new + 4 * n_layers * c.num_heads * c.dim_head * context * new
    t = max((w + kv) / tp / (hw.mem_bw * hw.bw_eff), flops / tp / (hw.peak_flops * hw.flops_eff))
    if tp > 1:                                 # two all-reduces of the activations per layer (ring)
        size = new * c.hidden_size * shape.dtype_bytes * 2 * (tp - 1) / tp
        t += 2 * n_layers * (hw.collective_s + size / hw.link_bw)
    return t + hw.iteration_s


class Roofline:
    """The costs of ``shape`` on a tensor-parallel group of ``tp`` ``hw`` devices, from the roofline
    (:func:`forward_time`): for hardware this machine does not have."""

    setup_s_per_row = 0.0
    """Seconds of a rollout beyond its prefill and decode iterations, per response: none (a GPU's caching allocator
    hands the KV cache over without zeroing it; the result is assembled on the device)."""

    def __init__(self, shape: ModelShape, hw: Hardware, tp: int = 1):
        shape.check_tp(tp)
        self.shape, self.hw, self.tp = shape, hw, tp

    def forward(self, rows: int, context: float, tokens: int) -> float:
        """Seconds of a target forward over ``rows`` x ``tokens`` new tokens after ``context`` cached ones."""
        return forward_time(self.shape, self.hw, self.tp, rows, context, tokens)

    def draft_level(self, rows: int, context: float, width: int) -> float:
        """Seconds of one SD draft level: a drafter forward of ``width`` nodes per row and its bookkeeping."""
        return forward_time(self.shape, self.hw, self.tp, rows, context, width, weight_bytes=self.shape.drafter_bytes,
                            layers=1) + self.hw.draft_level_s

    def plain_overhead(self, rows: int) -> float:
        """None beyond the forward: the hardware's fixed costs are in it."""
        return 0.0

    def sd_factor(self, rows: int) -> float:
        """1: the roofline's draft levels carry their fixed cost (``draft_level_s``)."""
        return 1.0


@dataclass(frozen=True)
class MeasuredCosts:
    """Forward and draft-level seconds measured on one machine (:func:`tltlib.measured_costs.measure_costs`),
    interpolated log-log in rows and linearly in tokens and context (and extrapolated linearly beyond the last
    measured tokens or context): for validating the simulator against runs of the same machine.

    ``target_s[r][c][t]``: a forward of ``rows[r]`` rows x ``tokens[t]`` tokens after ``contexts[c]`` cached ones;
    ``draft_s[r][c][w]``: one draft level of ``widths[w]`` nodes per row."""

    rows: tuple
    contexts: tuple
    tokens: tuple
    target_s: tuple
    widths: tuple = (1,)
    draft_s: tuple = ()
    overhead: tuple = ()
    """((rows, seconds), ...): seconds per decode iteration beyond its forwards at those running rows (sampling, the
    engine's bookkeeping), interpolated log-linearly in the rows; fitted on measured rollouts
    (:func:`tltlib.measured_costs.fit_overheads`)."""
    sd_scale: tuple = ()
    """((rows, factor), ...): an SD step's measured time over what its forwards (draft levels and verify) cost at
    those running rows (the acceptance, each level's top-k and bookkeeping, the verify's positions and the commit
    scale with the step); interpolated as ``overhead``, 1 when empty."""
    setup_s_per_row: float = 0.0
    """Seconds of a rollout beyond its prefill and decode iterations (allocating and zeroing the KV cache, reading
    the results back) per response it samples, at the fitted rollouts' longest length; fitted on measured
    rollouts."""
    noise: float = 0.0
    """The measurement's noise: how much two passes over the same forwards disagreed (90th percentile of the
    cells, :func:`tltlib.physical.pass_noise`); how far a fitted value may cross a physical bound and be moved onto
    it."""
    notes: tuple = ()
    """What the measurement moved onto a physical bound within its noise (:mod:`tltlib.physical`), in words."""
    fit_notes: tuple = ()
    """What the fit of ``overhead``, ``sd_scale`` and ``setup_s_per_row`` moved onto a bound, in words."""

    def __post_init__(self):
        """Refuse what cannot be physical (:mod:`tltlib.physical`): costs that fall as rows, context or new tokens
        grow, a negative overhead or set-up, an SD step cheaper than its forwards."""
        t = np.asarray(self.target_s, dtype=np.float64)
        if t.shape != (len(self.rows), len(self.contexts), len(self.tokens)) or not (t > 0).all():
            raise ValueError(f"MeasuredCosts: target_s must be positive seconds of shape rows x contexts x tokens "
                             f"({len(self.rows)}, {len(self.contexts)}, {len(self.tokens)}), got {t.shape}")
        monotone(t, [("rows", self.rows), ("context", self.contexts), ("tokens", self.tokens)], "a target forward", 0)
        if self.draft_s:
            monotone(self.draft_s, [("rows", self.rows), ("context", self.contexts), ("width", self.widths)],
                     "a draft level", 0)
        bad = [f"overhead {1e3 * x:.3g} ms at {r:g} rows" for r, x in self.overhead if x < 0]
        bad += [f"an SD step {x:.2f}x its forwards at {r:g} rows" for r, x in self.sd_scale if x < 1]
        bad += [f"set-up {1e3 * self.setup_s_per_row:.3g} ms per response"] if self.setup_s_per_row < 0 else []
        if bad or self.noise < 0:
            raise CalibrationError(f"MeasuredCosts cannot be physical: {'; '.join(bad) or f'noise {self.noise}'} "
                                   "(overheads and set-up >= 0, an SD step >= 1x its forwards, noise >= 0)")

    def forward(self, rows: int, context: float, tokens: int) -> float:
        return _interp(self.target_s, self.rows, self.contexts, self.tokens, rows, context, tokens)

    def draft_level(self, rows: int, context: float, width: int) -> float:
        if not self.draft_s:
            raise ValueError("these measured costs have no drafter timings: measure them with a drafter")
        return _interp(self.draft_s, self.rows, self.contexts, self.widths, rows, context, width)

    def plain_overhead(self, rows: int) -> float:
        """Seconds of a plain decode iteration beyond its forward (an SD step: see ``sd_scale``)."""
        return _by_rows(self.overhead, rows)

    def sd_factor(self, rows: int) -> float:
        """An SD step's measured time over its forwards' at ``rows`` running rows (1 without a fit)."""
        return _by_rows(self.sd_scale, rows) if self.sd_scale else 1.0


def _by_rows(points: tuple, rows: int) -> float:
    """``((rows, seconds), ...)`` interpolated at ``rows``, linearly in log rows (constant beyond the ends; 0 when
    empty)."""
    if not points:
        return 0.0
    at, seconds = zip(*points)
    return float(np.interp(math.log(max(rows, 1)), np.log(at), seconds))


def _linear(xs, ys, x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly beyond both ends (a single point: constant)."""
    xs, ys = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if xs.size == 1:
        return float(ys[0])
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = xs.size - 2
    else:
        return float(np.interp(x, xs, ys))
    return float(ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i]))


def _interp(table, rows_at, contexts_at, cols_at, rows: int, context: float, col: float) -> float:
    t = np.asarray(table, dtype=np.float64)
    lr = np.log(np.clip(rows, rows_at[0], rows_at[-1]))
    by_context = []
    for c in range(len(contexts_at)):
        per_col = [math.exp(np.interp(lr, np.log(rows_at), np.log(t[:, c, j]))) for j in range(len(cols_at))]
        by_context.append(_linear(cols_at, per_col, col))
    return max(_linear(contexts_at, by_context, context), 0.5 * min(by_context))


def iteration_time(costs, rows: int, context: float, strategy: SpecStrategy) -> float:
    """Seconds of one decode iteration under ``costs`` (:class:`Roofline` or :class:`MeasuredCosts`): a plain
    forward, or an SD step (``depth`` draft levels of ``top_k`` nodes per row for a tree, one node for a chain, none
    for n-gram drafts; then one verify forward over 1 + the verified drafts); with the costs' per-iteration overhead
    (plain) or SD factor."""
    if not strategy.enabled:
        return costs.forward(rows, context, 1) + costs.plain_overhead(rows)
    verify = costs.forward(rows, context, strategy.verify_tokens + 1)
    width = strategy.top_k if strategy.kind == "tree" else 1
    draft = 0.0 if strategy.kind == "ngram" else strategy.depth * costs.draft_level(rows, context, width)
    return (verify + draft) * costs.sd_factor(rows)
