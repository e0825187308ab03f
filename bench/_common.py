"""Shared benchmark plumbing: the command line (common flags, checked values, one-line errors), allocator
settings, loading, machine/version info, timing, JSON + markdown output.

Every bench script runs the competitors side by side in one process, warms up first, reports medians and ratios,
prints a markdown table last and writes ``bench/results/<name>.json`` + ``.md`` with the machine and versions.
A bad flag stops the script before anything loads, with one line ``error: argument --FLAG: what is wrong; what to
give`` and exit status 1 (run directly or as ``python -m tltlib bench NAME``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tltlib.fileio import cache_root

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
MODEL = "data/tiny-reasoner"
DRAFTER = "data/tiny-reasoner-drafter"
SMOLLM2 = str(cache_root() / "models" / "smollm2-135m")
"""Where ``python -m tltlib get-model smollm2-135m`` puts SmolLM2-135M (the default model of the SmolLM2 benches):
under ``$TLTLIB_CACHE`` where it is set (:func:`tltlib.model.importers.cache_dir`), else ``~/.cache/tltlib``."""


def ensure_malloc_env() -> None:
    """Re-exec with glibc malloc settings that avoid the ~2x slower first large batch on CPU (DESIGN.md).

    The same command line runs again: ``python -m tltlib bench NAME ...`` stays under tltlib's CLI (whose errors are
    one line), a script run directly stays a direct run."""
    if any(os.environ.get(k) != v for k, v in MALLOC.items()):
        os.environ.update(MALLOC)
        os.execv(sys.executable, [sys.executable, *_command_args()])


def _command_args() -> list[str]:
    """The interpreter's arguments that started this bench: the original ``-m tltlib ...`` ones when it came through
    tltlib's CLI (``sys.argv`` then holds only the script and its flags), else the script and its flags."""
    orig = getattr(sys, "orig_argv", [])
    if "-m" in orig and orig[orig.index("-m") + 1:orig.index("-m") + 2] == ["tltlib"]:
        return orig[1:]
    return sys.argv


class BenchParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr, ``error: argument --FLAG: ...``, and exit status 1: the
    form every other error of ``python -m tltlib`` takes (argparse's default prints the usage first and exits 2)."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(1)


def bench_parser(doc: str) -> BenchParser:
    """The parser of a bench script, described by the first paragraph of its module docstring ``doc``."""
    return BenchParser(description=" ".join(doc.split("\n\n")[0].split()))


def parse_bench_args(ap: argparse.ArgumentParser, argv: list[str] | None = None, malloc: bool = True):
    """Re-exec with the malloc settings first when ``malloc`` (cheap: nothing heavy is imported yet), then parse the
    flags: a bad one stops here, before any model loads."""
    if malloc:
        ensure_malloc_env()
    return ap.parse_args(argv)


def add_model_flags(ap: argparse.ArgumentParser, drafter: str | None = None, drafter_help: str | None = None,
                    model: str | None = MODEL, model_help: str | None = None) -> None:
    """``--model`` (a checkpoint folder, default ``model``) and ``--drafter`` when ``drafter`` is its default; a
    folder that is not there stops the parse."""
    ap.add_argument("--model", default=model, type=folder("model", MODEL), help=model_help)
    if drafter is not None:
        ap.add_argument("--drafter", default=drafter, type=folder("drafter", DRAFTER), help=drafter_help)


def add_recipe_flags(ap: argparse.ArgumentParser) -> None:
    """``--recipe`` (a train-grpo parameter file, default the tiny reasoner's) and ``--model`` / ``--drafter``
    overriding its folders: the GRPO benches that run a recipe's trainer."""
    ap.add_argument("--recipe", type=existing_file, default="params/train/cpu-tiny.yaml",
                    help="a train-grpo parameter file (params/train/*.yaml) with a drafter and tlt settings")
    ap.add_argument("--model", type=folder("model", MODEL), help="override the recipe's model")
    ap.add_argument("--drafter", type=folder("drafter", DRAFTER), help="override the recipe's drafter")


def add_num_generations(ap: argparse.ArgumentParser, default: int = 8, help: str | None = None) -> None:
    """``--num-generations`` (completions per prompt, TRL's name; checked positive), the old ``--group`` refused with
    the new name (:func:`tltlib.cli.parser.add_num_generations`)."""
    from tltlib.cli.parser import add_num_generations as add
    add(ap, default, help, type=positive_int)


def add_device_flags(ap: argparse.ArgumentParser, device: str = "auto", dtype: str = "float32") -> None:
    """``--device`` (checked by tltlib's loader) and ``--dtype``."""
    ap.add_argument("--device", default=device)
    ap.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16"])


def add_output_flags(ap: argparse.ArgumentParser, repeats: int | None = None, out_help: str | None = None) -> None:
    """``--repeats`` (timed rounds, when ``repeats`` is its default) and ``--out`` (results folder)."""
    if repeats is not None:
        ap.add_argument("--repeats", type=positive_int, default=repeats)
    ap.add_argument("--out", default=None, help=out_help)


class Listed(str):
    """A list flag exactly as typed (what the results' settings record) with its checked, parsed ``items``."""

    items: tuple = ()


def _number(text: str, kind, ok, what: str):
    """``kind(text)`` when it parses and passes ``ok``, else an argparse error saying it is not ``what``."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    """``text`` as an int >= 1 (an argparse ``type``)."""
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """``text`` as an int >= 0 (an argparse ``type``)."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def temperature(text: str) -> float:
    """``text`` as a sampling temperature, a finite float >= 0 (an argparse ``type``)."""
    return _number(text, float, lambda v: 0 <= v < math.inf, "a temperature (a number >= 0)")


def positive_float(text: str) -> float:
    """``text`` as a finite float > 0 (an argparse ``type``)."""
    return _number(text, float, lambda v: 0 < v < math.inf, "a number > 0")


def strategy_name(text: str) -> str:
    """``text`` when it names a speculative strategy (``off``, ``chain-D``, ``ngram-D``, ``tree-DxK-N``)."""
    from tltlib.spec.strategy import SpecStrategy
    try:
        SpecStrategy.parse(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def strategy(text: str):
    """``text`` as a :class:`tltlib.spec.strategy.SpecStrategy` (an argparse ``type`` or a :func:`listed` item)."""
    from tltlib.spec.strategy import SpecStrategy
    return SpecStrategy.parse(strategy_name(text))


def listed(item, example: str, sep: str = ","):
    """An argparse ``type`` for a ``sep``-separated list of ``item`` values (``item``: one of the checks above):
    returns a :class:`Listed`; a bad entry is named, with ``example`` as the fix."""
    def parse(text: str) -> Listed:
        values = []
        for part in text.split(sep):
            try:
                values.append(item(part.strip()))
            except argparse.ArgumentTypeError as e:
                what = "comma" if sep == "," else repr(sep)
                raise argparse.ArgumentTypeError(f"{e}; give a {what}-separated list such as {example}") from None
        out = Listed(text)
        out.items = tuple(values)
        return out
    return parse


def resolve(path: str | os.PathLike) -> Path:
    """A path as given if it exists (or is absolute), else under the project root: where tltlib's loaders look, so
    ``data/tiny-reasoner`` works from any folder."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else ROOT / p


def folder(what: str, example: str):
    """An argparse ``type`` for a ``what`` folder (see :func:`resolve`); returns the text as given."""
    def check(text: str) -> str:
        if not resolve(text).is_dir():
            raise argparse.ArgumentTypeError(f"no {what} folder {text!r}; give a local {what} folder such as "
                                             f"{example}")
        return text
    return check


def existing_file(text: str) -> str:
    """``text`` when it names a file (an argparse ``type``)."""
    if not Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"no file {text!r}")
    return text


def use_all_cores() -> None:
    """torch on every core: the benchmark sets it, the library never does (DESIGN.md). An explicit
    ``OMP_NUM_THREADS`` wins (the test tier runs every bench it starts on one thread)."""
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)


def load_models(args, drafter: bool = False, device: str | None = None, all_cores: bool = True,
                kernels: bool = True):
    """tltlib's ``load`` of ``args.model`` (and ``args.drafter``) on ``device`` (default ``args.device``) in
    ``args.dtype``, with torch on every core first when ``all_cores``; returns ``(model, tokenizer, drafter)``
    (``drafter`` None without one). ``kernels``: this machine's kernel table measured for their shapes first where it
    lacks them (CPU float32; a benchmark is a moment the user chose, and a rollout only reads the table)."""
    from tltlib import load
    from tltlib.kernels import ensure_kernels
    if all_cores:
        use_all_cores()
    model, tok, draft = load(args.model, args.drafter if drafter else None, device=device or args.device,
                             dtype=args.dtype)
    if kernels:
        ensure_kernels(model, draft)
    return model, tok, draft


def result_name(bench: str, device: str, dtype: str, suffix: str = "") -> str:
    """``<bench>-<device kind>-<dtype><suffix>``, the stem of a results file (``cuda:1`` counts as ``cuda``)."""
    return f"{bench}-{device.split(':')[0]}-{dtype}{suffix}"


def machine_info(device: str) -> dict:
    """:func:`tltlib.machine.machine_info` (imported when called: nothing heavy before the malloc re-exec)."""
    from tltlib.machine import machine_info as info
    return info(device)


def timed(fn, device: str) -> float:
    """Seconds one call of ``fn`` takes (synchronising CUDA around it)."""
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t


def interleaved_medians(fns: dict, device: str, repeats: int, warmup: int = 1,
                        settle: float = 0.0) -> dict[str, tuple[float, list[float]]]:
    """Time competitors side by side: ``warmup`` untimed calls of each, then ``repeats`` rounds that call every
    competitor once, in order. A slow spell of a shared machine then hits all of them alike instead of one block.
    ``settle``: seconds of idle (untimed) after each call, so that a competitor whose OpenMP threads keep spinning
    after it returns (Intel OpenMP's default: 200 ms) does not slow the next one down. Returns ``{name: (median
    seconds, all seconds)}``."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            settle_down(settle)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
            settle_down(settle)
    return {name: (statistics.median(t), t) for name, t in times.items()}


def _cpu_times() -> tuple[int, int] | None:
    """``(busy, total)`` jiffies of all CPUs from ``/proc/stat`` (None where there is none: not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)      # idle + iowait
    return sum(fields) - idle, sum(fields)


def weight_bytes(model) -> int:
    """Bytes of the weights a decode forward reads once: every parameter, less an untied input embedding (looked up
    a row at a time, not read whole)."""
    size = lambda p: p.numel() * p.element_size()
    total = sum(size(p) for p in model.parameters())
    return total - (size(model.embed.weight) if model.lm_head is not None else 0)


def read_bandwidth(repeats: int = 5) -> tuple[float, int]:
    """Bytes per second this CPU's memory is read at, and the buffer's bytes: over a float32 buffer of 4x the
    last-level cache (at least 1 GiB), on huge pages where the loader puts a model's weights on them
    (:mod:`tltlib.kernels.huge_pages`: a sum reads ~1.1x faster from them on an AMD EPYC), the faster of two reads
    (:data:`BANDWIDTH_READS`), each the median of ``repeats``: so a step's floor is set at the fastest rate this
    machine has been seen to read its weights at."""
    return _read_rate(_bandwidth_buffer(), repeats)


BANDWIDTH_READS = "the faster of a sum and the stream kernel's read"
"""How :func:`read_bandwidth` reads (results record it): torch's sum (one stream through memory per thread) and, where
the CPU kernels are built, a product of one row by the buffer as a [N, 1024] weight through the ``stream`` kernel
(several streams per thread: :mod:`tltlib.kernels.stream_linear_cpp`). On an AMD EPYC VM (AVX2, 2 threads) the
kernel read faster than the sum once it read several streams per thread (41 against 38 GB/s over SmolLM2's LM
head): a floor at the sum's rate alone would be below what the machine reads."""


def bandwidth_reader(repeats: int = 5) -> Callable[[], tuple[float, int]]:
    """:func:`read_bandwidth` as a callable that keeps its buffer from its first read on: for a bench that reads the
    bandwidth around every step it times (one 1 GiB allocation, not one per read)."""
    held = []

    def read() -> tuple[float, int]:
        if not held:
            held.append(_bandwidth_buffer())
        return _read_rate(held[0], repeats)
    return read


def _bandwidth_buffer():
    import torch

    from tltlib.kernels import huge_pages
    from tltlib.machine import llc_bytes
    return huge_pages.empty((max(1 << 30, 4 * llc_bytes()) // 4,), torch.float32).fill_(1.0)


def bandwidth_reads(buffer) -> list:
    """The reads :func:`read_bandwidth` times over ``buffer`` (float32, contiguous), each a call that reads all of it:
    torch's sum and, where the CPU kernels are built, one row of ones by the buffer as a ``[N, 1024]`` weight through
    the ``stream`` kernel (its N outputs are the weight rows' sums; a tail of under 1,024 floats is left out)."""
    import torch

    from tltlib.kernels.ragged_attention import kernel
    reads = [buffer.sum]
    module = kernel()
    if module is not None:
        weight = buffer[: buffer.numel() // 1024 * 1024].view(-1, 1024)
        row, none = torch.ones(1, 1024), torch.empty(0)
        reads.append(lambda: module.stream_linear(row, weight, none))
    return reads


def _read_rate(buffer, repeats: int) -> tuple[float, int]:
    rates = []
    for read in bandwidth_reads(buffer):
        read()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            read()
            times.append(time.perf_counter() - t0)
        rates.append(buffer.numel() * 4 / statistics.median(times))
    return max(rates), buffer.numel() * 4


def settle_down(seconds: float, limit: float = 3.0, window: float = 0.05, busy: float = 0.1,
                clock=time.perf_counter, sleep=time.sleep) -> None:
    """Idle ``seconds``, then on until the machine is quiet (under ``busy`` of its CPUs in use over ``window`` s)
    or ``limit`` s have passed: a peer in another process (vLLM's worker) may keep its cores busy after its call
    returns, for longer than OpenMP's 200 ms spin, and would slow the next competitor down. Nothing when
    ``seconds`` is 0. ``clock``, ``sleep``: time's, or a fake clock's in tests."""
    if seconds <= 0:
        return
    sleep(seconds)
    end = clock() + limit
    while clock() < end:
        a = _cpu_times()
        sleep(window)
        b = _cpu_times()
        if a is None or b is None or b[1] == a[1] or (b[0] - a[0]) / (b[1] - a[1]) < busy:
            return


def markdown_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:,.2f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_results(name: str, payload: dict, table: str, out_dir: Path | None = None) -> Path:
    """Write ``<name>.json`` and ``<name>.md`` (table + machine line) atomically; print the table last."""
    out_dir = Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    m = payload["machine"]
    from tltlib.machine import described
    md = (f"{table}\n\nMachine: {described(m)}, torch {m['torch']}, "
          f"transformers {m['transformers']}, Python {m['python']}.\n")
    for suffix, text in ((".json", json.dumps(payload, indent=1) + "\n"), (".md", md)):
        tmp = out_dir / f".{name}{suffix}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / f"{name}{suffix}")
    print(md)
    return out_dir / f"{name}.json"


def save_png(fig, dest: Path) -> Path:
    """Save ``fig`` as ``dest`` atomically (a temporary file renamed), close it and print where it went."""
    import matplotlib.pyplot as plt
    tmp = dest.with_name(f".{dest.name}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    tmp.replace(dest)
    plt.close(fig)
    print(f"figure: {dest}")
    return dest


TASK_HELP = ("prompts: 'chain' (the tiny reasoner's chain task) or 'words' (GSM8K-style word problems with the "
             "model's chat template: the task for real models such as SmolLM2)")


def task_prompts(task: str, tokenizer, count: int, seed: int, steps: int | None = None) -> list[list[int]]:
    """Token ids of ``count`` seeded prompts of ``task`` ('chain': ``steps`` fixes every problem's step count)."""
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems
    from tltlib.tasks.datasets import generate_task
    from tltlib.tasks.prompts import encode_prompts
    if task == "chain":
        return encode_prompts(generate_problems(ChainTaskConfig(), count, seed=seed, steps=steps), tokenizer)
    return encode_prompts(generate_task(task, count, seed), tokenizer)


def model_suffix(model: str, default: str = "data/tiny-reasoner") -> str:
    """``""`` for the default model, else ``-<its folder name>``: results of another model get their own files."""
    return "" if model == default else "-" + Path(model).expanduser().resolve().name


def depth_table(acceptance: list[dict], strategies: str, labels: dict[str, str]) -> str:
    """Per-depth acceptance at the first and the last probed RL step: P(draft d accepted | drafts 1..d-1 were),
    from the shares of SD row-steps accepting at least d drafts."""
    rows = []
    for name in strategies.split(","):
        for a in (acceptance[0], acceptance[-1]):
            for key, label in labels.items():
                ge = a.get(f"{key}:{name}:ge")
                if ge:
                    cond = [ge[0]] + [ge[d] / ge[d - 1] if ge[d - 1] > 0 else 0.0 for d in range(1, len(ge))]
                    rows.append([name, a["step"], label, *[f"{c:.2f}" for c in cond]])
    if not rows:
        return ""
    depth = max(len(r) for r in rows) - 3
    rows = [r + [""] * (depth + 3 - len(r)) for r in rows]
    return ("\n\nAcceptance by draft depth (P(depth d accepted | depths before it were)), first and last step:\n\n"
            + markdown_table(["strategy", "step", "drafter", *[f"d={d}" for d in range(1, depth + 1)]], rows))
