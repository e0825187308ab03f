"""What a check runs on, from the command line and a ``train-grpo`` job file: the model and drafter folders, the
prompts (the job's problems, a generated task or a dataset file) and the sampling settings (the job's
GRPOConfig unless a flag says otherwise), all checked before anything loads.

Paper: none. Departures: none (tooling).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...errors import BadInput, NotFound
from ...fileio import ROOT, check_file_writable, resolve
from ...tasks.datasets import generate_task, load_problems
from ...tasks.prompts import encode_prompts
from ..rljob import job_problems, read_job
from .config import CheckConfig

TINY = ROOT / "data" / "tiny-reasoner"


@dataclass(frozen=True)
class CheckInputs:
    """The folders, prompts source and settings of one check."""

    model: str
    drafter: str
    dataset: str
    job: str
    config: CheckConfig


def _names(text: str) -> tuple:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def _rows(text: str) -> tuple:
    try:
        return tuple(int(r) for r in _names(text))
    except ValueError:
        raise BadInput(f"check: --rows {text!r} must be comma-separated row counts, e.g. 1,4,16") from None


def check_inputs(args) -> CheckInputs:
    """The check's inputs from parsed ``check`` arguments: a flag wins over the job's setting (``--params``),
    which wins over the default. Folders and the output's folder are checked here, before any loading."""
    job = read_job(args.params, {"model": args.model, "drafter": args.drafter or None}) if args.params else None
    g = job.grpo if job is not None else None

    def pick(flag, from_job, default):
        return flag if flag is not None else (from_job if job is not None else default)

    model = args.model or (job.model if job is not None else str(TINY))
    drafter = args.drafter if args.drafter is not None else (job.drafter if job is not None else "")
    for what, path in (("--model", model), ("--drafter", drafter)):
        if path and not resolve(path).is_dir():
            raise NotFound(f"check: {what} {path!r} is not a folder: pass a local model (drafter) folder")
    for what, path in (("--out", args.out), ("--prior", args.prior)):   # where it writes, before minutes of tests
        if path:
            check_file_writable(path, f"check {what} file")             # the path as the command writes it
    cfg = CheckConfig(
        temperature=pick(args.temperature, g and g.temperature, 1.0), top_p=pick(args.top_p, g and g.top_p, 1.0),
        top_k=pick(args.top_k, g and g.top_k, 0),
        max_new_tokens=pick(args.max_new_tokens, g and g.max_completion_length, 256), prompts=args.prompts,
        samples=args.samples, strategy=args.strategy, arms=_names(args.arms), rows=_rows(args.rows),
        parts=_names(args.parts), seed=args.seed)
    if args.prior and "pays" not in cfg.parts:
        raise BadInput("check: --prior is written by the pays part; add it to --parts or drop --prior")
    return CheckInputs(model, drafter or "", args.dataset or "", args.params or "", cfg)


def check_dtype(flag: str) -> str:
    """The dtype a check runs in: ``--dtype`` as given; ``auto`` (the default) is float32 on every device, CUDA
    included: in bfloat16 a verify forward over several tokens and the decode forwards it replaces round
    differently, so the greedy identity and the χ² tests would call rounding a loss."""
    if flag not in ("auto", "float32", "bfloat16"):
        raise BadInput(f"check: --dtype {flag!r}: choose auto (float32), float32 or bfloat16")
    return "float32" if flag == "auto" else flag


def check_prompts(inputs: CheckInputs, tokenizer, seed: int) -> list[list[int]]:
    """The tokenized prompts: the job's training problems, else ``--dataset`` (``chain``, ``words`` or a file),
    else the chain task for the character-level tiny reasoner and word problems for other models."""
    n = inputs.config.prompts
    if inputs.job and not inputs.dataset:
        problems = job_problems(read_job(inputs.job, {"model": inputs.model, "drafter": inputs.drafter or None}))[0]
    elif inputs.dataset in ("chain", "words") or not inputs.dataset:
        task = inputs.dataset or ("chain" if len(tokenizer) < 1000 else "words")
        problems = generate_task(task, n, seed + 4000)
    else:
        path = resolve(inputs.dataset)
        if not path.is_file():
            raise NotFound(f"check: --dataset {inputs.dataset!r} is neither chain, words nor a file")
        problems = load_problems(path)
    if len(problems) < n:
        raise BadInput(f"check: {Path(inputs.dataset or inputs.job).name or 'the task'} gives {len(problems)} "
                       f"prompts but the tests need {n} (--prompts, at least 4): use more prompts or lower --prompts")
    return encode_prompts(problems[:n], tokenizer)
