"""When the online drafter trains: ``tlt.drafter_train: always`` (every RL step) beside ``on_drift`` (only when the
accept length of the step's learned-drafter SD steps fell by ``--margin`` from its best since it last trained), on
one train-grpo recipe with the run's alarms watching.

Each mode runs ``--steps`` RL steps of the recipe's trainer (``rljob.build``: the same model, drafter, prompts and
seed), one after the other in this process. Per step: the accept length of the rollout's SD steps
(``spec/accept_len_mean``), the drafter's micro-steps and seconds, whether it trained, the acceptance over its best,
and the alarms that fired (``alarm/*``; the shipped drafters should raise none). Before the first step and after the
last, the accepted length of each mode's online drafter on its final policy, on ``--probe`` fixed prompts with
``--probe-strategy`` (the same strategy for both: the rollout's own mix of strategies differs between runs).
The acceptance cost of the saved compute: the final probe's accept length of ``on_drift`` over ``always``, beside
their ratio of drafter micro-steps. Partial results are written after each mode.

    python -m tltlib bench drafter_train --recipe params/train/cpu-tiny.yaml --steps 20
    python -m tltlib bench drafter_train --recipe params/train/cpu-smollm2.yaml --steps 20 --tag=-smollm2
"""
from __future__ import annotations

import gc
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_output_flags,
    add_recipe_flags,
    bench_parser,
    listed,
    machine_info,
    markdown_table,
    parse_bench_args,
    positive_float,
    positive_int,
    result_name,
    strategy_name,
    use_all_cores,
    write_results,
)

MODES = ("always", "on_drift")
KEYS = ("spec/accept_len_mean", "spec/steps", "drafter/micro_steps", "drafter/trained", "drafter/accept_vs_best",
        "drafter/learning", "drafter/version", "time/drafter_s", "time/rollout_s", "time/step_s", "rl/reward_mean",
        "alarm/accept_floor", "alarm/sd_slower", "alarm/drafter_stale", "alarm/drafter_mismatch", "alarm/floor")


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_recipe_flags(ap)
    ap.add_argument("--steps", type=positive_int, default=20, help="RL steps per mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--margin", type=positive_float, default=0.1, help="on_drift's drift_margin")
    ap.add_argument("--modes", type=listed(lambda m: m if m in MODES else _bad(m), "always,on_drift"),
                    default="always,on_drift", help="the modes to run, comma-separated")
    ap.add_argument("--probe", type=positive_int, default=8, help="probe prompts for the final accepted length")
    ap.add_argument("--probe-strategy", type=strategy_name, default="chain-6", help="the probes' strategy")
    ap.add_argument("--tag", default="", help="suffix of the result files (e.g. -smollm2)")
    add_output_flags(ap)
    return parse_bench_args(ap, argv)


def _bad(mode: str):
    import argparse
    raise argparse.ArgumentTypeError(f"{mode!r} is not a mode ({', '.join(MODES)})")


def load_job(args, mode: str):
    """The recipe's job with the flags' model, drafter, steps, seed and ``tlt.drafter_train = mode``."""
    from tltlib.lab.rljob import read_job
    job = read_job(args.recipe, {"model": args.model, "drafter": args.drafter})    # the flags' folders first
    if job.tlt is None or not job.drafter:
        raise SystemExit(f"{args.recipe}: the drafter-training comparison needs TLT with a drafter (tlt: and "
                         "drafter: are empty); give a recipe with both, or --drafter")
    return replace(job, grpo=replace(job.grpo, max_steps=args.steps, seed=args.seed),
                   tlt=replace(job.tlt, drafter_train=mode, drift_margin=args.margin))


def run_mode(args, mode: str, log=print) -> dict:
    """One mode's run: per-step metrics (:data:`KEYS`), the probes before and after, the alarms' warnings."""
    from tltlib.lab.e2e import probe_row
    from tltlib.lab.rljob import build
    from tltlib.tasks.datasets import generate_task
    job = load_job(args, mode)
    trainer, _ = build(job)
    probe = generate_task(job.task_cfgs[1], args.probe, seed=20_002)
    temp, max_new = trainer.args.temperature, trainer.args.max_completion_length

    def probed(step: int) -> float:
        return probe_row(trainer.model, {"online": trainer.drafter}, trainer.tokenizer, probe, args.probe_strategy,
                         temp, max_new, step)["online"]

    out = {"probe": [[0, probed(0)]], "steps": [], "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, args.steps + 1):
            m = trainer.step()
            out["steps"].append({k: m.get(k) for k in KEYS})
            log(f"{mode} step {step}: accept {m.get('spec/accept_len_mean', float('nan')):.2f}  drafter "
                f"{m.get('drafter/micro_steps', 0):.0f} micro-steps ({m['time/drafter_s']:.2f} s)  vs best "
                f"{m.get('drafter/accept_vs_best', float('nan')):.3f}  step {m['time/step_s']:.1f} s")
    out["warnings"] = [str(w.message) for w in caught if w.category.__name__ == "AlarmWarning"]
    out["probe"].append([args.steps, probed(args.steps)])
    out["alarms_fired"] = {k: v for k, v in trainer.alarms.fired_at.items()} if trainer.alarms else {}
    out["sd_steps"] = trainer.alarms.sd_steps if trainer.alarms else 0
    log(f"{mode}: probe ({args.probe_strategy}) {out['probe'][0][1]:.2f} -> {out['probe'][1][1]:.2f}, "
        f"{len(out['warnings'])} alarms")
    return out


def summarize(runs: dict) -> dict:
    """Per mode: total micro-steps and drafter seconds, RL steps that trained, mean accept length over all steps
    and the last 5, the final probe, alarms; and on_drift over always (when both ran)."""
    out = {}
    for mode, r in runs.items():
        acc = [m["spec/accept_len_mean"] for m in r["steps"] if m.get("spec/accept_len_mean") is not None]
        out[mode] = {"micro_steps": sum(m["drafter/micro_steps"] or 0 for m in r["steps"]),
                     "drafter_s": sum(m["time/drafter_s"] for m in r["steps"]),
                     "trained_steps": sum(int(m["drafter/trained"] or 0) for m in r["steps"]),
                     "accept_mean": statistics.fmean(acc) if acc else None,
                     "accept_last5": statistics.fmean(acc[-5:]) if acc else None,
                     "probe_first": r["probe"][0][1], "probe_last": r["probe"][-1][1],
                     "alarms": len(r["warnings"]), "sd_steps": r["sd_steps"]}
    if set(MODES) <= set(out):
        a, d = out["always"], out["on_drift"]
        out["on_drift_vs_always"] = {
            "probe_last": d["probe_last"] / a["probe_last"],
            "accept_last5": d["accept_last5"] / a["accept_last5"] if a["accept_last5"] else None,
            "micro_steps": d["micro_steps"] / a["micro_steps"] if a["micro_steps"] else None,
            "drafter_s": d["drafter_s"] / a["drafter_s"] if a["drafter_s"] else None}
    return out


def main() -> None:
    args = parse_args()
    from tltlib.lab.rljob import read_job
    job = read_job(args.recipe, {"model": args.model, "drafter": args.drafter})
    use_all_cores()
    name = result_name("drafter_train", job.device, job.dtype, args.tag)
    t0 = time.perf_counter()
    runs: dict = {}

    def write(final: bool) -> Path:
        payload = {"bench": "drafter_train", "machine": machine_info(job.device),
                   "settings": {**vars(args), "modes": str(args.modes), "recipe_job": job.settings()},
                   "complete": final, "wall_s": time.perf_counter() - t0, "runs": runs, "summary": summarize(runs)}
        return write_results(name, payload, tables(payload), args.out)

    for mode in args.modes.items:
        runs[mode] = run_mode(args, mode, log=lambda s: print(s, flush=True))
        gc.collect()
        write(final=mode == args.modes.items[-1])


def tables(p: dict) -> str:
    """The markdown of a (partial) result: accept length and drafter micro-steps per step side by side, totals."""
    s, runs, summ = p["settings"], p["runs"], p["summary"]
    modes = list(runs)
    n = max(len(r["steps"]) for r in runs.values())
    cell = lambda r, k, i, f: f.format(r["steps"][i][k]) if i < len(r["steps"]) and r["steps"][i][k] is not None \
        else ""
    rows = [[i + 1, *[x for m in modes for x in (cell(runs[m], "spec/accept_len_mean", i, "{:.2f}"),
                                                  cell(runs[m], "drafter/micro_steps", i, "{:.0f}"))]]
            for i in range(n)]
    text = (f"{s['recipe']}, {s['steps']} RL steps per mode, seed {s['seed']}, on_drift margin {s['margin']}"
            f"{'' if p['complete'] else ' (partial)'}; {p['wall_s'] / 60:.1f} min wall.\n\n"
            "Accept length of the rollout's SD steps and drafter micro-steps per RL step:\n\n"
            + markdown_table(["step", *[f"{m} {what}" for m in modes for what in ("accept", "micro-steps")]], rows))
    text += "\n\n" + markdown_table(
        ["mode", "micro-steps", "drafter s", "steps trained", "accept (mean)", "accept (last 5)",
         f"probe {s['probe_strategy']} first", "last", "alarms"],
        [[m, f"{summ[m]['micro_steps']:.0f}", f"{summ[m]['drafter_s']:.1f}", summ[m]["trained_steps"],
          f"{summ[m]['accept_mean']:.2f}", f"{summ[m]['accept_last5']:.2f}", f"{summ[m]['probe_first']:.2f}",
          f"{summ[m]['probe_last']:.2f}", summ[m]["alarms"]] for m in modes])
    r = summ.get("on_drift_vs_always")
    if r:
        text += (f"\n\non_drift / always: final probe accept length {r['probe_last']:.3f}x, last-5-steps accept "
                 f"{r['accept_last5']:.3f}x, drafter micro-steps {r['micro_steps']:.3f}x, drafter seconds "
                 f"{r['drafter_s']:.3f}x.")
    return text


if __name__ == "__main__":
    main()
