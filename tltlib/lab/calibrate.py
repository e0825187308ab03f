"""The simulator against this machine: measure its costs, then check its predictions against runs measured here
(``python -m tltlib simulate --validate``).

1. **Costs** (:mod:`tltlib.sim.measure`): target forwards of rows x new tokens after short and long cached
   contexts, drafter forwards of 1 and 4 nodes per row (a tree's ``branch``) — a :class:`tltlib.sim.costs.MeasuredCosts`
   table, the same costs the simulator uses for hardware it only knows from its datasheet — timed in two passes whose
   disagreement is the measurement's noise; then the engine's costs beyond its forwards (sampling, bookkeeping, a
   rollout's set-up) fitted on rollouts of other prompts than the checks' by the same engine, run between the checks
   so that the machine's drift reaches both alike; a GRPO step is predicted from the other measured steps
   (leave-one-out). Nothing that cannot be physical is fitted (:mod:`tltlib.sim.physical`): a noisy machine, costs that
   fall as the work grows, a negative overhead or an SD step cheaper than its forwards are refused with "rerun on
   a quiet machine".
2. **Runs** measured in the same process, then simulated from their own inputs (the responses' lengths, the SD
   strategies the adaptive engine played and their accept lengths): a long-tailed rollout without SD and with the
   adaptive engine (rollout time and speedup); GRPO steps of the baseline and of TLT in one process, interleaved
   (median step time and the step speedup).
   Data parallelism: 2 workers' shards of the rollout, run one after the other here in the same rounds as the
   rollouts and predicted from the same calibration (the idle share of the slowest worker's wait), and the spot
   trainer's harvested share in a ``bench e2e_grpo --workers 2`` results file against the simulator's preemption
   model, from that file's measured idle windows and micro-steps.
3. **Checks** (:class:`Check`): predicted / measured within ``tolerance`` (15%; shares: 5 points), each
   named; the command exits non-zero when one is off. Every measured run is recorded with its prediction and the
   machine's speed just before it (:class:`Drift`), so that an outlier can be told from a slow moment.

Departures: the workers' shards run one after the other on all of this machine's threads, not one thread each as
under torchrun (the idle share depends on the shards' lengths and on how a rollout's cost scales with its rows).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import BadInput, NotFound
from ..model.sampling import SamplingConfig
from ..rl.config import TLTConfig
from ..rl.grpo import GRPOConfig
from ..rl.trainer import GRPOTrainer
from ..rollout.adaptive import DEFAULT_ARMS, AdaptiveConfig, AdaptiveController, TunerConfig, timed_rollout
from ..rollout.engine import RolloutConfig, RolloutEngine
from ..sim.costs import MeasuredCosts, hardware
from ..sim.measure import fit_overheads, measure_costs, typical_seconds
from ..sim.physical import NOISE_LIMIT
from ..sim.simulate import (
    OFF,
    LengthDistribution,
    SDPolicy,
    StepConfig,
    harvested_share,
    simulate_rollout,
    simulate_step,
)
from ..spec.strategy import SpecStrategy
from ..tasks.chain import ChainTaskConfig, generate_problems
from ..tasks.prompts import encode_prompts

TOLERANCE = 0.15
SHARE_TOLERANCE = 0.05
CALIBRATION = {"contexts": (32, 256, 768), "tokens": (1, 5, 9, 17), "widths": (1, 4), "repeats": 5, "passes": 2}
"""The calibration's cost measurement (:func:`tltlib.sim.measure.measure_costs`): contexts from a prompt to a long
response, the verify widths the strategies use, two passes (their disagreement is the noise)."""


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
    """The machine's speed now against its speed while the costs were measured: fixed decode forwards (each of
    ``rows`` x 1 token after ``context`` cached ones, the median of ``calls``) timed now over the same timed at
    calibration. A shared VM's speed moves by tens of percent within minutes, and not alike for every shape: one
    row (dispatch-bound) and 16 rows (compute-bound) are probed. Recorded beside every measured run, and the
    tolerance of the fitted overheads' physical bounds (:func:`tltlib.sim.measure.fit_overheads`); predictions
    are not scaled by it (an earlier version did: a probe of 0.1 s is itself noisy, and the calibration rollouts
    run between the checks already see the machine as the checks do)."""

    def __init__(self, model, rows: tuple[int, ...] = (1, 16), context: int = 256, calls: int = 15):
        self.model, self.rows, self.context, self.calls = model, tuple(rows), context, calls
        self.reference: list[np.ndarray] = []

    @torch.no_grad()
    def probe(self) -> np.ndarray:
        """Seconds of each fixed forward now (median of ``calls``), one per entry of ``rows``."""
        dev, vocab = self.model.device, self.model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        out = []
        for rows in self.rows:
            cache = self.model.new_cache(rows, self.context + 2)
            prompt = torch.randint(0, vocab, (rows, self.context), generator=g).to(dev)
            self.model.forward_cached(prompt, cache, logits_at=torch.full((rows,), self.context - 1, device=dev))
            cache.advance(self.context)
            x = torch.randint(0, vocab, (rows, 1), generator=g).to(dev)
            out.append(typical_seconds(lambda: self.model.forward_cached(x, cache), self.calls, dev))
        return np.array(out)

    def calibrating(self) -> None:
        """Time the probe as part of the reference (call it while the costs are measured)."""
        self.reference.append(self.probe())

    def factors(self) -> np.ndarray:
        """Each probe now over its reference's median, one per entry of ``rows`` (1: as fast as at calibration; 1.2:
        20% slower); ones before any reference."""
        if not self.reference:
            return np.ones(len(self.rows))
        return self.probe() / np.median(np.stack(self.reference), axis=0)


# -------------------------------------------------------------------------------------------------- drift
def _factor(drift: Drift | None) -> np.ndarray:
    """The machine's speed drift now, per probe (:meth:`Drift.factors`; ``[1.0]`` without a :class:`Drift`)."""
    return drift.factors() if drift else np.ones(1)


def _moved(factors) -> float:
    """How far the machine's speed had moved over some runs: the largest ``|factor - 1|`` of their probes."""
    return max((float(np.max(np.abs(np.asarray(f) - 1))) for f in factors), default=0.0)


def _record(runs: list | None, what: str, simulated: float, measured: float, slowdown) -> None:
    """One measured run, its prediction and the machine's ``slowdown`` just before it (:meth:`Drift.factors`, one
    per probe; 1.2 = 20% slower than during the cost measurement), for the results file (``runs``: None records
    nothing): ``slowdown`` is the last (largest) probe's, ``slowdowns`` every probe's."""
    if runs is not None:
        f = np.atleast_1d(np.asarray(slowdown, dtype=np.float64))
        runs.append({"run": what, "simulated_s": simulated, "measured_s": measured, "slowdown": float(f[-1]),
                     "slowdowns": [float(x) for x in f]})


def _without(xs: list, i: int) -> list:
    """``xs`` less its ``i``-th item (leave-one-out)."""
    return [x for j, x in enumerate(xs) if j != i]


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
def _cpu_step(model, costs: MeasuredCosts, prompts: int, num_generations: int, prompt_len: float, **kw) -> StepConfig:
    """The StepConfig of a one-process run on this machine (measured costs, the engine decodes with the policy)."""
    return StepConfig(model.config, hardware("cpu"), nodes=1, tp=1, prompts=prompts, num_generations=num_generations,
                      prompt_len=int(round(prompt_len)), lengths=LengthDistribution(samples=(1,)),
                      dtype_bytes=model.embed.weight.element_size(), logprob_passes=0, weight_sync=False, costs=costs,
                      **kw)


def _mean_len(prompts) -> float:
    return float(np.mean([len(p) for p in prompts]))


def _measured(engine, prompts, strategy, seed: int, drift: Drift | None) -> tuple:
    """(result, wall seconds, the machine's speed factor just before) of one rollout."""
    f = _factor(drift)
    res, seconds = timed_rollout(engine, prompts, strategy, seed)
    return res, seconds, f


def _calibration_rollout(engine, tokenizer, count: int, problems_seed: int, strategy, seed: int) -> tuple:
    """A rollout of ``count`` prompts of other problems than any check's (``problems_seed``), as
    :func:`fit_overheads` takes it."""
    prompts = encode_prompts(generate_problems(ChainTaskConfig(), count, seed=problems_seed), tokenizer)
    res, seconds = timed_rollout(engine, prompts, strategy, seed)
    return res.timeline, _mean_len(prompts), seconds, len(res.lengths)


def check_rollouts(model, tokenizer, drafter, costs: MeasuredCosts, problems, num_generations: int, max_new: int,
                   temperature: float, threshold: int = 32, seed: int = 0, repeats: int = 3, workers: int = 2,
                   drift: Drift | None = None, runs: list | None = None) -> tuple[list[Check], MeasuredCosts]:
    """A long-tailed rollout of ``problems`` without SD, with chain-8 at or below ``threshold`` rows, and with the
    adaptive engine (its bandit first tuned on two rollouts of other prompts), and ``workers`` data-parallel shards
    of it without SD, in ``repeats`` rounds. In each round each arm first rolls out as many prompts of *other*
    problems (seeds ``seed + 100 ...``): the calibration rollouts, from which :func:`fit_overheads` fits the engine's
    costs beyond its forwards — measured over the same minutes as the checks, so the machine's drift reaches both
    alike — then the checks' prompts; then each worker's shard (on an engine of the same configuration, whose kept
    buffers are the shards' size). Every check, the shards' included, is simulated from the one fit and from its
    own lengths and strategies; medians over the rounds. Each run, its prediction and the machine's speed before it
    (``drift``) are appended to ``runs``. Returns (checks, ``costs`` with the fitted overheads)."""
    if len(problems) % workers:
        raise BadInput(f"{workers} workers cannot share {len(problems)} prompts evenly (whole GRPO groups)")
    config = RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new),
                           num_generations=num_generations)
    engine, shard_engine = (RolloutEngine(model, config, drafter=drafter) for _ in range(2))
    controller = AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(
        arms=("off", *DEFAULT_ARMS), seed=seed)), costs, drafter)     # the tuner reads the costs the simulator does
    chain8, plain = SpecStrategy.parse("chain-8"), SpecStrategy()
    fixed = lambda it, rows: chain8 if rows <= threshold else plain               # noqa: E731
    arms = {"no SD": None, f"chain-8 at <= {threshold} rows": fixed, "adaptive": controller}
    prompts = encode_prompts(problems, tokenizer)
    size = len(problems) // workers
    shards = [prompts[w * size:(w + 1) * size] for w in range(workers)]
    others = iter(range(seed + 100, seed + 100 + 2 + repeats * len(arms)))
    calibration, measured = [], {name: [] for name in arms}         # (result, seconds, speed factor)
    by_worker = [[] for _ in range(workers)]
    for strategy in arms.values():                                                  # warm-up
        timed_rollout(engine, prompts[:2], strategy, seed)
    timed_rollout(shard_engine, encode_prompts(generate_problems(ChainTaskConfig(), size, seed=seed + 200),
                                               tokenizer), None, seed)   # a shard's shape: its buffers are kept
    for i in range(2):
        calibration.append(_calibration_rollout(engine, tokenizer, len(problems), next(others), controller, seed + i))
    for r in range(repeats):
        for name, strategy in arms.items():
            calibration.append(_calibration_rollout(engine, tokenizer, len(problems), next(others), strategy,
                                                    seed + r))
            measured[name].append(_measured(engine, prompts, strategy, seed, drift))
        for w in range(workers):
            by_worker[w].append(_measured(shard_engine, shards[w], None, seed + w, drift))
    moved = _moved(f for runs_ in (*measured.values(), *by_worker) for _, _, f in runs_)
    fitted = fit_overheads(costs, calibration, drift=moved)
    plen = int(round(_mean_len(prompts)))
    times = {}
    for name, rounds in measured.items():
        pairs = []
        for res, seconds, f in rounds:
            policy = policy_from(res.timeline) if arms[name] is not None else OFF
            pairs.append((simulate_rollout(fitted, res.lengths.numpy(), plen, policy).time_s, seconds))
            _record(runs, f"rollout, {name}", *pairs[-1], f)
        times[name] = tuple(float(np.median(v)) for v in zip(*pairs))
    checks = [Check(f"rollout {len(prompts)} x {num_generations}, {name}: median seconds", p, m)
              for name, (p, m) in times.items()]
    for name in list(times)[1:]:
        (p0, m0), (p1, m1) = times["no SD"], times[name]
        checks.append(Check(f"rollout speedup, {name} over no SD", p0 / p1, m0 / m1))
    return checks + worker_checks(fitted, shards, by_worker, runs), fitted


def worker_checks(costs: MeasuredCosts, shards: list, by_worker: list, runs: list | None = None) -> list[Check]:
    """The data-parallel checks from each worker's measured shard rollouts (``by_worker[w]``: (result, seconds,
    speed factor) per round, as :func:`check_rollouts` ran them one after the other here), each simulated from its
    own lengths under ``costs``: the slowest worker's median rollout, and the idle share (the wait for the slowest,
    over every worker's time). Each run is recorded in ``runs``."""
    predicted, measured = [], []
    workers = len(shards)
    for w, ps in enumerate(shards):
        sims = [simulate_rollout(costs, res.lengths.numpy(), round(_mean_len(ps))).time_s
                for res, _, _ in by_worker[w]]
        for x, (_, seconds, f) in zip(sims, by_worker[w], strict=True):
            _record(runs, f"worker {w} of {workers}, shard rollout", x, seconds, f)
        predicted.append(float(np.median(sims)))
        measured.append(float(np.median([seconds for _, seconds, _ in by_worker[w]])))
    idle = lambda t: float((max(t) - np.asarray(t)).sum() / (max(t) * len(t)))          # noqa: E731
    return [Check(f"{workers} workers x {len(shards[0])} prompts, slowest worker's rollout: median seconds",
                  max(predicted), max(measured)),
            Check(f"{workers} workers, idle share of the rollout", idle(predicted), idle(measured), share=True)]


def check_harvest(results_json) -> list[Check]:
    """The spot trainer's harvested share in a ``bench e2e_grpo --workers W`` results file against the simulator's
    model of it (every idle window trained but for half a micro-step lost to preemption), from the same file's
    measured idle windows and micro-step times."""
    from pathlib import Path

    from ..fileio import read_json
    if not Path(results_json).is_file():
        raise NotFound(f"{results_json}: no such results file; run `python -m tltlib bench e2e_grpo "
                       "--workers 2` to write it (or skip the check: --workers-results '')")
    d = read_json(results_json, "run python -m tltlib bench e2e_grpo --workers 2 to write it")
    sched = (d.get("summary") or {}).get("schedule")
    if not sched or not sched.get("idle_s_by_step"):
        raise BadInput(f"{results_json}: no spot-trainer schedule (summary.schedule.idle_s_by_step); is it a "
                       "bench e2e_grpo --workers results file?")
    idle = np.asarray(sched["idle_s_by_step"], dtype=np.float64)      # per step, summed over the waiting workers
    micro = np.nan_to_num(np.asarray(sched["micro_step_s_by_step"], dtype=np.float64))
    train = np.asarray(sched["train_s_by_step"], dtype=np.float64)
    if d["workers"] != 2:       # the file sums the waits of a step: one window per step only with 2 workers
        raise BadInput(f"{results_json}: check_harvest reads runs of 2 workers (one idle window per step); this "
                       f"one ran {d['workers']}")
    predicted = harvested_share(idle, micro, d["settings"].get("spot_max"))
    return [Check(f"{d['workers']} workers (bench file), share of idle time the spot trainer harvested", predicted,
                  float(train.sum() / idle.sum()), share=True)]


def check_steps(model, tokenizer, drafter, costs: MeasuredCosts, problems, args: GRPOConfig, tlt: TLTConfig,
                steps: int, drift: Drift | None = None, runs: list | None = None,
                notes: list | None = None) -> tuple[list[Check], float, float]:
    """GRPO steps of the baseline and of TLT in one process, interleaved after one warm-up step each (left out:
    it pays one-time costs), measured; each step simulated from its own lengths and the SD strategies it played,
    with the inputs the *other* measured steps give (leave-one-out): the engine's costs beyond its forwards
    refitted on that policy's other rollouts (:func:`fit_overheads`: TLT's rollout also streams drafter pairs),
    the update's tokens/s of both policies' other steps and TLT's other drafter micro-steps. Each step is recorded
    in ``runs`` as in :func:`check_rollouts`; what a refit moved onto a physical bound is appended to ``notes``
    (once each). Returns (checks, update tokens/s and seconds per drafter micro-step,
    medians of every step)."""
    if steps < 2:
        raise BadInput(f"check_steps needs at least 2 steps per policy (each is predicted from the others), got "
                       f"{steps}")
    tlt_model = copy.deepcopy(model)
    trainers = {"baseline": GRPOTrainer(copy.deepcopy(model), tokenizer, problems, args),
            "tlt": GRPOTrainer(tlt_model, tokenizer, problems, args, drafter=copy.deepcopy(drafter).attach(tlt_model),
                               tlt=tlt)}
    rollouts = {name: [] for name in trainers}
    for name, trainer in trainers.items():              # keep each step's rollout (its lengths and strategies)
        def rollout(problems, clock=None, _inner=trainer.rollout, _seen=rollouts[name]):
            _seen.append(_inner(problems, clock))
            return _seen[-1]
        trainer.rollout = rollout
    for trainer in trainers.values():                                   # warm-up
        trainer.step()
    measured = {name: [] for name in trainers}                          # (metrics, speed factor) per step
    for step in range(steps):
        for name in (("baseline", "tlt") if step % 2 == 0 else ("tlt", "baseline")):
            f = _factor(drift)
            measured[name].append((trainers[name].step(), f))
    plen = float(np.mean([len(p) for p in encode_prompts(problems[: args.prompts_per_step], tokenizer)]))
    update_rate = {n: [m["update/tokens_per_s"] for m, _ in v] for n, v in measured.items()}
    micro = [m["time/drafter_s"] / max(tlt.drafter_steps, 1) for m, _ in measured["tlt"]]
    predicted = {name: [] for name in trainers}
    for name in trainers:
        seen = [(r.timeline, plen, m["time/rollout_s"], len(r.lengths))
                for r, (m, _) in zip(rollouts[name][1:], measured[name], strict=True)]  # the warm-up step left out
        for i, (result, (m, f)) in enumerate(zip(rollouts[name][1:], measured[name], strict=True)):
            rate = float(np.median(_without(update_rate[name], i) + update_rate["tlt" if name == "baseline" else
                                                                                "baseline"]))
            refit = fit_overheads(costs, _without(seen, i), drift=_moved(g for _, g in _without(measured[name], i)))
            if notes is not None:
                notes += [n for n in (f"GRPO steps, {name}: {note}" for note in refit.fit_notes) if n not in notes]
            cfg = _cpu_step(model, refit, args.prompts_per_step,
                            args.num_generations, plen, update_tokens_per_s=rate,
                            micro_step_s=float(np.median(_without(micro, i) if name == "tlt" else micro)),
                            drafter_steps=tlt.drafter_steps if name == "tlt" else 0)
            x = simulate_step(cfg, policy_from(result.timeline) if name == "tlt" else OFF, name, check_memory=False,
                              lengths=[result.lengths.numpy()])
            predicted[name].append({"step": x.step_s, "rollout": x.rollout_s, "update": x.update_s})
            _record(runs, f"GRPO step, {name}", x.step_s, m["time/step_s"], f)
    measured_s = {n: [{p: m[f"time/{p}_s"] for p in ("step", "rollout", "update")} for m, _ in v]
                  for n, v in measured.items()}
    med = {k: {n: {p: float(np.median([x[p] for x in v[n]])) for p in ("step", "rollout", "update")}
               for n in trainers}
           for k, v in (("p", predicted), ("m", measured_s))}
    checks = [Check(f"GRPO step, {n}: median {p} seconds", med["p"][n][p], med["m"][n][p])
              for n in trainers for p in ("rollout", "update", "step")]
    return checks + [Check("GRPO step speedup, TLT over baseline", med["p"]["baseline"]["step"] /
                           med["p"]["tlt"]["step"], med["m"]["baseline"]["step"] / med["m"]["tlt"]["step"])], \
        float(np.median(update_rate["baseline"] + update_rate["tlt"])), float(np.median(micro))


def validate(model, tokenizer, drafter, prompts: int = 16, num_generations: int = 8, max_new: int = 720,
             temperature: float = 0.9, steps: int = 6, seed: int = 0, cost_rows=(1, 2, 4, 8, 16, 32, 64, 128),
             workers_results=None, log=print) -> tuple[list[Check], dict]:
    """Measure this machine's costs (forwards at ``cost_rows`` rows), then check the simulator against measured
    rollouts (one process, and 2 workers' shards), GRPO steps of the chain task (``prompts`` x ``num_generations``, at
    most
    ``max_new`` tokens) and, from ``workers_results`` (a ``bench e2e_grpo --workers 2`` results file; None: skip),
    the spot trainer's harvested share; returns (checks, the measured inputs and every measured run with its
    prediction and the machine's speed before it: ``runs``)."""
    if workers_results is not None:
        harvest = check_harvest(workers_results)            # a missing or foreign file fails before the timing
    drift = Drift(model)
    log("measuring forward costs ...")
    drift.calibrating()
    costs = measure_costs(model, drafter, rows=cost_rows, **CALIBRATION)
    drift.calibrating()
    problems = generate_problems(ChainTaskConfig(), 4096, seed=seed + 1)
    args = GRPOConfig(num_generations=num_generations, generation_batch_size=prompts * num_generations,
                      max_completion_length=max_new,
                      temperature=temperature, learning_rate=1e-4, max_steps=steps, seed=seed,
                      micro_batch_tokens=2048)
    tlt = TLTConfig(speculative="adaptive", drafter_steps=6, drafter_batch=4)
    log("measuring rollouts and 2 workers' shards (other prompts' to fit the engine's costs beyond its forwards, "
        "then the checks') ...")
    runs: list[dict] = []
    checks, costs = check_rollouts(model, tokenizer, drafter, costs, problems[:prompts], num_generations, max_new,
                                   temperature,
                                   seed=seed, drift=drift, runs=runs)
    log("measuring and simulating GRPO steps ...")
    step_notes: list[str] = []
    stepped, update, micro = check_steps(model, tokenizer, drafter, costs, problems, args, tlt, steps, drift, runs,
                                         step_notes)
    checks += stepped
    if workers_results is not None:
        checks += harvest
    return checks, {"costs": costs, "update_tokens_per_s": update, "micro_step_s": micro,
                    "speed_reference_s": dict(zip(drift.rows, np.median(np.stack(drift.reference), axis=0).tolist())),
                    "runs": runs, "step_notes": step_notes}


def report(checks: list[Check], inputs: dict, machine: dict, settings: dict) -> tuple[str, dict]:
    """The results of :func:`validate` as a markdown table (the checks, the inputs measured here, the calibration's
    noise and what it moved onto a physical bound, the machine) and as the results file's payload."""
    costs = inputs["costs"]
    rows = [f"| {c.what} | {c.predicted:.3f} | {c.measured:.3f} | "
            + (f"{100 * c.error:+.1f} points" if c.share else f"{c.error:+.1%}") + f" | {'ok' if c.ok else 'OFF'} |"
            for c in checks]
    moved = [*costs.notes, *costs.fit_notes, *inputs.get("step_notes", [])]
    table = ("| check | simulated | measured | error | within 15% (shares: 5 points) |\n|---|---|---|---|---|\n"
             + "\n".join(rows)
             + f"\n\nInputs measured here: update {inputs['update_tokens_per_s']:.0f} tokens/s, drafter micro-step "
             f"{inputs['micro_step_s'] * 1e3:.1f} ms, forward costs of {len(costs.rows)} row counts x "
             f"{len(costs.contexts)} contexts x {len(costs.tokens)} token counts; engine overhead per iteration "
             + ", ".join(f"{1e3 * x:.2f} ms at {r:.0f} rows" for r, x in costs.overhead)
             + "; an SD step's time over its forwards' " + ", ".join(f"{x:.2f}x at {r:.0f} rows" for r, x in
                                                                  costs.sd_scale)
             + f"; a rollout's set-up {1e3 * costs.setup_s_per_row:.2f} ms per response.\n"
             + f"\nCalibration: two passes over the forward costs disagreed by {costs.noise:.1%} (90th percentile; "
               f"refused above {NOISE_LIMIT:.0%}); "
             + ("moved onto a physical bound within that noise: " + "; ".join(moved) if moved else
                "nothing needed moving onto a physical bound")
             + f".\n\nMachine: {machine['cpu']} ({machine['threads']} threads), torch {machine['torch']}, Python "
               f"{machine['python']}.\n")
    payload = {"checks": [{"what": c.what, "simulated": c.predicted, "measured": c.measured, "error": c.error,
                           "share": c.share, "ok": c.ok} for c in checks], "machine": machine, "settings": settings,
               "update_tokens_per_s": inputs["update_tokens_per_s"], "micro_step_s": inputs["micro_step_s"],
               "overhead": costs.overhead, "sd_scale": costs.sd_scale, "setup_s_per_row": costs.setup_s_per_row,
               "noise": costs.noise, "notes": moved, "runs": inputs.get("runs", [])}
    return table, payload
