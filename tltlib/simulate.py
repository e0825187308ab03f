"""A simulator of synchronous GRPO steps with and without TLT on W data-parallel rollout workers, for the scales this
machine cannot run (the paper's 1-8 nodes of 8 H100 and its 7B-32B models).

**Costs.** One decode iteration of a worker (a tensor-parallel group of ``tp`` devices) over ``rows`` running rows,
each with ``context`` tokens in its cache and ``tokens`` new tokens (1 for plain decoding, 1 + the verified drafts
for an SD step) costs, on the roofline of the hardware (:func:`forward_time`):

    max(bytes / (mem_bw x bw_eff), flops / (peak_flops x flops_eff)) + 2 layers x TP all-reduce + iteration_s

with bytes = the weights read once (/ tp) + the rows' KV cache read, flops = 2 x parameters x new tokens + the
attention over the cache. An SD step adds ``depth`` drafter forwards (one decoder layer and the LM head, each a
forward of the same kind) before its verify forward.

**A rollout** (:func:`simulate_rollout`): the worker's responses have given lengths; all running rows advance together
(plain: one token per iteration; an SD step: the strategy's accept length, its expected tokens per row), so the
running set only changes when a response ends, and the rollout is simulated interval by interval between those
events. The SD policy picks, at each running-row count, off (above ``threshold``) or a strategy. It returns the
time, the running-rows timeline and the peak KV cache.

**A step** (:func:`simulate_step`): every worker's rollout (lengths drawn per worker), then the synchronous rest:
log-probability forwards and the update (6 x parameters x tokens on every device, at ``train_eff``), the gradient
all-reduce, the weight sync to the rollout engine; with TLT the spot trainer fills each worker's idle window (the
last rollout's end minus its own) and costs the step only its preemption (half a micro-step on average) and the
drafter sync. Memory is checked per device: the training states (sharded over every device, as FSDP/ZeRO-3), the
rollout weights (/ tp) and the peak KV cache (/ tp) must fit; otherwise the configuration is refused with the
amount it needs.

Paper: TLT §7 (Table 3: 1.21/1.45/1.62/1.76x for Qwen2.5-7B on 1/2/4/8 nodes, 1.83/2.12x for Qwen2.5-32B on 4/8;
the rollout ~85% of a step). Departures:
1. Expected values, not samples: every running row advances by the strategy's accept length per SD step (the
   acceptance's variance, and the engine's queueing when KV memory runs short, are not modelled).
2. Data parallelism splits whole GRPO groups evenly over the workers (as :mod:`tltlib.world`); the paper's engine
   also rebalances nothing between workers, which is where the tail's idle time comes from.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .model import ModelConfig
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


@dataclass(frozen=True)
class MeasuredCosts:
    """Forward and draft-level seconds measured on one machine (:func:`tltlib.calibrate.measure_costs`),
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

    def __post_init__(self):
        t = np.asarray(self.target_s, dtype=np.float64)
        if t.shape != (len(self.rows), len(self.contexts), len(self.tokens)) or not (t > 0).all():
            raise ValueError(f"MeasuredCosts: target_s must be positive seconds of shape rows x contexts x tokens "
                             f"({len(self.rows)}, {len(self.contexts)}, {len(self.tokens)}), got {t.shape}")

    def forward(self, rows: int, context: float, tokens: int) -> float:
        return _interp(self.target_s, self.rows, self.contexts, self.tokens, rows, context, tokens)

    def draft_level(self, rows: int, context: float, width: int) -> float:
        if not self.draft_s:
            raise ValueError("these measured costs have no drafter timings: measure them with a drafter")
        return _interp(self.draft_s, self.rows, self.contexts, self.widths, rows, context, width)


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
    for n-gram drafts; then one verify forward over 1 + the verified drafts)."""
    if not strategy.enabled:
        return costs.forward(rows, context, 1)
    verify = costs.forward(rows, context, strategy.verify_tokens + 1)
    if strategy.kind == "ngram":
        return verify
    width = strategy.top_k if strategy.kind == "tree" else 1
    return verify + strategy.depth * costs.draft_level(rows, context, width)


# ------------------------------------------------------------------------------------------ the SD policy
@dataclass(frozen=True)
class SDPolicy:
    """When SD runs and with what: off above ``threshold`` running rows; at or below, the strategy of the bucket
    the row count falls in (``buckets``: (lowest rows, strategy name) pairs, increasing; a bucket may instead hold a
    mix ((name, share of iterations), ...), as a measured adaptive rollout that explored plays it), which emits
    ``accept[name]`` tokens per row per SD step (its accept length, bonus token included: measured, or from
    per-depth acceptance with :func:`tltlib.adaptive.expected_tokens`)."""

    threshold: int = 0
    buckets: tuple = ()
    accept: tuple = ()
    """(strategy name, tokens per row per SD step) pairs."""

    def __post_init__(self):
        names = dict(self.accept)
        for lo, played in self.buckets:
            for name, _ in _as_mix(played):
                SpecStrategy.parse(name)
                if name != "off" and name not in names:
                    raise ValueError(f"SDPolicy: strategy {name!r} has no accept length; give accept=(({name!r}, "
                                     "tokens per SD step), ...)")
        for name, a in self.accept:
            if not 1 <= a <= SpecStrategy.parse(name).depth + 1:
                raise ValueError(f"SDPolicy: accept length of {name} must be in [1, depth + 1], got {a}")

    def mix(self, rows: int) -> list[tuple[SpecStrategy, float, float]]:
        """(strategy, tokens per row per iteration, share of iterations) at ``rows`` running rows."""
        if rows > self.threshold or not self.buckets:
            return [(SpecStrategy(), 1.0, 1.0)]
        played = [p for lo, p in self.buckets if rows >= lo]
        accept = dict(self.accept)
        return [(SpecStrategy.parse(n), accept.get(n, 1.0), w)
                for n, w in _as_mix(played[-1] if played else self.buckets[0][1])]

    def choose(self, rows: int) -> tuple[SpecStrategy, float]:
        """The (strategy, tokens per row per iteration) played most at ``rows`` running rows."""
        strategy, tokens, _ = max(self.mix(rows), key=lambda m: m[2])
        return strategy, tokens


def _as_mix(played) -> tuple:
    """A bucket's strategy name or mix as ((name, share), ...) with shares summing to 1."""
    pairs = ((played, 1.0),) if isinstance(played, str) else tuple(played)
    total = sum(w for _, w in pairs)
    return tuple((n, w / total) for n, w in pairs)


OFF = SDPolicy()


# --------------------------------------------------------------------------------------------- a rollout
@dataclass
class RolloutSim:
    """One worker's simulated rollout."""

    time_s: float
    timeline: list = field(default_factory=list)
    """(seconds at the end of an interval, running rows, strategy name) per interval between response ends."""
    peak_kv_tokens: float = 0.0
    """Most tokens in the KV cache at once (finished responses free theirs)."""


def simulate_rollout(costs, lengths: Sequence[int], prompt_len: int, policy: SDPolicy = OFF) -> RolloutSim:
    """Prefill, then decode until every response of ``lengths`` has ended, under ``costs`` (:class:`Roofline` or
    :class:`MeasuredCosts`; see the module docstring)."""
    lengths = np.sort(np.asarray(lengths, dtype=np.float64))
    if lengths.size == 0:
        raise ValueError("a rollout needs at least one response length")
    n = lengths.size
    t = costs.forward(n, 0, prompt_len)                            # the prefill, all prompts at once
    gen, done, out = 0.0, 0, RolloutSim(0.0)
    while done < n:
        rows = n - done
        mix = policy.mix(rows)                                     # one strategy, or the shares a bandit played
        per_iter = sum(a * w for _, a, w in mix)
        k = max(1, math.ceil((lengths[done] - gen) / per_iter))    # iterations until the next response ends
        mid = prompt_len + gen + k * per_iter / 2
        t += k * sum(w * iteration_time(costs, rows, mid, st) for st, _, w in mix)
        gen += k * per_iter
        out.peak_kv_tokens = max(out.peak_kv_tokens, rows * (prompt_len + min(gen, lengths[-1])))
        out.timeline.append((t, rows, max(mix, key=lambda m: m[2])[0].name))
        done = int(np.searchsorted(lengths, gen, side="right"))
    out.time_s = t
    return out


# ------------------------------------------------------------------------------------ response lengths
@dataclass(frozen=True)
class LengthDistribution:
    """Response lengths: resampled from measured ``samples`` (scaled by ``scale``), or a log-normal fitted to a
    median and a 99th percentile; either way cut at ``cap`` (the maximum completion length: the paper's 32K), where
    the cut responses pile up as they do in a real rollout."""

    samples: tuple = ()
    median: float = 0.0
    p99: float = 0.0
    cap: int = 32768
    scale: float = 1.0

    def __post_init__(self):
        if not self.samples and not (self.median > 0 and self.p99 >= self.median):
            raise ValueError("a length distribution needs measured samples, or a median > 0 and a p99 >= it; got "
                             f"{len(self.samples)} samples, median {self.median}, p99 {self.p99}")
        if self.cap < 1 or not self.scale > 0:
            raise ValueError(f"cap must be >= 1 and scale > 0, got {self.cap}, {self.scale}")

    @classmethod
    def fit(cls, samples: Sequence[int], cap: int, scale: float = 1.0) -> "LengthDistribution":
        """The log-normal through the samples' median and p99, scaled (e.g. to a longer cap) and cut at ``cap``."""
        x = np.asarray(samples, dtype=np.float64)
        if x.size == 0:
            raise ValueError("cannot fit a length distribution to no samples: give measured response lengths")
        return cls(median=float(np.median(x)) * scale, p99=float(np.percentile(x, 99)) * scale, cap=cap)

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.samples:
            x = rng.choice(np.asarray(self.samples, dtype=np.float64), size=n) * self.scale
        else:
            sigma = math.log(self.p99 / self.median) / 2.326 if self.p99 > self.median else 0.0
            x = self.median * np.exp(sigma * rng.standard_normal(n))
        return np.clip(np.round(x), 1, self.cap)


# ------------------------------------------------------------------------------------------------- a step
@dataclass(frozen=True)
class StepConfig:
    """One synchronous GRPO step of a cluster."""

    model: ModelConfig
    hardware: Hardware
    nodes: int = 1
    tp: int = 1
    prompts: int = 64
    group: int = 8
    prompt_len: int = 512
    lengths: LengthDistribution = field(default_factory=lambda: LengthDistribution(median=2000, p99=24000))
    dtype_bytes: int = 2
    logprob_passes: int = 1
    """No-grad forwards over the batch before the update (the old policy's log-probs; 2 with a reference)."""
    micro_step_s: float = 0.1
    """One drafter micro-step (the spot trainer's preemption costs half of one on average)."""
    drafter_steps: int = 0
    """Drafter micro-steps on the step's critical path when there is no spot trainer (one process)."""
    weight_sync: bool = True
    """Copy the trained weights to a separate rollout engine each step (verl, TRL with vLLM); False when the engine
    decodes with the training module itself (tltlib)."""
    costs: object = None
    """Measured forward costs of this machine (:class:`MeasuredCosts`) instead of the hardware's roofline."""
    update_tokens_per_s: float = 0.0
    """Measured update throughput per device (tokens/s, forward + backward); 0: from the hardware's train_eff."""
    seed: int = 0

    @property
    def devices(self) -> int:
        return self.nodes * self.hardware.devices_per_node

    @property
    def workers(self) -> int:
        """Data-parallel rollout workers: tensor-parallel groups."""
        return self.devices // self.tp

    def __post_init__(self):
        ModelShape(self.model).check_tp(self.tp)
        if self.nodes < 1 or self.devices % self.tp:
            raise ValueError(f"{self.devices} devices cannot form groups of tp={self.tp}")
        if self.prompts % self.workers:
            raise ValueError(f"{self.workers} rollout workers cannot share {self.prompts} prompts (whole GRPO groups) "
                             "evenly; change prompts, nodes or tp")


@dataclass
class StepSim:
    """A simulated step: seconds per phase, the workers' rollouts, idle and harvested shares."""

    policy: str
    rollout_s: float
    logprob_s: float
    update_s: float
    sync_s: float
    drafter_s: float
    workers: list
    """Every worker's :class:`RolloutSim`."""
    memory_gb: float
    """Per device (:func:`memory_needed`, summed)."""

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.logprob_s + self.update_s + self.sync_s + self.drafter_s

    @property
    def idle_frac(self) -> float:
        """Share of the workers' rollout time spent waiting for the last one."""
        ends = np.array([w.time_s for w in self.workers])
        return float((ends.max() - ends).sum() / (ends.max() * ends.size))

    def harvested(self, micro_step_s: float) -> float:
        """Share of the idle time the spot trainer trains in (all but the last, interrupted micro-step)."""
        ends = np.array([w.time_s for w in self.workers])
        idle = ends.max() - ends
        return float(np.maximum(idle - micro_step_s / 2, 0).sum() / idle.sum()) if idle.sum() > 0 else float("nan")


def memory_needed(cfg: StepConfig, peak_kv_tokens: float) -> dict[str, float]:
    """Bytes per device by purpose: the training states (bf16 weights and gradients, fp32 master weights and AdamW
    moments, sharded over every device as FSDP/ZeRO-3), the update's activations (one sequence of the longest
    length per micro-batch, each layer's input kept for gradient checkpointing), the rollout engine's weights and
    its peak KV cache (over the TP group)."""
    shape, c = ModelShape(cfg.model, cfg.dtype_bytes), cfg.model
    return {"training states": c.num_parameters * (2 * cfg.dtype_bytes + 12) / cfg.devices,
            "update activations": c.num_layers * (cfg.prompt_len + cfg.lengths.cap) * c.hidden_size * cfg.dtype_bytes,
            "rollout weights": shape.decode_bytes / cfg.tp,
            "KV cache": peak_kv_tokens * shape.kv_bytes_per_token / cfg.tp}


def simulate_step(cfg: StepConfig, policy: SDPolicy = OFF, name: str = "baseline", spot_trainer: bool = False,
                  check_memory: bool = True, lengths: Sequence | None = None) -> StepSim:
    """One synchronous RL step (see the module docstring); the same lengths for every policy at one seed, or the
    given ``lengths`` (one sequence of response lengths per worker: a measured step)."""
    shape, hw = ModelShape(cfg.model, cfg.dtype_bytes), cfg.hardware
    rows = cfg.prompts * cfg.group // cfg.workers
    if lengths is None:
        rng = np.random.default_rng(cfg.seed)
        lengths = [cfg.lengths.draw(rows, rng) for _ in range(cfg.workers)]
    lengths = [np.asarray(x, dtype=np.float64) for x in lengths]
    if len(lengths) != cfg.workers or any(x.size != rows for x in lengths):
        raise ValueError(f"lengths: give {cfg.workers} worker(s) x {rows} response lengths, got "
                         f"{[x.size for x in lengths]}")
    costs = cfg.costs or Roofline(shape, hw, cfg.tp)
    sims = [simulate_rollout(costs, x, cfg.prompt_len, policy) for x in lengths]
    parts = memory_needed(cfg, max(s.peak_kv_tokens for s in sims))
    need = sum(parts.values())
    if check_memory and need > hw.memory * hw.mem_util:
        raise ValueError(f"{cfg.model.num_parameters / 1e9:.1f} B parameters on {cfg.nodes} node(s) of {hw.name} "
                         f"(tp {cfg.tp}) need {need / GB:.0f} GB per device ("
                         + ", ".join(f"{k} {v / GB:.0f} GB" for k, v in parts.items()) +
                         f") but {hw.memory * hw.mem_util / GB:.0f} GB of a device's {hw.memory / GB:.0f} GB are "
                         "usable: add nodes, raise tp or shorten the responses")
    tokens = float(sum((x + cfg.prompt_len).sum() for x in lengths))
    update, logprob = _update_times(cfg, tokens)
    grad_bw = hw.net_bw if cfg.nodes > 1 else hw.link_bw              # the ring's slowest link
    grads = 2 * cfg.model.num_parameters * cfg.dtype_bytes * (cfg.devices - 1) / cfg.devices / grad_bw
    weights = shape.decode_bytes / cfg.tp / hw.link_bw if cfg.weight_sync else 0.0   # training -> rollout engine
    merge = 2 * shape.drafter_bytes / grad_bw if cfg.devices > 1 else 0.0             # the drafters' all-reduce
    if spot_trainer and cfg.workers > 1:                             # in the idle windows: preemption + merge
        drafter = cfg.micro_step_s / 2 + merge
    else:                                                            # after the update, on the critical path
        drafter = cfg.drafter_steps * cfg.micro_step_s + (merge if cfg.drafter_steps else 0.0)
    return StepSim(name, max(s.time_s for s in sims), logprob, update, grads + weights, drafter, sims, need / GB)


def _update_times(cfg: StepConfig, tokens: float) -> tuple[float, float]:
    """(update, log-prob forwards) seconds for ``tokens`` prompt + response tokens spread over every device."""
    hw, per_device = cfg.hardware, tokens / cfg.devices
    if cfg.update_tokens_per_s:                                      # measured: a forward is a third of an update
        update = per_device / cfg.update_tokens_per_s
        return update, cfg.logprob_passes * update / 3
    flops_token = 2 * cfg.model.num_parameters
    return (3 * flops_token * per_device / (hw.peak_flops * hw.train_eff),
            cfg.logprob_passes * flops_token * per_device / (hw.peak_flops * hw.flops_eff))


def compare_policies(cfg: StepConfig, tlt: SDPolicy, tlt_base: SDPolicy | None = None) -> dict[str, StepSim]:
    """Baseline (no SD), TLT-Base (``tlt_base``: the n-gram drafter only) and TLT (``tlt``, spot trainer on) on the
    same lengths; ``result[name].step_s`` etc."""
    out = {"baseline": simulate_step(cfg)}
    if tlt_base is not None:
        out["tlt-base"] = simulate_step(cfg, tlt_base, "tlt-base")
    out["tlt"] = simulate_step(cfg, tlt, "tlt", spot_trainer=True)
    return out
