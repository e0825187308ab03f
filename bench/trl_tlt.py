"""TRL's GRPOTrainer three ways on one workload: TRL generating itself (tuned for the device), TRL with tltlib's
rollout and SD off, and TRL with tltlib's rollout running TLT (adaptive SD + online drafter), both through
``rollout_func``; the same model, prompts, reward, batch, completion length, temperature, lr and seeds.

Everything but the generation is TRL's own (its loss, optimizer, micro-batches, logging), set as a user who measured
on this device sets it (``bench/_trl_peer.py``'s ``tuned``: no bf16 autocast on a CPU without native bf16, no
gradient checkpointing, micro-batches of up to ``--trl-rows`` rows, one generation per optimizer step); the TRL arm
generates with transformers' continuous batching (its fastest generation here), the tltlib arms with the engine.

Each run (arm and seed) runs in a child process of its own, so one run's memory is gone before the next
(``--one-process``: all in this one; SmolLM2's runs filled a 24 GiB VM that way).

Per arm, seed and RL step: TRL's step time, its generation phase (TRL's ``generate`` or the whole ``rollout_func``
call: the rollout, the weight sync and, with TLT, the drafter's training), the rollout alone, the reward; per seed
the held-out accuracy of the final policy (greedy, the same evaluator for every arm). Reported: median phases and
ratios, the rollout speedup of TRL + TLT over TRL's own generation, the step speedup against its Amdahl bound,
reward curves (mean +- std over seeds, and whether they overlap) and held-out accuracy (Welch's t-test). With
``--two-processes N``: the TLT arm again as two processes under accelerate's launcher (gloo on a CPU) for N steps,
and the share of the idle process-time its spot trainer harvested.

    python -m tltlib bench trl_tlt                                      # the tiny reasoner, 16 x 8, 720 tokens
    python -m tltlib bench trl_tlt --model ~/.cache/tltlib/models/smollm2-135m-words-sft \\
        --drafter data/smollm2-135m-drafter --task words --prompts 8 --num-generations 4 --max-new 384 \\
        --temperature 0.7 --lr 1e-5 --steps 3 --seeds 2 --held-out 24 --trl-rows 8 --two-processes 0 --tag=-smollm2
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DRAFTER,
    add_model_flags,
    add_num_generations,
    add_output_flags,
    bench_parser,
    listed,
    machine_info,
    markdown_table,
    nonnegative_int,
    parse_bench_args,
    positive_float,
    positive_int,
    resolve,
    result_name,
    temperature,
    write_results,
)
from _trl_peer import TRL_TUNED_ROWS, _trl_timers, trl_settings  # noqa: E402
from tltlib.errors import Refused

ARMS = ("trl", "tlt-off", "tlt")
LABELS = {"trl": "TRL tuned (its own generation)", "tlt-off": "TRL + tltlib rollout, SD off",
          "tlt": "TRL + tltlib rollout, TLT"}


def arm_name(text: str) -> str:
    """``text`` when it names an arm (a :func:`listed` item)."""
    if text not in ARMS:
        raise argparse.ArgumentTypeError(f"{text!r} is not an arm ({', '.join(ARMS)})")
    return text


def parse_args(argv=None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, drafter=DRAFTER, drafter_help="the TLT arm's warm drafter (trained online)")
    ap.add_argument("--task", default="chain", choices=["chain", "words"])
    ap.add_argument("--task-max-steps", type=positive_int, default=4, help="words: reasoning steps per problem")
    ap.add_argument("--steps", type=positive_int, default=6, help="RL steps per seed and arm")
    ap.add_argument("--seeds", type=positive_int, default=3)
    ap.add_argument("--prompts", type=positive_int, default=16, help="prompts per step (all processes)")
    add_num_generations(ap, 8)
    ap.add_argument("--max-new", type=positive_int, default=720)
    ap.add_argument("--temperature", type=temperature, default=0.9)
    ap.add_argument("--lr", type=positive_float, default=1e-4)
    ap.add_argument("--held-out", type=positive_int, default=64, help="held-out problems for the final accuracy")
    ap.add_argument("--arms", type=listed(arm_name, "trl,tlt"), default="trl,tlt-off,tlt")
    ap.add_argument("--trl-rows", type=positive_int, default=TRL_TUNED_ROWS, help="TRL's micro-batch rows")
    ap.add_argument("--two-processes", type=nonnegative_int, default=3,
                    help="steps of the TLT arm as two processes (0 = skip)")
    ap.add_argument("--tag", default="", help="suffix of the result files (e.g. -smollm2)")
    ap.add_argument("--summarize", metavar="JSON", default="",
                    help="only summarize the runs of an earlier result file again (and rewrite its tables)")
    ap.add_argument("--one-process", action="store_true",
                    help="run every arm and seed in this process (default: each in a child process of its own, "
                         "so one run's memory is gone before the next: SmolLM2's runs filled 24 GiB in one process)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)   # in a child process: where its JSON goes
    ap.add_argument("--worker-arm", default="tlt", help=argparse.SUPPRESS)
    ap.add_argument("--worker-seed", type=int, default=0, help=argparse.SUPPRESS)
    add_output_flags(ap)
    return parse_bench_args(ap, argv)


# ------------------------------------------------------------------------------------------------ one run
def data(args):
    """(training problems, held-out problems) of the task, disjoint."""
    from tltlib.tasks import WordTaskConfig, generate_task
    task = WordTaskConfig(max_steps=args.task_max_steps, zipf_exponent=0.0) if args.task == "words" else "chain"
    problems = generate_task(task, 4096 + args.held_out, seed=1234)
    held = problems[-args.held_out:]
    seen = {str(p.prompt) for p in held}
    return [p for p in problems[:-args.held_out] if str(p.prompt) not in seen], held


def reward_funcs(args):
    from tltlib.rl import accuracy_reward, format_reward
    return [accuracy_reward, format_reward] if args.task == "words" else [accuracy_reward]


def longest_sequence(args, train) -> int:
    """The longest prompt (as the model reads it) plus ``--max-new``: what TRL's continuous-batching cache holds."""
    from tltlib.tasks import encode_prompts, load_tokenizer
    return max(len(p) for p in encode_prompts(train[:512], load_tokenizer(resolve(args.model)))) + args.max_new


def trl_config(args, arm: str, seed: int, out: str, longest: int, processes: int = 1):
    """TRL's GRPOConfig of an arm: the workload, TRL tuned for the device; one generation per optimizer step."""
    import torch
    from trl import GRPOConfig
    batch = args.prompts * args.num_generations // processes
    tuned = trl_settings(batch, longest, args.trl_rows, continuous=arm == "trl")["tuned"]
    return GRPOConfig(output_dir=out, max_steps=args.steps, seed=seed, num_generations=args.num_generations,
                      max_completion_length=args.max_new, temperature=args.temperature, learning_rate=args.lr,
                      beta=0.0, loss_type="dapo", use_cpu=not torch.cuda.is_available(), logging_steps=1,
                      report_to="none", save_strategy="no", disable_tqdm=True, **tuned)


def run_arm(args, arm: str, seed: int, train, held, processes: int = 1) -> dict:
    """One arm and seed: TRL's training for ``--steps`` steps, timed by phase, then the held-out accuracy."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from tltlib.integrations import tlt_rollout_func
    from tltlib.rl import TLTConfig
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    rollout = None
    if arm != "trl":
        rollout = tlt_rollout_func(args.model, args.drafter if arm == "tlt" else None,
                                   tlt=TLTConfig(speculative="adaptive" if arm == "tlt" else "off",
                                                 online_drafter=arm == "tlt"))
    rows = [{"prompt": p.prompt, "answer": p.answer} for p in train]
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(model=str(resolve(args.model)), reward_funcs=reward_funcs(args),
                              args=trl_config(args, arm, seed, out, longest_sequence(args, train), processes),
                              train_dataset=Dataset.from_list(rows),
                              rollout_func=None if rollout is None else timed_call(rollout, calls := []))
        phases = _trl_timers(trainer, trainer.model)
        t = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t
    steps = [h for h in trainer.state.log_history if "step_time" in h]
    gen = phases["generate"] if arm == "trl" else calls
    acc = held_out_accuracy(trainer.model, trainer.processing_class, held, args.max_new) if held else None
    out = {"arm": arm, "seed": seed, "total_s": total, "step_s": [h["step_time"] for h in steps],
           "generate_s": gen, "rollout_s": [h.get("time/rollout_s", g) for h, g in zip(steps, gen)],
           "drafter_s": [h.get("time/drafter_s", 0.0) for h in steps],
           "weight_sync_s": [h.get("time/weight_sync_s", 0.0) for h in steps],
           "reward": [h.get("reward") for h in steps], "accept_len": [h.get("spec/accept_len_mean") for h in steps],
           "sd_share": [h.get("spec/time_frac") for h in steps],
           "sched": [{k: v for k, v in h.items() if k.startswith("sched/")} for h in steps],
           "len_mean": [h.get("completions/mean_length") for h in steps], "held_out": acc}
    del trainer, rollout
    gc.collect()
    return out


def timed_call(fn, times: list):
    """``fn`` with each call's seconds appended to ``times`` (the rollout_func's whole phase)."""
    def call(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        times.append(time.perf_counter() - t)
        return out
    return call


def held_out_accuracy(hf_model, tokenizer, problems, max_new: int) -> float:
    """Greedy accuracy of TRL's final policy on ``problems`` (tltlib's engine on a copy of its weights; greedy
    decoding is deterministic, so every arm is measured by the same evaluator)."""
    import numpy as np
    import torch

    from tltlib.integrations.trl_weights import config_of, copy_weights, hf_tensors, unwrapped
    from tltlib.model.decoder import Transformer
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rl import accuracy_reward
    from tltlib.rollout import RolloutConfig, RolloutEngine
    from tltlib.tasks import encode_prompts
    hf = unwrapped(hf_model)
    model = Transformer(config_of(hf), init_std=0.0).to(next(hf.parameters()).dtype)
    copy_weights(model, hf_tensors(hf))
    engine = RolloutEngine(model.eval().requires_grad_(False),
                           RolloutConfig(SamplingConfig(temperature=0.0, max_new_tokens=max_new)))
    with torch.no_grad():
        texts = engine.generate(encode_prompts(problems, tokenizer)).texts(tokenizer)
    return float(np.mean([accuracy_reward([p.prompt], [t], [p.answer])[0] for p, t in zip(problems, texts)]))


# --------------------------------------------------------------------------------------------- two processes
def workload_flags(args, steps: int) -> list[str]:
    """The flags that give a child process this run's workload (``steps`` RL steps)."""
    return ["--model", str(args.model), "--drafter", str(args.drafter), "--task", args.task,
            "--task-max-steps", str(args.task_max_steps), "--steps", str(steps), "--prompts", str(args.prompts),
            "--num-generations", str(args.num_generations), "--max-new", str(args.max_new),
            "--temperature", str(args.temperature), "--lr", str(args.lr), "--trl-rows", str(args.trl_rows),
            "--held-out", str(args.held_out)]


def in_child(args, arm: str, seed: int, launcher: list[str], steps: int, env: dict | None = None) -> dict:
    """One run of ``arm`` and ``seed`` in a process of its own (started by ``launcher``), its result read back."""
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "worker.json"
        cmd = [*launcher, __file__, "--worker", str(dest), "--worker-arm", arm, "--worker-seed", str(seed),
               *workload_flags(args, steps)]
        done = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
        if done.returncode != 0:
            raise Refused(f"the run of {arm}, seed {seed} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(dest.read_text())


def two_processes(args) -> dict:
    """The TLT arm as two processes (accelerate's launcher, gloo on a CPU) for ``--two-processes`` steps: each
    process rolls out half the prompts; its ``sched/*`` metrics per step (no held-out evaluation)."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
    print(f"two processes: {args.two_processes} steps of the TLT arm ...", flush=True)
    return in_child(args, "tlt", 0, launcher, args.two_processes, {"OMP_NUM_THREADS": "1"})   # a core each


def worker(args) -> None:
    """In a child process: one arm and seed (the two-process run: on this process's share, without the held-out
    evaluation); rank 0 writes the result."""
    train, held = data(args)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    out = run_arm(args, args.worker_arm, args.worker_seed, train, held if processes == 1 else [], processes)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.worker).write_text(json.dumps(out))


# ------------------------------------------------------------------------------------------------ summary
def med(values) -> float | None:
    v = [x for x in values if x is not None]
    return float(statistics.median(v)) if v else None


def summarize(runs: dict) -> dict:
    """Per arm: median step, generation phase, rollout, drafter and sync over all steps and seeds; reward curves;
    held-out accuracy. Comparisons of TLT against TRL's own generation and against SD off."""
    import numpy as np

    from tltlib.lab.e2e import amdahl_bound, same_learning
    out = {}
    for arm, rs in runs.items():
        # the first step of each run is its warm-up (a tltlib arm's set-up: the model, the tuner's cost model)
        pooled = {k: [x for r in rs for x in r[k][1:]] for k in ("step_s", "generate_s", "rollout_s", "drafter_s",
                                                                  "weight_sync_s", "accept_len")}
        out[arm] = {k.removesuffix("_s"): med(v) for k, v in pooled.items()}
        out[arm]["first_step_extra"] = med([r["generate_s"][0] - med(r["generate_s"][1:]) for r in rs])
        out[arm]["reward_by_step"] = [[r["reward"][k] for r in rs] for k in range(len(rs[0]["reward"]))]
        out[arm]["held_out"] = [r["held_out"] for r in rs]
    cmp = {}
    for base in ("trl", "tlt-off"):
        if base not in out or "tlt" not in out:
            continue
        b, t = out[base], out["tlt"]
        share, speed = b["generate"] / b["step"], b["generate"] / t["generate"]
        bound = amdahl_bound(share, speed)
        overlap, p = same_learning(b, t)
        cmp[base] = {"generation_share": share, "generation_speedup": speed,
                     "rollout_speedup": b["rollout"] / t["rollout"], "step_speedup": b["step"] / t["step"],
                     "amdahl_bound": bound, "of_bound": (b["step"] / t["step"]) / bound,
                     "reward_curves_overlap_frac": float(np.mean(overlap)), "held_out_welch_p": p}
    out["comparison"] = cmp
    return out


def tables(s: dict, runs: dict, two: dict | None, args) -> str:
    head = (f"TRL's GRPOTrainer on {args.model}, {args.prompts} prompts x {args.num_generations} completions per "
            f"step, up to {args.max_new} tokens, T={args.temperature}, lr {args.lr}, {args.steps} steps x "
            f"{args.seeds} seeds (median seconds per step over steps 2-{args.steps} of every seed, the first being "
            "each run's warm-up; the arms interleaved per seed)")
    arms = [a for a in ARMS if a in s]
    rows = [[LABELS[a], s[a]["generate"], s[a]["rollout"], s[a]["drafter"], s[a]["weight_sync"], s[a]["step"],
             s[a]["accept_len"] if s[a]["accept_len"] is not None else "—",
             f"{s['trl']['generate'] / s[a]['generate']:.2f}x" if "trl" in s else "—",
             f"{s['trl']['step'] / s[a]['step']:.2f}x" if "trl" in s else "—"] for a in arms]
    text = head + "\n\n" + markdown_table(
        ["arm", "generation phase", "rollout", "drafter", "weight sync", "step", "accept length",
         "generation vs TRL", "step vs TRL"], rows)
    for base, c in s["comparison"].items():
        text += (f"\n\nTLT against {LABELS[base]}: generation {c['generation_speedup']:.2f}x (rollout alone "
                 f"{c['rollout_speedup']:.2f}x); its share of the step {c['generation_share']:.0%}, so the Amdahl "
                 f"bound is {c['amdahl_bound']:.2f}x; the step {c['step_speedup']:.2f}x = {c['of_bound']:.0%} of "
                 f"the bound. Reward curves overlap (|mean difference| <= the two stds) at "
                 f"{c['reward_curves_overlap_frac']:.0%} of the steps; held-out accuracy Welch p = "
                 + ("n/a" if c["held_out_welch_p"] is None else f"{c['held_out_welch_p']:.2f}") + ".")
    text += "\n\nReward per step, mean +- std over seeds:\n\n" + markdown_table(
        ["step", *(LABELS[a] for a in arms)],
        [[k + 1, *(_band(s[a]["reward_by_step"][k]) for a in arms)] for k in range(len(s[arms[0]]["reward_by_step"]))])
    text += "\n\nHeld-out accuracy (greedy, per seed): " + "; ".join(
        f"{LABELS[a]} {', '.join(f'{x:.3f}' for x in s[a]['held_out'])}" for a in arms) + "."
    if two:
        sched = [st for st in two["sched"] if st]
        text += (f"\n\nTwo processes (accelerate's launcher, gloo; {args.prompts // 2} prompts each), TLT arm, "
                 f"{len(sched)} steps: idle share of the processes' rollout time "
                 + ", ".join(f"{st.get('sched/idle_frac', 0):.0%}" for st in sched)
                 + "; harvested by the spot trainer " + ", ".join(f"{st.get('sched/harvested', 0):.0%}" for st in sched)
                 + "; spot micro-steps " + ", ".join(f"{st.get('sched/micro_steps', 0):.0f}" for st in sched) + ".")
    return text


def _band(values) -> str:
    import numpy as np
    v = [x for x in values if x is not None]
    return f"{np.mean(v):.3f} +- {np.std(v):.3f}" if v else "—"


def resummarize(path: Path) -> None:
    """Summarize an earlier result file's runs again with this script's :func:`summarize` and rewrite it."""
    from tltlib.fileio import read_json
    d = read_json(path, "give a bench/results/trl_tlt-*.json file")
    args = argparse.Namespace(**d["settings"])
    args.arms = argparse.Namespace(items=tuple(d["runs"]))
    d["summary"] = summarize(d["runs"])
    write_results(path.stem, d, tables(d["summary"], d["runs"], d.get("two_processes"), args), path.parent)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if args.summarize:
        resummarize(Path(args.summarize))
        return
    import torch

    from tltlib.integrations import check_trl_version
    check_trl_version()
    train, held = data(args)
    runs = {a: [] for a in args.arms.items}
    for seed in range(args.seeds):
        for arm in args.arms.items:
            r = run_arm(args, arm, seed, train, held) if args.one_process else \
                in_child(args, arm, seed, [sys.executable], args.steps)
            runs[arm].append(r)
            print(f"seed {seed} {arm}: steps {', '.join(f'{x:.1f}' for x in r['step_s'])} s; generation "
                  f"{', '.join(f'{x:.1f}' for x in r['generate_s'])} s; held-out {r['held_out']:.3f}", flush=True)
    summary = summarize(runs)
    two = two_processes(args) if args.two_processes and "tlt" in runs else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import trl
    payload = {"bench": "trl_tlt", "machine": machine_info(device), "trl": trl.__version__,
               "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "summary": summary, "runs": runs, "two_processes": two}
    write_results(result_name("trl_tlt", device, "float32", args.tag), payload, tables(summary, runs, two, args),
                  args.out)


if __name__ == "__main__":
    main()
