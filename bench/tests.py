"""The test suite's size and time on this machine: the README's test tiers (every tier but ``gpu`` and ``slow``,
as ``python -m tltlib test`` and CI run them) in a subprocess, their counts, the wall time and the slowest tests.

    python -m tltlib bench tests            # ~10 min on 2 cores
    python -m tltlib bench tests --busy 2   # the same beside 2 busy loops (bench/busy.py), against the quiet run

Writes ``bench/results/tests-<cpu>.json`` and ``.md``; docs/results.md and the README render the suite's size and
time from it (``python -m tltlib report``), so a test count in the docs is never typed in by hand. ``--busy N``
writes ``busy_tests-<cpu>.json`` instead, with the ratio to the quiet file of the same CPU: the default tier must stay
green and within 2x its quiet time on a busy machine (no test in it judges this machine's speed).
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    ROOT,
    add_output_flags,
    bench_parser,
    machine_info,
    markdown_table,
    parse_bench_args,
    write_results,
)

SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")
SLOW = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)", re.M)
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", re.M)


def parse_args(argv=None):
    ap = bench_parser(__doc__)
    from tltlib.cli.commands import TEST_MARKERS
    ap.add_argument("--markers", default=TEST_MARKERS, help="pytest's -m expression (default: the README's "
                    "test command's, %(default)r)")
    ap.add_argument("--busy", type=int, default=0, help="run the suite beside this many busy loops (one pure-Python "
                    "loop per process, as bench/busy.py does); 0: a quiet run")
    add_output_flags(ap)
    args = parse_bench_args(ap, argv, malloc=False)
    if args.busy < 0:
        ap.error(f"argument --busy: {args.busy} is not >= 0")
    return args


BUSY_LIMIT = 2.0
"""The default tier on a busy machine may take at most this many times its quiet time (issue 57)."""


def run_suite(markers: str) -> dict:
    """Run pytest with ``markers`` and ``--durations=20`` in the workers ``python -m tltlib test`` starts; its counts,
    workers, wall time, exit status and slowest tests."""
    from tltlib.cli.bootstrap import notebook_env
    notebook_env()                                  # as python -m tltlib test runs it (Jupyter state in the venv)
    t0 = time.perf_counter()
    from tltlib.cli.commands import pytest_args, test_workers
    workers = test_workers()
    args = pytest_args(["-q", "-p", "no:randomly", "--durations=20", "-rfE"], workers, markers)
    out = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    last = next((line for line in reversed(out.stdout.splitlines()) if " in " in line and "passed" in line), "")
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(k) for k, kind in SUMMARY.findall(last)}
    slowest = [{"seconds": float(s), "when": w, "test": t} for s, w, t in SLOW.findall(out.stdout)][:20]
    failures = [{"test": t, "message": m} for t, m in FAILED.findall(out.stdout)]
    return {"markers": markers, "workers": workers, "returncode": out.returncode, "seconds": seconds, "counts": counts,
            "slowest": slowest, "failures": failures, "summary": last.strip("= ")}


def main() -> None:
    args = parse_args()
    m = machine_info("cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", m["cpu"].lower().replace("(r)", "").replace("(tm)", "")).strip("-")
    if args.busy:
        return busy_main(args, m, slug)
    result = run_suite(args.markers)
    c = result["counts"]
    text = (f"The test suite (`pytest -m {args.markers!r}`): {c.get('passed', 0)} passed, {c.get('failed', 0)} "
            f"failed, {c.get('skipped', 0)} skipped in {result['seconds'] / 60:.1f} min in {result['workers']} "
            f"worker(s) (exit status {result['returncode']}); the slowest:\n\n"
            + markdown_table(["seconds", "test"], [[f"{s['seconds']:.1f}", f"`{s['test']}`"]
                                                   for s in result["slowest"]])
            + "".join(f"\n\nFailed: `{f['test']}` ({f['message']})" for f in result["failures"]))
    write_results(f"tests-{slug}", {"bench": "tests", "machine": m, "settings": vars(args), **result}, text, args.out)
    if result["returncode"] != 0:
        sys.exit(f"error: the test suite failed (exit status {result['returncode']}): {result['summary']}")


def busy_main(args, m: dict, slug: str) -> None:
    """The suite beside ``args.busy`` busy loops, its time against the quiet file ``tests-<cpu>.json`` of this CPU."""
    import json
    import os

    from busy import SPIN
    quiet_file = Path(args.out or ROOT / "bench" / "results") / f"tests-{slug}.json"
    if not quiet_file.is_file():
        sys.exit(f"error: no quiet run of this CPU to compare with ({quiet_file}): run python -m tltlib bench tests "
                 "first, on a quiet machine")
    quiet = json.loads(quiet_file.read_text())
    loops = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
    try:
        result = run_suite(args.markers)
        load = os.getloadavg()
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait(timeout=30)
    ratio = result["seconds"] / quiet["seconds"]
    c = result["counts"]
    text = (f"The default tier (`pytest -m {args.markers!r}`) beside {args.busy} busy loops (load average "
            f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at its end): {c.get('passed', 0)} passed, "
            f"{c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped in {result['seconds'] / 60:.1f} min, "
            f"{ratio:.2f}x the quiet run's {quiet['seconds'] / 60:.1f} min ({quiet_file.name}; the limit is "
            f"{BUSY_LIMIT:g}x); the slowest:\n\n"
            + markdown_table(["seconds", "test"], [[f"{s['seconds']:.1f}", f"`{s['test']}`"]
                                                   for s in result["slowest"]])
            + "".join(f"\n\nFailed: `{f['test']}` ({f['message']})" for f in result["failures"]))
    write_results(f"busy_tests-{slug}", {"bench": "tests", "machine": m, "settings": vars(args), "busy": args.busy,
                                         "load_average": list(load), "quiet_seconds": quiet["seconds"],
                                         "ratio": ratio, "limit": BUSY_LIMIT, **result}, text, args.out)
    if result["returncode"] != 0:
        sys.exit(f"error: on a busy machine the test suite failed: {result['summary']}")
    if ratio > BUSY_LIMIT:
        sys.exit(f"error: on a busy machine the test suite took {ratio:.2f}x its quiet time (limit {BUSY_LIMIT:g}x)")


if __name__ == "__main__":
    main()
