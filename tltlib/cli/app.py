"""``python -m tltlib ...``: parse the command line, run the command inside ``.venv`` (set up first when it is
missing), and print an error tltlib raised on purpose as one line (``--debug``: the traceback).

The commands ``setup``, ``run`` and ``test`` work from a bare Python 3.11 (standard library only): they create
``.venv`` in the project, install PyTorch and the project into it (:mod:`tltlib.cli.bootstrap`), and re-run
themselves inside it.

Departures: none (tooling).
"""
from __future__ import annotations

import os
import signal
import sys
import traceback

from ..errors import TLTError
from . import bootstrap, commands
from .parser import build_parser


def _raised_by_us(exc: BaseException) -> bool:
    """True when ``exc`` is the project's own error type (:class:`tltlib.errors.TLTError`): an error raised on purpose,
    whose message says the cause and the fix. Anything else raised anywhere (a ``KeyError``, a division by zero) is a
    bug and keeps its traceback."""
    return isinstance(exc, TLTError)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)                   # unwinds: temporary folders are cleaned up or kept as .failed


def _set_up(step):
    """A set-up step as a command handler: its exit status is 0 whatever the step returns (a path is not a status)."""
    def handler(args) -> int:
        step()
        return 0
    return handler


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    setups = {"setup": _set_up(lambda: bootstrap.setup(force=True)),       # from a bare Python: not re-run
              "setup-vllm": _set_up(bootstrap.setup_vllm),                   # inside .venv; their errors are
              "setup-browser": _set_up(bootstrap.setup_browser)}             # one line as every command's
    if args.cmd not in setups and not bootstrap.in_venv() and not os.environ.get("TLTLIB_NO_VENV"):
        i = argv.index(args.cmd)                      # the same command line inside .venv (run -> run-notebooks)
        bootstrap.reexec_in_venv([*argv[:i], "run-notebooks" if args.cmd == "run" else args.cmd, *argv[i + 1:]])
    handlers = {"run": commands.cmd_run_notebooks, "run-notebooks": commands.cmd_run_notebooks,
                "test": commands.cmd_test, "train-reasoner": commands.cmd_train_reasoner,
                "train-drafter": commands.cmd_train_drafter, "train-grpo": commands.cmd_train_grpo,
                "sample-responses": commands.cmd_sample_responses, "warm-start": commands.cmd_warm_start,
                "get-model": commands.cmd_get_model, "import-gguf": commands.cmd_import_gguf,
                "kernels": commands.cmd_kernels, "bench": commands.cmd_bench, "simulate": commands.cmd_simulate,
                "report": commands.cmd_report, "check": commands.cmd_check,
                **setups}
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return handlers[args.cmd](args)
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:
            print("terminated (SIGTERM)", file=sys.stderr)
        raise
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:                            # noqa: BLE001 - sorted into ours (one line) and bugs
        if args.debug:
            raise
        if not _raised_by_us(e):
            traceback.print_exc()
            print(f"error: the {type(e).__name__} above is a bug in tltlib, not a problem with your input: please "
                  "report it with this traceback and the command line", file=sys.stderr)
            return 1
        print(f"error: {e}\n(run with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
