"""The check's tables: ``bench check`` (``python -m tltlib check`` on a model and its drafter: each verdict and the
wall time; then each fault it must catch, injected on purpose, and what it said).

Departures: none (tooling).
"""
from __future__ import annotations

from collections.abc import Callable

from .format import md_table, minutes

CHECK = (("tiny reasoner", "check-cpu-float32"), ("SmolLM2-135M", "check-cpu-float32-smollm2-135m-words-sft"))
"""``bench check``'s files."""
TIME_GOAL_S = 300.0
"""The issue's goal: the whole check in under 5 minutes on this CPU for SmolLM2 with its drafter."""
CAUGHT_P = 1e-6
"""A fault counts as caught at p below this, or by an exact mismatch (greedy identity)."""


def caught(row: dict) -> bool:
    """Whether an injected fault was caught: p < 1e-6, or greedy identity failed on a margin beyond a float tie."""
    if row["test"] == "greedy identity":
        return row["status"] == "fail"
    return row["pvalue"] is not None and row["pvalue"] < CAUGHT_P and row["status"] in ("fail", "warn")


def verdicts(stem: str) -> Callable:
    """The check's verdicts on a shipped model and drafter, and its wall time."""
    def render(r) -> str:
        d = r.json(stem)
        rows = [[v["status"].upper(), v["part"], v["name"], v["line"]] for v in d["check"]["verdicts"]]
        m = d["machine"]
        return (md_table(["verdict", "part", "test", "what was measured"], rows)
                + f"\n\nThe whole check: {minutes(d['check_wall_s'])} on {m.get('gpu') or m['cpu']} "
                  f"({m['threads']} threads).")
    return render


def faults(stem: str) -> Callable:
    """Each injected fault, the test that should catch it and what it said (the clean runs beside)."""
    def render(r) -> str:
        rows = [[f["fault"], f["test"], f["status"], "—" if f["pvalue"] is None else f"{f['pvalue']:.1e}",
                 ("caught" if caught(f) else "**missed**") if not f["fault"].startswith("none") else "—", f["line"]]
                for f in r.json(stem)["faults"]]
        return md_table(["injected fault", "test", "verdict", "p", "caught", "evidence"], rows)
    return render


RENDERERS: dict[str, Callable] = {
    **{f"check{tag}_{name}": make(stem) for tag, (_, stem) in zip(("", "_smollm2"), CHECK)
       for name, make in (("verdicts", verdicts), ("faults", faults))},
}
"""The check's renderers a doc can name (``<!-- report: NAME -->``)."""
