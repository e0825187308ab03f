"""End-to-end GRPO: the baseline (plain decoding, no drafter) vs TLT (adaptive SD + online drafter), side by side in
one process on the same prompts and seeds, with TRL's GRPOTrainer on the same workload as the peer, run with its
defaults and tuned for the device.

Per RL step and policy: the time of each phase (rollout, reference/old log-probs, update, drafter training), the
step, the reward; per seed the held-out accuracy at the end (greedy). Reported: median step time and speedup, the
rollout's share of the baseline step, the Amdahl bound 1 / ((1 - s) + s / r) from that share s and the measured
rollout speedup r, and how close TLT's step speedup gets to it; reward curves (mean +- std over seeds) and whether
they overlap; final held-out accuracy of both with Welch's t-test. For the first seed, the accepted length per RL
step of the drafter TLT trains online, of the same drafter kept frozen, and of the n-gram drafter, on a fixed probe
set (measured outside the timed phases). Also the update's tokens/s with length-bucketed micro-batches vs padded
micro-batches of a fixed row count in arrival order (TRL's per-device batches).

TRL's GRPOTrainer then runs ``--trl-steps`` steps on seed 0's prompts, once per ``--trl-runs`` entry, each from the
checkpoint: ``defaults`` (TRL's own: bf16 autocast, gradient checkpointing, 8-row micro-batches, plain ``generate``),
``tuned`` (what a user who measured sets on this device: no autocast, no checkpointing, ``--trl-rows`` micro-batches,
transformers' continuous batching with a cache sized to the batch), and between them ``no-bf16`` and
``no-bf16-no-ckpt``, each changing one setting, so the gap between the defaults and the tuned run is attributed per
phase (generate, score, loss forward, backward) to what caused it. Every setting that matters is recorded.

    python -m tltlib bench e2e_grpo                                  # CPU, tiny reasoner, 3 seeds x 8 steps
    python -m tltlib bench e2e_grpo --drafter data/tiny-reasoner-drafter-short   # the drifted warm-up
    python -m tltlib bench e2e_grpo --device cuda --dtype bfloat16 --model ... --drafter ...
    python -m tltlib bench e2e_grpo --workers 2     # data-parallel workers under torchrun, with the spot trainer
    python -m tltlib bench e2e_grpo --trl-runs defaults,tuned       # only TRL's defaults and the tuned run

With ``--workers W`` the script starts itself under torchrun (W processes, one thread each on the CPU) and runs, per
RL step and in turn, the baseline, TLT with the spot trainer and TLT with the warm drafter frozen, all data-parallel
(:func:`tltlib.lab.e2e.compare_workers`); then, back in one process, TLT with the one-process online drafter for the
same steps, for the accepted-length comparison. Reported besides the table above: each step's idle share of the
workers' rollout time, the share of it harvested for drafter training, the preemption latency (also in micro-steps),
the drafter sync and the spot trainer's overhead on the step's critical path (from the last rollout's end until
every worker holds the merged drafter). ``--seeds`` and ``--trl-steps`` do not apply there (one seed, no TRL).
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DRAFTER,
    MODEL,
    add_device_flags,
    add_model_flags,
    add_num_generations,
    add_output_flags,
    bench_parser,
    depth_table,
    existing_file,
    listed,
    load_models,
    machine_info,
    markdown_table,
    nonnegative_int,
    parse_bench_args,
    positive_float,
    positive_int,
    result_name,
    save_png,
    strategy_name,
    temperature,
    write_results,
)
from _trl_peer import TRL_TUNED_ROWS, _trl_peer, _trl_tables, trl_comparison, trl_key, trl_run_name  # noqa: E402


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, drafter=DRAFTER, drafter_help="TLT's warm drafter (trained online)")
    add_device_flags(ap)
    ap.add_argument("--steps", type=positive_int, default=8, help="RL steps per seed")
    ap.add_argument("--seeds", type=positive_int, default=3)
    ap.add_argument("--prompts", type=positive_int, default=16, help="prompts per step (x --num-generations "
                                                                     "completions)")
    add_num_generations(ap, 8)
    ap.add_argument("--max-new", type=positive_int, default=720)
    ap.add_argument("--temperature", type=temperature, default=0.9)
    ap.add_argument("--lr", type=positive_float, default=1e-4)
    ap.add_argument("--micro-batch-tokens", type=positive_int, default=2048)
    ap.add_argument("--drafter-steps", type=nonnegative_int, default=6)
    ap.add_argument("--drafter-batch", type=positive_int, default=4)
    ap.add_argument("--threshold", type=nonnegative_int, default=0, help="SD switch (0 = the device default)")
    ap.add_argument("--on-drafter-change", default="discount", choices=["discount", "reset", "keep"],
                    help="the tuner's reward windows of the drafter's arms after it trains: re-explore or keep")
    ap.add_argument("--held-out", type=positive_int, default=128, help="held-out problems for the final accuracy")
    ap.add_argument("--probe", type=nonnegative_int, default=16,
                    help="probe prompts for the accepted-length curves (0 = off)")
    ap.add_argument("--probe-strategy", type=listed(strategy_name, "chain-6,tree-6x4-24"), default="chain-8",
                    help="strategies of the accepted-length probes, comma-separated (the first is plotted)")
    ap.add_argument("--trl-steps", type=nonnegative_int, default=2, help="TRL GRPOTrainer steps (0 = skip the peer)")
    ap.add_argument("--trl-runs", type=listed(trl_run_name, "defaults,tuned"),
                    default="defaults,no-bf16,no-bf16-no-ckpt,tuned",
                    help="TRL runs, in turn: defaults (TRL's own), tuned (for the device), and between them no-bf16 "
                         "(the defaults with bf16 off) and no-bf16-no-ckpt (and gradient checkpointing off)")
    ap.add_argument("--trl-rows", type=positive_int, default=TRL_TUNED_ROWS,
                    help="the tuned TRL run's micro-batch rows (the largest divisor of the batch up to this)")
    ap.add_argument("--trl-continuous", default="on", choices=["on", "off"],
                    help="the tuned TRL run generates with transformers' continuous batching")
    ap.add_argument("--workers", type=nonnegative_int, default=0,
                    help="data-parallel workers under torchrun (0 = one process)")
    ap.add_argument("--spot-max", type=nonnegative_int, default=200,
                    help="with --workers: the spot trainer's micro-step budget")
    ap.add_argument("--train-on", default="own", choices=["own", "all"],
                    help="with --workers: the spot trainer's data (scheduler.train_on; older results: pairs)")
    ap.add_argument("--tag", default="", help="suffix of the result files (e.g. -drift)")
    ap.add_argument("--recipe", type=existing_file,
                    help="a train-grpo parameter file (params/train/*.yaml): its model, drafter, task, curriculum, "
                         "rewards, grpo and tlt settings and eval_problems replace the flags that set them (giving "
                         "one of those flags too is refused; --model and --drafter override the file's)")
    add_output_flags(ap)
    ap.add_argument("--replot", metavar="JSON", type=existing_file,
                    help="only redraw the figures of an earlier result file")
    ap.set_defaults(**{k: None for k in (*RECIPE_FLAGS, "model", "drafter", "trl_steps")})
    return _with_recipe(parse_bench_args(ap, argv), ap.error)


RECIPE_FLAGS = {"prompts": 16, "num_generations": 8, "max_new": 720, "temperature": 0.9, "lr": 1e-4,
                "micro_batch_tokens": 2048,
                "drafter_steps": 6, "drafter_batch": 4, "threshold": 0, "on_drafter_change": "discount",
                "held_out": 128, "spot_max": 200, "train_on": "own"}
"""The flags a ``--recipe`` sets, with their defaults without one."""


def _with_recipe(args, error):
    """Fill the flags a recipe sets from ``--recipe`` (refusing them given beside it) or from their defaults;
    ``error(message)`` stops the parse."""
    args.job = None
    if not args.recipe:
        for k, v in {**RECIPE_FLAGS, "model": MODEL, "drafter": DRAFTER, "trl_steps": 2}.items():
            setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
        return args
    given = [k for k in RECIPE_FLAGS if getattr(args, k) is not None]
    if given:
        error(f"--{given[0].replace('_', '-')} is set by the recipe {args.recipe}: change it there (or "
                         "drop --recipe)")
    if args.trl_steps:
        error("TRL's peer runs the chain task's accuracy reward only: give --trl-steps 0 with --recipe")
    from tltlib.lab.rljob import read_job
    job = args.job = read_job(args.recipe, {"model": args.model, "drafter": args.drafter})   # flags first
    g, t = job.grpo, job.tlt
    if t is None:
        error(f"{args.recipe}: tlt is null (the baseline); the comparison needs TLT's settings")
    args.model, args.drafter = job.model, job.drafter
    if not args.drafter:
        error(f"{args.recipe}: no drafter; give --drafter")
    args.trl_steps = 0
    for k, v in {"prompts": g.prompts_per_step, "num_generations": g.num_generations,
                 "max_new": g.max_completion_length,
                 "temperature": g.temperature, "lr": g.learning_rate, "micro_batch_tokens": g.micro_batch_tokens,
                 "drafter_steps": t.drafter_steps, "drafter_batch": t.drafter_batch, "threshold": t.threshold,
                 "on_drafter_change": t.on_drafter_change, "held_out": job.eval_problems,
                 "spot_max": job.scheduler.max_micro_steps, "train_on": job.scheduler.train_on}.items():
        setattr(args, k, v)
    return args


def main() -> None:
    args = parse_args()
    if args.replot:
        from tltlib.fileio import read_json
        _figures(read_json(args.replot, "give a bench/results/e2e_grpo-*.json file"), Path(args.replot))
    elif args.workers:
        from tltlib.rl.world import launched_by_torchrun
        if launched_by_torchrun():
            _worker(args)
        else:
            _launch_workers(args)
    else:
        _one_process(args)


def _one_process(args) -> None:
    """Baseline vs TLT over ``--seeds`` x ``--steps``, the update's speed by micro-batching, TRL's peer."""
    from tltlib.lab.e2e import compare, summarize, update_speed
    from tltlib.rl.trainer import GRPOTrainer
    from tltlib.tasks.prompts import encode_prompts
    model, tok, drafter = load_models(args, drafter=True)
    device = str(model.device)
    train, held, probe = _data(args)
    result = compare(model, tok, drafter, train, held, partial(_grpo, args), _tlt(args), args.seeds, args.steps,
                     probe, args.probe_strategy, log=lambda s: print(s, flush=True),
                     trainer_kwargs=_trainer_kwargs(args))
    upd = update_speed(GRPOTrainer(copy.deepcopy(model), tok, train, _grpo(args, 0), **_trainer_kwargs(args)),
                       encode_prompts(train[: args.prompts], tok))
    trl = _trl_peer(args, _trl_prompts(args, train, model, tok), device) if args.trl_steps else {}
    fair = trl.get("tuned") or trl.get("defaults")          # the baseline's speedup over TRL: against tuned TRL
    summary = summarize(result["runs"], statistics.median(fair["step_s"]) if fair and fair["step_s"] else None)
    if fair and fair["step_s"]:
        summary["comparison"]["trl_run"] = fair["run"]
    trl_cmp = trl_comparison(summary["baseline"], trl) if trl else None
    summary["before"] = result["before"]
    table = _tables(summary, result["acceptance"], upd, args, device) + _trl_tables(trl, trl_cmp, summary, args)
    payload = {"bench": "e2e_grpo", "machine": machine_info(device), "settings": _settings(args), "summary": summary,
               "acceptance": result["acceptance"], "update_speed": upd, "trl": trl.get("defaults"),
               **{trl_key(name): r for name, r in trl.items() if name != "defaults"}, "trl_comparison": trl_cmp,
               "runs": result["runs"]}
    path = write_results(result_name("e2e_grpo", device, args.dtype, args.tag), payload, table, args.out)
    _figures(payload, path)


def _settings(args) -> dict:
    """The flags as run, with the recipe's whole job when there is one."""
    out = {k: v for k, v in vars(args).items() if k != "job"}
    if args.job is not None:
        out["recipe_job"] = args.job.settings()
    return out


def _grpo(args, seed=0):
    from dataclasses import replace

    from tltlib.rl.grpo import GRPOConfig
    if args.job is not None:
        return replace(args.job.grpo, max_steps=args.steps, seed=seed)
    return GRPOConfig(num_generations=args.num_generations, generation_batch_size=args.prompts * args.num_generations,
                      max_completion_length=args.max_new, temperature=args.temperature, learning_rate=args.lr,
                      max_steps=args.steps, seed=seed, micro_batch_tokens=args.micro_batch_tokens)


def _data(args):
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems
    from tltlib.tasks.datasets import generate_task
    if args.job is not None:
        from tltlib.lab.rljob import job_problems
        train, held = job_problems(args.job)
        probe = generate_task(args.job.task_cfgs[1], args.probe, seed=20_002) if args.probe else []
        return train, held, probe
    train = generate_problems(ChainTaskConfig(), 4096, seed=1)
    held = generate_problems(ChainTaskConfig(zipf_exponent=0.6), args.held_out, seed=10_001)
    probe = generate_problems(ChainTaskConfig(zipf_exponent=0.6), args.probe, seed=20_002) if args.probe else []
    return train, held, probe


def _trainer_kwargs(args) -> dict:
    """The recipe's reward functions and curriculum (without one: the trainer's defaults)."""
    if args.job is None:
        return {}
    from tltlib.rl.grpo import reward_funcs_named
    return {"reward_funcs": reward_funcs_named(args.job.rewards), "curriculum": args.job.curriculum}


def _tlt(args):
    from tltlib.rl.config import TLTConfig
    if args.job is not None:
        return args.job.tlt
    return TLTConfig(speculative="adaptive", threshold=args.threshold, drafter_steps=args.drafter_steps,
                     drafter_batch=args.drafter_batch, on_drafter_change=args.on_drafter_change)


def _worker(args) -> None:
    """One torchrun rank of ``--workers W``: the data-parallel comparison; rank 0 writes the raw result."""
    import json

    from tltlib.lab.e2e import compare_workers
    from tltlib.rl.scheduler import SchedulerConfig
    from tltlib.rl.world import DistributedWorld
    sched = SchedulerConfig(max_micro_steps=args.spot_max, train_on=args.train_on)
    world = DistributedWorld(args.device, sched.hang_timeout_s)
    model, tok, drafter = load_models(args, drafter=True, device=world.device, all_cores=False, kernels=False)
    train, held, probe = _data(args)
    out = compare_workers(model, tok, drafter, train, _grpo(args), _tlt(args), sched, args.steps, probe,
                          args.probe_strategy, world, log=lambda s: print(s, flush=True),
                          trainer_kwargs=_trainer_kwargs(args))
    if out is not None:
        import torch
        raw = Path(os.environ["TLTLIB_E2E_RAW"])
        for name, policy in out.pop("policies").items():      # evaluated by the launcher once the workers are gone
            torch.save(policy.state_dict(), raw.with_name(f"{name}.pt"))
        raw.write_text(json.dumps(out, default=float))
    world.close()


def _evaluate_policies(args, runs: dict, folder: Path, model, tok, train, held) -> None:
    """The held-out accuracy of each run's final policy (``<run>.pt`` in ``folder``, from the workers), one at a
    time in this process, into ``runs``; greedy, so the same with or without the drafter."""
    import torch

    from tltlib.rl.trainer import GRPOTrainer
    for name, rs in runs.items():
        policy = copy.deepcopy(model)
        policy.load_state_dict(torch.load(folder / f"{name}.pt", map_location=policy.device))
        rs[0].update(GRPOTrainer(policy, tok, train, _grpo(args), **_trainer_kwargs(args)).evaluate(held))
        print(f"{name}: held-out accuracy {rs[0]['eval/accuracy']:.3f}", flush=True)
        del policy


def _launch_workers(args) -> None:
    """Run the W ranks under torchrun, then the one-process online drafter for the accepted-length comparison."""
    import json
    import subprocess

    from tltlib.lab.e2e import probe_row, schedule_summary, summarize
    from tltlib.rl.trainer import GRPOTrainer
    from tltlib.rl.world import check_one_gpu_per_worker, torchrun_command
    check_one_gpu_per_worker(args.workers, args.device)   # before torchrun starts a worker
    args.seeds, args.trl_steps = 1, 0                 # what the data-parallel comparison runs (recorded as such)
    cmd = torchrun_command(args.workers, ["bench", "e2e_grpo", *sys.argv[1:]])
    with tempfile.TemporaryDirectory() as folder:     # the raw result and the policies: gone however this ends
        raw = Path(folder) / "raw.json"
        t = time.perf_counter()
        rc = subprocess.run(cmd, env={**os.environ, "TLTLIB_NO_VENV": "1", "TLTLIB_E2E_RAW": str(raw)}).returncode
        if rc != 0 or not raw.is_file():
            raise SystemExit(f"the {args.workers}-worker run failed (exit {rc})")
        result = json.loads(raw.read_text())
        print(f"{args.workers} workers: {time.perf_counter() - t:.0f} s; now the held-out evaluations and the "
              "one-process online drafter", flush=True)
        model, tok, drafter = load_models(args, drafter=True)
        train, held, probe = _data(args)
        _evaluate_policies(args, result["runs"], raw.parent, model, tok, train, held)
    online = copy.deepcopy(drafter).attach(model)
    tr = GRPOTrainer(model, tok, train, _grpo(args), drafter=online, tlt=_tlt(args), **_trainer_kwargs(args))
    one = []
    for step in range(args.steps):
        m = tr.step()
        row = probe_row(model, {"online": online}, tok, probe, args.probe_strategy, args.temperature, args.max_new,
                        step + 1) if probe else {}
        one.append({"step": step + 1, "accept": row.get("online"), "step_s": m["time/step_s"], "probe": row,
                    "drafter_s": m["time/drafter_s"]})
        print(f"one process, step {step + 1}: {m['time/step_s']:.2f} s, accepted length {row.get('online')}",
              flush=True)
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    runs = result["runs"]
    summary = summarize({"baseline": runs["baseline"], "tlt": runs["tlt"]})
    frozen = summarize({"baseline": runs["baseline"], "tlt": runs["tlt-frozen"]})
    summary["tlt-frozen"], summary["comparison-frozen"] = frozen["tlt"], frozen["comparison"]
    summary["schedule"] = schedule_summary(runs["tlt"][0]["steps"])
    summary["schedule_baseline"] = schedule_summary(runs["baseline"][0]["steps"])
    last = result["acceptance"][-1] if result["acceptance"] else None
    summary["accept_last"] = {"spot": last and last["online"], "frozen": last and last["frozen"],
                              "one_process_online": one[-1]["accept"] if one else None}
    table = _worker_tables(summary, result["acceptance"], one, args, device, runs["tlt"][0]["steps"])
    payload = {"bench": "e2e_grpo", "workers": args.workers, "machine": machine_info(device),
               "settings": _settings(args),
               "summary": summary, "acceptance": result["acceptance"], "one_process": one, "runs": runs}
    path = write_results(result_name("e2e_grpo", device, args.dtype, f"-w{args.workers}{args.tag}"), payload, table,
                         args.out)
    _figures(payload, path)


def _worker_tables(s, acceptance, one, args, device, tlt_steps) -> str:
    b, t, f, c, sc = s["baseline"], s["tlt"], s["tlt-frozen"], s["comparison"], s["schedule"]
    rows = [[name, v["rollout"], v["logprob"], v["update"], v["drafter"], _with_iqr(v, "step"),
             f"{b['step'] / v['step']:.2f}x", f"{v['rollout'] / v['step']:.0%}"]
            for name, v in (("baseline", b), ("TLT, spot trainer", t), ("TLT, drafter frozen", f))]
    text = (f"GRPO end to end on {args.workers} data-parallel workers (torchrun), {args.prompts} prompts x "
            f"{args.num_generations} completions per step, up to {args.max_new} tokens, T={args.temperature}, lr "
            f"{args.lr}, "
            f"{args.steps} steps, {args.dtype} on {device} (median seconds per step, rank 0's phases, the arms "
            f"interleaved; the step's interquartile range in brackets)\n\n"
            + markdown_table(["policy", "rollout", "log-prob", "update", "drafter", "step", "speedup",
                              "rollout share"], rows))
    text += (f"\n\nTLT with the spot trainer: step {c['step_speedup']:.2f}x, rollout {c['rollout_speedup']:.2f}x, "
             f"{c['of_bound']:.0%} of the Amdahl bound {c['amdahl_bound']:.2f}x. Held-out accuracy: baseline "
             f"{b['held_out'][0]:.3f}, TLT {t['held_out'][0]:.3f}, TLT frozen {f['held_out'][0]:.3f}.")
    pct = lambda x: "n/a" if x is None else f"{x:.0%}"      # noqa: E731
    text += ("\n\nSpot trainer, per step (TLT run):\n\n" + markdown_table(
        ["step", "idle share", "harvested", "micro-steps", "micro-step s", "preemption s", "in micro-steps",
         "sync s", "overhead s", "step s"],
        [[k + 1, pct(sc["idle_frac_by_step"][k]), pct(sc["harvested_by_step"][k]), sc["micro_steps_by_step"][k],
          sc["micro_step_s_by_step"][k], sc["preempt_s_by_step"][k], sc["preempt_micro_steps_by_step"][k],
          sc["sync_s_by_step"][k], sc["overhead_s_by_step"][k], t_["time/step_s"]]
         for k, t_ in enumerate(tlt_steps)]))
    text += (f"\n\nIdle share of the workers' rollout time: {pct(sc['idle_frac'])} (baseline run: "
             f"{pct(s['schedule_baseline']['idle_frac'])}); harvested for drafter training: "
             f"{pct(sc['harvested_total'])} of the idle worker-time (goal >= 80%); spot-trainer overhead on the "
             f"critical path (from the last rollout's end until every worker holds the merged drafter): "
             f"{sc['overhead_share']:.2%} of the step (goal <= 1%); preemption "
             f"latency at most {sc['preempt_micro_steps_max']:.2f} micro-steps (goal <= 1).")
    if acceptance:
        ref = {o["step"]: o.get("probe", {}) for o in one}
        for name in args.probe_strategy.split(","):
            text += (f"\n\nAccepted length per RL step ({name} on {args.probe} probe prompts, TLT's policy):\n\n"
                     + markdown_table(["step", "spot-trained", "frozen", "one-process online (own run)"],
                                      [[a["step"], a.get(f"online:{name}"), a.get(f"frozen:{name}"),
                                        ref.get(a["step"], {}).get(f"online:{name}")] for a in acceptance]))
        text += depth_table(acceptance, args.probe_strategy, {"online": "spot-trained", "frozen": "frozen"})
        al = s["accept_last"]
        if al["one_process_online"]:
            text += (f"\n\nLast step: spot-trained {al['spot']:.2f} vs one-process online "
                     f"{al['one_process_online']:.2f} ({al['spot'] / al['one_process_online'] - 1:+.1%}; goal: no more "
                     f"than 5% below) vs frozen {al['frozen']:.2f}.")
    return text


def _figures(payload: dict, json_path: Path) -> None:
    """``<result>-acceptance.png`` (accepted length per RL step) beside the result file; with ``--workers`` also
    ``-gantt.png`` (the TLT run's last step on every worker) and ``-harvest.png`` (idle and harvested time)."""
    from tltlib.lab.plots import acceptance_curves, harvest_bars, reward_curves, worker_gantt
    figs = {}
    rows = payload.get("acceptance") or []
    if payload.get("workers"):
        one = {o["step"]: o["accept"] for o in payload.get("one_process", [])}
        rows = [{**a, "one_process": one.get(a["step"])} for a in rows]
        steps = payload["runs"]["tlt"][0]["steps"]
        figs["gantt"] = worker_gantt(steps[-1]["sched/timeline"], f"TLT, step {len(steps)}, "
                                     f"{payload['workers']} workers: rollout, spot training, sync, update")
        figs["harvest"] = harvest_bars(steps)
    s = payload.get("summary", {})
    if not payload.get("workers") and "reward_by_step" in s.get("baseline", {}):
        figs["rewards"] = reward_curves({"baseline": s["baseline"]["reward_by_step"],
                                         "TLT": s["tlt"]["reward_by_step"]})
    if rows:
        figs["acceptance"] = acceptance_curves(rows, payload["settings"]["probe_strategy"].split(",")[0], online_label=(
            "spot-trained drafter" if payload.get("workers") else "online drafter (trained each step)"))
    for name, fig in figs.items():
        save_png(fig, json_path.with_name(f"{json_path.stem}-{name}.png"))


def _trl_prompts(args, train, model, tok) -> list:
    """The problems of seed 0's first ``--trl-steps`` RL steps, in order: TRL (dataset not shuffled) gets each step
    the prompts tltlib's baseline and TLT got at that step of seed 0."""
    from tltlib.rl.trainer import GRPOTrainer
    drawer = GRPOTrainer(copy.deepcopy(model), tok, train, _grpo(args, 0))
    return [p for _ in range(args.trl_steps) for p in drawer.next_problems()]


def _with_iqr(v: dict, key: str) -> str:
    """``median [q25-q75]`` of a summarised time (old result files without a spread: the value alone)."""
    lo_hi = v.get("spread", {}).get(key)
    return f"{v[key]:.2f} [{lo_hi[0]:.2f}-{lo_hi[1]:.2f}]" if lo_hi else f"{v[key]:.2f}"


def _tables(s, acceptance, upd, args, device) -> str:
    from tltlib.lab.e2e import LENGTH_KEYS
    b, t, c = s["baseline"], s["tlt"], s["comparison"]
    rows = [[name, v["rollout"], v["logprob"], v["update"], v["drafter"], _with_iqr(v, "step"),
             f"{b['step'] / v['step']:.2f}x", f"{v['rollout'] / v['step']:.0%}"] for name, v in (("baseline", b),
                                                                                                 ("TLT", t))]
    text = (f"GRPO end to end, {args.prompts} prompts x {args.num_generations} completions, up to {args.max_new} "
            f"tokens, "
            f"T={args.temperature}, lr {args.lr}, {args.steps} steps x {args.seeds} seeds, {args.dtype} on {device}"
            " (median seconds per step over all steps and seeds, the arms interleaved; the step's interquartile "
            "range in brackets)\n\n" + markdown_table(
                ["policy", "rollout", "log-prob", "update", "drafter", "step", "speedup", "rollout share"], rows))
    text += (f"\n\nRollout speedup {c['rollout_speedup']:.2f}x; Amdahl bound {c['amdahl_bound']:.2f}x from the "
             f"baseline's rollout share {c['rollout_share_baseline']:.0%}; TLT's step speedup "
             f"{c['step_speedup']:.2f}x = {c['of_bound']:.0%} of the bound. Drafter training: "
             f"{c['drafter_share_of_tlt_step']:.1%} of TLT's step.")
    if b.get("weights_moved") is not None:                 # a bf16/fp16 policy: AdamW steps float32 master weights
        text += (f" Share of the policy's weights one update changed (median; bf16 weights, float32 masters): "
                 f"baseline {b['weights_moved']:.2%}, TLT {t['weights_moved']:.2%}.")
    text += ("\n\nReward per step, mean +- std over seeds:\n\n" + markdown_table(
        ["step", "baseline", "TLT"], [[k + 1, f"{statistics.mean(x):.3f} +- {statistics.pstdev(x):.3f}",
                                      f"{statistics.mean(y):.3f} +- {statistics.pstdev(y):.3f}"]
                                     for k, (x, y) in enumerate(zip(b["reward_by_step"], t["reward_by_step"]))]))
    text += (f"\n\nCurves overlap (|mean difference| <= sum of the stds) at {c['reward_curves_overlap_frac']:.0%} of "
             f"the steps. Held-out accuracy (greedy, {args.held_out} problems): baseline "
             f"{statistics.mean(b['held_out']):.3f} ({', '.join(f'{x:.3f}' for x in b['held_out'])}), TLT "
             f"{statistics.mean(t['held_out']):.3f} ({', '.join(f'{x:.3f}' for x in t['held_out'])}); Welch t-test "
             f"p = {c['held_out_welch_p'] if c['held_out_welch_p'] is None else round(c['held_out_welch_p'], 3)}.")
    if s.get("before"):
        text += f" The initial policy: {s['before']['eval/accuracy']:.3f}."
    text += "\n\nResponse lengths at the first and the last RL step (per seed):\n\n" + markdown_table(
        ["policy", "seed", "step", "mean", "p50", "p90", "p99", "max"],
        [[name, k, which, *[f"{d[key]:.0f}" if d.get(key) is not None else "n/a" for key in LENGTH_KEYS]]
         for name, v in (("baseline", b), ("TLT", t)) for k, seed in enumerate(v.get("lengths_first_last", []))
         for which, d in zip(("first", "last"), seed)])
    if acceptance:
        text += (f"\n\nAccepted length per RL step ({args.probe_strategy.split(',')[0]} on {args.probe} probe "
                 "prompts, seed 0):\n\n"
                 + markdown_table(["step", "online drafter", "frozen drafter", "n-gram"],
                                  [[a["step"], a["online"], a["frozen"], a["ngram"]] for a in acceptance]))
        text += depth_table(acceptance, args.probe_strategy, {"online": "online", "frozen": "frozen"})
    if upd:
        text += "\n\nUpdate (forward + backward) on one rollout's batch:\n\n" + markdown_table(
            ["micro-batches", "count", "padded tokens", "tokens/s"],
            [[k, v["micro_batches"], v["padded_tokens"], v["tokens_per_s"]] for k, v in upd.items() if k != "tokens"])
    return text


if __name__ == "__main__":
    main()
