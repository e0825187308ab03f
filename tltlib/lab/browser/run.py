"""One notebook's run in the browser tier (a copy opened in JupyterLab, Run All Cells, the checks, the artefacts in
``runs/browser/<notebook>/``), its result (:class:`BrowserRun`, ``result.json``), a session of several notebooks
(one JupyterLab and one Chromium), and the script ``python -m tltlib.lab.browser``.

Paper: none (tooling). Departures:

1. The copy runs from ``runs/`` (``runs/browser-<notebook>.ipynb``), not from ``notebooks/``: the committed notebook
   is never written (JupyterLab autosaves), a concurrent ``python -m tltlib run`` never sees a stray notebook, and at
   the same depth below the project root the notebook's relative links (``../figures/...``) resolve as from
   ``notebooks/``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...errors import TLTError
from ...fileio import atomic_write_text
from ...machine import cpu_name
from ..notebook import JupyterLabProfile, jupyterlab_profile
from .config import OUT_ROOT, BrowserConfig, check_browser
from .page import has_slider, move_slider, open_notebook, problems, run_all, save, saved_errors, whole_notebook
from .server import JupyterLab, RunMeter


@dataclass(frozen=True)
class BrowserRun:
    """What one notebook's run in the browser measured and found (``result.json`` in its artefacts folder)."""

    notebook: str
    """The notebook's file name."""
    wall_seconds: float
    """Run All Cells to the last cell done."""
    budget_seconds: float
    """The profile's budget for it."""
    peak_rss_gb: float
    """The kernel's peak resident memory (its process tree), GB."""
    budget_rss_gb: float
    """The profile's budget for it."""
    kernel_cpu_seconds: float
    """CPU seconds the kernel's process tree used during the run (above the wall time: it ran on both cores)."""
    tier_cpu_seconds: float
    """CPU seconds JupyterLab's server, playwright and Chromium used during the run (what the tier itself took)."""
    errors: tuple[str, ...]
    """Errors a reader sees: tracebacks, cells not executed, broken images, widgets that did not render."""
    stderr: tuple[str, ...]
    """Other stderr output (warnings), shown but not an error."""
    widget: dict
    """The slider moved: its name, readout before and after, whether the figure changed (and why not); for a
    notebook without a slider (:func:`has_slider`), ``{"slider": None, "expected": False}``."""
    cell_done_seconds: dict
    """When each code cell (by its index among the code cells) was seen done, seconds after Run All Cells."""
    artefacts: str
    """The folder of the screenshots, the executed copy and result.json."""
    versions: dict = field(default_factory=dict)
    """Chromium, JupyterLab, ipywidgets, playwright."""
    machine: dict = field(default_factory=dict)
    """The CPU, its load before and after the run, the kernel's torch threads, ``TLTLIB_KERNELS``, the date."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"


def _versions(browser) -> dict:
    import importlib.metadata as md
    return {"chromium": browser.version, "jupyterlab": md.version("jupyterlab"),
            "ipywidgets": md.version("ipywidgets"), "playwright": md.version("playwright")}


def _machine(load_before: float, threads: int | None) -> dict:
    """The CPU, and how loaded it was: the 1-minute load average before Run All Cells and after the run (2 on 2
    cores means the kernel shared them with a second busy process)."""
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2), "kernel_threads": threads or "unset",
            "TLTLIB_KERNELS": os.environ.get("TLTLIB_KERNELS", ""), "date": time.strftime("%Y-%m-%d %H:%M")}


def run_in_browser(browser, lab: JupyterLab, profile: JupyterLabProfile, out_root: Path = OUT_ROOT,
                   config: BrowserConfig = BrowserConfig()) -> BrowserRun:
    """Run ``profile.notebook`` in ``lab`` on a new page of ``browser`` (playwright's): a copy opened, Run All
    Cells, the problems a reader would see collected, a slider moved, screenshots, the executed copy saved; every
    artefact in ``out_root/<notebook stem>/`` (replacing the last run's)."""
    nb = profile.notebook
    out = out_root / nb.stem
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    copy = lab.root / "runs" / f"browser-{nb.name}"
    shutil.copyfile(nb, copy)
    rel = copy.relative_to(lab.root).as_posix()
    page = browser.new_page(viewport={"width": config.width, "height": config.height})
    try:
        kernel = lab.kernel_process(open_notebook(page, lab, rel, f"browser-{nb.stem}", config))
        load_before = os.getloadavg()[0]
        with RunMeter(kernel) as meter:
            wall, cell_seconds = run_all(page, rel, profile.seconds * config.slack)
        errors, stderr = problems(page)
        page.screenshot(path=str(out / "ran.png"))
        whole_notebook(page, out / "notebook.png", config)
        widget = move_slider(page, out, config) if has_slider(nb) else {"slider": None, "expected": False}
        if widget.get("problem"):
            errors.append(f"widget: {widget['problem']}")
        save(page, config)
    except BaseException:
        page.screenshot(path=str(out / "failed.png"))
        raise
    finally:
        page.close()
        session = [s for s in lab.api("GET", "api/sessions") if s.get("path") == rel]
        for s in session:
            lab.api("DELETE", f"api/sessions/{s['id']}")
        if copy.exists():
            shutil.move(copy, out / nb.name)
    errors += saved_errors(out / nb.name, errors)
    run = BrowserRun(nb.name, round(wall, 1), profile.seconds, round(meter.peak_gb, 3), profile.rss_gb,
                     round(meter.kernel_cpu, 1), round(meter.tier_cpu, 1), tuple(errors), tuple(stderr), widget,
                     cell_seconds, str(out), _versions(browser), _machine(load_before, lab.threads))
    atomic_write_text(out / "result.json", run.to_json())
    return run


class BrowserSession:
    """JupyterLab and headless Chromium for several notebooks (a context manager): ``run(notebook)`` each."""

    def __init__(self, config: BrowserConfig = BrowserConfig(), out_root: Path = OUT_ROOT):
        self.config, self.out_root = config, out_root

    def __enter__(self) -> BrowserSession:
        check_browser(self.config.chromium)
        from playwright.sync_api import sync_playwright
        self._lab = JupyterLab(start_seconds=self.config.start_seconds, log=self.out_root / "jupyterlab.log",
                               threads=self.config.threads)
        self._lab.__enter__()
        try:
            self._pw = sync_playwright().start()
            self._browser = self._pw.chromium.launch(executable_path=self.config.chromium, headless=True)
        except BaseException:
            self._lab.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._browser.close()
            self._pw.stop()
        finally:
            self._lab.__exit__(None, None, None)

    def run(self, notebook: str | os.PathLike) -> BrowserRun:
        """Run ``notebook`` (a path or a prefix such as ``02``) with its JupyterLab profile."""
        return run_in_browser(self._browser, self._lab, jupyterlab_profile(notebook), self.out_root, self.config)


def _run_and_print(names: list[str]) -> bool:
    """Run the notebooks ``names``, one line each (and its errors); True when one has an error or is over a
    budget."""
    profiles = [jupyterlab_profile(n) for n in names]  # every name checked before anything starts
    bad = False
    with BrowserSession() as session:
        for profile in profiles:
            run = session.run(profile.notebook)
            over = run.wall_seconds > run.budget_seconds or run.peak_rss_gb > run.budget_rss_gb
            bad |= over or bool(run.errors)
            slider = ("no slider" if not run.widget["expected"] else
                      f"slider {run.widget['slider']!r} {'redrew' if run.widget['changed'] else 'did NOT redraw'} "
                      "its figure")
            print(f"{run.notebook}: {run.wall_seconds:.1f} s (budget {run.budget_seconds} s), kernel peak "
                  f"{run.peak_rss_gb:.2f} GB (budget {run.budget_rss_gb} GB), {len(run.errors)} errors, {slider}; "
                  f"{run.artefacts}", flush=True)
            for e in run.errors:
                print(f"  error: {e}", flush=True)
    return bad


def main(argv: list[str] | None = None) -> int:
    """``python -m tltlib.lab.browser NOTEBOOK ...``: run each in the browser; one line per notebook; exit 1 when
    one has an error or is over a budget; an error tltlib raised on purpose (no Chromium, no profile) as one line."""
    names = list(sys.argv[1:] if argv is None else argv)
    if not names:
        print("usage: python -m tltlib.lab.browser NOTEBOOK ... (paths or prefixes, e.g. 02 04)", file=sys.stderr)
        return 2
    try:
        return 1 if _run_and_print(names) else 0
    except TLTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
