"""The simulator against this machine: measure its costs, then check its predictions against runs measured here
(``python -m tltlib simulate --validate``).

1. **Costs** (:func:`measure_costs`): target forwards of rows x new tokens after short and long cached contexts,
   drafter forwards of 1 and ``top_k`` nodes per row, the update's tokens per second and a drafter micro-step —
   a :class:`tltlib.simulate.MeasuredCosts` table, the same costs the simulator uses for hardware it only knows
   from its datasheet.
2. **Runs** measured in the same process, then simulated from their own inputs (the responses' lengths, the SD
   strategies the adaptive engine played and their accept lengths): a long-tailed rollout without SD and with the
   adaptive engine (rollout time and speedup); GRPO steps of the baseline and of TLT in one process, interleaved
   (median step time and the step speedup).
3. **Checks** (:class:`Check`): predicted / measured within ``tolerance`` (15%), each named; the command exits
   non-zero when one is off.

Departures: the data-parallel checks (idle and harvested shares on 2 workers) are not in the validation yet.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import torch

from .adaptive import DEFAULT_ARMS, AdaptiveConfig, AdaptiveController, TunerConfig, timed_rollout
from .adaptive import measure_costs as controller_costs
from .draft_train import DrafterTrainConfig, DrafterTrainer, rollout_dataset
from .e2e import update_speed
from .grpo import GRPOConfig
from .rollout import RolloutConfig, RolloutEngine
from .sampling import SamplingConfig
from .costs import MeasuredCosts, hardware
from .simulate import OFF, LengthDistribution, SDPolicy, StepConfig, simulate_rollout, simulate_step
from .speculative import SpecStrategy
from .tasks import ChainTaskConfig, encode_prompts, generate_problems
from .trainer import GRPOTrainer, TLTConfig

TOLERANCE = 0.15


@dataclass
class Check:
    """One prediction of the simulator next to its measurement."""

    what: str
    predicted: float
    measured: float
    tolerance: float = TOLERANCE

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted / self.measured - 1

    @property
    def ok(self) -> bool:
        return abs(self.error) <= self.tolerance


# -------------------------------------------------------------------------------------------------- costs
@torch.no_grad()
def measure_costs(model, drafter=None, rows=(1, 2, 4, 8, 16, 32, 64, 128), contexts=(64, 512), tokens=(1, 5, 9, 17),
                  widths=(1, 4), repeats=3) -> MeasuredCosts:
    """Seconds of target forwards (``rows`` x ``tokens`` new tokens after each of ``contexts`` cached ones) and of
    drafter forwards (``widths`` nodes per row), the fastest of ``repeats`` after a warm-up."""
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
                target[i, j, k] = _fastest(lambda x=x: model.forward_cached(x, cache), repeats, dev)
            if drafter is None:
                continue
            dcache = drafter.new_cache(b, ctx + max(widths) + 1)
            drafter.forward_cached(h[:, :-1], prompt[:, 1:], dcache, logits_at=torch.full((b,), ctx - 2, device=dev))
            dcache.advance(ctx - 1)
            for k, n in enumerate(widths):
                f = h[:, -1:].expand(b, n, h.shape[-1]).contiguous()
                x = torch.randint(0, vocab, (b, n), generator=g).to(dev)
                draft[i, j, k] = _fastest(lambda f=f, x=x: drafter.forward_cached(f, x, dcache), repeats, dev)
    as_tuple = lambda a: tuple(tuple(tuple(float(v) for v in c) for c in r) for r in a)       # noqa: E731
    return MeasuredCosts(tuple(rows), tuple(contexts), tuple(tokens), as_tuple(target), tuple(widths),
                         as_tuple(draft) if drafter is not None else ())


def _fastest(fn, repeats: int, dev) -> float:
    fn()
    out = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out.append(time.perf_counter() - t)
    return min(out)


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


def check_rollouts(model, tokenizer, drafter, costs: MeasuredCosts, problems, group: int, max_new: int,
                   temperature: float, threshold: int = 32, seed: int = 0) -> list[Check]:
    """A long-tailed rollout without SD, with chain-8 at or below ``threshold`` rows, and with the adaptive engine
    (tuned on two earlier rollouts of other prompts): each measured, then simulated from its own lengths and the
    strategies it played."""
    engine = RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new),
                                                group_size=group), drafter=drafter)
    prompts = encode_prompts(problems, tokenizer)
    chain8, plain = SpecStrategy.parse("chain-8"), SpecStrategy()
    fixed = lambda it, rows: chain8 if rows <= threshold else plain               # noqa: E731
    controller = AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(
        arms=("off", *DEFAULT_ARMS), seed=seed)), controller_costs(model, drafter, max_batch=threshold), drafter)
    for i in range(2):                                                           # tuning, on other prompts
        other = encode_prompts(generate_problems(ChainTaskConfig(), len(problems), seed=seed + 100 + i), tokenizer)
        timed_rollout(engine, other, controller, seed + i)
    plen = float(np.mean([len(p) for p in prompts]))
    checks, times = [], {}
    for name, strategy in (("no SD", None), (f"chain-8 at <= {threshold} rows", fixed), ("adaptive", controller)):
        res, seconds = timed_rollout(engine, prompts, strategy, seed)
        policy = policy_from(res.timeline) if strategy is not None else OFF
        sim = simulate_rollout(costs, res.lengths.numpy(), int(round(plen)), policy)
        checks.append(Check(f"rollout {len(prompts)} x {group}, {name}: seconds", sim.time_s, seconds))
        times[name] = (sim.time_s, seconds)
    for name in list(times)[1:]:
        (p0, m0), (p1, m1) = times["no SD"], times[name]
        checks.append(Check(f"rollout speedup, {name} over no SD", p0 / p1, m0 / m1))
    return checks


def measure_micro_step(model, tokenizer, drafter, problems, batch: int, max_new: int, steps: int = 6) -> float:
    """Median seconds of one drafter micro-step of ``batch`` sequences, on pairs streamed from a rollout of
    ``problems`` (a copy of the drafter trains; the given one is untouched)."""
    pairs = rollout_dataset(model, tokenizer, problems, group_size=2, max_new_tokens=max_new)
    trainer = DrafterTrainer(copy.deepcopy(drafter).attach(model), DrafterTrainConfig(batch_sequences=batch))
    trainer.micro_step(pairs.sample(batch))                                        # warm-up
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        trainer.micro_step(pairs.sample(batch))
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def check_steps(model, tokenizer, drafter, costs: MeasuredCosts, problems, args: GRPOConfig, tlt: TLTConfig,
                steps: int, update_tokens_per_s: float, micro_step_s: float) -> list[Check]:
    """GRPO steps of the baseline and of TLT in one process, interleaved, measured; each simulated from its own
    lengths and the SD strategies it played, with the measured update rate and drafter micro-step."""
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
    measured = {name: [] for name in runs}
    for step in range(steps):
        for name in (("baseline", "tlt") if step % 2 == 0 else ("tlt", "baseline")):
            measured[name].append(runs[name].step()["time/step_s"])
    plen = float(np.mean([len(p) for p in encode_prompts(problems[: args.prompts_per_step], tokenizer)]))
    predicted = {}
    for name, results in rollouts.items():
        cfg = _cpu_step(model, costs, args.prompts_per_step, args.num_generations, plen,
                        update_tokens_per_s=update_tokens_per_s, micro_step_s=micro_step_s,
                        drafter_steps=tlt.drafter_steps if name == "tlt" else 0)
        predicted[name] = [simulate_step(cfg, policy_from(r.timeline) if name == "tlt" else OFF, name,
                                         check_memory=False, lengths=[r.lengths.numpy()]).step_s for r in results]
    med = {k: {n: float(np.median(v[n])) for n in runs} for k, v in (("p", predicted), ("m", measured))}
    return [*(Check(f"GRPO step, {n}: median seconds", med["p"][n], med["m"][n]) for n in runs),
            Check("GRPO step speedup, TLT over baseline", med["p"]["baseline"] / med["p"]["tlt"],
                  med["m"]["baseline"] / med["m"]["tlt"])]


def validate(model, tokenizer, drafter, prompts: int = 16, group: int = 8, max_new: int = 720,
             temperature: float = 0.9, steps: int = 4, seed: int = 0, cost_rows=(1, 2, 4, 8, 16, 32, 64, 128),
             log=print) -> tuple[list[Check], dict]:
    """Measure this machine's costs (forwards at ``cost_rows`` rows), then check the simulator against measured
    rollouts and GRPO steps of the chain task (``prompts`` x ``group``, at most ``max_new`` tokens); returns (checks,
    the measured inputs)."""
    log("measuring forward costs ...")
    costs = measure_costs(model, drafter, rows=cost_rows)
    problems = generate_problems(ChainTaskConfig(), 4096, seed=seed + 1)
    args = GRPOConfig(num_generations=group, generation_batch_size=prompts * group, max_completion_length=max_new,
                      temperature=temperature, learning_rate=1e-4, max_steps=steps, seed=seed,
                      micro_batch_tokens=2048)
    log("measuring the update and a drafter micro-step ...")
    probe = GRPOTrainer(copy.deepcopy(model), tokenizer, problems, args)
    update = update_speed(probe, encode_prompts(problems[:prompts], tokenizer))["length-bucketed"]["tokens_per_s"]
    tlt = TLTConfig(speculative="adaptive", drafter_steps=6, drafter_batch=4)
    micro = measure_micro_step(model, tokenizer, drafter, problems[:8], tlt.drafter_batch, max_new)
    log("measuring and simulating rollouts ...")
    checks = check_rollouts(model, tokenizer, drafter, costs, problems[:prompts], group, max_new, temperature,
                            seed=seed)
    log("measuring and simulating GRPO steps ...")
    checks += check_steps(model, tokenizer, drafter, costs, problems, args, tlt, steps, update, micro)
    return checks, {"costs": costs, "update_tokens_per_s": update, "micro_step_s": micro}
