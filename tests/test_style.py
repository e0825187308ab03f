"""One style for the whole project, kept by ruff as pyproject.toml configures it: lines of at most 120 characters,
imports sorted, pyflakes' errors (an unused import, an undefined name) — in tltlib, bench, examples, tests and the
notebooks."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")
    if beside.is_file():
        return [str(beside)]
    if shutil.which("ruff"):
        return [shutil.which("ruff")]
    pytest.fail("ruff is not installed: it is in the dev extra (python -m tltlib setup installs it)")


def test_the_project_keeps_its_style():
    out = subprocess.run([*_ruff(), "check", "--no-cache", "tltlib", "bench", "examples", "tests", "notebooks"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"ruff check (fix with: ruff check --fix, then by hand):\n{out.stdout[-4000:]}"


def test_the_style_check_fails_on_a_long_line(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("x = '" + "a" * 130 + "'\n")
    out = subprocess.run([*_ruff(), "check", "--no-cache", "bad.py"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 1 and "E501" in out.stdout
