"""Shared benchmark plumbing: allocator settings, machine/version info, timing, JSON + markdown output.

Every bench script runs the competitors side by side in one process, warms up first, reports medians and ratios,
prints a markdown table last and writes ``bench/results/<name>.json`` + ``.md`` with the machine and versions.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}


def ensure_malloc_env() -> None:
    """Re-exec with glibc malloc settings that avoid the ~2x slower first large batch on CPU (DESIGN.md)."""
    if any(os.environ.get(k) != v for k, v in MALLOC.items()):
        os.environ.update(MALLOC)
        os.execv(sys.executable, [sys.executable, *sys.argv])


def machine_info(device: str) -> dict:
    import torch
    import transformers
    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "device": device, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count()}
    try:
        cpu = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
        info["cpu"] = cpu.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


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


def interleaved_medians(fns: dict, device: str, repeats: int, warmup: int = 1) -> dict[str, tuple[float, list[float]]]:
    """Time competitors side by side: ``warmup`` untimed calls of each, then ``repeats`` rounds that call every
    competitor once, in order. A slow spell of a shared machine then hits all of them alike instead of one block.
    Returns ``{name: (median seconds, all seconds)}``."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return {name: (statistics.median(t), t) for name, t in times.items()}


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
    md = (f"{table}\n\nMachine: {m.get('gpu') or m['cpu']} ({m['threads']} threads), torch {m['torch']}, "
          f"transformers {m['transformers']}, Python {m['python']}.\n")
    for suffix, text in ((".json", json.dumps(payload, indent=1) + "\n"), (".md", md)):
        tmp = out_dir / f".{name}{suffix}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / f"{name}{suffix}")
    print(md)
    return out_dir / f"{name}.json"


TASK_HELP = ("prompts: 'chain' (the tiny reasoner's chain task) or 'words' (GSM8K-style word problems with the "
             "model's chat template: the task for real models such as SmolLM2)")


def task_prompts(task: str, tokenizer, count: int, seed: int, steps: int | None = None) -> list[list[int]]:
    """Token ids of ``count`` seeded prompts of ``task`` ('chain': ``steps`` fixes every problem's step count)."""
    from tltlib.tasks import ChainTaskConfig, encode_prompts, generate_problems, generate_task
    if task == "chain":
        return encode_prompts(generate_problems(ChainTaskConfig(), count, seed=seed, steps=steps), tokenizer)
    return encode_prompts(generate_task(task, count, seed), tokenizer)


def model_suffix(model: str, default: str = "data/tiny-reasoner") -> str:
    """``""`` for the default model, else ``-<its folder name>``: results of another model get their own files."""
    return "" if model == default else "-" + Path(model).expanduser().resolve().name
