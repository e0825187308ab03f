"""Notebooks in a real JupyterLab, driven by headless Chromium: the browser tier (``pytest -m browser``,
tests/test_browser.py; ``.venv/bin/python -m tltlib.lab.browser 02 04`` runs it as a script).

JupyterLab is started from this venv on 127.0.0.1 (a free port, a random token; its user settings and workspaces in
a temporary folder, so a user's layout is neither read nor changed). Debian's Chromium, driven by playwright, opens a
copy of the notebook, runs it from the Run menu (Run All Cells) with its own parameter cell's defaults, and the run is
checked as a reader sees it: no error output, no broken image, every code cell executed, and a slider moved with the
keyboard redraws the figure below it. The wall time (Run All Cells to the last cell done) and the kernel's peak
memory are measured for the notebook's JupyterLab profile (:func:`tltlib.lab.notebook.jupyterlab_profile`); the
tests assert them against its budgets. Each notebook's artefacts go to ``runs/browser/<notebook>/``: screenshots of
the whole notebook and of its first slider's cell before and after the move, the executed copy, ``result.json``.

Every wait has a bound and, when it runs out, says what it waited for. The set-up (Debian's ``chromium`` and
playwright in ``.venv``) is ``python3 -m tltlib setup-browser``; playwright's own browser download is never used.

Paper: none (tooling). Departures: in ``server`` (the kernel's environment) and ``run`` (where the copy runs).

Modules: ``config`` (the set-up it needs, the bounds of its waits), ``server`` (JupyterLab on 127.0.0.1, what a run
costs the kernel), ``page`` (what is done and read on JupyterLab's page), ``run`` (one notebook's run, its result and
artefacts; a session of several; the script).
"""
from .config import CHROMIUM, OUT_ROOT, SETUP_COMMAND, BrowserConfig, check_browser
from .run import BrowserRun, BrowserSession, main, run_in_browser
from .server import JupyterLab, RunMeter

__all__ = ["CHROMIUM", "OUT_ROOT", "SETUP_COMMAND", "BrowserConfig", "BrowserRun", "BrowserSession", "JupyterLab",
           "RunMeter", "check_browser", "main", "run_in_browser"]
