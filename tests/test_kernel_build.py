"""The C++ extensions' builds (tltlib.kernels.build): a folder per key, one builder at a time, every wait bounded.

The lock cases run with real processes: a builder that holds the lock (alive, killed, finishing), and a second
install of torch at another path (what a second venv is to the build).
"""
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tltlib.errors import BadInput, TimedOut
from tltlib.kernels import build
from tltlib.kernels import ragged_attention as ra

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = {"torch": "2.13.0", "abi": "1", "torch_dir": "/a/torch", "python": "3.11", "compiler": "c++ (Debian) 12",
           "cpu": "AMD EPYC", "cpu_flags": "avx2 fma"}

HOLDER = """
import sys
from tltlib.kernels.build import hold
with hold(sys.argv[1], 60, "a test build"):
    print("held", flush=True)
    sys.stdin.read()                       # holds until the test closes stdin (or kills this process)
"""


def _child_env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.fixture
def holder(tmp_path):
    """A real process holding the build lock ``tmp_path/x.lock`` (started; yields (process, lock))."""
    lock = tmp_path / "x.lock"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_child_env())
    try:
        assert proc.stdout.readline().strip() == "held", "the holder process did not take the lock"
        yield proc, lock
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def test_the_key_changes_with_every_part_the_binary_depends_on():
    ext = build.Extension("x", "int f() { return 1; }", ("f",), ("-O3", "-march=native"), ("-fopenmp",))
    base = build.key_of(ext, CONTEXT)
    assert base == build.key_of(ext, dict(CONTEXT)) and len(base) == 16
    for part in CONTEXT:                        # another torch, venv, Python, compiler or CPU: another folder
        assert build.key_of(ext, {**CONTEXT, part: CONTEXT[part] + "'"}) != base, part
    for other in (replace(ext, source="int f() { return 2; }"), replace(ext, functions=("g",)),
                  replace(ext, cflags=("-O3",)), replace(ext, ldflags=()), replace(ext, name="y")):
        assert build.key_of(other, CONTEXT) != base
    assert set(build.build_context()) == set(CONTEXT)


def test_the_kernel_folder_names_this_cpu_and_torch():
    ctx = build.build_context()
    assert ctx["torch"] == torch.__version__ and ctx["torch_dir"] == str(Path(torch.__file__).parent)
    assert build.folder_of(ra.EXTENSION).name.startswith("tltlib_ragged_attention-")
    assert build.folder_of(ra.EXTENSION, {**ctx, "cpu_flags": ctx["cpu_flags"] + " avx512f"}) != \
        build.folder_of(ra.EXTENSION)


def test_a_second_venvs_torch_builds_into_a_folder_of_its_own(tmp_path):
    """Two venvs' torch sit at two paths: each process names its own folder, so neither rewrites the other's build
    (PyTorch's shared folder made two clones rebuild each other's kernel for minutes)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    code = "from tltlib.kernels import build, ragged_attention as ra; print(build.folder_of(ra.EXTENSION))"
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_child_env(), timeout=300)
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=_child_env(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)])))
    assert here.returncode == 0 and other.returncode == 0, here.stderr + other.stderr
    assert here.stdout.strip() == str(build.folder_of(ra.EXTENSION))
    assert other.stdout.strip() != here.stdout.strip()
    assert Path(other.stdout.strip()).parent == Path(here.stdout.strip()).parent


def test_a_live_builder_is_waited_for_by_name_then_refused_past_the_bound(holder):
    proc, lock = holder
    said = []
    t = [0.0]

    def sleep(s):                               # a fake clock: the bound is reached without waiting it out
        t[0] += s
    with pytest.raises(TimedOut, match=rf"PID {proc.pid} on host .* has held {lock} for over 5 s while building "
                                       r"a test build.*TLTLIB_BUILD_WAIT_S"):
        with build.hold(lock, 5, "a test build", say=said.append, clock=lambda: t[0], sleep=sleep):
            pytest.fail("the lock of a live holder was taken")
    assert len(said) == 1 and f"waiting for PID {proc.pid}" in said[0] and str(lock) in said[0]
    assert proc.poll() is None                  # the builder was left alone


def test_a_waiter_takes_the_lock_when_the_builder_finishes(holder):
    proc, lock = holder
    said = []

    def sleep(s):                               # the builder finishes while this process waits
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
            proc.wait(timeout=60)
        time.sleep(s)
    with build.hold(lock, 120, "a test build", say=said.append, sleep=sleep):
        assert lock.read_text() == f"PID {os.getpid()} on host {os.uname().nodename}"
    assert len(said) == 1 and f"PID {proc.pid}" in said[0]


@pytest.mark.parametrize("age_s", [0, 3600])
def test_a_killed_builders_lock_is_taken_at_once_whatever_its_age(holder, age_s):
    """The operating system frees the lock of a process that died mid-build: a fresh lock file (a build killed a
    minute ago) is taken as fast as an old one; no waiting line."""
    proc, lock = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    old = time.time() - age_s
    os.utime(lock, (old, old))
    said = []
    with build.hold(lock, 0, "a test build", say=said.append):
        pass
    assert said == []


def test_a_built_kernel_is_imported_without_the_lock(holder):
    """A live process holding the kernel's build lock never delays loading the kernel once it is built."""
    proc, lock = holder
    if ra.kernel() is None:
        pytest.skip(f"no C++ build here: {ra._state['error']}")
    folder = build.folder_of(ra.EXTENSION)
    so = folder / "tltlib_ragged_attention.so"
    assert so.exists()
    os.replace(lock, folder.with_name(folder.name + ".lock"))    # the holder's locked file is now the kernel's lock
    code = ("from tltlib.kernels import build, ragged_attention as ra; m = build.load(ra.EXTENSION, wait_s=0); "
            "print(m.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_child_env(), timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == str(so) and "building" not in out.stderr, out.stderr
    assert proc.poll() is None


def test_a_bad_wait_bound_is_one_clear_error(monkeypatch):
    for bad in ("ten", "-1", "inf", "nan"):
        monkeypatch.setenv(build.WAIT_ENV, bad)
        with pytest.raises(BadInput, match=rf"TLTLIB_BUILD_WAIT_S='{bad}' is not a number of seconds >= 0"):
            build.wait_bound()
    monkeypatch.setenv(build.WAIT_ENV, "0")
    assert build.wait_bound() == 0
    monkeypatch.delenv(build.WAIT_ENV)
    assert build.wait_bound() == build.WAIT_S
    with pytest.raises(BadInput, match="must be a Python identifier"):
        build.Extension("ragged-attention", "x", ("f",))
    with pytest.raises(BadInput, match="binds no functions"):
        build.Extension("x", "x", ())


def test_the_kernel_past_the_wait_bound_runs_the_pytorch_path_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(ra, "_state", {})

    def busy(ext, **k):
        raise TimedOut("PID 1 on host h has held /x.lock for over 600 s while building the CPU ragged-attention "
                       "kernel")
    monkeypatch.setattr(build, "load", busy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ra.kernel() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "held /x.lock" in err[0] and "matmul path" in err[0]


@pytest.mark.slow
def test_two_venvs_build_once_each_and_never_rebuild_the_others(tmp_path):
    """The real thing, twice: a build for this venv's torch and one for a torch at another path, in one cache; each
    process then loads its own build without building again (~1 min on 2 cores)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    code = ("from tltlib.kernels import build, ragged_attention as ra; m = build.load(ra.EXTENSION); "
            "print(m.__file__)")
    cache = {"TLTLIB_CACHE": str(tmp_path / "cache")}
    venvs = {"here": _child_env(**cache), "other": _child_env(PYTHONPATH=f"{site}{os.pathsep}{ROOT}", **cache)}
    first = {k: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=900)
             for k, e in venvs.items()}
    assert all(r.returncode == 0 and "building" in r.stderr for r in first.values()), first
    built = {k: Path(r.stdout.strip().splitlines()[-1]) for k, r in first.items()}
    assert built["here"].parent != built["other"].parent
    mtimes = {k: p.stat().st_mtime_ns for k, p in built.items()}
    again = {k: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300)
             for k, e in venvs.items()}
    assert all(r.returncode == 0 and "building" not in r.stderr for r in again.values()), again
    assert {k: p.stat().st_mtime_ns for k, p in built.items()} == mtimes
