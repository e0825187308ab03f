"""The result files as the report's renderers read them: ``bench/results/<stem>.json`` through a :class:`Results`,
and a canonical run's metrics beside its figures (``figures/<notebook>.json``, written by ``python -m tltlib run``).
A missing or broken file is a :class:`ReportError` naming the command that writes it.

Departures: none (tooling).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import BadInput
from ...fileio import ROOT, read_json

NOTEBOOKS = ("01_profile_long_tail", "02_speculative_decoding_explained", "03_train_drafter", "04_adaptive_rollout",
             "05_grpo_with_tlt", "06_idle_time_drafter_training", "07_reproduce_speedup_plots")
"""The notebooks of the main job, in order (their canonical-run files are ``figures/<notebook>.json``)."""


class ReportError(BadInput):
    """A doc's block or a result file the report cannot render; the message names the doc or file and the fix."""


def writer(stem: str, root: Path = ROOT) -> str:
    """The command that writes ``bench/results/<stem>.json`` (its options are in the section of the doc that shows
    it, and in the file's ``settings``)."""
    if stem.startswith("simulate-validate"):
        return "python -m tltlib simulate --validate"
    if stem.startswith("simulate-project"):
        return "python -m tltlib simulate --project"
    bench = stem.split("-")[0]
    return f"python -m tltlib bench {bench}" if (root / "bench" / f"{bench}.py").is_file() else "its bench"


@dataclass
class Results:
    """The result files as renderers read them: ``json(stem)`` (``bench/results/<stem>.json``, loaded once, a missing
    or broken file named with the command that writes it), ``link(stem)`` (a markdown link to its ``.md`` from the
    doc being rendered), and a canonical run's metrics and run records under ``root`` (``canonical``,
    ``canonical_runs``)."""

    folder: Path = ROOT / "bench" / "results"
    doc: Path = ROOT / "docs" / "results.md"
    root: Path = ROOT
    _loaded: dict = field(default_factory=dict, repr=False)

    def json(self, stem: str) -> dict:
        if stem not in self._loaded:
            path = self.folder / f"{stem}.json"
            if not path.is_file():
                raise ReportError(f"{path}: no such results file; run {writer(stem, self.root)} (or change the "
                                  "renderer that reads it, in tltlib/lab/report/)")
            try:
                self._loaded[stem] = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ReportError(f"{path} is not valid JSON ({e.msg}, line {e.lineno}): run "
                                  f"{writer(stem, self.root)} again") from None
        return self._loaded[stem]

    def link(self, stem: str, text: str | None = None) -> str:
        """``[text](relative path to bench/results/<stem>.md)`` from the doc being rendered."""
        rel = os.path.relpath(self.folder / f"{stem}.md", self.doc.parent)
        return f"[{text or stem + '.md'}]({rel})"

    def canonical(self, notebook: str, folder: str = "figures") -> dict:
        """A canonical run's metrics of ``notebook`` (``<folder>/<notebook>.json``, written by ``python -m tltlib
        run`` beside the figures it drew: ``figures`` for ``params/cpu-tiny.yaml``, ``figures/smollm2`` for
        ``params/cpu-smollm2.yaml``)."""
        return self._canonical(notebook, folder)["metrics"]

    def canonical_runs(self, folder: str = "figures") -> list[dict]:
        """The ``run`` record (notebook, params, command, finished, seconds, machine) of every notebook of a
        canonical run that has one, in order."""
        runs = [self._canonical(nb, folder)["run"] for nb in NOTEBOOKS if (self.root / folder / f"{nb}.json").is_file()]
        if not runs:
            self._canonical(NOTEBOOKS[0], folder)                # raises the error that says how to make them
        return runs

    def _canonical(self, notebook: str, folder: str) -> dict:
        path = self.root / folder / f"{notebook}.json"
        if not path.is_file():
            raise ReportError(f"{path}: no canonical-run metrics; run python -m tltlib run with the parameter file "
                              f"whose FIGURES_DIR is {folder} (it writes each notebook's metrics beside its figures)")
        return read_json(path, "run python -m tltlib run again")
