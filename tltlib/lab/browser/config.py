"""The browser tier's set-up (Debian's Chromium and playwright, checked before anything starts), where its artefacts
go, and the bounds of its waits.

Paper: none (tooling). Departures: none.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import BadInput, MissingDependency, TimedOut
from ...fileio import ROOT

CHROMIUM = Path("/usr/bin/chromium")
"""Debian's Chromium (``apt-get install chromium``), the browser the tier drives."""
SETUP_COMMAND = "python3 -m tltlib setup-browser"
OUT_ROOT = ROOT / "runs" / "browser"
"""Where each notebook's artefacts go: ``runs/browser/<notebook stem>/``."""


@dataclass(frozen=True)
class BrowserConfig:
    """How the browser tier runs a notebook, and the bounds of its waits."""

    chromium: str = str(CHROMIUM)
    """The Chromium executable playwright drives."""
    slack: float = 5.0
    """The wait for Run All Cells is bounded by the profile's seconds times this (the machine may be loaded; the
    budget itself is asserted by the tests, on the measured time)."""
    start_seconds: float = 120.0
    """Bound of each start-up wait: JupyterLab answering, the notebook opening, its kernel becoming idle."""
    redraw_seconds: float = 90.0
    """Bound of the wait for the figure to change after the slider moved."""
    threads: int | None = None
    """Torch threads of the notebook's kernel (``OMP_NUM_THREADS`` in JupyterLab's environment); None: unset, as in
    a reader's JupyterLab (torch takes every core; torchrun gives each of its workers one thread). Never inherited:
    the test command runs one thread per test process (tests/conftest.py), which would run every notebook on half a
    2-core laptop, and a value of 2 would run each of notebook 06's two torchrun workers on both cores (5x slower)."""
    width: int = 1400
    """Browser viewport width, pixels."""
    height: int = 1000
    """Browser viewport height, pixels (the whole-notebook screenshot grows it to the notebook's height)."""

    def __post_init__(self):
        if self.threads is not None and not (isinstance(self.threads, int) and self.threads >= 1):
            raise BadInput(f"BrowserConfig.threads is {self.threads!r}; give a whole number >= 1, or None to leave "
                           "OMP_NUM_THREADS unset (torch takes every core)")
        for name in ("slack", "start_seconds", "redraw_seconds", "width", "height"):
            if not getattr(self, name) > 0:
                raise BadInput(f"BrowserConfig.{name} is {getattr(self, name)!r}; it must be positive")


def check_browser(chromium: str | os.PathLike = CHROMIUM) -> None:
    """Refuse, in one line naming the set-up command, when ``chromium`` or playwright is missing."""
    missing = [] if Path(chromium).is_file() and os.access(chromium, os.X_OK) else [f"Chromium at {chromium}"]
    try:
        import playwright.sync_api  # noqa: F401 - only whether it imports
    except ImportError:
        missing.append(f"playwright in {sys.prefix}")
    if missing:
        raise MissingDependency(f"the browser tier needs {' and '.join(missing)}; run: {SETUP_COMMAND}")


def wait(what: str, seconds: float, ready, every: float = 0.25):
    """Poll ``ready()`` until it returns something truthy (returned), at most ``seconds``; else :class:`TimedOut`
    naming ``what``."""
    deadline = time.monotonic() + seconds
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimedOut(f"waited {seconds:.0f} s for {what}")
        time.sleep(every)
