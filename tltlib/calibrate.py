"""The simulator against this machine: measure its costs, then check its predictions against runs measured here
(``python -m tltlib simulate --validate``).

1. **Costs** (:func:`measure_costs`): target forwards of rows x new tokens after short and long cached contexts,
   drafter forwards of 1 and ``top_k`` nodes per row — a :class:`tltlib.costs.MeasuredCosts` table, the same costs
   the simulator uses for hardware it only knows from its datasheet; then the engine's costs beyond its forwards
   (sampling, bookkeeping; :func:`fit_overheads`) fitted on rollouts of other prompts than the checks', and the
   update's tokens per second and a drafter micro-step from a warm-up GRPO step of each policy.
2. **Runs** measured in the same process, then simulated from their own inputs (the responses' lengths, the SD
   strategies the adaptive engine played and their accept lengths): a long-tailed rollout without SD and with the
   adaptive engine (rollout time and speedup); GRPO steps of the baseline and of TLT in one process, interleaved
   (median step time and the step speedup).
   Data parallelism: 2 workers' shards of the rollout, run one after the other here (the idle share of the
   slowest worker's wait), and the spot trainer's harvested share in a ``bench e2e_grpo --workers 2`` results file
   against the simulator's preemption model, from that file's measured idle windows and micro-steps.
3. **Checks** (:class:`Check`): predicted / measured within ``tolerance`` (15%; shares within 5 points), each
   named; the command exits non-zero when one is off. Every prediction of a time is scaled by the machine's speed
   drift since the costs were measured (:class:`Drift`: a fixed forward timed just before each measured run).

Departures: the workers' shards run one after the other on all of this machine's threads, not one thread each as
under torchrun (the idle share depends on the shards' lengths and on how a rollout's cost scales with its rows).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from .adaptive import DEFAULT_ARMS, AdaptiveConfig, AdaptiveController, TunerConfig, timed_rollout
from .adaptive import measure_costs as controller_costs
from .grpo import GRPOConfig
from .rollout import RolloutConfig, RolloutEngine
from .sampling import SamplingConfig
from .costs import MeasuredCosts, hardware, iteration_time
from .simulate import (OFF, LengthDistribution, SDPolicy, StepConfig, harvested_share, simulate_rollout,
                       simulate_step)
from .profiling import call_times
from .speculative import SpecStrategy
from .tasks import ChainTaskConfig, encode_prompts, generate_problems
from .trainer import GRPOTrainer, TLTConfig

TOLERANCE = 0.15
SHARE_TOLERANCE = 0.05


@dataclass
class Check:
    """One prediction of the simulator next to its measurement. Times and speedups are compared relatively
    (``tolerance``: 15%); shares (``share=True``: idle, harvested) in points (``tolerance``: 0.05 = 5 points), since
    15% of a 3% idle share is far below the machine's noise."""

    what: str
    predicted: float
    measured: float
    tolerance: float = TOLERANCE
    share: bool = False

    def __post_init__(self):
        if self.share and self.tolerance == TOLERANCE:
            self.tolerance = SHARE_TOLERANCE

    @property
    def error(self) -> float:
        """predicted / measured - 1; for a share, predicted - measured."""
        return self.predicted - self.measured if self.share else self.predicted / self.measured - 1

    @property
    def ok(self) -> bool:
        return abs(self.error) <= self.tolerance


class Drift:
    """The machine's speed now against its speed while the costs were measured: a fixed decode forward (``rows``
    x 1 token after ``context`` cached ones, the median of ``calls``) timed now over the same timed at calibration.
    A shared VM's speed moves by tens of percent within minutes; predictions made from costs measured minutes
    earlier are scaled by :meth:`factor`, taken just before each measured run."""

    def __init__(self, model, rows: int = 16, context: int = 256, calls: int = 15):
        self.model, self.rows, self.context, self.calls = model, rows, context, calls
        self.reference: list[float] = []

    @torch.no_grad()
    def probe(self) -> float:
        """Seconds of the fixed forward now (median of ``calls``)."""
        dev, vocab = self.model.device, self.model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        cache = self.model.new_cache(self.rows, self.context + 2)
        prompt = torch.randint(0, vocab, (self.rows, self.context), generator=g).to(dev)
        self.model.forward_cached(prompt, cache, logits_at=torch.full((self.rows,), self.context - 1, device=dev))
        cache.advance(self.context)
        x = torch.randint(0, vocab, (self.rows, 1), generator=g).to(dev)
        return _typical(lambda: self.model.forward_cached(x, cache), self.calls, dev)

    def calibrating(self) -> None:
        """Time the probe as part of the reference (call it while the costs are measured)."""
        self.reference.append(self.probe())

    def factor(self) -> float:
        """The probe now over the reference's median (1: as fast as at calibration; 1.2: 20% slower)."""
        return self.probe() / float(np.median(self.reference)) if self.reference else 1.0


# -------------------------------------------------------------------------------------------------- costs
@torch.no_grad()
def measure_costs(model, drafter=None, rows=(1, 2, 4, 8, 16, 32, 64, 128), contexts=(32, 256, 768),
                  tokens=(1, 5, 9, 17), widths=(1, 4), repeats=5) -> MeasuredCosts:
    """Seconds of target forwards (``rows`` x ``tokens`` new tokens after each of ``contexts`` cached ones) and of
    drafter forwards (``widths`` nodes per row), the median of ``repeats`` after a warm-up."""
    dev, vocab = model.device, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    target = np.zeros((len(rows), len(contexts), len(tokens)))
    draft = np.zeros((len(rows), len(contexts), len(widths)))
    for i, b in enumerate(rows):
        for j, ctx in enumerate(contexts):
            cache = model.new_cache(b, ctx + max(tokens) + 1)
            prompt = torch.randint(0, vocab, (b, ctx), generator=g).to(dev)
            _, h = model.forward_cached(prompt, cache, logits_at=torch.full((b,), ctx - 1, device=dev))
            cache.advance(ctx)
            for k, n in enumerate(tokens):
                x = torch.randint(0, vocab, (b, n), generator=g).to(dev)
                target[i, j, k] = _typical(lambda x=x: model.forward_cached(x, cache), repeats, dev)
            if drafter is None:
                continue
            dcache = drafter.new_cache(b, ctx + max(widths) + 1)
            drafter.forward_cached(h[:, :-1], prompt[:, 1:], dcache, logits_at=torch.full((b,), ctx - 2, device=dev))
            dcache.advance(ctx - 1)
            for k, n in enumerate(widths):
                f = h[:, -1:].expand(b, n, h.shape[-1]).contiguous()
                x = torch.randint(0, vocab, (b, n), generator=g).to(dev)
                draft[i, j, k] = _typical(lambda f=f, x=x: drafter.forward_cached(f, x, dcache), repeats, dev)
    as_tuple = lambda a: tuple(tuple(tuple(float(v) for v in c) for c in r) for r in a)       # noqa: E731
    return MeasuredCosts(tuple(rows), tuple(contexts), tuple(tokens), as_tuple(target), tuple(widths),
                         as_tuple(draft) if drafter is not None else ())


def _typical(fn, repeats: int, dev) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after a warm-up call."""
    return float(np.median(call_times(fn, repeats, dev)))


def _factor(drift: Drift | None) -> float:
    """The machine's speed drift now (1 without a :class:`Drift`)."""
    return drift.factor() if drift else 1.0


def policy_from(timeline: dict) -> SDPolicy:
    """The SD policy a measured rollout played: at each running-row count the strategies of its iterations with
    their shares (plain decoding included), each strategy's measured tokens per row per SD step, SD on up to the
    most rows it ran at."""
    strategy = np.asarray(timeline["strategy"]).astype(str)
    on = strategy != "off"
    if not on.any():
        return OFF
    active = np.asarray(timeline["active"])
    accepted = np.asarray(timeline["accepted"], dtype=np.float64)
    accept = {n: float((accepted[strategy == n].sum() + active[strategy == n].sum()) / active[strategy == n].sum())
              for n in set(strategy[on])}
    buckets = []
    for rows in sorted(set(active[active <= active[on].max()])):
        names, counts = np.unique(strategy[active == rows], return_counts=True)
        buckets.append((int(rows), tuple((str(n), int(c)) for n, c in zip(names, counts))))
    return SDPolicy(threshold=int(active[on].max()), buckets=tuple(buckets), accept=tuple(sorted(accept.items())))


# --------------------------------------------------------------------------------------------------- runs
def _cpu_step(model, costs: MeasuredCosts, prompts: int, group: int, prompt_len: float, **kw) -> StepConfig:
    """The StepConfig of a one-process run on this machine (measured costs, the engine decodes with the policy)."""
    return StepConfig(model.config, hardware("cpu"), nodes=1, tp=1, prompts=prompts, group=group,
                      prompt_len=int(round(prompt_len)), lengths=LengthDistribution(samples=(1,)),
                      dtype_bytes=model.embed.weight.element_size(), logprob_passes=0, weight_sync=False, costs=costs,
                      **kw)


def fit_overheads(costs: MeasuredCosts, rollouts) -> MeasuredCosts:
    """``costs`` with the engine's costs beyond its forwards (:attr:`MeasuredCosts.overhead`, ``sd_scale``) fitted
    to measured rollouts (``(timeline, prompt length)`` pairs), per band of running rows (doubling from 1): for
    plain iterations the median of measured less predicted seconds (smoothed by a line in the rows: a band holds
    few iterations), for SD steps the median of measured over predicted. Rollouts without plain iterations (or
    without SD steps) keep ``costs``' fit of those."""
    bare = replace(costs, overhead=(), sd_scale=())
    plain, sd = [], []
    for timeline, prompt_len in rollouts:
        gen = 0.0
        for rows, seconds, name, accepted in zip(timeline["active"], timeline["iter_time"], timeline["strategy"],
                                                 timeline["accepted"]):
            st = SpecStrategy.parse(str(name))
            predicted = iteration_time(bare, rows, prompt_len + gen, st)
            if st.enabled:
                sd.append((rows, seconds / predicted))
            else:
                plain.append((rows, seconds - predicted))
            gen += 1 + (accepted / rows if st.enabled else 0)
    if not plain and not sd:
        raise ValueError("no decode iterations to fit the overhead to: the calibration rollout was empty")
    return replace(bare, overhead=_band_line(plain) if plain else costs.overhead,
                   sd_scale=_band_medians(sd) if sd else costs.sd_scale)


def _band_line(points) -> tuple:
    """The medians of :func:`_band_medians`, smoothed: a line in the rows through them (weighted by how many
    points each band holds), evaluated at each band's median rows."""
    bands = _band_medians(points)
    if len(bands) < 2:
        return bands
    rows, y = np.asarray(points, dtype=np.float64).T
    counts = [int((np.floor(np.log2(rows)) == math.floor(math.log2(r))).sum()) for r, _ in bands]
    xs, ys = zip(*bands)
    slope, intercept = np.polyfit(xs, ys, 1, w=np.sqrt(counts))
    return tuple((x, float(intercept + slope * x)) for x in xs)


def _band_medians(points) -> tuple:
    """((median rows, median value), ...) of ``(rows, value)`` points per band of rows doubling from 1."""
    if not points:
        raise ValueError("no decode iterations to fit the overhead to: the calibration rollout was empty")
    rows, y = np.asarray(points, dtype=np.float64).T
    band = np.floor(np.log2(rows)).astype(int)
    return tuple((float(np.median(rows[band == k])), float(np.median(y[band == k]))) for k in np.unique(band))


def calibrate_engine(model, tokenizer, drafter, costs: MeasuredCosts, count: int, group: int, max_new: int,
                     temperature: float, threshold: int = 32, seed: int = 0):
    """Rollouts of other prompts than any check's (seeds ``seed + 100 ...``): one without SD, one with chain-8 at or
    below ``threshold`` rows and two with the adaptive engine (which tune its bandit); returns (``costs`` with the
    overheads :func:`fit_overheads` finds in them, the tuned controller)."""
    engine = RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new),
                                                group_size=group), drafter=drafter)
    controller = AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(
        arms=("off", *DEFAULT_ARMS), seed=seed)), controller_costs(model, drafter, max_batch=threshold), drafter)
    chain8, plain = SpecStrategy.parse("chain-8"), SpecStrategy()
    fixed = lambda it, rows: chain8 if rows <= threshold else plain               # noqa: E731
    measured = []
    for i, strategy in enumerate((None, fixed, controller, controller)):
        prompts = encode_prompts(generate_problems(ChainTaskConfig(), count, seed=seed + 100 + i), tokenizer)
        timed_rollout(engine, prompts[:2], strategy, seed + i)                          # warm-up
        res, _ = timed_rollout(engine, prompts, strategy, seed + i)
        measured.append((res.timeline, float(np.mean([len(p) for p in prompts]))))
    return fit_overheads(costs, measured), controller


def check_rollouts(model, tokenizer, drafter, costs: MeasuredCosts, controller, problems, group: int, max_new: int,
                   temperature: float, threshold: int = 32, seed: int = 0, repeats: int = 3,
                   drift: Drift | None = None) -> list[Check]:
    """A long-tailed rollout without SD, with chain-8 at or below ``threshold`` rows, and with the adaptive engine
    (``controller``, tuned on other prompts), in ``repeats`` rounds (the three interleaved in each): each measured,
    then simulated from its own lengths and the strategies it played (scaled by the machine's ``drift`` just
    before it); medians over the rounds."""
    engine = RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new),
                                                group_size=group), drafter=drafter)
    prompts = encode_prompts(problems, tokenizer)
    chain8, plain = SpecStrategy.parse("chain-8"), SpecStrategy()
    fixed = lambda it, rows: chain8 if rows <= threshold else plain               # noqa: E731
    plen = int(round(float(np.mean([len(p) for p in prompts]))))
    arms = {"no SD": None, f"chain-8 at <= {threshold} rows": fixed, "adaptive": controller}
    runs = {name: [] for name in arms}                                            # (simulated, measured) seconds
    for _ in range(repeats):
        for name, strategy in arms.items():
            f = _factor(drift)
            res, seconds = timed_rollout(engine, prompts, strategy, seed)
            policy = policy_from(res.timeline) if strategy is not None else OFF
            runs[name].append((f * simulate_rollout(costs, res.lengths.numpy(), plen, policy).time_s, seconds))
    times = {name: tuple(float(np.median(v)) for v in zip(*r)) for name, r in runs.items()}
    checks = [Check(f"rollout {len(prompts)} x {group}, {name}: median seconds", p, m)
              for name, (p, m) in times.items()]
    for name in list(times)[1:]:
        (p0, m0), (p1, m1) = times["no SD"], times[name]
        checks.append(Check(f"rollout speedup, {name} over no SD", p0 / p1, m0 / m1))
    return checks


def check_workers(model, tokenizer, costs: MeasuredCosts, problems, group: int, max_new: int, temperature: float,
                  workers: int = 2, seed: int = 0, repeats: int = 3, drift: Drift | None = None) -> list[Check]:
    """Data-parallel rollout workers, one after the other on this machine: each rolls out its shard of whole GRPO
    groups without SD (``repeats`` rounds, medians); the idle share (the wait for the slowest, over every worker's
    time) measured from their times, and simulated from each shard's own lengths."""
    if len(problems) % workers:
        raise ValueError(f"{workers} workers cannot share {len(problems)} prompts evenly (whole GRPO groups)")
    engine = RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new),
                                                group_size=group))
    shard = len(problems) // workers
    measured, predicted = [[] for _ in range(workers)], [[] for _ in range(workers)]
    for _ in range(repeats):
        for w in range(workers):
            prompts = encode_prompts(problems[w * shard:(w + 1) * shard], tokenizer)
            f = _factor(drift)
            res, seconds = timed_rollout(engine, prompts, None, seed + w)
            plen = int(round(float(np.mean([len(p) for p in prompts]))))
            measured[w].append(seconds)
            predicted[w].append(f * simulate_rollout(costs, res.lengths.numpy(), plen).time_s)
    measured = [float(np.median(m)) for m in measured]
    predicted = [float(np.median(p)) for p in predicted]
    idle = lambda t: float((max(t) - np.asarray(t)).sum() / (max(t) * len(t)))          # noqa: E731
    return [Check(f"{workers} workers x {shard} prompts, slowest worker's rollout: median seconds", max(predicted),
                  max(measured)),
            Check(f"{workers} workers, idle share of the rollout", idle(predicted), idle(measured), share=True)]


def check_harvest(results_json) -> list[Check]:
    """The spot trainer's harvested share in a ``bench e2e_grpo --workers W`` results file against the simulator's
    model of it (every idle window trained but for half a micro-step lost to preemption), from the same file's
    measured idle windows and micro-step times."""
    from pathlib import Path

    from .fileio import read_json
    if not Path(results_json).is_file():
        raise FileNotFoundError(f"{results_json}: no such results file; run `python -m tltlib bench e2e_grpo "
                                "--workers 2` to write it (or skip the check: --workers-results '')")
    d = read_json(results_json, "run python -m tltlib bench e2e_grpo --workers 2 to write it")
    sched = (d.get("summary") or {}).get("schedule")
    if not sched or not sched.get("idle_s_by_step"):
        raise ValueError(f"{results_json}: no spot-trainer schedule (summary.schedule.idle_s_by_step); is it a "
                         "bench e2e_grpo --workers results file?")
    idle = np.asarray(sched["idle_s_by_step"], dtype=np.float64)      # per step, summed over the waiting workers
    micro = np.nan_to_num(np.asarray(sched["micro_step_s_by_step"], dtype=np.float64))
    train = np.asarray(sched["train_s_by_step"], dtype=np.float64)
    if d["workers"] != 2:       # the file sums the waits of a step: one window per step only with 2 workers
        raise ValueError(f"{results_json}: check_harvest reads runs of 2 workers (one idle window per step); this "
                         f"one ran {d['workers']}")
    predicted = harvested_share(idle, micro, d["settings"].get("spot_max"))
    return [Check(f"{d['workers']} workers (bench file), share of idle time the spot trainer harvested", predicted,
                  float(train.sum() / idle.sum()), share=True)]


def check_steps(model, tokenizer, drafter, costs: MeasuredCosts, problems, args: GRPOConfig, tlt: TLTConfig,
                steps: int, drift: Drift | None = None) -> tuple[list[Check], float, float]:
    """GRPO steps of the baseline and of TLT in one process, interleaved after one warm-up step each, measured;
    each simulated from its own lengths and the SD strategies it played, with the update rate, the drafter
    micro-step and the engine's costs beyond its forwards (:func:`fit_overheads`: TLT's rollout also streams
    drafter pairs) that each policy's warm-up step measured (carried to the reference speed; each step's
    prediction scaled by the machine's ``drift`` just before it). Returns (checks, update tokens/s and seconds per drafter
    micro-step at the reference speed)."""
    tlt_model = copy.deepcopy(model)
    runs = {"baseline": GRPOTrainer(copy.deepcopy(model), tokenizer, problems, args),
            "tlt": GRPOTrainer(tlt_model, tokenizer, problems, args, drafter=copy.deepcopy(drafter).attach(tlt_model),
                               tlt=tlt)}
    rollouts = {name: [] for name in runs}
    for name, trainer in runs.items():                  # keep each step's rollout (its lengths and strategies)
        def rollout(problems, clock=None, _inner=trainer.rollout, _seen=rollouts[name]):
            _seen.append(_inner(problems, clock))
            return _seen[-1]
        trainer.rollout = rollout
    f_warm = _factor(drift)
    warm = {name: trainer.step() for name, trainer in runs.items()}
    micro_step_s = warm["tlt"]["time/drafter_s"] / max(tlt.drafter_steps, 1) / f_warm   # at the reference speed
    update_tokens_per_s = float(np.median([m["update/tokens_per_s"] for m in warm.values()])) * f_warm
    measured = {name: [] for name in runs}
    f_step = {name: [] for name in runs}
    for step in range(steps):
        for name in (("baseline", "tlt") if step % 2 == 0 else ("tlt", "baseline")):
            f_step[name].append(_factor(drift))
            m = runs[name].step()
            measured[name].append({k: m[f"time/{k}_s"] for k in ("step", "rollout", "update")})
    plen = float(np.mean([len(p) for p in encode_prompts(problems[: args.prompts_per_step], tokenizer)]))
    predicted = {}
    for name, results in rollouts.items():
        # the engine's costs beyond its forwards as in this policy's steps (TLT streams drafter pairs): refitted
        # on its warm-up step's rollout, carried to the reference speed
        warm_tl = dict(results[0].timeline, iter_time=np.asarray(results[0].timeline["iter_time"]) / f_warm)
        cfg = _cpu_step(model, fit_overheads(costs, [(warm_tl, plen)]), args.prompts_per_step, args.num_generations,
                        plen,
                        update_tokens_per_s=update_tokens_per_s, micro_step_s=micro_step_s,
                        drafter_steps=tlt.drafter_steps if name == "tlt" else 0)
        sims = [simulate_step(cfg, policy_from(r.timeline) if name == "tlt" else OFF, name, check_memory=False,
                              lengths=[r.lengths.numpy()]) for r in results[1:]]  # the warm-up step left out
        predicted[name] = [{"step": f * x.step_s, "rollout": f * x.rollout_s, "update": f * x.update_s}
                           for f, x in zip(f_step[name], sims)]
    med = {k: {n: {p: float(np.median([x[p] for x in v[n]])) for p in ("step", "rollout", "update")} for n in runs}
           for k, v in (("p", predicted), ("m", measured))}
    checks = [Check(f"GRPO step, {n}: median {p} seconds", med["p"][n][p], med["m"][n][p])
              for n in runs for p in ("rollout", "update", "step")]
    return checks + [Check("GRPO step speedup, TLT over baseline", med["p"]["baseline"]["step"] /
                           med["p"]["tlt"]["step"], med["m"]["baseline"]["step"] / med["m"]["tlt"]["step"])], \
        update_tokens_per_s, micro_step_s


def validate(model, tokenizer, drafter, prompts: int = 16, group: int = 8, max_new: int = 720,
             temperature: float = 0.9, steps: int = 6, seed: int = 0, cost_rows=(1, 2, 4, 8, 16, 32, 64, 128),
             workers_results=None, log=print) -> tuple[list[Check], dict]:
    """Measure this machine's costs (forwards at ``cost_rows`` rows), then check the simulator against measured
    rollouts (one process, and 2 workers' shards), GRPO steps of the chain task (``prompts`` x ``group``, at most
    ``max_new`` tokens) and, from ``workers_results`` (a ``bench e2e_grpo --workers 2`` results file; None: skip),
    the spot trainer's harvested share; returns (checks, the measured inputs)."""
    if workers_results is not None:
        harvest = check_harvest(workers_results)            # a missing or foreign file fails before the timing
    drift = Drift(model)
    log("measuring forward costs ...")
    drift.calibrating()
    costs = measure_costs(model, drafter, rows=cost_rows)
    drift.calibrating()
    problems = generate_problems(ChainTaskConfig(), 4096, seed=seed + 1)
    args = GRPOConfig(num_generations=group, generation_batch_size=prompts * group, max_completion_length=max_new,
                      temperature=temperature, learning_rate=1e-4, max_steps=steps, seed=seed,
                      micro_batch_tokens=2048)
    tlt = TLTConfig(speculative="adaptive", drafter_steps=6, drafter_batch=4)
    log("fitting the engine's per-iteration overhead on rollouts of other prompts ...")
    costs, controller = calibrate_engine(model, tokenizer, drafter, costs, prompts, group, max_new, temperature,
                                         seed=seed)
    drift.calibrating()
    log("measuring and simulating rollouts ...")
    checks = check_rollouts(model, tokenizer, drafter, costs, controller, problems[:prompts], group, max_new,
                            temperature, seed=seed, drift=drift)
    log("measuring and simulating 2 workers' rollouts ...")
    checks += check_workers(model, tokenizer, costs, problems[:prompts], group, max_new, temperature, seed=seed,
                            drift=drift)
    log("measuring and simulating GRPO steps ...")
    stepped, update, micro = check_steps(model, tokenizer, drafter, costs, problems, args, tlt, steps, drift)
    checks += stepped
    if workers_results is not None:
        checks += harvest
    return checks, {"costs": costs, "update_tokens_per_s": update, "micro_step_s": micro,
                    "speed_reference_s": float(np.median(drift.reference))}
