"""A simulator of synchronous GRPO steps with and without TLT on W data-parallel rollout workers, for the scales this
machine cannot run (the paper's 1-8 nodes of 8 H100 and its 7B-32B models).

**Costs** (:mod:`tltlib.sim.costs`): one decode iteration of a worker (a tensor-parallel group of ``tp`` devices) over
its running rows, from the roofline of a hardware preset or from costs measured on this machine; an SD step adds
``depth`` draft levels before its verify forward.

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
2. Data parallelism splits whole GRPO groups evenly over the workers (as :mod:`tltlib.rl.world`); the paper's engine
   also rebalances nothing between workers, which is where the tail's idle time comes from.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import BadInput
from ..model.decoder import ModelConfig
from ..spec.strategy import SpecStrategy
from .costs import GB, Hardware, ModelShape, Roofline, iteration_time


# ------------------------------------------------------------------------------------------ the SD policy
@dataclass(frozen=True)
class SDPolicy:
    """When SD runs and with what: off above ``threshold`` running rows; at or below, the strategy of the bucket
    the row count falls in (``buckets``: (lowest rows, strategy name) pairs, increasing; a bucket may instead hold a
    mix ((name, share of iterations), ...), as a measured adaptive rollout that explored plays it), which emits
    ``accept[name]`` tokens per row per SD step (its accept length, bonus token included: measured, or from
    per-depth acceptance with :func:`tltlib.rollout.adaptive.expected_tokens`)."""

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
                    raise BadInput(f"SDPolicy: strategy {name!r} has no accept length; give accept=(({name!r}, "
                                   "tokens per SD step), ...)")
        for name, a in self.accept:
            if not 1 <= a <= SpecStrategy.parse(name).depth + 1:
                raise BadInput(f"SDPolicy: accept length of {name} must be in [1, depth + 1], got {a}")

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
    """Set up, prefill, then decode until every response of ``lengths`` has ended, under ``costs`` (:class:`Roofline` or
    :class:`MeasuredCosts`; see the module docstring)."""
    lengths = np.sort(np.asarray(lengths, dtype=np.float64))
    if lengths.size == 0:
        raise BadInput("a rollout needs at least one response length")
    n = lengths.size
    t = n * costs.setup_s_per_row + costs.forward(n, 0, prompt_len)     # set-up, the prefill of all prompts at once
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
            raise BadInput("a length distribution needs measured samples, or a median > 0 and a p99 >= it; got "
                           f"{len(self.samples)} samples, median {self.median}, p99 {self.p99}")
        if self.cap < 1 or not self.scale > 0:
            raise BadInput(f"cap must be >= 1 and scale > 0, got {self.cap}, {self.scale}")

    @classmethod
    def fit(cls, samples: Sequence[int], cap: int, scale: float = 1.0) -> "LengthDistribution":
        """The log-normal through the samples' median and p99, scaled (e.g. to a longer cap) and cut at ``cap``."""
        x = np.asarray(samples, dtype=np.float64)
        if x.size == 0:
            raise BadInput("cannot fit a length distribution to no samples: give measured response lengths")
        return cls(median=float(np.median(x)) * scale, p99=float(np.percentile(x, 99)) * scale, cap=cap)

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.samples:
            x = rng.choice(np.asarray(self.samples, dtype=np.float64), size=n) * self.scale
        else:
            sigma = math.log(self.p99 / self.median) / 2.326 if self.p99 > self.median else 0.0
            x = self.median * np.exp(sigma * rng.standard_normal(n))
        return np.clip(np.round(x), 1, self.cap)


# ------------------------------------------------------------------------------------------------- a step
class DoesNotFit(BadInput):
    """A configuration whose weights, training states and KV cache do not fit in a device's memory (the message
    says how much it needs)."""


@dataclass(frozen=True)
class StepConfig:
    """One synchronous GRPO step of a cluster."""

    model: ModelConfig
    hardware: Hardware
    nodes: int = 1
    tp: int = 1
    prompts: int = 64
    num_generations: int = 8
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
            raise BadInput(f"{self.devices} devices cannot form groups of tp={self.tp}")
        if self.prompts % self.workers:
            raise BadInput(f"{self.workers} rollout workers cannot share {self.prompts} prompts (whole GRPO groups) "
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

    def harvested(self, micro_step_s: float, max_micro_steps: int | None = None) -> float:
        """Share of the idle time the spot trainer trains in: :func:`harvested_share` of the workers' waits."""
        ends = np.array([w.time_s for w in self.workers])
        return harvested_share(ends.max() - ends, micro_step_s, max_micro_steps)


def harvested_share(idle_s, micro_step_s, max_micro_steps: int | None = None) -> float:
    """Share of idle windows ``idle_s`` (seconds, one per waiting worker) that the spot trainer trains in: each
    window but half a micro-step (the one preempted when the last rollout ends, on average), and at most
    ``max_micro_steps`` micro-steps of ``micro_step_s`` per window (its budget); NaN without idle time."""
    idle = np.asarray(idle_s, dtype=np.float64)
    micro = np.broadcast_to(np.asarray(micro_step_s, dtype=np.float64), idle.shape)
    trained = np.maximum(idle - micro / 2, 0)
    if max_micro_steps is not None:
        trained = np.minimum(trained, max_micro_steps * micro)
    return float(trained.sum() / idle.sum()) if idle.sum() > 0 else float("nan")


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
    rows = cfg.prompts * cfg.num_generations // cfg.workers
    if lengths is None:
        rng = np.random.default_rng(cfg.seed)
        lengths = [cfg.lengths.draw(rows, rng) for _ in range(cfg.workers)]
    lengths = [np.asarray(x, dtype=np.float64) for x in lengths]
    if len(lengths) != cfg.workers or any(x.size != rows for x in lengths):
        raise BadInput(f"lengths: give {cfg.workers} worker(s) x {rows} response lengths, got "
                       f"{[x.size for x in lengths]}")
    costs = cfg.costs or Roofline(shape, hw, cfg.tp)
    sims = [simulate_rollout(costs, x, cfg.prompt_len, policy) for x in lengths]
    parts = memory_needed(cfg, max(s.peak_kv_tokens for s in sims))
    need = sum(parts.values())
    if check_memory and need > hw.memory * hw.mem_util:
        raise DoesNotFit(f"{cfg.model.num_parameters / 1e9:.1f} B parameters on {cfg.nodes} node(s) of {hw.name} "
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
