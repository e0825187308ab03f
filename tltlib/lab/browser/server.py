"""JupyterLab from this venv on 127.0.0.1 for the browser tier, and what a notebook's run costs: the kernel's peak
memory and CPU, the tier's own CPU (JupyterLab's server, playwright, Chromium).

Paper: none (tooling). Departures:

1. ``MPLBACKEND`` (``Agg`` under the test command) is removed from JupyterLab's environment, so the kernel draws
   figures inline as in a reader's JupyterLab.
2. ``OMP_NUM_THREADS`` is not inherited (the test command's one thread per test process would halve a notebook's
   cores): unset as in a reader's JupyterLab, or the config's :attr:`.config.BrowserConfig.threads`.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

from ...errors import Refused
from ...fileio import ROOT
from .config import OUT_ROOT, wait


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lab_settings(folder: Path) -> None:
    """User settings of the tier's JupyterLab: no news or update check (a request to the internet and a toast over
    the screenshots); everything else JupyterLab's defaults, as a new reader has them."""
    path = folder / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))


def lab_environment(environ, state: Path, threads: int | None) -> dict:
    """JupyterLab's environment: ``environ`` without ``MPLBACKEND`` and ``OMP_NUM_THREADS`` (set to ``threads`` when
    given), with the tier's own settings and workspaces folders under ``state``."""
    env = {k: v for k, v in environ.items() if k not in ("MPLBACKEND", "OMP_NUM_THREADS")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(JUPYTERLAB_SETTINGS_DIR=str(state / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(state / "ws"))
    return env


class JupyterLab:
    """JupyterLab from this venv on 127.0.0.1 (a free port and a random token), rooted at the project; a context
    manager: started (bounded wait for it to answer) on entry, stopped with its kernels on exit."""

    def __init__(self, root: Path = ROOT, start_seconds: float = 120.0, log: Path | None = None,
                 threads: int | None = None):
        self.root, self.start_seconds = root, start_seconds
        self.threads = threads
        self.log = log or OUT_ROOT / "jupyterlab.log"
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.process: subprocess.Popen | None = None
        self._state = None

    def __enter__(self) -> JupyterLab:
        self._state = tempfile.TemporaryDirectory(prefix="tltlib-jupyterlab-")
        state = Path(self._state.name)
        _lab_settings(state / "settings")
        env = lab_environment(os.environ, state, self.threads)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
                 f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
                 "--ServerApp.allow_root=True", "--ServerApp.port_retries=0"],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait(f"JupyterLab to answer on 127.0.0.1:{self.port} (its log: {self.log})", self.start_seconds,
                 self._answers)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
            raise Refused(f"JupyterLab exited with code {self.process.returncode} at start-up; {self.log}:\n{tail}")
        try:
            self.api("GET", "api/status")
            return True
        except OSError:
            return False

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()                  # JupyterLab shuts its kernels down on SIGTERM
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        if self._state is not None:
            self._state.cleanup()

    def url(self, path: str, workspace: str) -> str:
        """The page of ``path`` (relative to the root) in its own workspace (no layout from an earlier page)."""
        return f"http://127.0.0.1:{self.port}/lab/workspaces/{workspace}/tree/{path}?token={self.token}"

    def api(self, method: str, path: str):
        """Call the server's REST API; the decoded JSON (None for an empty answer)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def kernel_of(self, path: str) -> str | None:
        """The id of the kernel of the notebook at ``path`` (relative to the root), None while it has none."""
        for s in self.api("GET", "api/sessions"):
            if s.get("path") == path and s.get("kernel"):
                return s["kernel"]["id"]
        return None

    def kernel_process(self, kernel_id: str):
        """The kernel's process (psutil), found among JupyterLab's children by its connection file."""
        import psutil
        for p in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if any(f"kernel-{kernel_id}.json" in a for a in p.cmdline()):
                    return p
            except psutil.Error:
                continue
        return None


def _cpu_seconds(processes) -> float:
    """User + system CPU seconds of ``processes`` (psutil), those that ended meanwhile left out."""
    import psutil
    total = 0.0
    for p in processes:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


class RunMeter:
    """What a notebook's run costs (a context manager): the kernel's peak resident memory (its process tree,
    sampled every ``every`` seconds in a thread; ``peak_gb``), and the CPU seconds used meanwhile by the kernel's
    tree (``kernel_cpu``) and by everything else this process started: JupyterLab's server, playwright, Chromium
    (``tier_cpu``; processes that ended meanwhile are not counted)."""

    def __init__(self, kernel, every: float = 0.2):
        self.kernel, self.every, self.peak_bytes = kernel, every, 0
        self.kernel_cpu = self.tier_cpu = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _trees(self) -> tuple[list, list]:
        import psutil
        try:
            kernel = [self.kernel, *self.kernel.children(recursive=True)]
        except psutil.Error:
            kernel = []
        pids = {p.pid for p in kernel}
        return kernel, [p for p in psutil.Process().children(recursive=True) if p.pid not in pids]

    def _sample(self) -> None:
        import psutil
        while not self._stop.is_set():
            total = 0
            try:
                for p in self._trees()[0]:
                    total += p.memory_info().rss
            except psutil.Error:
                pass                                  # a child that ended between the listing and its read
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(self.every)

    def __enter__(self) -> RunMeter:
        kernel, tier = self._trees()
        self._cpu0 = _cpu_seconds(kernel), _cpu_seconds(tier)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        kernel, tier = self._trees()
        self.kernel_cpu = _cpu_seconds(kernel) - self._cpu0[0]
        self.tier_cpu = _cpu_seconds(tier) - self._cpu0[1]

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / 1e9
