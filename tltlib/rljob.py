"""An RL job from a parameter file: ``python -m tltlib train-grpo --params FILE`` (the GPU-node entry point).

The file (YAML) names the model, the drafter, the data and the two configuration sections::

    model: data/tiny-reasoner              # local checkpoint folder
    drafter: data/tiny-reasoner-drafter    # "" = no learned drafter
    dataset: ""                            # .jsonl / .parquet; "" = the chain task
    train_problems: 4096                   # prompts per epoch (dataset: cycling over the rows before the held-out)
    eval_problems: 128                     # held-out prompts for eval/accuracy, never trained on
    eval_steps: 10                         # evaluate every N steps (0 = at the end only)
    device: auto
    dtype: float32
    grpo: {num_generations: 8, ...}        # tltlib.grpo.GRPOConfig (TRL's names)
    tlt: {speculative: adaptive, ...}      # tltlib.trainer.TLTConfig; null = the baseline (plain decoding)

Every key and value is checked before anything loads (unknown keys with the closest spelling, wrong types, the
dataclasses' own checks). The job prints one JSON line of metrics per step (``rl/*``, ``rollout/*``, ``spec/*``,
``drafter/*``, ``time/*``) and appends it to ``OUTPUT/metrics.jsonl``; checkpoints go to ``OUTPUT`` every
``grpo.save_steps`` steps and at the end; ``--resume OUTPUT`` continues a run exactly where it stopped (with the
same file: ``OUTPUT/job.json`` records the model, drafter and data, the checkpoint the configurations). An update
whose gradient norm is not finite stops the run before it touches the policy or the last checkpoint.

Departures: none (tooling).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .fileio import atomic_write_text, check_output_folder, read_json
from .params import dataclass_from_mapping, params_path, resolve

TOP_LEVEL = {"model": str, "drafter": str, "dataset": str, "train_problems": int, "eval_problems": int,
             "eval_steps": int, "device": str, "dtype": str, "grpo": dict, "tlt": (dict, type(None)),
             "scheduler": dict}


@dataclass
class JobSpec:
    """A checked parameter file."""

    source: str
    model: str
    drafter: str
    dataset: str
    train_problems: int
    eval_problems: int
    eval_steps: int
    device: str
    dtype: str
    grpo: object
    tlt: object
    scheduler: object = None


def read_job(params: str | os.PathLike) -> JobSpec:
    """Parse and check a train-grpo parameter file (no model is loaded)."""
    import yaml

    from .grpo import GRPOConfig
    from .trainer import TLTConfig
    path = params_path(params)
    try:
        d = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a mapping with model, grpo, tlt, ...")
    unknown = sorted(set(d) - set(TOP_LEVEL))
    if unknown:
        raise ValueError(f"{path}: {unknown[0]!r} is not a train-grpo setting; settings: {', '.join(TOP_LEVEL)}")
    defaults = {"drafter": "", "dataset": "", "train_problems": 4096, "eval_problems": 128, "eval_steps": 0,
                "device": "auto", "dtype": "float32", "grpo": {}, "tlt": {}, "scheduler": {}}
    values = {**defaults, **d}
    if "model" not in d:
        raise ValueError(f"{path}: 'model' is missing: give the local checkpoint folder of the policy")
    for k, want in TOP_LEVEL.items():
        v = values[k]
        if isinstance(v, bool) or not isinstance(v, want):
            raise ValueError(f"{path}: {k} = {v!r} has the wrong type; expected {getattr(want, '__name__', 'a mapping or null')}")
    for k, lo in (("train_problems", 1), ("eval_problems", 0), ("eval_steps", 0)):
        if values[k] < lo:
            raise ValueError(f"{path}: {k} must be >= {lo}, got {values[k]}")
    for k, kind in (("model", "dir"), ("drafter", "dir"), ("dataset", "file")):
        p = values[k]
        if p and not (resolve(p).is_dir() if kind == "dir" else resolve(p).is_file()):
            what = "is a file; give its folder" if kind == "dir" and resolve(p).is_file() else \
                "is a folder; give the data file" if kind == "file" and resolve(p).is_dir() else "does not exist"
            raise FileNotFoundError(f"{path}: {k} {p!r} {what}")
    grpo = dataclass_from_mapping(GRPOConfig, values["grpo"], f"{path}: grpo")
    tlt = None if values["tlt"] is None else dataclass_from_mapping(TLTConfig, values["tlt"], f"{path}: tlt")
    from .scheduler import SchedulerConfig
    scheduler = dataclass_from_mapping(SchedulerConfig, values["scheduler"], f"{path}: scheduler")
    if tlt is not None and not values["drafter"] and tlt.speculative not in ("off",) and not \
            tlt.speculative.startswith("ngram"):
        raise ValueError(f"{path}: tlt.speculative = {tlt.speculative!r} needs a learned drafter: set 'drafter' (or "
                         "use speculative: off / ngram-D, or tlt: null for the baseline)")
    return JobSpec(str(path), values["model"], values["drafter"], values["dataset"], values["train_problems"],
                   values["eval_problems"], values["eval_steps"], values["device"], values["dtype"], grpo, tlt,
                   scheduler)


def build(spec: JobSpec, progress: bool = False, reward_funcs=None, workers=None):
    """(trainer, held-out problems) for a job spec: loads the model, tokenizer, drafter and data. Under torchrun
    (``workers``: a :class:`tltlib.scheduler.Workers`) the trainer is one data-parallel worker."""
    from .checkpoint import load
    from .grpo import accuracy_reward
    from .tasks import ChainTaskConfig, split_problems
    from .trainer import GRPOTrainer
    device = workers.device if workers is not None else spec.device
    model, tok, drafter = load(spec.model, spec.drafter or None, device=device, dtype=spec.dtype)
    train, held = split_problems(spec.dataset, spec.train_problems, spec.eval_problems, spec.grpo.seed,
                                 task=ChainTaskConfig(zipf_exponent=0.6))
    kw = dict(reward_funcs=reward_funcs or (accuracy_reward,), drafter=drafter if spec.tlt is not None else None,
              tlt=spec.tlt, progress=progress)
    if workers is None:
        return GRPOTrainer(model, tok, train, spec.grpo, **kw), held
    from .scheduler import DistributedGRPOTrainer
    return DistributedGRPOTrainer(model, tok, train, spec.grpo, scheduler=spec.scheduler, workers=workers, **kw), held


def run_job(params: str | os.PathLike, output_dir: str | os.PathLike | None = None, resume: bool = False,
            max_steps: int | None = None, progress: bool = True, out=sys.stdout, reward_funcs=None) -> list[dict]:
    """Train as the file says, writing checkpoints and metrics.jsonl to ``output_dir`` (default
    ``runs/train-grpo/<params name>``); ``resume``: continue the run saved there. Under torchrun every process is
    one data-parallel worker (:mod:`tltlib.scheduler`); rank 0 writes the log; a group restarted by torchrun
    (``--max-restarts``) resumes from the last checkpoint by itself."""
    from tqdm.auto import tqdm

    from .scheduler import Workers, launched_by_torchrun
    spec = read_job(params)
    output = Path(output_dir) if output_dir else resolve("runs") / "train-grpo" / Path(spec.source).stem
    is_checkpoint = lambda p: (p / "trainer_state.json").is_file()        # noqa: E731
    workers = Workers(spec.device, spec.scheduler.hang_timeout_s) if launched_by_torchrun() else None
    lead = workers is None or workers.rank == 0
    if workers is not None:                        # every rank must run the same file (else collectives mismatch)
        from dataclasses import asdict
        workers.check_same("parameter file", {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v
                                              for k, v in vars(spec).items() if k != "source"})
    # a group restarted by torchrun continues from the last checkpoint, but only a run this launch started or resumed
    # (launch.json holds torchrun's run id), never one that attempt 0 refused to touch
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    ours = run_id and (output / "launch.json").is_file() and \
        read_json(output / "launch.json", "start the run anew").get("run_id") == run_id
    restarted = bool(workers is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and ours)
    if restarted and is_checkpoint(output):
        resume = True
    # what the trainer's own checkpoint does not pin: the data and the files the run started from
    job = {k: getattr(spec, k) for k in ("model", "drafter", "dataset", "train_problems", "eval_problems")}
    if resume:
        if not is_checkpoint(output):
            raise FileNotFoundError(f"nothing to resume in {str(output)!r}: it holds no checkpoint "
                                    "(trainer_state.json); start the run without --resume")
        saved = read_json(output / "job.json", "resume with the parameter file that started the run") \
            if (output / "job.json").is_file() else job
        if saved != job:
            diff = ", ".join(f"{k}: {saved.get(k)!r} there, {job[k]!r} in {spec.source}" for k in job
                             if saved.get(k) != job[k])
            raise ValueError(f"{str(output)!r} was written by a run on other data or files ({diff}); resume with "
                             "the parameter file that started it (--params), or start a new run elsewhere")
    elif not restarted:
        check_output_folder(output, False, is_checkpoint, "training run",
                            hint=f"continue it with --params {spec.source} --resume {output}")
    if workers is not None:
        workers.barrier()                          # every rank has checked the folder before rank 0 writes to it
    trainer, held = build(spec, progress=False, reward_funcs=reward_funcs, workers=workers)
    log_file = output / "metrics.jsonl"
    if not resume and lead:
        output.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output / "job.json", json.dumps(job, indent=1) + "\n")
    if workers is not None and lead and run_id:
        output.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output / "launch.json", json.dumps({"run_id": run_id}) + "\n")
    if resume:
        trainer.load(output)
    if lead and log_file.is_file():                # drop lines of steps done after the checkpoint (they re-run)
        kept = [line for line in log_file.read_text().splitlines()
                if line.strip() and json.loads(line).get("rl/step", 0) <= trainer.step_count]
        atomic_write_text(log_file, "".join(f"{line}\n" for line in kept))
    steps = (max_steps or spec.grpo.max_steps) - trainer.step_count
    if steps <= 0 and lead:
        print(f"nothing to do: the run in {str(output)!r} is at step {trainer.step_count} of "
              f"{max_steps or spec.grpo.max_steps}; pass --max-steps N to train further", file=sys.stderr)
    bar = tqdm(total=max(steps, 0), desc="GRPO steps", unit="step", disable=not (progress and lead))

    def emit(m):
        if not lead:
            return
        line = json.dumps(m, default=float)
        print(line, file=out, flush=True)
        output.mkdir(parents=True, exist_ok=True)
        with open(log_file, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")

    def on_step(m):
        last = trainer.step_count == (max_steps or spec.grpo.max_steps)
        if held and (last or spec.eval_steps and trainer.step_count % spec.eval_steps == 0):
            m.update(trainer.evaluate(held))
        emit(m)
        bar.update(1)
        bar.set_postfix(reward=f"{m['rl/reward_mean']:.3f}", step_s=f"{m['time/step_s']:.1f}")

    history = trainer.train(max(steps, 0), on_step=on_step, save_to=output)
    bar.close()
    if workers is not None:
        workers.close()
    return history


def read_metrics_log(output_dir: str | os.PathLike) -> list[dict]:
    """The per-step metrics a run appended to ``metrics.jsonl``."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {str(output_dir)!r}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
