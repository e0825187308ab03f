"""Notebook parameter files and the schema every parameter is checked against before any notebook runs.

A parameter file (``params/*.yaml``) is a flat mapping of notebook parameters, with an optional ``notebooks:``
section of per-notebook overrides keyed by a quoted name prefix::

    MODEL_PATH: data/tiny-reasoner
    DEVICE: auto
    notebooks:
      "01": {N_PROMPTS: 64, NUM_GENERATIONS: 8}

:func:`plan_run` turns a file into the exact parameters each notebook will get, and refuses, naming the file, the
notebook and the key, everything that would otherwise be dropped or fail deep inside a notebook: a key no notebook
declares (with the closest spelling), a key under a notebook section that this notebook does not declare, a
section key YAML read as a number (``01:`` is the integer 1), a section that matches no notebook, a value of the
wrong type or out of range, a path that does not exist, a device this machine does not have. The schema below
(:data:`SCHEMA`) holds one :class:`Param` per parameter name; a notebook's schema is the entries for the names its
``parameters`` cell declares (a test checks every declared name has one and every default passes it).

Departures: none (tooling).
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import BadInput, NotFound
from ..fileio import ROOT, resolve
from ..model.importers import MODELS, cache_dir
from ..spec.strategy import SpecStrategy

RUNNER_SET = ("OUT_DIR",)
RENAMED = {"PAIRS": "TRAIN_ON", "GROUP_SIZE": "NUM_GENERATIONS", "TOP_K": "BRANCH"}
"""Notebook parameters of earlier versions: the error names the new one."""
"""Parameters the runner sets itself (a file may not: the value would be overwritten)."""


@dataclass(frozen=True)
class Param:
    """What one notebook parameter accepts."""

    kind: str
    """``int``, ``float``, ``str``, ``bool``, ``strategy``, ``strategies`` (a list of strategy names), ``path``,
    ``any`` (only ``check`` applies)."""
    lo: float | None = None
    """Smallest allowed value (numbers)."""
    hi: float | None = None
    """Largest allowed value (numbers)."""
    choices: tuple = ()
    """Allowed values (strings), if restricted."""
    exists: str = ""
    """For paths: ``"dir"`` or ``"file"`` must exist (after resolving against the project root); ``"out"``: an
    output folder (must not be a file); empty: no check."""
    empty_ok: bool = False
    """For paths: ``""`` is allowed (means "none", e.g. no dataset)."""
    check: Callable[[Any], str | None] | None = None
    """Extra check returning an error text or None."""
    expected: str = ""
    """What to say is expected, when the generated description would not be clear."""

    def describe(self) -> str:
        if self.expected:
            return self.expected
        what = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                "strategy": "a strategy name (off, chain-D, ngram-D, tree-DxK-N)",
                "strategies": "a list of strategy names", "path": "a path", "any": "a value"}[self.kind]
        if self.choices:
            what += " in " + ", ".join(map(repr, self.choices))
        if self.lo is not None and self.hi is not None:
            what += f" in [{self.lo}, {self.hi}]"
        elif self.lo is not None:
            what += f" >= {self.lo}"
        if self.exists:
            what += {"dir": " to an existing folder", "file": " to an existing file",
                     "out": " to a folder"}[self.exists]
        return what + (" (or \"\")" if self.empty_ok else "")

    def error(self, value, exists: bool = True) -> str | None:
        """Why ``value`` is not acceptable, or None (``exists=False``: a path's existence is not checked)."""
        k = self.kind
        if k == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            return "not an integer"
        if k == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return "not a number"
        if k in ("str", "path", "strategy") and not isinstance(value, str):
            return "not a string"
        if k == "bool" and not isinstance(value, bool):
            return "not true/false"
        if k in ("int", "float"):
            if not math.isfinite(value):
                return "not a finite number"
            if self.lo is not None and value < self.lo or self.hi is not None and value > self.hi:
                return "out of range"
        if self.choices and value not in self.choices:
            return "not an allowed value"
        if k == "strategy":
            return _strategy_error(value)
        if k == "strategies":
            if not isinstance(value, list) or not value:
                return "not a non-empty list"
            return next((e for e in map(_strategy_error, value) if e), None)
        if k == "path" and value == "":
            return None if self.empty_ok else "empty"
        if k == "path" and self.exists == "out":
            p = resolve(value)
            if p.exists() and not p.is_dir() or any(a.is_file() for a in p.parents):
                return f"{str(p)!r} is (inside) a file, not a folder"
        elif k == "path" and self.exists and exists:
            p = resolve(value)
            if not (p.is_dir() if self.exists == "dir" else p.is_file()):
                if p.parent == cache_dir() and p.name in MODELS:
                    return f"{str(p)!r} does not exist: import it first with python -m tltlib get-model {p.name}"
                return f"{str(p)!r} does not exist"
        return self.check(value) if self.check else None


def _strategy_error(name) -> str | None:
    try:
        SpecStrategy.parse(name)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _device_error(name: str) -> str | None:
    if name not in ("auto", "cpu", "cuda") and not (name.startswith("cuda:") and name[5:].isdigit()):
        return "not a device"
    if name.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            return "CUDA is not available on this machine; use cpu or auto"
    return None


def _message(check) -> Callable[[Any], str | None]:
    """A check that raises ValueError, as one that returns the message (None when the value passes)."""
    def run(value):
        try:
            check(value)
        except ValueError as e:
            return str(e)
        return None
    return run


def _rewards(names) -> None:
    from ..rl.grpo import reward_funcs_named
    reward_funcs_named(names, "REWARDS")


def _weights(value) -> None:
    if value is not None and (not isinstance(value, list) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in value)):
        raise BadInput("not null or a list of finite numbers, one per reward")


def _mapping(value) -> None:
    if not isinstance(value, dict):
        raise BadInput("not a mapping")


def _curriculum(value) -> None:
    if value is not None:
        from ..rl.curriculum import CurriculumConfig
        dataclass_from_mapping(CurriculumConfig, value, "CURRICULUM")


_DEVICE = Param("str", check=_device_error, expected="'auto', 'cpu', 'cuda' or 'cuda:N'")
_COUNT = Param("int", lo=1)
_PROB = Param("float", lo=0.0, hi=1.0)
SCHEMA: dict[str, Param] = {
    # models, data, devices, outputs
    "MODEL_PATH": Param("path", exists="dir"),
    "DRAFTER_PATH": Param("path", exists="dir"),
    "SHORT_DRAFTER_PATH": Param("path", exists="dir"),
    "DATASET": Param("path", exists="file", empty_ok=True),
    "TASK": Param("str", choices=("chain", "words")),
    "TASK_CONFIG": Param("any", check=_message(_mapping), expected="a mapping of the task's settings"),
    "REWARDS": Param("any", check=_message(_rewards), expected="a list of reward names (accuracy, format)"),
    "REWARD_WEIGHTS": Param("any", check=_message(_weights), expected="null or one number per reward"),
    "CURRICULUM": Param("any", check=_message(_curriculum), expected="null or a curriculum mapping (levels, ...)"),
    "DEVICE": _DEVICE,
    "DTYPE": Param("str", choices=("float32", "bfloat16", "float16")),
    "SEED": Param("int", lo=0, hi=2 ** 63 - 1),            # torch's generators take 64-bit seeds
    "OUT_DIR": Param("path"),
    "FIGURES_DIR": Param("path", exists="out", empty_ok=True),
    "DRAFTER_OUT": Param("path", exists="out", empty_ok=True),
    # rollout
    "N_PROMPTS": _COUNT,
    "NUM_GENERATIONS": _COUNT,
    "TEMPERATURE": Param("float", lo=0.0, hi=10.0),
    "DIST_TEMPERATURE": Param("float", lo=0.01, hi=10.0),
    "TOP_P": Param("float", lo=0.01, hi=1.0),
    "MAX_NEW_TOKENS": _COUNT,
    "WORKERS": _COUNT,
    # speculative decoding
    "TOY_TOKENS": Param("int", lo=2, hi=50),
    "TOY_CLOSENESS": _PROB,
    "TRACE_STEPS": _COUNT,
    "DEPTH": _COUNT,
    "BRANCH": _COUNT,
    "BUDGET": _COUNT,
    "PROBLEM_STEPS": Param("int", lo=1, hi=52),
    "CONTEXT_STEPS": Param("int", lo=0),
    "N_SAMPLES": _COUNT,
    "CHECK_PROMPTS": Param("int", lo=4),
    "CHECK_SAMPLES": _COUNT,
    "THRESHOLD": Param("int", lo=0),
    "DEMO_THRESHOLD": _COUNT,
    "ARMS": Param("strategies"),
    "FIXED": Param("strategy"),
    "RULE": Param("str", choices=("thompson", "epsilon-greedy")),
    "TUNING_ROLLOUTS": Param("int", lo=0),
    "WINDOW": _COUNT,
    # drafter training
    "N_TRAIN": _COUNT,
    "N_EVAL": _COUNT,
    "STEPS": _COUNT,
    "LR": Param("float", lo=1e-9, hi=1.0),
    "BATCH": _COUNT,
    "EVAL_EVERY": _COUNT,
    "EVAL_DEPTH": _COUNT,
    "N_ACCEPT": _COUNT,
    "ACCEPT_DEPTH": _COUNT,
    # GRPO with TLT
    "SEEDS": _COUNT,
    "MICRO_BATCH_TOKENS": _COUNT,
    "DRAFTER_STEPS": Param("int", lo=0),
    "DRAFTER_BATCH": _COUNT,
    "HELD_OUT": _COUNT,
    "PROBE_PROMPTS": Param("int", lo=0),
    "PROBE_STRATEGY": Param("strategy"),
    "TRL_RESULTS": Param("path", exists="file", empty_ok=True),
    # idle-time drafter training
    "SPOT_MAX_STEPS": _COUNT,
    "TRAIN_ON": Param("str", choices=("own", "all")),
    "RUN_DIR": Param("path", exists="dir", empty_ok=True),
    # reproducing the paper's plots
    "RESULTS_DIR": Param("path", exists="dir"),
    "HARDWARE": Param("str", choices=("h100", "a100", "b200")),
    "SIM_SEEDS": _COUNT,
    "CASE_STRATEGY": Param("strategy"),
}


# ----------------------------------------------------------------------------------------------- files
def params_path(params: str | os.PathLike, folder: str = "params") -> Path:
    """Resolve ``FOLDER/NAME.yaml``, ``NAME`` or a path; a clear error lists the files in ``folder`` otherwise
    (``params``: notebook parameter files; ``params/train``: train-grpo job files)."""
    p = Path(params)
    for c in (p, ROOT / p, ROOT / folder / p, ROOT / folder / f"{p}.yaml"):
        if c.is_file():
            return c
    available = sorted(f.name for f in (ROOT / folder).glob("*.yaml"))
    raise NotFound(f"params file {str(params)!r} not found; available in {folder}/: {available} "
                   "(or pass a path to your own YAML file)")


def load_yaml(path: Path):
    """A YAML file's content, refusing (with the file and line named) a key given twice in one mapping, which
    PyYAML would silently resolve to the last value, and YAML syntax errors."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """Refuses a key given twice in one mapping."""

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise BadInput(f"{path}, line {key_node.start_mark.line + 1}: {key!r} is given twice in the same "
                               "mapping; the second would silently replace the first: merge them")
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        return yaml.load(path.read_text(), Loader=StrictLoader)
    except yaml.YAMLError as e:
        raise BadInput(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None


def load_params(params: str | os.PathLike) -> tuple[dict, dict[str, dict]]:
    """(shared parameters, per-notebook overrides keyed by name prefix) from a YAML parameter file.

    Keys must be strings: YAML reads an unquoted ``01:`` as the integer 1, which would match no notebook."""
    path = params_path(params)
    data = load_yaml(path) or {}
    if not isinstance(data, dict):
        raise BadInput(f"{path}: expected a mapping of PARAMETER: value, got {type(data).__name__}")
    per_nb = data.pop("notebooks", None) or {}
    if not isinstance(per_nb, dict) or not all(isinstance(v, dict) for v in per_nb.values()):
        raise BadInput(f"{path}: 'notebooks' must map a notebook prefix (e.g. \"01\") to a mapping of parameters")
    for k in per_nb:
        if not isinstance(k, str):
            hint = f'"{k:02d}"' if isinstance(k, int) and not isinstance(k, bool) else f'"{k}"'
            raise BadInput(f"{path}: the notebook section {k!r} under 'notebooks' was read by YAML as "
                           f"{'a number' if isinstance(k, (int, float)) else type(k).__name__}, not a name prefix; "
                           f"quote it: {hint}:")
    for where, d in (("top level", data), *((f"notebooks/{k}", v) for k, v in per_nb.items())):
        bad = [k for k in d if not isinstance(k, str)]
        if bad:
            raise BadInput(f"{path}: key {bad[0]!r} ({where}) is not a parameter name; names are strings such "
                           "as N_PROMPTS")
    return data, per_nb


# ----------------------------------------------------------------------------------------------- planning
def declared_parameters(notebook: Path) -> dict[str, Any]:
    """Name -> default of every parameter a notebook's ``parameters`` cell declares (literal defaults only)."""
    import ast
    import json
    cells = json.loads(notebook.read_text())["cells"]
    cell = next((c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if cell is None:
        raise BadInput(f"{notebook}: no cell tagged 'parameters'")
    out = {}
    for node in ast.parse("".join(cell["source"])).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def inferred(default) -> Param:
    """The schema of a parameter SCHEMA does not list (a user's own notebook): the type of its default."""
    kinds = {bool: "bool", int: "int", float: "float", str: "str"}
    kind = kinds.get(type(default))
    if kind is None:
        return Param("any", check=lambda v: None if type(v) is type(default) else
                     f"not a {type(default).__name__} like the default", expected=f"a {type(default).__name__}")
    return Param(kind)


def _spelling(key: str, names) -> str:
    by_upper = {n.upper(): n for n in names}
    close = difflib.get_close_matches(str(key).upper(), sorted(by_upper), n=1, cutoff=0.6)
    return f" (did you mean {by_upper[close[0]]}?)" if close else ""


def plan_run(params: str | os.PathLike, notebooks: list[Path], selected: list[Path]) -> list[tuple[Path, dict]]:
    """The parameters each selected notebook gets, all checked before anything runs.

    Args:
        params: the parameter file.
        notebooks: every notebook of the suite (keys are checked against all of them, whatever is selected).
        selected: the notebooks to run, in order.

    Returns:
        ``[(notebook, {name: value})]`` for the selected notebooks: shared values the notebook declares, then its
        sections' overrides. Raises ValueError listing every problem, each naming the file, notebook and key.
    """
    path = params_path(params)
    shared, per_nb = load_params(path)
    declared = {nb: declared_parameters(nb) for nb in notebooks}
    everything = set().union(*map(set, declared.values()))
    problems = []
    for key in RUNNER_SET:
        if key in shared or any(key in v for v in per_nb.values()):
            problems.append(f"{key} is set by the runner (runs/<params>/<notebook>); choose the folder with --out")
    for key in sorted(set(shared) - everything - set(RUNNER_SET)):
        hint = f" (renamed {RENAMED[key]})" if key in RENAMED else _spelling(key, everything)
        problems.append(f"{key} is declared by no notebook{hint}")
    for prefix, overrides in per_nb.items():
        matched = [nb for nb in notebooks if nb.stem.startswith(prefix)]
        if not matched:
            problems.append(f"section \"{prefix}\" matches no notebook ({', '.join(nb.stem for nb in notebooks)})")
            continue
        for key in sorted(set(overrides) - set(RUNNER_SET)):
            missing = [nb.stem for nb in matched if key not in declared[nb]]
            if missing:
                owners = [nb.stem for nb in notebooks if key in declared[nb]]
                hint = f" (renamed {RENAMED[key]})" if key in RENAMED else _spelling(key, everything)
                where = (f"it is a parameter of {', '.join(owners)}: move it there" if owners
                         else f"no notebook declares it{hint}")
                problems.append(f"{key} under \"{prefix}\" is not a parameter of {', '.join(missing)}; {where}")
    plan, bad = {}, {}
    for nb in notebooks:          # every notebook's values, whatever is selected; paths must exist where it runs
        values = {k: v for k, v in shared.items() if k in declared[nb]}
        for prefix, overrides in per_nb.items():
            if nb.stem.startswith(prefix):
                values.update({k: v for k, v in overrides.items() if k in declared[nb]})
        for key, value in values.items():
            spec = SCHEMA.get(key) or inferred(declared[nb][key])
            error = spec.error(value, exists=nb in selected)
            why = error and f"{error}; expected {spec.describe()}"
            if why:
                bad.setdefault((key, repr(value), why), []).append(nb.stem)
        plan[nb] = values
    for (key, value, why), stems in bad.items():
        where = f"notebook {stems[0]}" if len(stems) == 1 else "notebooks " + ", ".join(s[:2] for s in stems)
        problems.append(f"{key} = {value} ({where}): {why}")
    problems += _workers_without_gpus(selected, declared, plan)
    if problems:
        raise BadInput(f"{path}: " + (problems[0] if len(problems) == 1 else
                                        f"{len(problems)} problems:\n  - " + "\n  - ".join(problems)))
    return [(nb, plan[nb]) for nb in selected]


def check_values(values: dict[str, Any], where: str) -> None:
    """Refuse, in one error naming each key, its value and what is expected (the range), notebook parameters that
    the schema refuses (what a notebook's first cell calls on its own parameters in JupyterLab, where no runner
    checked them: ``check_values({k: globals()[k] ...}, "02")``); ``where`` names the notebook."""
    problems = []
    for key, value in values.items():
        spec = SCHEMA.get(key) or inferred(value)
        error = spec.error(value)
        if error:
            problems.append(f"{key} = {value!r}: {error}; expected {spec.describe()}")
    if problems:
        raise BadInput(f"notebook {where}'s parameters: " + (problems[0] if len(problems) == 1 else
                                                              f"{len(problems)} problems:\n  - " +
                                                              "\n  - ".join(problems)) +
                       " (change them in the parameters cell)")


WORKER_NOTEBOOKS = ("06",)
"""Notebooks whose ``WORKERS`` are processes they start (torchrun); notebook 01's is a count in an estimate."""


def _workers_without_gpus(selected: list[Path], declared: dict, plan: dict) -> list[str]:
    """A problem per selected notebook of :data:`WORKER_NOTEBOOKS` that would start more data-parallel workers
    (``WORKERS``) than this machine has GPUs on a CUDA ``DEVICE`` (:func:`tltlib.rl.world.check_one_gpu_per_worker`),
    its defaults included. Without CUDA here a CUDA ``DEVICE`` is refused by its own check."""
    import torch

    from ..rl.world import check_one_gpu_per_worker
    out = []
    for nb in selected if torch.cuda.is_available() else ():
        if not nb.stem.startswith(WORKER_NOTEBOOKS):
            continue
        values = {**declared[nb], **plan[nb]}
        workers, device = values.get("WORKERS"), values.get("DEVICE")
        if type(workers) is not int or not isinstance(device, str):
            continue                                   # not a multi-worker notebook, or a value refused above
        try:
            check_one_gpu_per_worker(workers, device)
        except BadInput as e:
            out.append(f"notebook {nb.stem}: {e}")
    return out


# ------------------------------------------------------------------------------------------ config sections
def _yaml_number_hint(v) -> str:
    """For a string YAML 1.1 did not read as a number (``1e-4``): how to write it."""
    if not isinstance(v, str):
        return ""
    try:
        float(v)
    except ValueError:
        return ""
    return " (YAML reads 1e-4 as text: write 1.0e-4)"


def task_configs(task: str, settings: dict | None, source: str) -> tuple:
    """(training, held-out) configs of the generated task ``task`` (:func:`tltlib.tasks.datasets.task_config`) with
    ``settings`` (checked by :func:`dataclass_from_mapping`, ``source`` naming them). The chain task's held-out
    problems lean longer (Zipf 0.6 unless ``settings`` give an exponent), as the tiny reasoner's notebooks measure
    them; the word task's come from the training configuration."""
    from dataclasses import replace

    from ..tasks.chain import ChainTaskConfig
    from ..tasks.datasets import task_config
    cfg = dataclass_from_mapping(type(task_config(task)), settings, source)
    if isinstance(cfg, ChainTaskConfig):
        return cfg, replace(cfg, zipf_exponent=(settings or {}).get("zipf_exponent", 0.6))
    return cfg, cfg


def dataclass_from_mapping(cls, values: dict | None, source: str):
    """Build the frozen config dataclass ``cls`` from a YAML mapping, refusing (with ``source`` and the key named)
    keys it does not have (with the closest spelling) and values whose type is not the field's (a list is
    accepted for a tuple field). The dataclass's own checks then run as usual."""
    import dataclasses
    import typing
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise BadInput(f"{source}: {unknown[0]!r} is not a {cls.__name__} setting"
                       f"{_spelling(unknown[0], fields) or ''}; settings: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    out = {}
    for k, v in values.items():
        want = hints[k]
        allowed = typing.get_args(want) if typing.get_origin(want) in (typing.Union, __import__("types").UnionType) \
            else (want,)
        ok = False
        for t in allowed:
            base = typing.get_origin(t) or t
            if t is type(None):
                ok |= v is None
            elif base is bool:
                ok |= isinstance(v, bool)
            elif base is int:
                ok |= isinstance(v, int) and not isinstance(v, bool)
            elif base is float:
                ok |= isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            elif base is tuple:
                ok |= isinstance(v, (list, tuple))
                v = tuple(v) if ok and isinstance(v, list) else v
            else:
                ok |= isinstance(v, base)
        if not ok:
            names = {bool: "true/false", int: "an integer", float: "a finite number", str: "a string", tuple: "a list",
                     type(None): "null"}
            what = " or ".join(names.get(typing.get_origin(t) or t, str(t)) for t in allowed)
            raise BadInput(f"{source}: {k} = {v!r} is not {what}{_yaml_number_hint(v)}")
        out[k] = v
    try:
        return cls(**out)
    except (ValueError, TypeError) as e:
        raise BadInput(f"{source}: {e}") from None
