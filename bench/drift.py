"""One long RL run of a train-grpo recipe with TLT: how far the held-out accuracy rises, and how far the drafter
falls behind the policy when it is not trained.

The recipe's trainer (``rljob.build``: its model, drafter, task, rewards, curriculum, GRPO and TLT settings) runs
``--steps`` RL steps in one process. The held-out greedy accuracy is measured before the first step and every
``--eval-every`` steps; the accepted length on ``--probe`` fixed prompts (every strategy of ``--probe-strategy``, with
the per-depth acceptance) every ``--probe-every`` steps, outside the timed phases, for three drafters on the current
policy: the one TLT trains online, the recipe's warm drafter kept frozen, and a frozen copy of the online drafter
taken at each step of ``--snapshot`` (``online@<step>``). The warm drafter's gap mixes every change since it was
trained (for a warm-started model the warm start's too); the snapshot's gap is what RL alone moved after it.
Partial results are written after every evaluation, so a run cut short keeps what it measured.

    python -m tltlib bench drift --recipe params/train/cpu-smollm2.yaml --steps 72 --snapshot 12 --tag=-smollm2
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_output_flags,
    add_recipe_flags,
    bench_parser,
    depth_table,
    listed,
    machine_info,
    markdown_table,
    parse_bench_args,
    positive_int,
    result_name,
    save_png,
    strategy_name,
    use_all_cores,
    write_results,
)


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_recipe_flags(ap)
    ap.add_argument("--steps", type=positive_int, default=30, help="RL steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=positive_int, default=10, help="held-out accuracy every N steps")
    ap.add_argument("--probe", type=positive_int, default=8, help="probe prompts for the accepted length")
    ap.add_argument("--probe-every", type=positive_int, default=5, help="accepted length every N steps")
    ap.add_argument("--probe-strategy", type=listed(strategy_name, "chain-6,tree-6x4-24"), default="chain-6",
                    help="strategies of the probes, comma-separated (the first is plotted)")
    ap.add_argument("--snapshot", type=listed(positive_int, "12,36"), default="10",
                    help="steps after which a frozen copy of the online drafter joins the probes")
    ap.add_argument("--tag", default="", help="suffix of the result files (e.g. -smollm2)")
    add_output_flags(ap)
    args = parse_bench_args(ap, argv)
    late = [s for s in args.snapshot.items if s >= args.steps]
    if late:
        ap.error(f"--snapshot {late[0]} is not before the last step ({args.steps}): give steps below --steps")
    return args


def load_job(args):
    """The recipe's job with the flags' model, drafter, steps and seed; refused without TLT or a drafter."""
    from tltlib.lab.rljob import read_job
    job = read_job(args.recipe, {"model": args.model, "drafter": args.drafter})    # the flags' folders first
    job = replace(job, grpo=replace(job.grpo, max_steps=args.steps, seed=args.seed))
    if job.tlt is None or not job.drafter:
        raise SystemExit(f"{args.recipe}: the drift run needs TLT with a drafter (tlt: and drafter: are empty); "
                         "give a recipe with both, or --drafter")
    return job


def main() -> None:
    args = parse_args()
    from tltlib.lab.e2e import frozen_copy, long_run
    from tltlib.lab.rljob import build
    from tltlib.tasks.datasets import generate_task
    job = load_job(args)
    use_all_cores()
    trainer, held = build(job)
    probe = generate_task(job.task_cfgs[1], args.probe, seed=20_002)
    frozen = {"frozen": frozen_copy(trainer.drafter, trainer.model)}
    device = str(trainer.model.device)
    name = result_name("drift", device, job.dtype, args.tag)
    t0 = time.perf_counter()

    def write(out: dict, final: bool = False) -> Path:
        payload = {"bench": "drift", "machine": machine_info(device), "settings": {**vars(args),
                                                                                   "recipe_job": job.settings()},
                   "complete": final, "wall_s": time.perf_counter() - t0, **out}
        return write_results(name, payload, tables(payload), args.out)

    out = long_run(trainer, trainer.drafter, frozen, held, probe, args.probe_strategy, args.steps, args.eval_every,
                   args.probe_every, set(args.snapshot.items), log=lambda s: print(s, flush=True), on_eval=write)
    path = write(out, final=True)
    figure(out, args.probe_strategy.split(",")[0], path)


def tables(p: dict) -> str:
    """The markdown of a (partial) drift result: held-out accuracy by step, accepted length by step per strategy,
    the per-depth acceptance at the first and last probe, the drafter's cost."""
    from tltlib.lab.e2e import probe_labels
    s, steps = p["settings"], p["steps"]
    ev = p["eval"]
    minutes = sum(m["time/step_s"] for m in steps) / 60
    text = (f"One RL run of {s['recipe']} with TLT, {len(steps)} of {s['steps']} steps"
            f"{'' if p['complete'] else ' (partial: the run was still going)'}, seed {s['seed']}, "
            f"{minutes:.1f} min of RL steps ({p['wall_s'] / 60:.1f} min wall with the measurements).\n\n"
            "Held-out greedy accuracy:\n\n"
            + markdown_table(["step", "accuracy", "change", "mean length"],
                             [[e["step"], f"{e['eval/accuracy']:.3f}",
                               f"{e['eval/accuracy'] - ev[0]['eval/accuracy']:+.3f}", f"{e['eval/len_mean']:.1f}"]
                              for e in ev]))
    rows = p["acceptance"]
    labels = probe_labels(rows)
    for strat in s["probe_strategy"].split(","):
        text += (f"\n\nAccepted length ({strat}, bonus token included) on {s['probe']} probe prompts:\n\n"
                 + markdown_table(["step", *labels], [[r["step"], *[r.get(f"{k}:{strat}", "") for k in labels]]
                                                      for r in rows]))
    text += depth_table(rows, s["probe_strategy"], {k: k for k in labels}) if rows else ""
    if steps:
        med = lambda k: statistics.median(m[k] for m in steps)
        text += (f"\n\nMedian step {med('time/step_s'):.1f} s: rollout {med('time/rollout_s'):.1f} s, update "
                 f"{med('time/update_s'):.1f} s, online drafter training {med('time/drafter_s'):.2f} s "
                 f"({med('time/drafter_s') / med('time/step_s'):.1%} of the step).")
    return text


def figure(out: dict, strategy: str, json_path: Path) -> None:
    """``<result>.png``: held-out accuracy and accepted length of every drafter by RL step."""
    from tltlib.lab.e2e import probe_labels
    from tltlib.lab.plots import drift_panels
    save_png(drift_panels(out["eval"], out["acceptance"], probe_labels(out["acceptance"]), strategy),
             json_path.with_suffix(".png"))


if __name__ == "__main__":
    main()
