"""The simulator's tables: ``simulate --validate``'s checks and runs, and ``simulate --project`` beside the paper.

Departures: none (tooling).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from .format import bold, md_table, pct, x


def simulate_checks(stem: str) -> Callable:
    """Every check of ``simulate --validate``: simulated, measured, the error, within the tolerance."""
    def render(r) -> str:
        rows = []
        for c in r.json(stem)["checks"]:
            err = f"{100 * c['error']:+.1f} points" if c["share"] else f"{100 * c['error']:+.1f}%"
            rows.append([c["what"], f"{c['simulated']:.3f}", f"{c['measured']:.3f}", err, "ok" if c["ok"] else "OFF"])
        return md_table(["check", "simulated", "measured", "error", "within 15% (shares: 5 points)"], rows)
    return render


def simulate_runs(stems: Sequence[str]) -> Callable:
    """Several ``simulate --validate`` runs in a row: checks passed, the noise, the worst check."""
    def render(r) -> str:
        rows = []
        for i, stem in enumerate(stems, 1):
            d = r.json(stem)
            checks = d["checks"]
            worst = max(checks, key=lambda c: abs(c["error"]) / (0.05 if c["share"] else 0.15))
            err = f"{100 * worst['error']:+.1f}" + (" points" if worst["share"] else "%")
            rows.append([i, f"{sum(c['ok'] for c in checks)} of {len(checks)}", pct(d["noise"]),
                         len(d.get("notes", [])), f"{worst['what']}: {err}"])
        return md_table(["run", "checks within the tolerance", "passes' noise", "values moved onto a bound", "worst"],
                        rows)
    return render


def projection(stem: str) -> Callable:
    """The simulator at the paper's Table 3 settings (``simulate --project``) beside the paper."""
    def render(r) -> str:
        rows = []
        for model, points in r.json(stem)["projection"].items():
            for p in points:
                if "oom" in p:
                    need = re.search(r"need (\d+ GB) per device", p["oom"])
                    rows.append([model, p["nodes"], None, None, None, None,
                                 f"OOM (needs {need.group(1)} per GPU)" if need else "OOM",
                                 "OOM" if p.get("paper") is None else x(p["paper"]), None, None, None, None])
                    continue
                rows.append([model, p["nodes"], f"{p['workers']} x {p['rows_per_worker']}", f"{p['baseline_s']:.0f}",
                             pct(p["rollout_share"]), x(p["tlt_base_speedup"]), bold(x(p["speedup"])),
                             "—" if p.get("paper") is None else x(p["paper"]), x(p["rollout_speedup"]),
                             pct(p["sd_time_share"]), pct(p["idle_frac"]), pct(p["harvested"])])
        return md_table(["model", "nodes", "rollout workers x rows", "baseline step s", "rollout share", "TLT-Base",
                         "TLT (simulated)", "paper", "rollout speedup", "SD share of TLT's rollout", "idle share",
                         "harvested"], rows)
    return render



LATEST_VALIDATION = "simulate-validate-cpu-intel-xeon"
"""The latest `simulate --validate` run (the one docs/results.md shows first)."""
XEON_VALIDATE_RUNS = tuple(f"simulate-validate-cpu-intel-xeon-run{i}" for i in range(1, 6))


RENDERERS: dict[str, Callable] = {
    "validate": simulate_checks("simulate-validate-cpu"),
    "validate_latest": simulate_checks(LATEST_VALIDATION),
    "validate_xeon_runs": simulate_runs(XEON_VALIDATE_RUNS),
    "projection": projection("simulate-project-h100"),
}
"""The simulator renderers a doc can name (``<!-- report: NAME -->``)."""
