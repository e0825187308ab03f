"""How long the main job and the test suite take: the canonical run's wall time per notebook (``figures/*.json``)
and ``bench tests``' counts and time per machine (``bench/results/tests-<cpu>.json``).

Departures: none (tooling).
"""
from __future__ import annotations

from collections.abc import Callable

from .format import bold, md_table, minutes
from .results import ReportError


def run_times(r) -> str:
    """The canonical run's wall time per notebook (``figures/<notebook>.json``'s ``run``), its machine and total."""
    runs = r.canonical_runs()
    machines = sorted({run["machine"] for run in runs})
    rows = [[run["notebook"].removesuffix(".ipynb"), minutes(run["seconds"])] for run in runs]
    rows.append([bold("all"), bold(minutes(sum(run["seconds"] for run in runs)))])
    return (md_table(["notebook", "wall time"], rows)
            + f"\n\n`{runs[0]['command']}`, {', '.join(machines)}, finished {runs[-1]['finished']}.")


def test_suites(r) -> list[tuple[str, dict]]:
    """Every ``bench tests`` file (``bench/results/tests-<cpu>.json``) as (stem, its data); a file of a failing
    suite is refused (the docs quote a green suite or nothing)."""
    stems = sorted(p.stem for p in r.folder.glob("tests-*.json"))
    if not stems:
        raise ReportError(f"{r.folder}: no tests-<cpu>.json; run python -m tltlib bench tests")
    suites = [(stem, r.json(stem)) for stem in stems]
    for stem, d in suites:
        c = d["counts"]
        if d["returncode"] != 0 or c.get("failed") or c.get("error"):
            raise ReportError(f"{r.folder / stem}.json records a failing suite ({d['summary']}): fix the tests, then "
                              "run python -m tltlib bench tests again")
    return suites


def test_suite(r) -> str:
    """The test suite's size and time per machine (``bench tests``: ``bench/results/tests-<cpu>.json``)."""
    rows = []
    for stem, d in test_suites(r):
        m, c = d["machine"], d["counts"]
        rows.append([f"{m['cpu']} ({m['threads']} threads), torch {m['torch']}", f"`-m {d['markers']!r}`",
                     suite_processes(d), c.get("passed", 0), c.get("skipped", 0), c.get("failed", 0),
                     minutes(d["seconds"]), r.link(stem, "slowest tests")])
    return md_table(["machine", "tiers", "processes", "passed", "skipped", "failed", "wall time", ""], rows)


def suite_processes(d: dict) -> str:
    """How a ``bench tests`` file's suite ran: in N pytest-xdist workers, or in one process (files written before
    ``python -m tltlib test`` started workers have no ``workers``)."""
    workers = d.get("workers", 1)
    return f"{workers} workers" if workers > 1 else "one process"


def busy_suite(r) -> str:
    """The default tier beside busy loops against its quiet time (``bench tests --busy N``:
    ``bench/results/busy_tests-<cpu>.json``); a failing or too slow run is refused."""
    stems = sorted(p.stem for p in r.folder.glob("busy_tests-*.json"))
    if not stems:
        raise ReportError(f"{r.folder}: no busy_tests-<cpu>.json; run python -m tltlib bench tests --busy 2")
    rows = []
    for stem in stems:
        d = r.json(stem)
        m, c = d["machine"], d["counts"]
        if d["returncode"] != 0 or d["ratio"] > d["limit"]:
            raise ReportError(f"{r.folder / stem}.json records a busy run that failed or took {d['ratio']:.2f}x its "
                              "quiet time: fix the tests, then run python -m tltlib bench tests --busy 2 again")
        rows.append([f"{m['cpu']} ({m['threads']} threads), torch {m['torch']}", d["busy"],
                     f"{d['load_average'][0]:.1f}", c.get("passed", 0), c.get("failed", 0),
                     minutes(d["quiet_seconds"]), minutes(d["seconds"]), f"{d['ratio']:.2f}x",
                     r.link(stem, "slowest tests")])
    return md_table(["machine", "busy loops", "load", "passed", "failed", "quiet", "busy", "ratio", ""], rows)


RENDERERS: dict[str, Callable] = {
    "run_times": run_times,
    "test_suite": test_suite,
    "busy_suite": busy_suite,
}
"""The run-time renderers a doc can name (``<!-- report: NAME -->``)."""
