"""Run a command on a busy machine: one pure-Python loop per core (or ``--procs``) spins beside it the whole time.

What a shared CI machine or a laptop with a notebook open does to a test run, made repeatable: the default test tier
must stay green and within 2x its quiet time under it (issue 57; the result is in docs/results.md).

    python bench/busy.py -- python -m tltlib test                    # the default tier beside 2 busy loops
    python bench/busy.py --procs 4 -- .venv/bin/python -m pytest tests/test_spec.py -q

Prints the command's wall time and the load average at the end; exits with the command's status.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

SPIN = "while True:\n    pass\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1, help="busy loops (default: one per core, "
                    "%(default)s here)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --, e.g. python bench/busy.py -- python -m tltlib test")
    if args.procs < 1:
        ap.error(f"argument --procs: {args.procs} is not >= 1")
    loops = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.procs)]
    start = time.monotonic()
    try:
        rc = subprocess.run(command).returncode
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait(timeout=30)
    seconds = time.monotonic() - start
    load = os.getloadavg()
    print(f"busy.py: {' '.join(command)} exited {rc} after {int(seconds // 60)} min {seconds % 60:.0f} s beside "
          f"{args.procs} busy loops (load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
