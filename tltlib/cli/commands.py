"""What each ``python -m tltlib`` command does, once its arguments are parsed (:mod:`tltlib.cli.parser`) and it runs
inside the venv: each imports what it needs when called, so building the parser never imports torch.

Departures: none (tooling).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ..errors import BadInput
from .bootstrap import ROOT, TINY_DRAFTER, TINY_MODEL, notebook_env


def cmd_run_notebooks(args) -> int:
    """Run the notebooks: one line per notebook (its time, where its outputs went, its headline number), the
    kernels' and papermill's output in the run's log (``--verbose``: on the terminal, with papermill's cell bar)."""
    from ..lab.notebook import run_notebooks
    notebook_env()
    t0 = time.perf_counter()
    done = run_notebooks(args.params, out_root=args.out, only=args.only, progress=not args.quiet,
                         notebooks=args.notebooks, log=not args.verbose, on_event=_NotebookLines(args.params))
    print(f"{len(done)} notebook{'s' * (len(done) != 1)} in {_duration(time.perf_counter() - t0)}", flush=True)
    return 0


class _NotebookLines:
    """``python -m tltlib run``'s screen: the log's path, then one line per notebook (rewritten in place while it
    runs when the screen is a terminal)."""

    def __init__(self, params: str):
        self.params, self.tty, self.width = params, sys.stdout.isatty(), 0

    def __call__(self, kind: str, **info) -> None:
        if kind == "begin":
            self.width = max(len(nb.stem) for nb in info["notebooks"])
            where = f"; full log: {_shown(info['log'])}" if info["log"] else ""
            print(f"running {len(info['notebooks'])} notebook(s) with {self.params}{where}", flush=True)
        elif kind == "start" and self.tty:
            print(f"  {info['notebook'].stem:<{self.width}}  running ...", end="", flush=True)
        elif kind == "failed":
            line = f"  {info['notebook'].stem:<{self.width}}  {_duration(info['seconds']):>10}  failed"
            print(("\r" if self.tty else "") + line + "\033[K" * self.tty, flush=True)
        elif kind == "done":
            from ..lab.notebook import headline
            line = (f"  {info['notebook'].stem:<{self.width}}  {_duration(info['seconds']):>10}  "
                    f"{_shown(info['folder'])}/  {headline(info['notebook'], info['metrics'])}").rstrip()
            print(("\r" if self.tty else "") + line + "\033[K" * self.tty, flush=True)


def _duration(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s" if seconds >= 60 else f"{seconds:.0f} s"


def _shown(path) -> str:
    """``path`` relative to the project when it is inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


TEST_MARKERS = "not gpu and not slow and not browser and not timing"
"""The tiers ``python -m tltlib test`` runs (the README's test command; ``bench tests`` times the same)."""


TEST_WORKERS_MAX = 4
"""At most this many pytest-xdist workers for ``python -m tltlib test`` (each holds its own models and venv imports,
~1-2 GiB; a GPU node's many cores would otherwise start dozens)."""


def test_workers() -> int:
    """How many pytest-xdist workers ``python -m tltlib test`` starts: one per core this process may run on, at most
    :data:`TEST_WORKERS_MAX`; 1 (no workers) without pytest-xdist. Each test process runs one torch thread
    (tests/conftest.py), so one process per core keeps every core busy: on a 2-core AMD EPYC the default tier took
    20 min 20 s in one process, its cores 37% idle."""
    import importlib.util
    if importlib.util.find_spec("xdist") is None:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, TEST_WORKERS_MAX))


def pytest_args(extra: list[str], workers: int | None = None, markers: str = TEST_MARKERS) -> list[str]:
    """The arguments ``python -m tltlib test`` (and ``bench tests``) gives pytest: ``markers`` (the README's tiers),
    ``workers`` xdist workers (default :func:`test_workers`) handed one test at a time (``--maxschedchunk 1``: the
    long tests, which tests/conftest.py puts first, spread over the workers), then ``extra``; ``extra`` naming its own
    workers (``-n``, ``--numprocesses``, ``-p no:xdist``) keeps them."""
    workers = test_workers() if workers is None else workers
    own = any(a == "no:xdist" or a.startswith(("-n", "--numprocesses")) for a in extra)
    parallel = ["-n", str(workers), "--maxschedchunk", "1"] if workers > 1 and not own else []
    return ["-m", markers, *parallel, *extra]


def cmd_test(args) -> int:
    import pytest
    notebook_env()
    os.chdir(ROOT)
    return pytest.main(pytest_args(args.pytest_args))


def cmd_train_reasoner(args) -> int:
    from ..lab.reasoner import ReasonerTrainConfig, train_reasoner
    from ..model.weights import pick_device
    extra = {k: v for k, v in (("lr", args.lr), ("eval_problems", args.eval_problems)) if v is not None}
    cfg = ReasonerTrainConfig(preset=args.preset, steps=args.steps, minutes=args.minutes, seed=args.seed, **extra)
    card = train_reasoner(cfg, args.out, progress=not args.quiet, overwrite=args.overwrite,
                          device=pick_device(args.device))
    print(card)
    print(f"saved {args.out}")
    return 0


def cmd_train_drafter(args) -> int:
    from ..drafting.train import DrafterTrainConfig
    from ..drafting.warmup import train_warm_drafter
    out = args.out or str(ROOT / "runs" / "drafters" / f"{Path(args.model).resolve().name}-drafter")
    command = "python -m tltlib train-drafter " + " ".join(a for a in sys.argv[2:] if a != "--quiet")
    from ..model.weights import pick_device
    recipe = DrafterTrainConfig(steps=args.steps, ce_positions=args.ce_positions, unroll=args.unroll,
                                ce_vocab=args.ce_vocab, minutes=args.minutes,
                                **({"lr": args.lr} if args.lr else {}),
                                **({"batch_sequences": args.batch} if args.batch else {}))
    print(train_warm_drafter(args.model, out, recipe, seed=args.seed, progress=not args.quiet,
                             overwrite=args.overwrite, task_max_steps=args.task_max_steps, command=command.strip(),
                             device=pick_device(args.device), dtype=args.dtype, dataset=args.dataset,
                             init=args.init, n_train=args.n_train, n_eval=args.n_eval,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             n_accept=args.n_accept, draft_vocab=args.draft_vocab, responses=args.responses))
    print(f"saved {out}")
    return 0




def cmd_get_model(args) -> int:
    from ..model.importers import MODELS, cache_dir, get_model, is_imported
    if args.list or not args.name:
        for name, m in MODELS.items():
            where = Path(args.root or cache_dir()) / name
            print(f"{name}: {m.about}\n    {where} ({'imported' if is_imported(where) else 'not imported yet'})")
        return 0
    print(get_model(args.name, args.root, progress=not args.quiet))
    return 0


def kernels_drafter(model: str, drafter: str | None) -> str | None:
    """The drafter ``python -m tltlib kernels`` measures beside ``model``: the one given ('' for none), else the tiny
    reasoner's with the tiny reasoner, none with another model (the tiny drafter fits no other target)."""
    if drafter is not None:
        return drafter or None
    return TINY_DRAFTER if model == TINY_MODEL else None


def cmd_kernels(args) -> int:
    from ..kernels import search as ks
    from ..kernels import table as kt
    from ..model.loading import load
    if not kt.enabled():
        raise BadInput(f"{kt.ENV}={os.environ.get(kt.ENV)} turns this machine's kernel table off; unset it (or set it "
                       "to 1) to measure it")
    drafter_path = kernels_drafter(args.model, args.drafter)
    model, _, drafter = load(args.model, drafter_path, device="cpu", dtype="float32")
    before = kt.current().size
    table = ks.ensure(model, drafter, progress=not args.quiet, measure=True)
    shapes = f"{args.model}" + (f" and {drafter_path}" if drafter_path else "")
    if table.size == before:
        print(f"kernel table for {shapes}: already measured ({table.size} cells in {kt.cache_path(table.machine)})")
    else:
        print(ks.summary(table, set(table.linear) | set(table.attention)).removeprefix("tltlib: ") + f" for {shapes}")
    return 0


def cmd_import_gguf(args) -> int:
    from ..model.importers import import_gguf
    rec = import_gguf(args.file, args.out, overwrite=args.overwrite)
    print(f"imported {rec['name'] or rec['gguf_file']} ({rec['architecture']}, {rec['parameters'] / 1e6:.1f} M "
          f"parameters; logits within {rec['logits_max_abs_diff']:.1e} of transformers) -> {args.out}")
    return 0


def cmd_train_grpo(args) -> int:
    from ..lab.rljob import read_job, run_job
    from ..rl.world import check_one_gpu_per_worker, launched_by_torchrun, shard, torchrun_command
    if args.workers and launched_by_torchrun():
        raise BadInput("--workers starts torchrun itself; under torchrun drop --workers (the world size is "
                       "torchrun's --nproc-per-node)")
    if args.max_restarts and not args.workers:
        raise BadInput("--max-restarts goes with --workers; under torchrun give it to torchrun (torchrun "
                       "--max-restarts N ... -m tltlib train-grpo ...)")
    if args.workers:
        job = read_job(args.params)                  # one clear error here rather than one per worker
        shard(job.grpo.prompts_per_step, args.workers, 0)
        check_one_gpu_per_worker(args.workers, job.device)
        argv = sys.argv[1:]
        i = argv.index("train-grpo")
        rest, skip = [], False
        for a in argv[i + 1:]:                        # the same command without --workers / --max-restarts
            if skip:
                skip = False
            elif a in ("--workers", "--max-restarts"):
                skip = True
            elif not a.startswith(("--workers=", "--max-restarts=")):
                rest.append(a)
        cmd = torchrun_command(args.workers, ["train-grpo", *rest], args.max_restarts)
        return subprocess.run(cmd, env={**os.environ, "TLTLIB_NO_VENV": "1"}).returncode
    if args.resume and args.output_dir and Path(args.resume).resolve() != Path(args.output_dir).resolve():
        raise BadInput(f"--resume {args.resume} continues the run in that folder; drop --output-dir "
                       f"{args.output_dir} (a resumed run writes where it was saved)")
    run_job(args.params, output_dir=args.resume or args.output_dir, resume=bool(args.resume),
            max_steps=args.max_steps, progress=not args.quiet)
    return 0


def cmd_check(args) -> int:
    from ..fileio import resolve
    from ..lab.check import card_numbers, run_check, screen, write_report
    from ..lab.check.inputs import check_dtype, check_inputs, check_prompts
    from ..model.loading import load
    from ..model.weights import pick_device
    inputs = check_inputs(args)                                # every setting checked before anything loads
    device, dtype = pick_device(args.device), check_dtype(args.dtype)       # float32 unless asked: like with like
    model, tok, drafter = load(inputs.model, inputs.drafter or None, device=device, dtype=dtype)
    prompts = check_prompts(inputs, tok, args.seed)
    log = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    card = card_numbers(resolve(inputs.drafter)) if inputs.drafter else {}
    report = run_check(model, tok, drafter, prompts, inputs.config, card=card, prior_path=args.prior or None, log=log,
                       progress=not args.quiet)
    report.settings.update(model=inputs.model, drafter=inputs.drafter, dataset=inputs.dataset, params=inputs.job)
    write_report(report, args.out)
    print(screen(report))
    print(f"report: {args.out}")
    return 1 if report.lossless is False else 0             # untested (--parts without lossless): 0, said so


def cmd_simulate(args) -> int:
    import json

    from ..fileio import atomic_write_text, check_writable, resolve
    from ..lab.calibrate import report, validate
    from ..machine import machine_info
    from ..model.loading import load
    if args.validate == args.project:
        raise BadInput("say what to simulate: --validate (check the simulator against runs measured here) or "
                       "--project (the paper's settings, beside its Table 3)")
    vars(args).update(_simulate_workload(args))             # before anything loads or is measured
    check_writable(resolve(args.out) / "simulate.json", "--out folder's results")   # a file there: refused now
    if args.project:
        return _simulate_project(args)
    model, tok, drafter = load(args.model, args.drafter, device="cpu")
    checks, inputs = validate(model, tok, drafter, prompts=args.prompts, num_generations=args.num_generations,
                              max_new=args.max_new,
                              steps=args.steps, workers_results=resolve(args.workers_results) if args.workers_results
                              else None, log=lambda s: print(s, file=sys.stderr, flush=True))
    table, payload = report(checks, inputs, machine_info(), {k: v for k, v in vars(args).items() if k != "func"})
    print(table)
    out = resolve(args.out)
    atomic_write_text(out / "simulate-validate-cpu.json", json.dumps(payload, indent=1) + "\n")
    atomic_write_text(out / "simulate-validate-cpu.md", table)
    bad = [c.what for c in checks if not c.ok]
    if bad:
        print(f"error: {len(bad)} prediction(s) off by more than 15% (shares: 5 points): {'; '.join(bad)}",
              file=sys.stderr)
        return 1
    return 0


def cmd_report(args) -> int:
    from ..lab.report import broken_links, render_docs
    changed = render_docs(check=args.check)
    shown = ", ".join(_shown(p) for p in changed)
    broken = broken_links()
    for link in broken:
        print(f"broken link: {link}", file=sys.stderr)
    if args.check:
        if changed:
            print(f"out of date: {shown}; run python -m tltlib report to render them from their result files",
                  file=sys.stderr)
        if changed or broken:
            return 1
        print("every rendered table equals its result file, and every link resolves")
        return 0
    print(f"rendered {shown}" if changed else "nothing to render: every table equals its result file")
    return 1 if broken else 0


def cmd_bench(args) -> int:
    import runpy
    script = ROOT / "bench" / f"{args.name}.py"
    if not script.is_file():
        names = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("_"))
        raise BadInput(f"unknown benchmark {args.name!r}; choose one of {names}")
    sys.argv = [str(script), *args.bench_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_sample_responses(args) -> int:
    """``python -m tltlib sample-responses``: ``--n`` problems of ``--dataset`` (a generated task drawn with seed
    ``--seed`` + 1000, train-drafter's training seed for word problems; or a file's first rows), one sampled response
    each, appended to ``--out``."""
    from ..drafting.responses import sample_responses
    from ..fileio import resolve
    from ..model.loading import load
    from ..tasks.datasets import generate_task, load_problems
    target, tok, _ = load(args.model, None, device=args.device)
    generated = args.dataset in ("", "chain", "words")
    problems = (generate_task(args.dataset or "chain", args.n, args.seed + 1000) if generated
                else load_problems(resolve(args.dataset))[: args.n])
    st = sample_responses(target, tok, problems, args.out, args.temperature, args.max_new_tokens, args.batch,
                          args.seed, progress=not args.quiet)
    print(f"{st['rows']} responses ({st['tokens']} tokens) in {st['seconds']:.0f} s appended to {args.out}")
    return 0


def cmd_warm_start(args) -> int:
    """``python -m tltlib warm-start``: load ``--model`` (float32, CPU or the GPU), train, write ``--out``."""
    from ..fileio import resolve
    from ..lab.sft import WarmStartConfig, check_warm_start_out, warm_start, write_warm_start
    from ..model.loading import load
    given = {k: getattr(args, k) for k in ("steps", "batch", "lr", "max_problem_steps", "seed")}
    cfg = WarmStartConfig(**{k: v for k, v in given.items() if v is not None})
    out = check_warm_start_out(resolve(args.out), args.overwrite)       # before the model loads and trains
    model, tok, _ = load(args.model, None, dtype="float32")
    log = warm_start(model, tok, cfg, progress=not args.quiet)
    write_warm_start(model, resolve(args.model), out, cfg, log)
    print(f"warm start: loss {log['loss'][0]:.3f} -> {log['loss'][-1]:.3f} in {log['seconds']:.0f} s; "
          f"written to {out}")
    return 0


SIMULATE_DEFAULTS = {
    "validate": {"prompts": 16, "num_generations": 8, "max_new": 720, "steps": 6, "model": "data/tiny-reasoner",
                 "drafter": "data/tiny-reasoner-drafter",
                 "workers_results": "bench/results/e2e_grpo-cpu-float32-w2.json"},
    "project": {"prompts": 64, "num_generations": 8, "max_new": 32768, "hardware": "h100",
                "lengths_from": "bench/results/e2e_grpo-cpu-float32.json"}}
"""``simulate``'s flags where not given, per mode: the runs measured here (--validate), the paper's (--project). A
flag only the other mode has is refused, not ignored."""
WORKLOAD = ("prompts", "num_generations", "max_new", "steps")
"""The workload flags among them: whole numbers, checked."""


def _simulate_workload(args) -> dict:
    """``simulate``'s flags of its mode (the workload: --prompts, --num-generations, --max-new, --validate's
    --steps; --validate's model, drafter and workers' results; --project's hardware and lengths), the mode's defaults
    where not given, each checked before anything loads or is measured; a flag of the other mode is refused."""
    mode, other = ("project", "validate") if args.project else ("validate", "project")
    for key in SIMULATE_DEFAULTS[other].keys() - SIMULATE_DEFAULTS[mode].keys():
        if getattr(args, key) is not None:
            flag = "--" + key.replace("_", "-")
            raise BadInput(f"{flag} goes with --{other}, not --{mode} (which would ignore it): drop {flag}, or run "
                           f"simulate --{other}")
    settings = {}
    for key, default in SIMULATE_DEFAULTS[mode].items():
        value = default if getattr(args, key) is None else getattr(args, key)
        least = 2 if key == "num_generations" else 1          # GRPO compares a completion with its group's others
        if key in WORKLOAD and value < least:
            raise BadInput(f"--{key.replace('_', '-')} must be >= {least}, got {value}")
        settings[key] = value
    return settings


def _simulate_project(args) -> int:
    """The simulator at the paper's Table 3 settings: a table beside the paper's, and its JSON."""
    import json

    from ..fileio import atomic_write_text, resolve
    from ..paper.numbers import SETTINGS
    from ..paper.projection import ProjectionConfig, lengths_from_bench, project, table3
    lengths = lengths_from_bench(resolve(args.lengths_from), cap=args.max_new)
    rows = {m: project(ProjectionConfig(model=m, tp=s["tp"], nodes=s["nodes"], hardware=args.hardware,
                                        prompts=args.prompts, num_generations=args.num_generations,
                                        lengths=lengths)) for m, s in SETTINGS.items()}
    workload, cap = _workload_words(args)
    text = (f"Simulated end-to-end speedup of TLT over the baseline at {workload}{args.hardware}, 8 per node; "
            f"response lengths: a log-normal of median {lengths.median:.0f} and p99 {lengths.p99:.0f} tokens, from "
            f"{args.lengths_from} scaled to {cap}) beside the paper's Table 3 (`python -m tltlib simulate "
            "--project`):\n\n" + table3(rows))
    print(text)
    out = resolve(args.out)
    payload = {"settings": {k: v for k, v in vars(args).items() if k != "func"},
               "lengths": {"median": lengths.median, "p99": lengths.p99, "cap": lengths.cap}, "projection": rows}
    atomic_write_text(out / f"simulate-project-{args.hardware}.json", json.dumps(payload, indent=1) + "\n")
    atomic_write_text(out / f"simulate-project-{args.hardware}.md", text)
    return 0


def _workload_words(args) -> tuple[str, str]:
    """How the projection's text names its workload and its cap: the paper's settings in its words, else the flags
    given."""
    paper = SIMULATE_DEFAULTS["project"]
    if (args.prompts, args.num_generations, args.max_new) == (paper["prompts"], paper["num_generations"],
                                                              paper["max_new"]):
        return "the paper's settings (64 prompts x 8, 32K max, ", "32K"
    return (f"{args.prompts} prompts x {args.num_generations}, at most {args.max_new} tokens (not the paper's "
            "settings; ", str(args.max_new))
