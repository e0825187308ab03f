"""The test suite's size and time on this machine: the README's test tiers (every tier but ``gpu`` and ``slow``,
as ``python -m tltlib test`` and CI run them) in a subprocess, their counts, the wall time and the slowest tests.

    python -m tltlib bench tests            # ~10 min on 2 cores

Writes ``bench/results/tests-<cpu>.json`` and ``.md``; docs/results.md and the README render the suite's size and
time from it (``python -m tltlib report``), so a test count in the docs is never typed in by hand.
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
    add_output_flags(ap)
    return parse_bench_args(ap, argv, malloc=False)


def run_suite(markers: str) -> dict:
    """Run pytest with ``markers`` and ``--durations=10``; its counts, wall time, exit status and slowest tests."""
    from tltlib.cli.bootstrap import notebook_env
    notebook_env()                                  # as python -m tltlib test runs it (Jupyter state in the venv)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", markers, "-q", "-p", "no:randomly", "--durations=10",
                          "-rfE"],
                         cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    last = next((line for line in reversed(out.stdout.splitlines()) if " in " in line and "passed" in line), "")
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(k) for k, kind in SUMMARY.findall(last)}
    slowest = [{"seconds": float(s), "when": w, "test": t} for s, w, t in SLOW.findall(out.stdout)][:10]
    failures = [{"test": t, "message": m} for t, m in FAILED.findall(out.stdout)]
    return {"markers": markers, "returncode": out.returncode, "seconds": seconds, "counts": counts,
            "slowest": slowest, "failures": failures, "summary": last.strip("= ")}


def main() -> None:
    args = parse_args()
    m = machine_info("cpu")
    result = run_suite(args.markers)
    c = result["counts"]
    text = (f"The test suite (`pytest -m {args.markers!r}`): {c.get('passed', 0)} passed, {c.get('failed', 0)} "
            f"failed, {c.get('skipped', 0)} skipped in {result['seconds'] / 60:.1f} min (exit status "
            f"{result['returncode']}); the slowest:\n\n"
            + markdown_table(["seconds", "test"], [[f"{s['seconds']:.1f}", f"`{s['test']}`"]
                                                   for s in result["slowest"]])
            + "".join(f"\n\nFailed: `{f['test']}` ({f['message']})" for f in result["failures"]))
    slug = re.sub(r"[^a-z0-9]+", "-", m["cpu"].lower().replace("(r)", "").replace("(tm)", "")).strip("-")
    write_results(f"tests-{slug}", {"bench": "tests", "machine": m, "settings": vars(args), **result}, text, args.out)
    if result["returncode"] != 0:
        sys.exit(f"error: the test suite failed (exit status {result['returncode']}): {result['summary']}")


if __name__ == "__main__":
    main()
