"""What the notebooks share: the papermill runner, paths, devices, metrics.json and figures.

Notebooks are thin (a ``parameters`` cell of literals, then calls into tltlib and plots); everything they would
otherwise repeat lives here, tested. Parameter files and their checks are in :mod:`tltlib.lab.params`.

The runner executes ``notebooks/NN_*.ipynb`` in order with papermill, from the project root. Each notebook writes
into a temporary folder that replaces ``runs/<params name>/<notebook>/`` only when the notebook has finished, so
the executed copy, its figures and its ``metrics.json`` always come from one run; the figures are then copied into
``FIGURES_DIR`` in one step. A failed or interrupted notebook leaves the previous outputs as they were and its
partly executed copy in ``runs/<params name>/<notebook>.failed/`` (the failing cell marked by papermill).

A notebook's JupyterLab profile (:func:`jupyterlab_profile`) is how a reader runs it: its own parameter cell's
defaults, within the budgets (seconds, GB) stored in its metadata; the browser tier (:mod:`tltlib.lab.browser`)
checks a run in a real JupyterLab against them.

Departures: none (tooling).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput, NotFound, Refused
from ..fileio import atomic_file, atomic_folder, atomic_write_text, check_writable, output_path, read_json
from .params import ROOT, plan_run, resolve

__all__ = ["resolve", "write_metrics", "read_metrics", "save_figure", "run_notebooks", "headline", "JupyterLabProfile",
           "jupyterlab_profile", "profiled_notebooks"]


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_metrics(metrics: dict, out_dir: str | os.PathLike) -> Path:
    """Write ``OUT_DIR/metrics.json`` (plain JSON: numpy/torch values converted, NaN -> null), atomically; a
    relative ``OUT_DIR`` is under the project root, whatever the working directory (a notebook's kernel runs in
    notebooks/)."""
    return atomic_write_text(output_path(out_dir) / "metrics.json", json.dumps(_jsonable(metrics), indent=2,
                                                                             sort_keys=True) + "\n")


def read_metrics(out_dir: str | os.PathLike) -> dict:
    """``OUT_DIR/metrics.json`` as a dict."""
    return read_json(output_path(out_dir) / "metrics.json", "run the notebook again")


def save_figure(fig, name: str, out_dir: str | os.PathLike, figures_dir: str | os.PathLike | None = None) -> None:
    """Save ``fig`` as ``OUT_DIR/name.png`` (a relative ``OUT_DIR`` under the project root) and, when ``figures_dir``
    is set, also into it (the committed figures). Returns nothing, so a notebook cell that ends with it shows the
    figure and no echo."""
    out = output_path(out_dir) / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    if figures_dir:
        dest = output_path(figures_dir)
        dest.mkdir(parents=True, exist_ok=True)
        fig.savefig(dest / f"{name}.png", dpi=110, bbox_inches="tight")


# --------------------------------------------------------------------------------------------------- runner
class NotebookError(Refused):
    """A notebook failed under the runner; the message holds the failing cell's error and where the partly
    executed copy is."""


def notebook_paths(only: list[str] | None = None, folder: str | os.PathLike | None = None) -> list[Path]:
    """The ordered notebooks ``NN_*.ipynb`` of ``folder`` (default ``notebooks/``), optionally filtered by name
    prefixes (each prefix must match; ``["05,06"]`` is ``["05", "06"]``)."""
    folder = resolve(folder) if folder else ROOT / "notebooks"
    paths = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise NotFound(f"no NN_*.ipynb notebooks in {str(folder)!r}")
    if only is not None:
        only = [o.strip() for part in only for o in part.split(",")]
        if not only or not all(only):
            raise BadInput("--only needs notebook prefixes, e.g. --only 01 03 or --only 01,03 (an empty prefix would "
                           "match all)")
        chosen = [p for p in paths if any(p.stem.startswith(o) for o in only)]
        unmatched = [o for o in only if not any(p.stem.startswith(o) for p in paths)]
        if unmatched:
            raise BadInput(f"no notebook matches {unmatched}; notebooks: {[p.stem for p in paths]}")
        paths = chosen
    return paths


def _cell_error(e, nb: Path, kept: Path) -> NotebookError:
    cell = f"cell [{e.exec_count}]" if getattr(e, "exec_count", None) else f"cell {e.cell_index}"
    msg = " ".join(str(e.evalue).split()) if e.evalue else ""
    return NotebookError(f"{nb.name} failed in {cell}: {e.ename}: {msg}\n  partly executed notebook: {kept}")


def run_notebooks(params: str | os.PathLike = "params/cpu-tiny.yaml", out_root: str | os.PathLike = "runs",
                  only: list[str] | None = None, progress: bool = True,
                  notebooks: str | os.PathLike | None = None, log: bool = False, on_event=None) -> list[Path]:
    """Execute the notebooks in order with papermill; return the executed copies.

    Every notebook's parameters are checked first (:func:`tltlib.lab.params.plan_run`), for all notebooks, so a typo
    fails before anything runs. Each notebook gets the parameters its ``parameters`` cell declares plus
    ``OUT_DIR``; outputs are swapped in atomically (see the module docstring). ``notebooks``: another folder of
    ``NN_*.ipynb`` notebooks than the suite's. ``progress``: papermill's bar of executed cells.

    ``log``: everything papermill and the kernels print (the cells' output, warnings, the kernel's start-up) goes to
    ``runs/<params name>/run.log`` instead of the terminal, appended to per run. ``on_event(kind, **info)`` is told
    ``"begin"`` (``notebooks``: their paths, ``log``: the log's path or None), ``"start"`` (``notebook``),
    ``"done"`` (``notebook``, ``seconds``, ``folder``: its outputs, ``metrics``: its metrics.json or {}) or
    ``"failed"`` (``notebook``, ``seconds``; the error follows)."""
    from .params import params_path
    plan = plan_run(params, notebook_paths(folder=notebooks), notebook_paths(only, notebooks))
    run_dir = check_writable(resolve(out_root) / params_path(params).stem, "run folder (--out)")
    log_path = run_dir / "run.log" if log else None
    event = on_event or (lambda kind, **info: None)
    event("begin", notebooks=[nb for nb, _ in plan], log=log_path)
    done = []
    for nb, values in plan:
        event("start", notebook=nb)
        t0 = time.perf_counter()
        try:
            with _output_to(log_path, f"{nb.name} with {params_path(params)}"):
                final = _run_one(nb, values, run_dir, progress and not log, log_output=log)
        except BaseException:
            event("failed", notebook=nb, seconds=time.perf_counter() - t0)
            raise
        done.append(final / nb.name)
        metrics = read_json(final / "metrics.json", "") if (final / "metrics.json").is_file() else {}
        if values.get("FIGURES_DIR"):                  # the committed figures name the run they come from
            _write_provenance(resolve(values["FIGURES_DIR"]) / f"{nb.stem}.json", nb, params_path(params), metrics,
                              time.perf_counter() - t0)
        event("done", notebook=nb, seconds=time.perf_counter() - t0, folder=final, metrics=metrics)
    return done


def _run_one(nb: Path, values: dict, run_dir: Path, progress: bool, log_output: bool) -> Path:
    """Execute notebook ``nb`` with ``values`` into ``run_dir/<name>/`` (swapped in when it has finished; its
    figures then copied to FIGURES_DIR); returns the folder."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError
    final, failed = run_dir / nb.stem, run_dir / f"{nb.stem}.failed"
    figures_dir = values.get("FIGURES_DIR", "")
    try:
        with atomic_folder(final, failed_to=failed) as tmp:
            inject = {**values, "OUT_DIR": str(tmp)}
            if figures_dir:
                inject["FIGURES_DIR"] = ""            # copied by the runner once the notebook has succeeded
            try:
                pm.execute_notebook(str(nb), str(tmp / nb.name), parameters=inject, kernel_name="python3",
                                    language="python", cwd=str(ROOT), progress_bar=progress, log_output=log_output)
            except PapermillExecutionError as e:
                raise _cell_error(e, nb, failed / nb.name) from None
    except (KeyboardInterrupt, SystemExit):
        if failed.is_dir():
            (failed / "INTERRUPTED").write_text("the run was interrupted while this notebook executed\n")
        raise
    if failed.exists():
        shutil.rmtree(failed)                         # a successful run supersedes an older failure
    if figures_dir:                                   # each figure replaced atomically, after the run succeeded
        for png in final.glob("*.png"):
            with atomic_file(resolve(figures_dir) / png.name) as tmp_png:
                shutil.copy2(png, tmp_png)
    return final


def _write_provenance(path: Path, nb: Path, params: Path, metrics: dict, seconds: float) -> None:
    """Beside a notebook's committed figures: which run drew them (the notebook, its parameter file, when, on what
    machine, how long it took) and the metrics it wrote, so a number quoted from a figure has its source."""
    from ..machine import machine_info
    m = machine_info("cpu")
    shown = str(params.relative_to(ROOT)) if params.is_relative_to(ROOT) else str(params)
    run = {"notebook": nb.name, "params": shown, "command": f"python -m tltlib run --params {shown}",
           "finished": time.strftime("%Y-%m-%d"),
           "seconds": round(seconds, 1), "machine": f"{m['cpu']} ({m['threads']} threads), torch {m['torch']}"}
    atomic_write_text(path, json.dumps({"run": run, "metrics": _jsonable(metrics)}, indent=1, sort_keys=True) + "\n")


@contextlib.contextmanager
def _output_to(path: Path | None, title: str):
    """Send this process's output and its children's (the kernels inherit the file descriptors) to ``path``,
    appended, with papermill's log at INFO (the cells' output) — or leave everything where it was (None)."""
    if path is None:
        yield
        return
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    handler = logging.StreamHandler(sys.stderr)
    logger = logging.getLogger("papermill")
    level = logger.level
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {title}\n")
        f.flush()
        os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
        logger.addHandler(handler), logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            logger.removeHandler(handler), logger.setLevel(level)
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


HEADLINES = {
    "01": ("rollout/p99_over_p50", "p99 response {:.1f}x the median"),
    "02": ("spec/chi2_pvalue", "SD vs plain samples: chi-square p = {:.2f}"),
    "03": ("spec/accept_len_mean", "drafter: {:.2f} tokens per SD step"),
    "04": ("adaptive/speedup_vs_no_sd", "adaptive rollout {:.2f}x no SD"),
    "05": ("e2e/step_speedup", "GRPO step {:.2f}x with TLT"),
    "06": ("sched/harvested", "{:.0%} of the idle worker-time trained the drafter"),
    "07": ("sim/case_study_speedup", "simulated case study {:.2f}x"),
}
"""The number each notebook's line in ``python -m tltlib run`` shows: (its metrics.json key, format)."""


def headline(notebook: str | os.PathLike, metrics: dict) -> str:
    """The headline number of notebook ``notebook`` (a path or a name ``NN_...``) from its ``metrics``; "" where the
    notebook has none or did not write it."""
    key, fmt = HEADLINES.get(Path(notebook).name[:2], (None, ""))
    value = metrics.get(key) if key else None
    return fmt.format(value) if isinstance(value, (int, float)) else ""


# --------------------------------------------------------------------------------------------- JupyterLab profile
PROFILE_KEY = ("tltlib", "jupyterlab")
"""Where a notebook keeps its JupyterLab profile: ``nb.metadata["tltlib"]["jupyterlab"]``."""


@dataclass(frozen=True)
class JupyterLabProfile:
    """How a notebook runs as a reader runs it in JupyterLab: its own parameter cell's defaults (nothing injected),
    within the budgets stored in its metadata (``nb.metadata["tltlib"]["jupyterlab"] = {"seconds": ..., "rss_gb":
    ...}``). The browser tier (:mod:`tltlib.lab.browser`) checks a run against them."""

    notebook: Path
    """The notebook."""
    seconds: float
    """Budget for Run All Cells to finish, in seconds, on a quiet 2-core CPU."""
    rss_gb: float
    """Budget for the kernel's peak resident memory (its process tree), in GB (1e9 bytes)."""

    def __post_init__(self):
        for name in ("seconds", "rss_gb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise BadInput(f"{self.notebook.name}: the JupyterLab profile's {name} is {value!r}; it must be a "
                               f"positive number (metadata {_profile_key_text()})")


def _profile_key_text() -> str:
    return 'nb.metadata["tltlib"]["jupyterlab"] = {"seconds": <budget>, "rss_gb": <budget>}'


def _profile_entry(notebook: Path) -> dict | None:
    metadata = read_json(notebook, "the notebook must be valid .ipynb JSON").get("metadata", {})
    entry = metadata.get(PROFILE_KEY[0], {})
    entry = entry.get(PROFILE_KEY[1]) if isinstance(entry, dict) else None
    return entry if isinstance(entry, dict) else None


def profiled_notebooks(folder: str | os.PathLike | None = None) -> list[Path]:
    """The notebooks ``NN_*.ipynb`` of ``folder`` (default ``notebooks/``) that have a JupyterLab profile."""
    return [p for p in notebook_paths(folder=folder) if _profile_entry(p) is not None]


def jupyterlab_profile(notebook: str | os.PathLike) -> JupyterLabProfile:
    """The JupyterLab profile of ``notebook`` (a path, or a name prefix of a notebook in ``notebooks/``: ``"02"``);
    a notebook without one is refused, naming the notebooks that have one and the metadata key that adds one."""
    path = resolve(notebook)
    if not path.is_file():
        if path.suffix == ".ipynb" or os.sep in str(notebook):
            raise NotFound(f"no notebook {str(notebook)!r} (give a path to an .ipynb file or a prefix such as 02)")
        matches = notebook_paths([str(notebook)])
        if len(matches) > 1:
            raise BadInput(f"{str(notebook)!r} matches {[p.stem for p in matches]}: give a longer prefix")
        path = matches[0]
    path = path.resolve()
    entry = _profile_entry(path)
    if entry is None:
        have = [p.name for p in profiled_notebooks()]
        raise BadInput(f"{path.name} has no JupyterLab profile; notebooks in notebooks/ that have one: "
                       f"{', '.join(have) or 'none'}; add one in the notebook's metadata: {_profile_key_text()}")
    if set(entry) != {"seconds", "rss_gb"}:
        raise BadInput(f"{path.name}: the JupyterLab profile {entry} must have exactly the keys seconds and rss_gb "
                       f"({_profile_key_text()})")
    return JupyterLabProfile(path, entry["seconds"], entry["rss_gb"])
