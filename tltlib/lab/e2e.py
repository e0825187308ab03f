"""The end-to-end comparison of RL with and without TLT (bench/e2e_grpo.py and notebook 05 run it).

:func:`compare` trains the baseline (plain decoding, no drafter) and TLT (adaptive SD + online drafter) from the same
initial policy, seed by seed, on the same prompts (the prompt order depends only on the seed), their steps
interleaved so that a slow spell of a shared machine hits both alike. For the first seed it also measures, after
every RL step and outside the timed phases, the accepted length on fixed probe prompts of the drafter TLT trains
online, of the same warm drafter kept frozen, and of the n-gram drafter: the drift of a drafter the policy leaves
behind. :func:`summarize` turns the histories into the numbers the paper reports: per-phase step time, speedup, the
rollout share and the Amdahl bound, reward curves and held-out accuracy with a significance test. Times are medians
over the steps of every seed, with their interquartile range: on a shared machine one step slowed by a neighbour
(a 28 s rollout among 1-5 s ones) would otherwise decide a mean. :func:`long_run` is one longer TLT run
(``bench drift``): the held-out accuracy along it, and the accepted length of the online drafter against the warm
drafter and against copies of the online drafter frozen at given steps, whose gap is the policy's drift alone.

Paper: TLT §7 (end-to-end speedup with the same reward curves, Fig. 11-12; drafter adaptation, Fig. 15).
Departures: the paper compares against verl on 8-64 H100s; :func:`compare` runs in one process, :func:`compare_workers`
on W torchrun workers of one machine.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
import warnings
from dataclasses import replace

import numpy as np
import torch
from scipy.stats import ttest_ind
from tqdm.auto import tqdm

from ..drafting.warmup import measure_acceptance
from ..errors import BadInput
from ..fileio import read_json
from ..machine import device_sync
from ..model.logprobs import SequenceBatch, micro_batches, padded_tokens, response_logprobs
from ..rl.scheduler import SchedulerConfig
from ..rl.trainer import GRPOTrainer
from ..rl.world import DistributedWorld
from ..spec.strategy import SpecStrategy

PHASES = ("rollout", "reward", "logprob", "update", "drafter")
LENGTH_KEYS = ("len_mean", "len_p50", "len_p90", "len_p99", "len_max")
"""The response-length statistics :func:`summarize` keeps for the first and the last RL step of each seed."""


def compare(model, tokenizer, drafter, train, held_out, grpo_for_seed, tlt, seeds: int, steps: int,
            probe=(), probe_strategy: str = "chain-8", log=print, trainer_kwargs: dict | None = None,
            progress: bool = False) -> dict:
    """Train baseline and TLT side by side; returns ``{"runs": {policy: [per seed: {"steps": [...],
    "eval/accuracy": ...}]}, "acceptance": [per step: {"step", "online", "frozen", "ngram"}], "before": the initial
    policy's held-out ``eval/*``}``.

    Args:
        model, tokenizer, drafter: the initial policy and its warm drafter (copied per seed, never modified).
        train, held_out: problems to train on and to measure the final greedy accuracy on.
        grpo_for_seed: ``seed -> GRPOConfig``; tlt: the :class:`TLTConfig` of the TLT runs.
        probe: problems for the accepted-length curves (seed 0 only; empty: skipped).
        trainer_kwargs: more :class:`GRPOTrainer` arguments, the same for both (``reward_funcs``, ``curriculum``).
        progress: a bar over the RL steps of both policies, its last words what runs now (a step, the probe, an
            evaluation); one update per RL step, nothing inside the timed phases.
    """
    runs, acceptance, kw = {"baseline": [], "tlt": []}, [], dict(trainer_kwargs or {})
    bar = tqdm(total=2 * seeds * steps, desc="RL steps (baseline and TLT)", unit="step", disable=not progress)
    bar.set_postfix_str("held-out accuracy of the initial policy")
    before = GRPOTrainer(model, tokenizer, train, grpo_for_seed(0), **kw).evaluate(held_out)
    log(f"initial policy: held-out accuracy {before['eval/accuracy']:.3f}")
    for seed in range(seeds):
        base_model, tlt_model = copy.deepcopy(model), copy.deepcopy(model)
        online = copy.deepcopy(drafter).attach(tlt_model)
        frozen = frozen_copy(drafter, tlt_model)                       # the warm drafter, never trained
        cfg = grpo_for_seed(seed)
        trainers = {"baseline": GRPOTrainer(base_model, tokenizer, train, cfg, **kw),
                    "tlt": GRPOTrainer(tlt_model, tokenizer, train, cfg, drafter=online, tlt=tlt, **kw)}
        hist = {k: [] for k in trainers}
        for step in range(steps):
            for name in (("baseline", "tlt") if step % 2 == 0 else ("tlt", "baseline")):
                bar.set_postfix_str(f"seed {seed}, step {step + 1}: {name}")
                m = trainers[name].step()
                bar.update()
                hist[name].append(m)
                log(f"seed {seed} step {step + 1} {name:8s} step {m['time/step_s']:6.2f} s  rollout "
                    f"{m['time/rollout_s']:6.2f} s  update {m['time/update_s']:5.2f} s  drafter "
                    f"{m['time/drafter_s']:5.2f} s  reward {m['rl/reward_mean']:.3f}")
            if seed == 0 and probe:
                bar.set_postfix_str(f"seed {seed}, step {step + 1}: the drafters' accepted length")
                row = probe_row(tlt_model, {"online": online, "frozen": frozen, "ngram": None}, tokenizer, probe,
                                probe_strategy, cfg.temperature, cfg.max_completion_length, step + 1)
                acceptance.append(row)
                log(f"  accepted length ({probe_strategy}): online {row['online']:.2f}  frozen {row['frozen']:.2f}  "
                    f"n-gram {row['ngram']:.2f}")
        for name, tr in trainers.items():
            bar.set_postfix_str(f"seed {seed}: held-out accuracy of {name}")
            runs[name].append({"seed": seed, "steps": hist[name], **tr.evaluate(held_out)})
            log(f"seed {seed} {name}: held-out accuracy {runs[name][-1]['eval/accuracy']:.3f}")
    bar.close()
    return {"runs": runs, "acceptance": acceptance, "before": before}


def probe_row(model, drafters: dict, tokenizer, probe, strategies: str, temperature: float, max_new: int,
              step: int) -> dict:
    """The accepted length on ``probe`` of each drafter of ``drafters`` (``{label: drafter}``; None: the n-gram
    drafter, at the first strategy's depth only) with each strategy of ``strategies`` (comma-separated names):
    ``row[f"{label}:{strategy}"]``, and for the first strategy also ``row[label]``; the per-depth acceptance as
    ``row[f"{label}:{strategy}:ge"]`` = [share of the SD row-steps accepting at least d drafts, d = 1..depth]."""
    row = {"step": step}
    for k, name in enumerate(s.strip() for s in strategies.split(",")):
        st = SpecStrategy.parse(name)
        for label, d in drafters.items():
            if d is None and k:
                continue
            out = measure_acceptance(model, d, tokenizer, probe, SpecStrategy("ngram", st.depth) if d is None else st,
                                     temperature, max_new)
            row[f"{label}:{name}"] = out["spec/accept_len_mean"]
            row[f"{label}:{name}:ge"] = [out.get(f"spec/accept_ge_{i}", 0.0) for i in range(1, st.depth + 1)]
            if k == 0:
                row[label] = row[f"{label}:{name}"]
    return row


def probe_labels(rows: list[dict]) -> list[str]:
    """The drafters :func:`probe_row` rows hold, in the order first seen (``online``, ``frozen``, ...)."""
    return [k for k in dict.fromkeys(k for r in rows for k in r) if k != "step" and ":" not in k]


def summarize(runs: dict, trl_step_s: float | None = None) -> dict:
    """Per policy the median time of each phase and of the step over all steps and seeds (``spread``: their
    interquartile ranges), the speedup and rollout share and Amdahl bound from those medians, reward curves,
    held-out accuracy with Welch's t-test, and (given TRL's step time) the baseline's speedup over TRL."""
    out = {}
    for name, rs in runs.items():
        steps = [m for r in rs for m in r["steps"]]
        times = {p: [m[f"time/{p}_s"] for m in steps] for p in (*PHASES, "step")}
        out[name] = {p: float(np.median(v)) for p, v in times.items()}
        out[name]["spread"] = {p: [float(np.percentile(v, 25)), float(np.percentile(v, 75))] for p, v in times.items()}
        out[name]["reward_by_step"] = [[r["steps"][k]["rl/reward_mean"] for r in rs]
                                       for k in range(len(rs[0]["steps"]))]
        out[name]["held_out"] = [r["eval/accuracy"] for r in rs]
        out[name]["lengths_first_last"] = [[{k: r["steps"][i].get(f"rollout/{k}") for k in LENGTH_KEYS}
                                            for i in (0, -1)] for r in rs]
        acc = [m["spec/accept_len_mean"] for m in steps if "spec/accept_len_mean" in m]
        out[name]["accept_len"] = float(np.mean(acc)) if acc else None
        moved = [m["update/weights_moved"] for m in steps if not math.isnan(m.get("update/weights_moved", math.nan))]
        out[name]["weights_moved"] = float(np.median(moved)) if moved else None     # None: a float32 policy
    b, t = out["baseline"], out["tlt"]
    share, speed = b["rollout"] / b["step"], b["rollout"] / t["rollout"]
    bound = amdahl_bound(share, speed)
    overlap, p = same_learning(b, t)
    out["comparison"] = {"rollout_share_baseline": share, "rollout_speedup": speed,
                         "step_speedup": b["step"] / t["step"], "amdahl_bound": bound,
                         "of_bound": (b["step"] / t["step"]) / bound,
                         "drafter_share_of_tlt_step": t["drafter"] / t["step"],
                         "reward_curves_overlap_frac": float(np.mean(overlap)), "held_out_welch_p": p}
    if trl_step_s:
        out["comparison"]["trl_step_s"] = trl_step_s
        out["comparison"]["baseline_vs_trl_step"] = trl_step_s / b["step"]
    return out


def same_learning(b: dict, t: dict) -> tuple[list[bool], float | None]:
    """Whether two policies learned alike: per RL step, whether their reward bands (mean +- std over seeds) overlap
    (``reward_by_step``), and Welch's p of their held-out accuracies (``held_out``; None without a spread)."""
    overlap = [abs(np.mean(x) - np.mean(y)) <= np.std(x) + np.std(y)
               for x, y in zip(b["reward_by_step"], t["reward_by_step"])]
    p = None
    if len(b["held_out"]) > 1 and np.std(b["held_out"] + t["held_out"]) > 0:
        with warnings.catch_warnings():       # one policy's seeds may tie exactly (2 seeds, 48 problems): scipy
            warnings.simplefilter("ignore", RuntimeWarning)   # warns of precision loss, the p-value stays valid
            p = float(ttest_ind(b["held_out"], t["held_out"], equal_var=False).pvalue)
    return overlap, p


def amdahl_bound(rollout_share: float, rollout_speedup: float) -> float:
    """Step speedup when only the rollout (``rollout_share`` of the step) gets ``rollout_speedup`` faster."""
    return 1.0 / ((1.0 - rollout_share) + rollout_share / rollout_speedup)


def update_speed(trainer, prompt_ids: list[list[int]], rows: int = 16, repeats: int = 2) -> dict:
    """Tokens/s of the update's forward + backward on one rollout of ``prompt_ids``: length-bucketed micro-batches
    (``trainer.args.micro_batch_tokens``) vs padded micro-batches of ``rows`` sequences in arrival order."""
    res = trainer.engine.generate(prompt_ids, torch.Generator(device=trainer.device).manual_seed(123))
    G = trainer.args.num_generations
    prompts = [res.prompt_ids[i // G] for i in range(res.num_sequences)]
    responses = [res.response_ids(i) for i in range(res.num_sequences)]
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    plans = {"length-bucketed": micro_batches(lengths, trainer.args.micro_batch_tokens),
             f"padded, {rows} rows in arrival order": [list(range(i, min(i + rows, len(lengths))))
                                                       for i in range(0, len(lengths), rows)]}
    out, model, sync = {"tokens": sum(lengths)}, trainer.model, device_sync(trainer.device)
    for name, groups in plans.items():
        times = []
        for _ in range(repeats):
            sync()                                   # on a GPU: the work, not its launches, is timed
            t = time.perf_counter()
            model.zero_grad(set_to_none=True)
            for g in groups:
                mb = SequenceBatch.build(prompts, responses, g, trainer.engine.pad_id, trainer.device)
                response_logprobs(model, mb, trainer.sampling, trainer.args.logprob_chunk).sum().backward()
            sync()
            times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
        out[name] = {"seconds": min(times), "tokens_per_s": sum(lengths) / min(times),
                     "padded_tokens": padded_tokens(lengths, groups), "micro_batches": len(groups)}
    return out


def trl_phases(results_json, run: str = "tuned") -> dict | None:
    """A TRL run's median step from a bench/e2e_grpo result file, as phases: ``{"rollout": generate seconds,
    "reward": the rest of TRL's generate-and-score (rewards, tokenising, bookkeeping), "update": the rest}``; files
    without the generate-and-score timing give rollout and update only. ``run``: ``tuned`` (TRL set up for the
    device, the fair peer) or ``defaults`` (TRL's own settings; older files hold only these, under ``trl``).
    None when the file has no such TRL run."""
    if run not in ("tuned", "defaults", "no-bf16", "no-bf16-no-ckpt"):
        raise BadInput(f"TRL run {run!r}: choose tuned, defaults, no-bf16 or no-bf16-no-ckpt")
    key = "trl" if run == "defaults" else "trl_" + run.replace("-", "_")
    trl = read_json(results_json, "run python -m tltlib bench e2e_grpo again").get(key)
    if not trl or not trl.get("step_s") or not trl.get("generate_s"):
        return None
    med = lambda k: float(statistics.median(trl[k]))                                      # noqa: E731
    step, gen = med("step_s"), med("generate_s")
    if not trl.get("generate_and_score_s"):
        return {"rollout": gen, "update": max(step - gen, 0.0)}
    scored = med("generate_and_score_s")
    return {"rollout": gen, "reward": max(scored - gen, 0.0), "update": max(step - scored, 0.0)}


def trl_peer(results_json, run: str = "tuned") -> dict | None:
    """TRL beside tltlib on the workload the bench ran them on, from a bench/e2e_grpo result file: ``{"workload":
    (prompts, completions per prompt, max new tokens), "phases": {"tltlib baseline": its median phases, "TRL
    <run>": :func:`trl_phases`}}``; None when the file has no such TRL run. A notebook draws these apart from its own
    runs when its workload differs (two workloads on one axis would compare nothing)."""
    trl = trl_phases(results_json, run)
    if trl is None:
        return None
    d = read_json(results_json, "run python -m tltlib bench e2e_grpo again")
    s = d["settings"]
    workload = (int(s["prompts"]), int(s.get("num_generations", s.get("group"))), int(s["max_new"]))
    base = {k: float(v) for k, v in d["summary"]["baseline"].items() if k in ("rollout", "reward", "logprob",
                                                                              "update", "drafter", "step")}
    return {"workload": workload, "phases": {"tltlib baseline": base, f"TRL {run}": trl}}


def compare_workers(model, tokenizer, drafter, train, grpo, tlt, scheduler, steps: int, probe=(),
                    probe_strategy: str = "chain-8", world=None, log=print,
                    trainer_kwargs: dict | None = None) -> dict | None:
    """:func:`compare` for data-parallel workers (call it on every rank under torchrun): the baseline, TLT with the
    spot trainer, and TLT with the same warm drafter frozen, stepped in turn on the same prompts. After every RL
    step rank 0 measures, outside the timed phases, the accepted length of the spot-trained and the frozen drafter on
    TLT's current policy; the ranks then start the next step together. Returns on rank 0 ``{"runs": {policy:
    [{"seed", "steps": [...]}]}, "acceptance": [...], "policies": {policy: model}}`` (None elsewhere): the held-out
    accuracy is left to the caller, after the workers are gone (two workers holding three SmolLM2 trainers each
    had no room left for it in 24 GiB).

    Args: as :func:`compare` (no held-out problems), with ``grpo`` one :class:`GRPOConfig`, ``scheduler`` the TLT run's
    :class:`~tltlib.rl.scheduler.SchedulerConfig` and ``world`` a :class:`~tltlib.rl.world.DistributedWorld`.
    """
    world = world or DistributedWorld(str(model.device), scheduler.hang_timeout_s)
    kw = dict(trainer_kwargs or {})
    models = {k: copy.deepcopy(model) for k in ("baseline", "tlt", "tlt-frozen")}
    online = copy.deepcopy(drafter).attach(models["tlt"])
    probe_frozen = frozen_copy(drafter, models["tlt"])             # the warm drafter on TLT's policy, for probes
    trainers = {
        "baseline": GRPOTrainer(models["baseline"], tokenizer, train, grpo, world=world,
                                scheduler=replace(scheduler, spot_trainer=False), **kw),
        "tlt": GRPOTrainer(models["tlt"], tokenizer, train, grpo, drafter=online, tlt=tlt, scheduler=scheduler,
                           world=world, **kw),
        "tlt-frozen": GRPOTrainer(models["tlt-frozen"], tokenizer, train, grpo,
                                  drafter=copy.deepcopy(drafter).attach(models["tlt-frozen"]),
                                  tlt=replace(tlt, online_drafter=False), world=world,
                                  scheduler=SchedulerConfig(spot_trainer=False), **kw)}
    hist, acceptance, lead = {k: [] for k in trainers}, [], world.rank == 0
    names = list(trainers)
    for step in range(steps):
        for name in names[step % len(names):] + names[:step % len(names)]:     # rotate who goes first
            m = trainers[name].step()
            hist[name].append(m)
            if lead:
                log(f"step {step + 1} {name:10s} step {m['time/step_s']:6.2f} s  rollout {m['time/rollout_s']:6.2f} s"
                    f"  idle {m['sched/idle_frac']:.0%}  harvested {m['sched/harvested']:.0%}  reward "
                    f"{m['rl/reward_mean']:.3f}")
        if lead and probe:
            row = probe_row(models["tlt"], {"online": online, "frozen": probe_frozen}, tokenizer, probe,
                            probe_strategy, grpo.temperature, grpo.max_completion_length, step + 1)
            acceptance.append(row)
            log(f"  accepted length ({probe_strategy}): spot-trained {row['online']:.2f}  frozen {row['frozen']:.2f}")
        world.barrier()
    if not lead:
        return None
    return {"runs": {name: [{"seed": grpo.seed, "steps": hist[name]}] for name in trainers},
            "acceptance": acceptance, "policies": models}


def schedule_summary(steps: list[dict]) -> dict:
    """Medians over steps of the spot trainer's ``sched/*`` metrics (NaN-free ones), plus the per-step lists the
    notebook plots."""
    keys = ("idle_frac", "idle_s", "train_s", "harvested", "preempt_s", "preempt_micro_steps", "micro_step_s",
            "signal_s", "sync_s", "overhead_s", "micro_steps")
    out = {}
    for k in keys:
        v = [m[f"sched/{k}"] for m in steps if np.isfinite(m.get(f"sched/{k}", float("nan")))]
        out[k] = float(np.median(v)) if v else None
        out[f"{k}_by_step"] = [m.get(f"sched/{k}") for m in steps]
    out["harvested_total"] = (sum(m["sched/train_s"] for m in steps) / sum(m["sched/idle_s"] for m in steps)
                              if sum(m["sched/idle_s"] for m in steps) > 0 else None)
    out["overhead_share"] = float(np.median([m["sched/overhead_s"] / m["time/step_s"] for m in steps]))
    out["preempt_micro_steps_max"] = max((m["sched/preempt_micro_steps"] for m in steps), default=None)
    return out


def frozen_copy(drafter, target):
    """A copy of ``drafter`` (its weights as they are now, never trained again) attached to ``target``; the target
    model is shared, not copied."""
    snap = copy.deepcopy(drafter, {id(drafter.target): target})
    return snap.attach(target).requires_grad_(False)


def long_run(trainer, online, frozen: dict, held_out, probe, strategies: str, steps: int, eval_every: int,
             probe_every: int, snapshots=(), log=print, on_eval=None) -> dict:
    """One TLT run of ``steps`` RL steps with the held-out accuracy and the drafters' drift measured along it.

    The held-out greedy accuracy is measured before the first step, every ``eval_every`` steps and after the last;
    the accepted length on ``probe`` (:func:`probe_row`, every strategy of ``strategies``) of ``online`` (the drafter
    ``trainer`` trains) and of each drafter of ``frozen`` (``{label: drafter}``, never trained) before the first
    step, every ``probe_every`` steps, after the last and at every step of ``snapshots``, where a frozen copy of the
    online drafter joins ``frozen`` as ``online@<step>``: from then on the gap between the two is the policy's drift
    alone. ``on_eval(result)`` after every evaluation (to write partial results). Returns ``{"steps": [trainer
    metrics per step], "eval": [{"step", "eval/*"}], "acceptance": [probe rows], "snapshots": [steps]}``.
    """
    out = {"steps": [], "eval": [], "acceptance": [], "snapshots": sorted(snapshots)}
    temp, max_new = trainer.args.temperature, trainer.args.max_completion_length

    def measure(step: int, evaluate: bool, probing: bool) -> None:
        if probing and probe:
            row = probe_row(trainer.model, {"online": online, **frozen}, trainer.tokenizer, probe, strategies, temp,
                            max_new, step)
            out["acceptance"].append(row)
            log(f"  step {step}: accepted length ({strategies.split(',')[0]}) "
                + "  ".join(f"{k} {row[k]:.2f}" for k in ("online", *frozen)))
        if evaluate:
            out["eval"].append({"step": step, **trainer.evaluate(held_out)})
            log(f"  step {step}: held-out accuracy {out['eval'][-1]['eval/accuracy']:.3f}")
            if on_eval is not None:
                on_eval(out)

    measure(0, True, True)
    for step in range(1, steps + 1):
        m = trainer.step()
        out["steps"].append(m)
        log(f"step {step}: {m['time/step_s']:.1f} s (rollout {m['time/rollout_s']:.1f}, drafter "
            f"{m['time/drafter_s']:.1f})  reward {m['rl/reward_mean']:.3f}  "
            f"mean length {m['rl/completion_len_mean']:.0f}")
        if step in snapshots:
            frozen[f"online@{step}"] = frozen_copy(online, trainer.model)
        last = step == steps
        measure(step, last or step % eval_every == 0, last or step % probe_every == 0 or step in snapshots)
    return out
