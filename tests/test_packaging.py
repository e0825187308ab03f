"""Packaging and hygiene: environment.yml agrees with pyproject; importing tltlib changes no global state; CLI."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted |= set(extra)
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert {p for p in pip if not p.startswith("-e")} == wanted
    assert "python=3.11" in env["dependencies"]


def test_import_changes_no_global_state():
    code = """
import sys, random
import tltlib
assert "torch" not in sys.modules, "import tltlib must stay light (setup runs before torch exists)"
import torch
state = lambda: (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled(),
                 torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
                 torch.random.get_rng_state().sum().item(), random.getstate()[1][:5])
before = state()
import importlib, pkgutil
for m in pkgutil.walk_packages(tltlib.__path__, "tltlib."):
    if m.name != "tltlib.__main__":
        importlib.import_module(m.name)
assert state() == before, (before, state())
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "tltlib", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "run-notebooks" in out.stdout


def test_shipped_data_stays_small():
    """data/ holds only the small shipped models and sample data (the project's budget: ~40 MB in all)."""
    size = sum(f.stat().st_size for f in (ROOT / "data").rglob("*") if f.is_file())
    assert size <= 40e6, f"data/ is {size / 1e6:.1f} MB; keep large artefacts out of git (runs/, a cache folder)"


def test_the_command_line_parser_builds_without_torch():
    """``python -m tltlib setup`` runs from a bare Python: building the parser must not import torch."""
    code = ("import sys; sys.modules['torch'] = None; import tltlib.cli as c; p = c.build_parser(); "
            "print(sorted(p._subparsers._group_actions[0].choices))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sample-responses" in out.stdout and "warm-start" in out.stdout and "setup" in out.stdout


def test_the_test_command_runs_a_worker_per_core_long_tests_first_and_keeps_a_users_own_workers(monkeypatch):
    import importlib.util
    from types import SimpleNamespace

    from conftest import long_first
    from tltlib.cli import commands
    tiers = ["-m", commands.TEST_MARKERS]
    assert commands.pytest_args(["-q"], 2) == [*tiers, "-n", "2", "--maxschedchunk", "1", "-q"]
    assert commands.pytest_args(["-q"], 1) == [*tiers, "-q"]                    # one core: no workers
    for own in (["-n", "0"], ["-n0"], ["--numprocesses=3"], ["-p", "no:xdist"], ["--dist", "loadfile", "-n", "2"]):
        assert commands.pytest_args(own, 4) == [*tiers, *own]
    assert commands.pytest_args(["--dist", "loadfile"], 2) == [*tiers, "-n", "2", "--maxschedchunk", "1", "--dist",
                                                                "loadfile"]           # another schedule, our workers
    assert commands.pytest_args([], 2, "vllm")[:2] == ["-m", "vllm"]
    monkeypatch.setattr(commands.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert commands.test_workers() == 2
    monkeypatch.setattr(commands.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert commands.test_workers() == commands.TEST_WORKERS_MAX
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xdist" else real(name, *a))
    assert commands.test_workers() == 1                                         # without pytest-xdist: one process
    items = [SimpleNamespace(name=n, keywords={"long"} if n.startswith("L") else set())
             for n in ("a", "L1", "b", "L2", "c")]
    long_first(items)
    assert [i.name for i in items] == ["L1", "L2", "a", "b", "c"]
