"""What the notebooks share: parameter files, the papermill runner, paths, devices, metrics.json and figures.

Notebooks are thin (a ``parameters`` cell of literals, then calls into tltlib and plots); everything they would
otherwise repeat lives here, tested. Parameter files (``params/*.yaml``) are flat mappings of notebook parameters,
with an optional ``notebooks:`` section of per-notebook overrides keyed by name prefix (``"01"``)::

    MODEL_PATH: data/tiny-reasoner
    DEVICE: auto
    notebooks:
      "01": {N_PROMPTS: 64, GROUP_SIZE: 8}

The runner executes ``notebooks/NN_*.ipynb`` in order with papermill, from the project root, writing each executed
copy, its figures and its ``metrics.json`` to ``runs/<params name>/<notebook>/``.

Departures: none (tooling).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from .fileio import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent


def resolve(path: str | os.PathLike) -> Path:
    """A path as given if it exists (or is absolute), else relative to the project root (so notebooks work from
    ``notebooks/`` in JupyterLab and from the root under papermill)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    return ROOT / p


def pick_device(name: str = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when available, else ``"cpu"``; other names are checked and returned."""
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"DEVICE={name!r} but CUDA is not available here; use DEVICE='cpu' or 'auto'")
    return name


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
    """Write ``OUT_DIR/metrics.json`` (plain JSON: numpy/torch values converted, NaN -> null), atomically."""
    return atomic_write_text(Path(out_dir) / "metrics.json", json.dumps(_jsonable(metrics), indent=2,
                                                                        sort_keys=True) + "\n")


def read_metrics(out_dir: str | os.PathLike) -> dict:
    return json.loads((Path(out_dir) / "metrics.json").read_text())


def save_figure(fig, name: str, out_dir: str | os.PathLike, figures_dir: str | os.PathLike | None = None) -> Path:
    """Save ``fig`` as ``OUT_DIR/name.png`` and, when ``figures_dir`` is set, also into it (the committed figures)."""
    out = Path(out_dir) / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    if figures_dir:
        dest = resolve(figures_dir)
        dest.mkdir(parents=True, exist_ok=True)
        fig.savefig(dest / f"{name}.png", dpi=110, bbox_inches="tight")
    return out


# --------------------------------------------------------------------------------------------------- params
def params_path(params: str | os.PathLike) -> Path:
    """Resolve ``params/NAME.yaml``, ``NAME`` or a path; a clear error lists the available files otherwise."""
    p = Path(params)
    candidates = [p, ROOT / p, ROOT / "params" / p, ROOT / "params" / f"{p}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    available = sorted(f.name for f in (ROOT / "params").glob("*.yaml"))
    raise FileNotFoundError(f"params file {str(params)!r} not found; available in params/: {available} "
                            "(or pass a path to your own YAML file)")


def load_params(params: str | os.PathLike) -> tuple[dict, dict[str, dict]]:
    """(shared parameters, per-notebook overrides keyed by name prefix) from a YAML parameter file."""
    import yaml
    path = params_path(params)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of PARAMETER: value, got {type(data).__name__}")
    per_nb = data.pop("notebooks", None) or {}
    if not isinstance(per_nb, dict) or not all(isinstance(v, dict) for v in per_nb.values()):
        raise ValueError(f"{path}: 'notebooks' must map a notebook prefix (e.g. \"01\") to a mapping of parameters")
    return data, {str(k): v for k, v in per_nb.items()}


def notebook_paths(only: list[str] | None = None) -> list[Path]:
    """The ordered notebooks ``notebooks/NN_*.ipynb``, optionally filtered by name prefixes."""
    paths = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if only:
        paths = [p for p in paths if any(p.stem.startswith(o) for o in only)]
        if not paths:
            raise ValueError(f"no notebook matches {only}; notebooks: {[p.stem for p in notebook_paths()]}")
    return paths


def run_notebooks(params: str | os.PathLike = "params/cpu-tiny.yaml", out_root: str | os.PathLike = "runs",
                  only: list[str] | None = None, progress: bool = True) -> list[Path]:
    """Execute the notebooks in order with papermill; return the executed copies.

    Each notebook gets the parameters its ``parameters`` cell declares (shared, then its overrides) plus
    ``OUT_DIR = out_root/<params>/<notebook>``. A parameter no notebook declares is an error (a typo would
    otherwise be silently ignored)."""
    import papermill as pm

    shared, per_nb = load_params(params)
    run_dir = resolve(out_root) / params_path(params).stem
    plan = []
    for nb in notebook_paths(only):
        declared = set(pm.inspect_notebook(str(nb)))
        values = dict(shared)
        for prefix, overrides in per_nb.items():
            if nb.stem.startswith(prefix):
                values.update(overrides)
        values["OUT_DIR"] = str(run_dir / nb.stem)
        plan.append((nb, {k: v for k, v in values.items() if k in declared}))
    unknown = (set(shared) | {k for v in per_nb.values() for k in v}) - {k for _, inj in plan for k in inj}
    if unknown and not only:                          # fail before running anything
        raise ValueError(f"{params_path(params)}: parameters {sorted(unknown)} are declared by no notebook; "
                         "check their spelling against the notebooks' parameters cells")
    done = []
    for nb, inject in plan:
        out_dir = Path(inject["OUT_DIR"])
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{nb.stem}.", suffix=".ipynb", dir=out_dir)
        os.close(fd)
        try:
            pm.execute_notebook(str(nb), tmp, parameters=inject, kernel_name="python3", language="python",
                                cwd=str(ROOT), progress_bar=progress, log_output=False)
            os.replace(tmp, out_dir / nb.name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        done.append(out_dir / nb.name)
    return done
