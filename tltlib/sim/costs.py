"""The cost model: what a forward costs, from times measured on this machine or from the roofline of a device, and
what one decode iteration costs from them. The adaptive engine's tuner (its prior and its reward scale,
:mod:`tltlib.rollout.adaptive`) and the simulator (:mod:`tltlib.sim.simulate`) read the same costs through the same
:func:`iteration_time`.

* :class:`Hardware` — a device and how devices connect (bandwidths, peak FLOPs, memory), with the achieved shares
  of the peaks and fixed costs; presets for the H100, A100, B200 and this project's 2-core CPU.
* :class:`ModelShape` — the bytes and FLOPs a model's forward reads and does (from its :class:`ModelConfig`).
* :func:`forward_time` / :class:`Roofline` — one forward over ``rows`` x ``tokens`` new tokens after ``context``
  cached ones on a tensor-parallel group of ``tp`` devices::

      max(bytes / (mem_bw x bw_eff), flops / (peak_flops x flops_eff)) + 2 layers x TP all-reduce + iteration_s

  with bytes = the weights read once (/ tp) + the rows' KV cache read, flops = 2 x parameters x new tokens + the
  attention over the cache. The H100 preset reproduces the paper's Qwen2.5-7B decode rates (Tables 2 and 7).
* :class:`MeasuredCosts` — the same costs as measured here (:func:`tltlib.sim.measure.measure_costs`): target
  forwards by rows x cached context x new tokens, drafter forwards by rows x context x width, a drafter catch-up
  over a backlog, a plain forward over rows at unequal lengths; interpolated log-log in rows and linearly in tokens,
  width and context; with the engine's costs beyond its forwards where they were fitted
  (:func:`tltlib.sim.measure.fit_overheads`).
* :func:`iteration_time` — one decode iteration: a plain forward, or an SD step (the drafter's catch-up, which
  proposes the first draft level, ``depth - 1`` more draft levels, then one verify forward; model-free drafts cost
  their proposer's host time instead). :func:`predicted_speedup` — an SD strategy's speedup over plain decoding
  from its acceptance per draft depth (the tuner's prior). :func:`switch_cost` — what switching SD on costs once.

Paper: TLT §5.2 (the tuner's reward: measured tokens per second) and §6-7 (the H100 setting: SD pays at small
batches, less as verification turns compute-bound).
Departures: a roofline, not a kernel-level model: attention, MLP and the LM head are one memory/compute total.
"""
from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from ..errors import BadInput
from ..model.decoder import ModelConfig
from ..spec.acceptance import expected_tokens
from ..spec.strategy import OFF, SpecStrategy
from .physical import CalibrationError, monotone

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
                raise BadInput(f"Hardware {self.name!r}: {k} must be > 0, got {getattr(self, k)}")
        for k in ("bw_eff", "flops_eff", "train_eff", "mem_util"):
            if not 0 < getattr(self, k) <= 1:
                raise BadInput(f"Hardware {self.name!r}: {k} is a share of the peak, in (0, 1]; got "
                               f"{getattr(self, k)}")
        if self.devices_per_node < 1 or min(self.iteration_s, self.collective_s, self.draft_level_s) < 0:
            raise BadInput(f"Hardware {self.name!r}: devices_per_node >= 1; iteration_s, collective_s and "
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
        raise BadInput(f"unknown hardware preset {name!r}; choose one of {', '.join(HARDWARE)} or pass a Hardware")
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
            raise BadInput(f"tensor parallelism {tp} does not divide the model's {c.num_heads} attention heads; "
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
    model_free_s_per_row = 0.0
    """Host seconds per row of a model-free proposer (n-gram, suffix): none, as it overlaps the device's work."""

    def __init__(self, shape: ModelShape, hw: Hardware, tp: int = 1):
        shape.check_tp(tp)
        self.shape, self.hw, self.tp = shape, hw, tp

    def forward(self, rows: int, context: float | None, tokens: int) -> float:
        """Seconds of a target forward over ``rows`` x ``tokens`` new tokens after ``context`` cached ones (None:
        none, as :class:`MeasuredCosts` reads None as its shortest context; a controller asks before its first
        step)."""
        return forward_time(self.shape, self.hw, self.tp, rows, context or 0.0, tokens)

    def draft_level(self, rows: int, context: float | None, width: int) -> float:
        """Seconds of one SD draft level: a drafter forward of ``width`` nodes per row and its bookkeeping (context
        None: see :meth:`forward`)."""
        return forward_time(self.shape, self.hw, self.tp, rows, context or 0.0, width,
                            weight_bytes=self.shape.drafter_bytes, layers=1) + self.hw.draft_level_s

    def catch_up(self, rows: int, context: float | None, width: float) -> float:
        """Seconds of the drafter's catch-up over ``width`` backlog entries per row: a drafter forward of that many
        tokens and a draft level's bookkeeping."""
        return self.draft_level(rows, context, max(1, round(width)))

    def ragged_extra(self, rows: int, context: float | None = None) -> float:
        """None: the roofline does not tell masked from unmasked attention."""
        return 0.0

    def plain_overhead(self, rows: int) -> float:
        """None beyond the forward: the hardware's fixed costs are in it."""
        return 0.0

    def sd_factor(self, rows: int) -> float:
        """1: the roofline's draft levels carry their fixed cost (``draft_level_s``)."""
        return 1.0


MEASURED_FORMAT = "tltlib-measured-costs-2"
"""The format of :meth:`MeasuredCosts.to_dict` (a tuner prior file's ``costs``, a results file's cost model)."""


@dataclass(frozen=True)
class MeasuredCosts:
    """Forward costs measured on one machine (:func:`tltlib.sim.measure.measure_costs`), interpolated log-log in rows
    and linearly in tokens, width and context (extrapolated linearly beyond the last measured tokens, width or
    context; clamped to the measured rows). Treat it as read-only: it memoises lookups (the tuner asks every decode
    iteration).

    ``target_s[r][c][t]``: a target forward of ``rows[r]`` rows x ``tokens[t]`` new tokens after ``contexts[c]``
    cached ones; ``draft_s[r][c][w]``: one drafter forward (a draft level) of ``widths[w]`` nodes per row;
    ``catch_up_s[r]``: a drafter catch-up over ``catch_up_width`` backlog entries per row (logits at the last) after
    ``contexts[0]``; ``ragged_s[r]``: a one-token target forward with the rows at unequal lengths (masked attention:
    what every plain step costs once an SD step has left the rows ragged) after ``contexts[0]``."""

    rows: tuple
    contexts: tuple
    tokens: tuple
    target_s: tuple
    widths: tuple = (1,)
    draft_s: tuple = ()
    catch_up_width: int = 0
    """Backlog entries per row of the timed catch-up (0: not timed; wider ones are extrapolated linearly)."""
    catch_up_s: tuple = ()
    ragged_s: tuple = ()
    model_free_s_per_row: float = 2e-5
    """Host seconds per row and draft token of a model-free proposer (n-gram, suffix)."""
    overhead: tuple = ()
    """((rows, seconds), ...): seconds per decode iteration beyond its forwards at those running rows (sampling, the
    engine's bookkeeping), interpolated log-linearly in the rows; fitted on measured rollouts
    (:func:`tltlib.sim.measure.fit_overheads`)."""
    sd_scale: tuple = ()
    """((rows, factor), ...): an SD step's measured time over what its forwards (catch-up, draft levels and verify)
    cost at those running rows (the acceptance, each level's top-k and bookkeeping, the verify's positions and the
    commit scale with the step); interpolated as ``overhead``, 1 when empty."""
    setup_s_per_row: float = 0.0
    """Seconds of a rollout beyond its prefill and decode iterations (allocating and zeroing the KV cache, reading
    the results back) per response it samples, at the fitted rollouts' longest length; fitted on measured
    rollouts."""
    noise: float = 0.0
    """The measurement's noise: how much two passes over the same forwards disagreed (90th percentile of the
    cells, :func:`tltlib.sim.physical.pass_noise`; 0 for a measurement of one pass); how far a fitted value may
    cross a physical bound and be moved onto it."""
    notes: tuple = ()
    """What the measurement moved onto a physical bound (:mod:`tltlib.sim.physical`), in words."""
    fit_notes: tuple = ()
    """What the fit of ``overhead``, ``sd_scale`` and ``setup_s_per_row`` moved onto a bound, in words."""
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        """Refuse what cannot be physical (:mod:`tltlib.sim.physical`): costs that fall as rows, context or new tokens
        grow, a negative overhead or set-up, an SD step cheaper than its forwards."""
        t = np.asarray(self.target_s, dtype=np.float64)
        if t.shape != (len(self.rows), len(self.contexts), len(self.tokens)) or not (t > 0).all():
            raise BadInput(f"MeasuredCosts: target_s must be positive seconds of shape rows x contexts x tokens "
                           f"({len(self.rows)}, {len(self.contexts)}, {len(self.tokens)}), got {t.shape}")
        monotone(t, [("rows", self.rows), ("context", self.contexts), ("tokens", self.tokens)], "a target forward", 0)
        if self.draft_s:
            monotone(self.draft_s, [("rows", self.rows), ("context", self.contexts), ("width", self.widths)],
                     "a draft level", 0)
        for name in ("catch_up_s", "ragged_s"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.rows):
                raise BadInput(f"MeasuredCosts: {name} needs one value per measured row count ({len(self.rows)})")
        bad = [f"overhead {1e3 * x:.3g} ms at {r:g} rows" for r, x in self.overhead if x < 0]
        bad += [f"an SD step {x:.2f}x its forwards at {r:g} rows" for r, x in self.sd_scale if x < 1]
        bad += [f"set-up {1e3 * self.setup_s_per_row:.3g} ms per response"] if self.setup_s_per_row < 0 else []
        if bad or self.noise < 0:
            raise CalibrationError(f"MeasuredCosts cannot be physical: {'; '.join(bad) or f'noise {self.noise}'} "
                                   "(overheads and set-up >= 0, an SD step >= 1x its forwards, noise >= 0)")

    # ------------------------------------------------------------------------------------------- lookups
    def _at_rows(self, name: str, rows: float) -> np.ndarray:
        """Table ``name`` at ``rows`` (log-log between the measured row counts, clamped to them): ``[contexts,
        columns]`` seconds for the 3-d tables, ``[1]`` for the per-row ones; memoised per table and row count."""
        key = (name, rows)
        hit = self._memo.get(key)
        if hit is None:
            t = np.asarray(getattr(self, name), dtype=np.float64)
            lr = math.log(min(max(rows, self.rows[0]), self.rows[-1]))
            flat = t.reshape(len(self.rows), -1)
            at = np.array([math.exp(np.interp(lr, np.log(self.rows),
                                              np.log(flat[:, j]))) for j in range(flat.shape[1])])
            hit = self._memo[key] = at.reshape(t.shape[1:]) if t.ndim > 1 else at
        return hit

    def _lookup(self, name: str, cols: tuple, rows: int, context: float | None, col: float) -> float:
        """Table ``name`` at ``rows``, ``context`` (None: the shortest measured) and column value ``col``."""
        at = self._at_rows(name, rows)
        by_context = [_linear(cols, at[c], col) for c in range(len(self.contexts))]
        if context is None:
            return by_context[0]
        return max(_linear(self.contexts, by_context, context), 0.5 * min(by_context))

    def forward(self, rows: int, context: float | None, tokens: int) -> float:
        """Seconds of a target forward over ``rows`` x ``tokens`` new tokens after ``context`` cached ones."""
        return self._lookup("target_s", self.tokens, rows, context, tokens)

    def draft_level(self, rows: int, context: float | None, width: int) -> float:
        """Seconds of one drafter forward of ``width`` nodes per row (a draft level)."""
        if not self.draft_s:
            raise BadInput("these measured costs have no drafter timings: measure them with a drafter")
        return self._lookup("draft_s", self.widths, rows, context, width)

    def catch_up(self, rows: int, context: float | None, width: float) -> float:
        """Seconds of the drafter's catch-up over ``width`` backlog entries per row: a draft level of one node plus
        what the measured wide catch-up adds per entry (linear; without a timed catch-up, a draft level of that
        width, extrapolated linearly past the widest)."""
        one = self.draft_level(rows, context, 1)
        if width <= 1:
            return one
        if not self.catch_up_s:                        # no catch-up timed: as a draft level of that width
            return max(self.draft_level(rows, context, width), one)
        wide = float(self._at_rows("catch_up_s", rows)[0])
        extra = max(wide - self.draft_level(rows, None, 1), 0.0) / max(self.catch_up_width - 1, 1)
        return one + extra * (width - 1)

    def ragged_extra(self, rows: int, context: float | None = None) -> float:
        """Seconds a plain decode step of ``rows`` rows costs beyond a uniform one once rows are at unequal lengths
        (0 when not measured)."""
        if not self.ragged_s:
            return 0.0
        return max(float(self._at_rows("ragged_s", rows)[0]) - self.forward(rows, None, 1), 0.0)

    def plain_overhead(self, rows: int) -> float:
        """Seconds of a plain decode iteration beyond its forward (an SD step: see ``sd_scale``)."""
        return _by_rows(self.overhead, rows)

    def sd_factor(self, rows: int) -> float:
        """An SD step's measured time over its forwards' at ``rows`` running rows (1 without a fit)."""
        return _by_rows(self.sd_scale, rows) if self.sd_scale else 1.0

    # ---------------------------------------------------------------------------------------------- files
    def to_dict(self) -> dict:
        """JSON-able, with :data:`MEASURED_FORMAT` (read back by :meth:`from_dict`)."""
        out = {"format": MEASURED_FORMAT}
        for f in fields(self):
            if f.init:
                v = getattr(self, f.name)
                out[f.name] = json.loads(json.dumps(v)) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "MeasuredCosts":
        """A :meth:`to_dict` of this format; another (an older tltlib's cost model) is refused: measure afresh."""
        if not isinstance(d, dict) or d.get("format") != MEASURED_FORMAT:
            found = d.get("format") if isinstance(d, dict) else repr(d)
            raise BadInput(f"these costs were written in another format ({found}; this tltlib reads "
                           f"{MEASURED_FORMAT!r}): measure them afresh (measure_costs)")
        as_tuple = lambda v: tuple(as_tuple(x) for x in v) if isinstance(v, list) else v        # noqa: E731
        return cls(**{f.name: as_tuple(d[f.name]) for f in fields(cls) if f.init and f.name in d})


def _by_rows(points: tuple, rows: int) -> float:
    """``((rows, seconds), ...)`` interpolated at ``rows``, linearly in log rows (constant beyond the ends; 0 when
    empty)."""
    if not points:
        return 0.0
    at, seconds = zip(*points)
    return float(np.interp(math.log(max(rows, 1)), np.log(at), seconds))


def _linear(xs, ys, x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly beyond both ends (a single point: constant); pure Python
    (asked every decode iteration)."""
    n = len(xs)
    if n == 1:
        return float(ys[0])
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = n - 2
    else:
        i = bisect.bisect_right(xs, x) - 1
    return float(ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i]))


# ---------------------------------------------------------------------------------------- one decode iteration
def iteration_time(costs, rows: int, context: float | None, strategy: SpecStrategy) -> float:
    """Seconds of one decode iteration of ``rows`` running rows after ``context`` cached tokens (None: the shortest
    measured) under ``costs`` (:class:`Roofline` or :class:`MeasuredCosts`): a plain forward and the costs' overhead
    per plain iteration; or an SD step — a learned drafter's catch-up (one entry per row after an SD step; its output
    proposes the first draft level), ``depth - 1`` more draft levels of ``branch`` nodes per row for a tree (one for
    a chain), a model-free proposer's host time for n-gram and suffix drafts (a hybrid pays both), then one verify
    forward over 1 + the verified drafts — times the costs' SD factor."""
    if not strategy.enabled:
        return costs.forward(rows, context, 1) + costs.plain_overhead(rows)
    draft = 0.0
    if strategy.uses_drafter:
        width = 1 if strategy.kind == "chain" else strategy.branch
        draft = costs.catch_up(rows, context, 1) + (strategy.depth - 1) * costs.draft_level(rows, context, width)
    if strategy.kind in ("ngram", "suffix", "hybrid"):
        draft += costs.model_free_s_per_row * rows * (1 if strategy.kind == "ngram" else strategy.verify_tokens)
    return (costs.forward(rows, context, strategy.verify_tokens + 1) + draft) * costs.sd_factor(rows)


def plain_rate(costs, rows: int, context: float | None = None) -> float:
    """Tokens per second of plain decoding at ``rows`` running rows (and ``context``): the tuner's reward scale."""
    return rows / iteration_time(costs, rows, context, OFF)


def predicted_speedup(costs, strategy: SpecStrategy, rows: int, accept: Sequence[float] | float,
                      context: float | None = None) -> float:
    """Predicted speedup of ``strategy`` over plain decoding at ``rows`` running rows (and ``context``), given the
    acceptance ``accept`` (one rate, or the chance of accepting depth d given depth d-1 was, for d = 1, 2, ...):
    tokens per row per step (:func:`tltlib.spec.acceptance.expected_tokens`) over the step's time, against one token
    per plain iteration."""
    if not strategy.enabled:
        return 1.0
    plain = iteration_time(costs, rows, context, OFF)
    return expected_tokens(strategy, accept) * plain / iteration_time(costs, rows, context, strategy)


def switch_cost(costs, rows: int, context: float | None, backlog: float) -> float:
    """Seconds the first SD step after plain iterations pays beyond a later one: its catch-up over ``backlog``
    entries per row instead of one."""
    if backlog <= 1 or not getattr(costs, "draft_s", True):       # measured costs without drafter timings
        return 0.0
    return max(costs.catch_up(rows, context, backlog) - costs.catch_up(rows, context, 1), 0.0)
