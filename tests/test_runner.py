"""The notebook runner and the CLI around it: outputs swapped in atomically, failures kept for debugging, SIGTERM
cleaned up, library errors printed as one line, every command re-executed inside .venv."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")   # the notebooks extra (absent on a bare GPU image)

from tltlib.fileio import atomic_folder, check_output_folder, remove_stale_temporaries  # noqa: E402
from tltlib.lab.notebook import NotebookError, read_metrics, run_notebooks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BODY = """
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tltlib.lab.notebook import save_figure, write_metrics
fig = plt.figure(); plt.plot([LABEL, LABEL])
save_figure(fig, "fig_" + str(LABEL), OUT_DIR, FIGURES_DIR)
import time; time.sleep(SLEEP)
if FAIL:
    raise ValueError("the data is wrong: fix the data")
write_metrics({"label": LABEL}, OUT_DIR)
"""


def _suite(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('LABEL = 1\nFAIL = False\nSLEEP = 0.0\nOUT_DIR = "x"\nFIGURES_DIR = ""')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(BODY)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, folder / "01_demo.ipynb")
    return folder


def _params(tmp_path, **values) -> Path:
    p = tmp_path / "demo.yaml"
    p.write_text("".join(f"{k}: {v}\n" for k, v in values.items()))
    return p


def _run(tmp_path, **values):
    return run_notebooks(_params(tmp_path, **values), out_root=tmp_path / "runs", progress=False,
                         notebooks=_suite(tmp_path / "nbs"))


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.long
def test_failed_run_keeps_the_previous_outputs_and_the_partial_notebook(tmp_path):
    figures = tmp_path / "figures"
    (done,) = _run(tmp_path, LABEL=1, FIGURES_DIR=figures)
    out = done.parent
    assert read_metrics(out) == {"label": 1} and (figures / "fig_1.png").is_file()
    source = json.loads((figures / "01_demo.json").read_text())       # the committed figures name their run
    assert source["metrics"] == {"label": 1} and source["run"]["notebook"] == "01_demo.ipynb"
    assert source["run"]["params"].endswith("demo.yaml") and "threads" in source["run"]["machine"]
    with pytest.raises(NotebookError, match="01_demo.ipynb failed in cell \\[\\d\\]: ValueError: the data is wrong: "
                                            "fix the data\n  partly executed notebook: .*01_demo.failed/01_demo.ipynb"):
        _run(tmp_path, LABEL=2, FAIL=True, FIGURES_DIR=figures)
    assert read_metrics(out) == {"label": 1}                       # the last good run, whole
    assert sorted(p.name for p in out.iterdir()) == ["01_demo.ipynb", "fig_1.png", "metrics.json"]
    assert sorted(p.name for p in figures.iterdir()) == ["01_demo.json", "fig_1.png"]   # none of the failed run
    failed = out.with_name("01_demo.failed")
    assert (failed / "01_demo.ipynb").is_file() and (failed / "fig_2.png").is_file()
    assert "the data is wrong" in (failed / "01_demo.ipynb").read_text()
    assert _hidden(out.parent) == [] and _hidden(tmp_path) == []
    _run(tmp_path, LABEL=3, FIGURES_DIR=figures)                   # success replaces the outputs as a whole
    assert read_metrics(out) == {"label": 3} and not failed.exists()
    assert sorted(p.name for p in out.iterdir()) == ["01_demo.ipynb", "fig_3.png", "metrics.json"]
    assert sorted(p.name for p in figures.iterdir()) == ["01_demo.json", "fig_1.png", "fig_3.png"]
    assert json.loads((figures / "01_demo.json").read_text())["metrics"] == {"label": 3}


@pytest.mark.long
def test_sigterm_leaves_no_temporary_folder_and_keeps_the_partial_notebook(tmp_path):
    nbs = _suite(tmp_path / "nbs")
    env = {**os.environ, "TLTLIB_NO_VENV": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tltlib", "run-notebooks", "--quiet", "--params",
                             str(_params(tmp_path, SLEEP=60)), "--notebooks", str(nbs), "--out",
                             str(tmp_path / "runs")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "runs" / "demo"
    deadline = time.time() + 600                             # a bound on a hang, not on this machine's speed
    while time.time() < deadline and not any(run_dir.glob(".01_demo.*/fig_1.png")):
        time.sleep(0.2)
    assert any(run_dir.glob(".01_demo.*/fig_1.png")), "the notebook never started"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert _hidden(run_dir) == []
    assert not (run_dir / "01_demo").exists()
    assert (run_dir / "01_demo.failed" / "INTERRUPTED").is_file()


def test_library_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
    env = {**os.environ, "TLTLIB_NO_VENV": "1"}
    cmd = [sys.executable, "-m", "tltlib", "run", "--params", str(_params(tmp_path, TEMPRATURE=1))]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: ") and "TEMPRATURE is declared by no notebook" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 2                # the error and the --debug hint
    out = subprocess.run([*cmd[:3], "--debug", *cmd[3:]], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" in out.stderr


@pytest.mark.long
def test_the_main_job_prints_one_line_per_notebook_and_logs_the_rest(tmp_path):
    """``run``: a header naming the log, one line per notebook (its time, its output folder, its headline), a
    footer; what the cells and the kernel print goes to runs/<params>/run.log, nothing to stderr."""
    from tltlib.lab.notebook import headline
    suite = _suite(tmp_path / "nbs")
    nb = nbformat.read(suite / "01_demo.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell('print("a cell printed this")\n'
                                              'write_metrics({"rollout/p99_over_p50": 7.25}, OUT_DIR)'))
    nbformat.write(nb, suite / "01_demo.ipynb")
    env = {**os.environ, "TLTLIB_NO_VENV": "1"}
    out = subprocess.run([sys.executable, "-m", "tltlib", "run", "--params", str(_params(tmp_path, LABEL=4)),
                          "--notebooks", str(suite), "--out", str(tmp_path / "runs")], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    log = tmp_path / "runs" / "demo" / "run.log"
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and lines[0] == f"running 1 notebook(s) with {_params(tmp_path, LABEL=4)}; full log: {log}"
    assert lines[1].split()[0] == "01_demo" and f"{tmp_path / 'runs' / 'demo' / '01_demo'}/" in lines[1]
    assert lines[1].endswith("p99 response 7.2x the median") and lines[2].startswith("1 notebook in ")
    assert "a cell printed this" in log.read_text() and "Executing Cell" in log.read_text()
    assert headline("02_x", {"spec/chi2_pvalue": 0.5}) == "SD vs plain samples: chi-square p = 0.50"
    assert headline("01_x", {}) == "" and headline("99_x", {"a": 1}) == ""


def test_every_command_reexecutes_inside_the_venv():
    base = getattr(sys, "_base_executable", None)
    if not base or Path(base).parent == Path(sys.executable).parent or not (ROOT / ".venv").is_dir():
        pytest.skip("needs a base Python outside the project's .venv")
    out = subprocess.run([base, "-m", "tltlib", "bench", "no-such-bench"], cwd=ROOT, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "TLTLIB_NO_VENV"})
    assert "No module named" not in out.stderr
    assert out.returncode == 1 and "unknown benchmark 'no-such-bench'; choose one of" in out.stderr


def test_train_drafter_checks_its_output_before_any_work(tmp_path, monkeypatch):
    import tltlib.model.weights
    from tltlib.drafting.warmup import train_warm_drafter

    def no_work(*a, **k):
        raise AssertionError("the output folder must be checked before the target is loaded")

    monkeypatch.setattr(tltlib.model.weights, "load_model", no_work)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(NotADirectoryError, match="cannot write the drafter .*a-file' is a file, not a folder"):
        train_warm_drafter("data/tiny-reasoner", blocker / "out")
    with pytest.raises(FileExistsError, match="does not hold a drafter; refusing to replace it"):
        train_warm_drafter("data/tiny-reasoner", "data/tiny-reasoner", overwrite=True)
    with pytest.raises(FileExistsError, match="already holds a drafter; pass --overwrite"):
        train_warm_drafter("data/tiny-reasoner", "data/tiny-reasoner-drafter")
    from tltlib.lab.reasoner import ReasonerTrainConfig, train_reasoner
    with pytest.raises(FileExistsError, match="already holds a model; pass --overwrite"):
        train_reasoner(ReasonerTrainConfig(), "data/tiny-reasoner")
    from tltlib.cli import build_parser
    args = build_parser().parse_args(["train-drafter"])
    assert args.out is None and not args.overwrite                 # default: a new folder under runs/, not data/


def test_atomic_folder_replaces_as_a_whole_and_cleans_up_after_dead_writers(tmp_path):
    dest = tmp_path / "out"
    with atomic_folder(dest) as t:
        (t / "a.txt").write_text("1")
        (t / "old.txt").write_text("1")
    with atomic_folder(dest) as t:
        (t / "a.txt").write_text("2")
    assert sorted(p.name for p in dest.iterdir()) == ["a.txt"]    # no file of the older write survives
    with pytest.raises(RuntimeError):
        with atomic_folder(dest, failed_to=tmp_path / "out.failed") as t:
            (t / "a.txt").write_text("3")
            raise RuntimeError("boom")
    assert (dest / "a.txt").read_text() == "2" and (tmp_path / "out.failed" / "a.txt").read_text() == "3"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    with atomic_folder(dest) as writing:                             # a live writer's folder is kept
        stale = tmp_path / f".out.{dead}.tmp-abc"
        stale.mkdir()
        assert remove_stale_temporaries(dest) == [stale] and writing.is_dir()
        (writing / "a.txt").write_text("4")
    with pytest.raises(FileExistsError, match="already holds a thing"):
        check_output_folder(dest, False, lambda p: True, "thing")


def test_a_folder_replacement_killed_between_renames_is_put_back_never_deleted(tmp_path):
    """The writer died after moving the old folder aside: the complete new copy (or else the old one) comes back;
    the half-written one is removed."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    dest = tmp_path / "ckpt"
    for kind, text in (("old", "v1"), ("new", "v2"), ("k2j4", "partial")):
        d = tmp_path / f".ckpt.{dead}.tmp-{kind}"
        d.mkdir()
        (d / "a.txt").write_text(text)
    remove_stale_temporaries(dest)
    assert (dest / "a.txt").read_text() == "v2" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    (tmp_path / f".ckpt.{dead}.tmp-old").mkdir()                    # only the old copy survived the crash
    dest.rename(tmp_path / f".ckpt.{dead}.tmp-old" / "x")
    (tmp_path / f".ckpt.{dead}.tmp-old" / "a.txt").write_text("v1")
    with atomic_folder(dest, keep_existing=True) as t:               # the next writer recovers it first
        (t / "b.txt").write_text("new")
    assert (dest / "a.txt").read_text() == "v1" and (dest / "b.txt").read_text() == "new"


def test_recovery_reads_the_disk_not_whether_the_writers_pid_lives(tmp_path):
    """A restarted container reuses PIDs (PID 1 first): the complete copies of a writer whose PID lives again are
    put back and its half-written folder removed, and a new writer with that very PID is not blocked by them."""
    dest = tmp_path / "ckpt"
    for pid in (1, os.getpid()):
        for kind, text in (("old", "v1"), ("new", "v2"), ("k2j4", "partial")):
            d = tmp_path / f".ckpt.{pid}.tmp-{kind}"
            d.mkdir()
            (d / "a.txt").write_text(text)
        remove_stale_temporaries(dest)
        assert (dest / "a.txt").read_text() == "v2" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
        shutil.rmtree(dest)
    (tmp_path / f".ckpt.{os.getpid()}.tmp-new").mkdir()              # killed after its first rename: dest is gone
    (tmp_path / f".ckpt.{os.getpid()}.tmp-new" / "a.txt").write_text("v2")
    with atomic_folder(dest, keep_existing=True) as t:
        (t / "b.txt").write_text("v3")
    assert [(dest / f).read_text() for f in ("a.txt", "b.txt")] == ["v2", "v3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_folder_written_inside_another_ones_temporary_folder_does_not_wait_for_it(tmp_path):
    """A notebook writes its figures (an atomic folder) inside the runner's output folder while the runner is still
    writing it: the writer's liveness lock must not be a lock on the folder (it deadlocked CI's notebook runs)."""
    code = ("import sys; from pathlib import Path; from tltlib.fileio import atomic_folder\n"
            "with atomic_folder(Path(sys.argv[1]) / 'outer') as t:\n"
            "    with atomic_folder(t / 'inner') as u:\n"
            "        (u / 'f.txt').write_text('x')\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "outer" / "inner" / "f.txt").read_text() == "x"
    assert not list(tmp_path.glob(".*")) and not list((tmp_path / "outer").glob(".*"))   # no lock file left
