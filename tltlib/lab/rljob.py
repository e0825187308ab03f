"""An RL job from a parameter file: ``python -m tltlib train-grpo --params FILE`` (the GPU-node entry point).

The file (YAML) names the model, the drafter, the data and the configuration sections::

    model: data/tiny-reasoner              # local checkpoint folder
    drafter: data/tiny-reasoner-drafter    # "" = no learned drafter
    dataset: ""                            # .jsonl / .parquet; "" = the generated task below
    lengths: ""                            # response lengths measured before (notebook 01's lengths.json): the
                                           # memory check sizes the KV page pool from them; "" = max length
    task: chain                            # chain (the tiny reasoner's) or words (word problems, real models)
    task_config: {}                        # the task's settings (tasks.datasets.task_config), e.g. {max_steps: 4}
    rewards: [accuracy]                    # reward functions (rl.grpo.REWARD_FUNCS), weighted by grpo.reward_weights
    curriculum: null                       # tltlib.rl.curriculum.CurriculumConfig, e.g. {levels: [1, 2, 4]}
    train_problems: 4096                   # prompts per epoch (dataset: cycling over the rows before the held-out)
    eval_problems: 128                     # held-out prompts for eval/accuracy, never trained on
    eval_steps: 10                         # evaluate every N steps (0 = at the end only)
    device: auto
    dtype: float32
    grpo: {num_generations: 8, ...}        # tltlib.rl.grpo.GRPOConfig (TRL's names)
    tlt: {speculative: adaptive, ...}      # tltlib.rl.config.TLTConfig; null = the baseline (plain decoding)
    scheduler: {spot_trainer: true, ...}   # tltlib.rl.scheduler.SchedulerConfig (data-parallel workers)

Every key and value is checked before anything loads (a key given twice, unknown keys with the closest spelling,
wrong types, the dataclasses' own checks). The job prints one JSON line of metrics per step (``rl/*``,
``rollout/*``, ``spec/*``, ``drafter/*``, ``update/*``, ``time/*``, ``eval/*`` when it evaluates, ``sched/*`` under
torchrun) and appends it to ``OUTPUT/metrics.jsonl``; checkpoints go to
``OUTPUT`` every ``grpo.save_steps`` steps and at the end; ``--resume OUTPUT`` continues a run exactly where it
stopped (with the same file: ``OUTPUT/job.json`` records the model, drafter and data, the checkpoint the
configurations). Under torchrun every process is one data-parallel worker (:class:`tltlib.rl.world.DistributedWorld`),
rank 0 writes the log, and a group restarted by torchrun (``--max-restarts``) resumes from the last checkpoint by
itself. An update whose gradient norm is not finite stops the run before it touches the policy or the last
checkpoint.

Departures: none (tooling).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from ..errors import BadInput, NotFound, Refused
from ..fileio import atomic_write_text, check_output_folder, read_json, remove_stale_temporaries, resolve
from ..model.loading import load
from ..rl.config import TLTConfig
from ..rl.curriculum import CurriculumConfig, level_pools
from ..rl.grpo import GRPOConfig, reward_funcs_named
from ..rl.memory import MeasuredLengths
from ..rl.scheduler import SchedulerConfig
from ..rl.trainer import GRPOTrainer
from ..rl.world import DistributedWorld, check_one_gpu_per_worker, launched_by_torchrun, torchrun_command
from ..spec.strategy import SpecStrategy
from ..tasks.datasets import TASKS, split_problems
from .params import dataclass_from_mapping, load_yaml, params_path, task_configs

TOP_LEVEL = {"model": str, "drafter": str, "dataset": str, "lengths": str, "task": str, "task_config": dict,
             "rewards": list, "curriculum": (dict, type(None)), "train_problems": int, "eval_problems": int,
             "eval_steps": int, "device": str, "dtype": str, "grpo": dict, "tlt": (dict, type(None)), "scheduler": dict}
DEFAULTS = {"drafter": "", "dataset": "", "lengths": "", "task": "chain", "task_config": {}, "rewards": ["accuracy"],
            "curriculum": None, "train_problems": 4096, "eval_problems": 128, "eval_steps": 0, "device": "auto",
            "dtype": "float32", "grpo": {}, "tlt": {}, "scheduler": {}}
RENAMED = {("scheduler", "pairs"): "train_on"}
"""Settings of earlier versions: the error names the new key."""
JOB_KEYS = ("model", "drafter", "dataset", "task", "task_config", "train_problems", "eval_problems")
"""What the checkpoint does not pin and OUTPUT/job.json records: the data and the files the run started from."""


@dataclass
class Job:
    """A checked parameter file."""

    source: str
    model: str
    drafter: str
    dataset: str
    lengths: str
    task: str
    task_config: dict
    rewards: list
    curriculum: CurriculumConfig | None
    train_problems: int
    eval_problems: int
    eval_steps: int
    device: str
    dtype: str
    grpo: GRPOConfig
    tlt: TLTConfig | None
    scheduler: SchedulerConfig

    @property
    def task_cfgs(self) -> tuple:
        """(training, held-out) configs of the generated task (:func:`tltlib.lab.params.task_configs`)."""
        return task_configs(self.task, self.task_config, f"{self.source}: task_config")

    def settings(self) -> dict:
        """Every field, the configs as plain dicts (what a result file or a cross-rank check records)."""
        return {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in vars(self).items()}

    def record(self) -> dict:
        """The job.json of a run: :data:`JOB_KEYS` as the file gives them."""
        return {k: getattr(self, k) for k in JOB_KEYS}


OVERRIDABLE = ("model", "drafter")
"""The settings a command's flags (``--model``, ``--drafter``) may replace in a job file (:func:`read_job`)."""


def read_job(params: str | os.PathLike, overrides: dict | None = None) -> Job:
    """Parse and check a train-grpo parameter file (no model is loaded). ``overrides``: the flags that replace the
    file's folders (``{"model": ..., "drafter": ...}``, :data:`OVERRIDABLE`; None: the file's), applied before any
    check, so a folder the file names but the flag replaces is never looked for (and a flag's folder is)."""
    path = params_path(params, folder="params/train")
    d = load_yaml(path)
    if not isinstance(d, dict):
        raise BadInput(f"{path}: expected a mapping with model, grpo, tlt, ...")
    unknown = sorted(set(d) - set(TOP_LEVEL))
    if unknown:
        raise BadInput(f"{path}: {unknown[0]!r} is not a train-grpo setting; settings: {', '.join(TOP_LEVEL)}")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if set(given) - set(OVERRIDABLE):
        raise BadInput(f"{path}: only {', '.join(OVERRIDABLE)} can be overridden, not {sorted(set(given))}")
    if "model" not in d and "model" not in given:
        raise BadInput(f"{path}: 'model' is missing: give the local checkpoint folder of the policy")
    values = {**DEFAULTS, **d, **{k: str(v) for k, v in given.items()}}
    for k, want in TOP_LEVEL.items():
        v = values[k]
        if isinstance(v, bool) or not isinstance(v, want):
            raise BadInput(f"{path}: {k} = {v!r} has the wrong type; expected "
                           f"{getattr(want, '__name__', 'a mapping or null')}")
    for k, lo in (("train_problems", 1), ("eval_problems", 0), ("eval_steps", 0)):
        if values[k] < lo:
            raise BadInput(f"{path}: {k} must be >= {lo}, got {values[k]}")
    for k, kind in (("model", "dir"), ("drafter", "dir"), ("dataset", "file"), ("lengths", "file")):
        _check_path(path, k, values[k], kind, flag=k in given)
    if values["lengths"]:
        MeasuredLengths.load(resolve(values["lengths"]))          # a wrong file is refused before anything loads
    for (section, old), new in RENAMED.items():
        if old in (values[section] or {}):
            raise BadInput(f"{path}: {section}.{old} was renamed {section}.{new}: write {new}: "
                           f"{values[section][old]}")
    grpo = dataclass_from_mapping(GRPOConfig, values["grpo"], f"{path}: grpo")
    if values["task"] not in TASKS:
        raise BadInput(f"{path}: task {values['task']!r} is not a generated task; choose one of {', '.join(TASKS)} "
                       "(or give a dataset file)")
    task_configs(values["task"], values["task_config"], f"{path}: task_config")
    reward_funcs_named(values["rewards"], f"{path}: rewards")
    if grpo.reward_weights is not None and len(grpo.reward_weights) != len(values["rewards"]):
        raise BadInput(f"{path}: grpo.reward_weights has {len(grpo.reward_weights)} values for the "
                       f"{len(values['rewards'])} rewards {values['rewards']}; give one weight per reward")
    curriculum = None if values["curriculum"] is None else \
        dataclass_from_mapping(CurriculumConfig, values["curriculum"], f"{path}: curriculum")
    tlt = None if values["tlt"] is None else dataclass_from_mapping(TLTConfig, values["tlt"], f"{path}: tlt")
    scheduler = dataclass_from_mapping(SchedulerConfig, values["scheduler"], f"{path}: scheduler")
    _check_strategies(path, tlt, values["drafter"])
    if tlt is not None:
        tlt.check_drafter(bool(values["drafter"]), str(path))
    if tlt is not None and tlt.prior:
        _check_path(path, "tlt.prior", tlt.prior, "file")        # its fit to the model is checked when it loads
    return Job(str(path), values["model"], values["drafter"], values["dataset"], values["lengths"], values["task"],
               values["task_config"], values["rewards"], curriculum, values["train_problems"],
               values["eval_problems"], values["eval_steps"], values["device"], values["dtype"], grpo, tlt, scheduler)


def _check_strategies(path: Path, tlt: TLTConfig | None, drafter: str) -> None:
    """Before loading: every strategy the job can run (``tlt.speculative``, or each of ``tlt.arms`` under
    ``adaptive``) has the drafter it needs (``suffix`` and ``ngram`` are model-free); that each can be read and fits
    the room the rollout's cache leaves a step, ``TLTConfig`` checked when the job's ``tlt`` was read."""
    if tlt is None or tlt.speculative == "off":
        return
    if tlt.speculative == "adaptive":
        learned = [str(arm) for arm in tlt.arms if SpecStrategy.parse(arm).uses_drafter]
        needs = f"the adaptive tuner's arms need a learned drafter ({', '.join(learned)})" if learned else None
    else:
        needs = "needs a learned drafter" if SpecStrategy.parse(tlt.speculative).uses_drafter else None
    if needs and not drafter:
        raise BadInput(f"{path}: tlt.speculative = {tlt.speculative!r}: {needs}: set 'drafter' (or use a "
                       "model-free speculative: ngram-D or suffix-D-N, model-free tlt.arms, off, or tlt: null for the "
                       "baseline)")


def _check_path(source: Path, key: str, value: str, kind: str, flag: bool = False) -> None:
    """Refuse a ``key`` path of the job that is missing or of the wrong kind; ``flag``: it came from ``--key``."""
    if not value:
        return
    p = resolve(value)
    where = f"--{key} {value!r} (replacing {source}'s {key})" if flag else f"{source}: {key} {value!r}"
    if kind == "dir" and not p.is_dir():
        what = "is a file; give its folder" if p.is_file() else "does not exist"
        if not p.exists() and key == "model" and "tltlib/models" in str(p):
            what += (" (tltlib's model cache: import it with python -m tltlib get-model NAME; a warm-started one "
                     "is made by python -m tltlib warm-start, see the file's first lines)")
        raise NotFound(f"{where} {what}")
    if kind == "file" and not p.is_file():
        what = "is a folder; give the data file" if p.is_dir() else "does not exist"
        raise NotFound(f"{where} {what}")


def write_job_params(path: str | os.PathLike, model: str, drafter: str, grpo: dict, tlt: dict | None,
                     scheduler: dict, device: str = "auto", dtype: str = "float32", train_problems: int = 4096,
                     eval_problems: int = 128, eval_steps: int = 0, task: str = "chain",
                     task_config: dict | None = None,
                     rewards: list | None = None, curriculum: dict | None = None) -> Path:
    """Write a train-grpo parameter file (checked by reading it back: a bad value fails here, not in the workers)."""
    d = {"model": str(model), "drafter": str(drafter), "device": device, "dtype": dtype, "task": task,
         "task_config": dict(task_config or {}), "rewards": list(rewards or ["accuracy"]),
         "curriculum": None if curriculum is None else dict(curriculum),
         "train_problems": train_problems, "eval_problems": eval_problems, "eval_steps": eval_steps,
         "grpo": dict(grpo), "tlt": None if tlt is None else dict(tlt), "scheduler": dict(scheduler)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(d, sort_keys=False))
    read_job(path)
    return path


def job_problems(job: Job) -> tuple[list, list]:
    """(training, held-out problems) of a job: from its dataset, else generated from its task
    (:attr:`Job.task_cfgs`)."""
    cfg, held_cfg = job.task_cfgs
    train, held = split_problems(job.dataset, job.train_problems, job.eval_problems, job.grpo.seed,
                                 task=held_cfg, train_task=cfg)
    if job.curriculum is not None:                 # a level the data lacks is named with the file, before loading
        level_pools(train, job.curriculum, job.grpo.prompts_per_step,
                    f"{job.source}: the training problems of {job.dataset or 'task ' + job.task}")
    return train, held


def build(job: Job, progress: bool = False, reward_funcs=None, world: DistributedWorld | None = None):
    """(trainer, held-out problems) for a job: loads the model, tokenizer, drafter and data. Under torchrun
    (``world``) the trainer is one data-parallel worker with the job's scheduler settings."""
    device = world.device if world is not None else job.device
    train, held = job_problems(job)
    model, tok, drafter = load(job.model, job.drafter or None, device=device, dtype=job.dtype)
    funcs = reward_funcs or reward_funcs_named(job.rewards)
    trainer = GRPOTrainer(model, tok, train, job.grpo, reward_funcs=funcs,
                          drafter=drafter if job.tlt is not None else None, tlt=job.tlt, progress=progress,
                          world=world, scheduler=job.scheduler if world is not None else None,
                          curriculum=job.curriculum,
                          lengths=MeasuredLengths.load(resolve(job.lengths)) if job.lengths else None)
    return trainer, held


# --------------------------------------------------------------------------------------------------- the run
def run_job(params: str | os.PathLike, output_dir: str | os.PathLike | None = None, resume: bool = False,
            max_steps: int | None = None, progress: bool = True, out=sys.stdout, reward_funcs=None) -> list[dict]:
    """Train as the file says, writing checkpoints and metrics.jsonl to ``output_dir`` (default
    ``runs/train-grpo/<params name>``); ``resume``: continue the run saved there."""
    job = read_job(params)
    output = Path(output_dir) if output_dir else resolve("runs") / "train-grpo" / Path(job.source).stem
    world = DistributedWorld(job.device, job.scheduler.hang_timeout_s) if launched_by_torchrun() else None
    lead = world is None or world.rank == 0
    if world is not None:                          # every rank must run the same file (else collectives mismatch)
        world.check_same("parameter file", {k: v for k, v in job.settings().items() if k != "source"})
        world.shard(job.grpo.prompts_per_step)     # a world that cannot split the groups: refused before any load
    if lead:
        remove_stale_temporaries(output)           # puts back a checkpoint whose save was killed between renames
    if world is not None:
        world.barrier()                            # ... before any rank looks at the folder
    resume = _check_output(job, output, resume, world)
    if world is not None:
        world.barrier()                            # every rank has checked the folder before rank 0 writes to it
    trainer, held = build(job, progress=False, reward_funcs=reward_funcs, world=world)
    if lead:
        print(f"memory: {trainer.kv_plan.describe()}", file=sys.stderr)
    log = MetricsLog(output / "metrics.jsonl", out, lead)
    if lead:
        _write_run_files(job, output, resume, world)
    if resume:
        trainer.load(output)
    log.keep_until(trainer.step_count, trainer.history)      # steps after the checkpoint re-run
    target = max_steps or job.grpo.max_steps
    steps = max(target - trainer.step_count, 0)
    if steps == 0 and lead:
        print(f"nothing to do: the run in {str(output)!r} is at step {trainer.step_count} of {target}; pass "
              "--max-steps N to train further", file=sys.stderr)
    bar = tqdm(total=steps, desc="GRPO steps", unit="step", disable=not (progress and lead))

    def on_step(m):
        if held and (trainer.step_count == target or job.eval_steps and trainer.step_count % job.eval_steps == 0):
            m.update(trainer.evaluate(held))
        log.emit(m)
        bar.update(1)
        bar.set_postfix(reward=f"{m['rl/reward_mean']:.3f}", step_s=f"{m['time/step_s']:.1f}")

    history = trainer.train(steps, on_step=on_step, save_to=output)
    bar.close()
    if world is not None:
        world.close()
    return history


def _check_output(job: Job, output: Path, resume: bool, world) -> bool:
    """Before any work: whether the run resumes (asked for, or a group torchrun restarted), and that the output
    folder can be written without losing anything. Refusals say what to pass instead."""
    has_checkpoint = (output / "trainer_state.json").is_file()
    unfinished = not has_checkpoint and (output / "job.json").is_file()
    # a group restarted by torchrun continues from the last checkpoint, but only a run this launch started or
    # resumed (launch.json holds torchrun's run id), never one that attempt 0 refused to touch
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    ours = run_id and (output / "launch.json").is_file() and \
        read_json(output / "launch.json", "start the run anew").get("run_id") == run_id
    restarted = bool(world is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and ours)
    if restarted and has_checkpoint:
        resume = True
    if resume:
        if unfinished:
            raise NotFound(f"nothing to resume in {str(output)!r}: the run there stopped before its first "
                           "checkpoint (grpo.save_steps: 0 saves only at the end); start it again without "
                           "--resume (its files are replaced)")
        if not has_checkpoint:
            raise NotFound(f"nothing to resume in {str(output)!r}: it holds no checkpoint "
                           "(trainer_state.json); start the run without --resume")
        _check_same_job(job, output)
        return True
    if not restarted:
        check_output_folder(output, unfinished, lambda p: has_checkpoint or unfinished, "training run",
                            hint=f"continue it with --params {job.source} --resume {output}")
        if unfinished:
            print(f"note: {str(output)!r} holds a run stopped before its first checkpoint: starting it anew",
                  file=sys.stderr)
    return False


def _check_same_job(job: Job, output: Path) -> None:
    """A resumed run must read the data and files it started with (paths compared as resolved folders)."""
    mine = job.record()
    saved = read_json(output / "job.json", "resume with the parameter file that started the run") \
        if (output / "job.json").is_file() else mine

    def same(k):
        a, b = saved.get(k, DEFAULTS.get(k)), mine[k]          # a key older runs did not record: its default
        if k in ("model", "drafter", "dataset") and a and b:
            return resolve(a).resolve() == resolve(b).resolve()
        return a == b
    diff = [k for k in mine if not same(k)]
    if diff:
        text = ", ".join(f"{k}: {saved.get(k)!r} there, {mine[k]!r} in {job.source}" for k in diff)
        raise BadInput(f"{str(output)!r} was written by a run on other data or files ({text}); resume with "
                       "the parameter file that started it (--params), or start a new run elsewhere")


def _write_run_files(job: Job, output: Path, resume: bool, world) -> None:
    """job.json of a new run; launch.json (torchrun's run id) under torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not resume:
        output.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output / "job.json", json.dumps(job.record(), indent=1) + "\n")
    if world is not None and run_id:
        output.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output / "launch.json", json.dumps({"run_id": run_id}) + "\n")


class MetricsLog:
    """The run's metrics.jsonl: one JSON line per RL step, printed to ``out`` and appended (rank 0 only)."""

    def __init__(self, path: Path, out, lead: bool):
        self.path, self.out, self.lead = path, out, lead

    def keep_until(self, step: int, history: list[dict] = ()) -> None:
        """Drop the lines of steps after ``step`` (they re-run after a resume; a last line torn by a killed write
        goes too), and write back from the checkpoint's ``history`` (each step's metrics, as its line held them)
        the lines of steps up to ``step`` that the log lacks (a torn last line of the checkpoint's own step), with
        a note naming them: those steps do not re-run."""
        if not (self.lead and self.path.is_file()):
            return
        kept = [(m.get("rl/step", 0), line) for line, m in parse_metrics(self.path, torn_tail_ok=True)
                if m.get("rl/step", 0) <= step]
        have = {s for s, _ in kept}
        lost = [m for m in history if m.get("rl/step", 0) <= step and m.get("rl/step", 0) not in have]
        kept = sorted(kept + [(m["rl/step"], json.dumps(m, default=float)) for m in lost], key=lambda sl: sl[0])
        atomic_write_text(self.path, "".join(f"{line}\n" for _, line in kept))
        if lost:
            steps = ", ".join(str(m["rl/step"]) for m in lost)
            print(f"note: {str(self.path)!r} lacked the line of step {steps} (a last line torn by a killed write), "
                  "which the checkpoint holds and does not re-run: written back from the checkpoint",
                  file=sys.stderr)

    def emit(self, m: dict) -> None:
        if not self.lead:
            return
        line = json.dumps(m, default=float)
        print(line, file=self.out, flush=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


def parse_metrics(path: Path, torn_tail_ok: bool = False) -> list[tuple[str, dict]]:
    """(line, metrics) of every line of a metrics.jsonl; a line that is not JSON is an error naming the file and
    line, except a torn last line with ``torn_tail_ok`` (dropped)."""
    lines = [x for x in path.read_text(encoding="utf-8", errors="replace").splitlines() if x.strip()]
    out = []
    for i, line in enumerate(lines, 1):
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError as e:
            if torn_tail_ok and i == len(lines):
                break
            raise BadInput(f"{path}, line {i}: not a JSON line of metrics ({e.msg}); the log is damaged: delete "
                           "that line (and the ones after it) or start a new run") from None
    return out


def read_metrics_log(output_dir: str | os.PathLike) -> list[dict]:
    """The per-step metrics a run appended to ``metrics.jsonl`` (a last line torn by a killed run is left out)."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        raise NotFound(f"no metrics.jsonl in {str(output_dir)!r}")
    return [m for _, m in parse_metrics(path, torn_tail_ok=True)]


# ------------------------------------------------------------------------------------------------ launching
STOP_WAIT_S = 30.0
"""How long :func:`launch` waits for an interrupted or failed job's processes to stop after SIGTERM before SIGKILL."""


def launch(params: str | os.PathLike, workers: int, output_dir: str | os.PathLike, max_restarts: int = 0,
           extra: tuple = (), progress: bool = True, timeout_s: float | None = None) -> Path:
    """Run ``train-grpo --params PARAMS`` on ``workers`` torchrun processes and wait for it (a notebook's way to
    start a job), with a progress bar over the RL steps; returns ``output_dir``. Raises with the end of the workers'
    output when the job fails. More workers than GPUs under CUDA is refused before torchrun starts."""
    check_one_gpu_per_worker(workers, read_job(params).device)
    cmd = torchrun_command(workers, ["train-grpo", "--params", str(params), "--output-dir", str(output_dir),
                                     "--quiet", *extra], max_restarts)
    bar = tqdm(desc=f"GRPO steps on {workers} workers", unit="step", disable=not progress)
    with tempfile.TemporaryFile("w+") as err:
        # its own session, so that a timeout or an interrupt stops torchrun and every worker it started
        proc = subprocess.Popen(cmd, env={**os.environ, "TLTLIB_NO_VENV": "1"}, stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True)
        timer = None
        if timeout_s is not None:
            timer = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGTERM))
            timer.start()
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    m = json.loads(line)
                    bar.update(1)
                    bar.set_postfix(step_s=f"{m['time/step_s']:.1f}", idle=f"{m.get('sched/idle_frac', 0):.0%}",
                                    harvested=f"{m.get('sched/harvested', float('nan')):.0%}")
            rc = proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            try:                                   # torchrun stops its workers on SIGTERM; a bound on that wait
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            proc.stdout.close()
            if timer is not None:
                timer.cancel()
        bar.close()
        if rc != 0:
            err.seek(0)
            lines = [x for x in err.read().splitlines() if x.strip() and not x.startswith(("W", "*"))]
            errors = [x for x in lines if x.startswith("error:") or "Error" in x]
            raise Refused(f"the {workers}-worker job failed (exit {rc}): {' '.join(cmd)}\n"
                          + "\n".join((errors or lines)[-8:]))
    return Path(output_dir)
