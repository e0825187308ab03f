"""Building and loading the project's C++ extensions: once per binary that can differ, and no wait without a bound.

PyTorch's ``load_inline`` keeps one build folder per extension name in ``~/.cache/torch_extensions`` and a lock file
that a killed build leaves behind (every later process then waits on it forever), and it rebuilds whenever another
venv wrote that folder's ``build.ninja`` with its own include paths: two clones on one machine rebuilt each other's
kernel, each waiting minutes on the other's lock. Here instead:

* **One folder per key** (:func:`key_of`): the key hashes everything the binary depends on (the source, the compiler
  flags, the compiler's ``--version``, the CPU's model and instruction-set flags, as the build uses ``-march=native``,
  torch's version, C++ ABI and install folder, Python's version). Two venvs have two folders and never touch each
  other's; a home folder shared by machines of different CPUs cannot load a kernel built for another CPU. The folder
  is ``$TLTLIB_CACHE/extensions/<name>-<key>`` (default ``~/.cache/tltlib/extensions``).
* **Written whole** (:func:`tltlib.fileio.atomic_folder`): a build runs in a fresh temporary folder renamed into place
  when it has loaded, so a killed build leaves no half-written folder and no PyTorch lock in the real one. A built
  folder is imported directly (no lock, no ninja, ~10 ms).
* **One builder at a time, a bounded wait** (:func:`hold`): builders of one key take an ``flock`` on
  ``<name>-<key>.lock``, which the operating system releases when the holder ends however it ends, so a dead
  builder's lock is taken over at once whatever its age. A live builder is waited for with one line naming the lock
  and its PID, for at most :data:`WAIT_S` (``TLTLIB_BUILD_WAIT_S``); past that the caller runs the PyTorch path
  with one line (:class:`tltlib.errors.TimedOut`).

Departures: none (tooling).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import BadInput, TimedOut
from ..fileio import atomic_folder, cache_root
from ..machine import cpu_flags, cpu_name

WAIT_ENV = "TLTLIB_BUILD_WAIT_S"
"""Environment variable: seconds to wait for another process building the same extension (default :data:`WAIT_S`)."""
WAIT_S = 600.0
"""How long a process waits for a live builder of the same key: a build takes ~20 s on 2 quiet cores, 4-5 minutes on
2 busy ones."""
POLL_S = 0.2
"""How often a waiting process tries the lock again."""


@dataclass(frozen=True)
class Extension:
    """A C++ extension compiled from an inline source.

    Attributes:
        name: the module's name (a Python identifier; the binary's ``PyInit_<name>``).
        source: the C++ source (``#include <torch/extension.h>``).
        functions: the source's functions bound for Python.
        cflags, ldflags: the compiler's and the linker's extra flags.
        what: the words a message names it by ("the CPU ragged-attention kernel").
    """
    name: str
    source: str
    functions: tuple[str, ...]
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    what: str = "a C++ extension"

    def __post_init__(self):
        if not self.name.isidentifier():
            raise BadInput(f"Extension.name must be a Python identifier (its module's name), got {self.name!r}")
        if not self.functions:
            raise BadInput(f"Extension {self.name!r} binds no functions: name the source's functions to call")


@functools.lru_cache(maxsize=None)
def compiler_version() -> str:
    """The first line of the C++ compiler's ``--version`` (``$CXX``, else ``c++``); "" where it does not answer."""
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else ""


def build_context() -> dict[str, str]:
    """What besides its source and flags a binary built here depends on (the parts of :func:`key_of`)."""
    return {"torch": torch.__version__, "abi": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
            "torch_dir": str(Path(torch.__file__).parent), "python": "%d.%d" % sys.version_info[:2],
            "compiler": compiler_version(), "cpu": cpu_name(), "cpu_flags": cpu_flags()}


def key_of(ext: Extension, context: dict[str, str]) -> str:
    """A 16-hex-digit key of everything ``ext``'s binary depends on: its source and flags and ``context``
    (:func:`build_context`); two builds share a folder only when every part is equal."""
    parts = [ext.name, ext.source, *ext.functions, "\0", *ext.cflags, "\0", *ext.ldflags, "\0",
             *(f"{k}={context[k]}" for k in sorted(context))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """Where built extensions live: ``$TLTLIB_CACHE/extensions`` (default ``~/.cache/tltlib/extensions``)."""
    return cache_root() / "extensions"


def wait_bound() -> float:
    """Seconds to wait for a live builder: ``TLTLIB_BUILD_WAIT_S`` or :data:`WAIT_S`."""
    text = os.environ.get(WAIT_ENV)
    if text is None:
        return WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise BadInput(f"{WAIT_ENV}={text!r} is not a number of seconds >= 0: unset it (waits {WAIT_S:.0f} s for "
                       "another process building the same kernel) or set e.g. 60")
    return value


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _holder(lock: Path) -> str:
    """Who holds ``lock``, as its holder wrote it ("PID 123 on host h"), or "another process"."""
    try:
        text = lock.read_text().strip()
    except OSError:
        text = ""
    return text or "another process"


@contextmanager
def hold(lock: str | os.PathLike, wait_s: float, what: str, say: Callable[[str], None] = _say,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
    """Hold the exclusive build lock ``lock`` for the body (an ``flock``: the operating system releases it when the
    holder ends, so a dead holder's lock is free at once whatever its age).

    A live holder is waited for, saying so in one line that names the lock and the holder's PID, for at most
    ``wait_s`` seconds; then :class:`TimedOut`. On a filesystem without locks the body runs unlocked (builds
    there may run twice, each into its own temporary folder)."""
    import fcntl
    lock = Path(lock)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, said = clock(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(lock)
                if clock() - start >= wait_s:
                    raise TimedOut(f"{holder} has held {lock} for over {wait_s:.0f} s while building {what}; if it "
                                   f"is stuck, end it (the lock is freed when it ends) or raise {WAIT_ENV}") from None
                if not said:
                    say(f"tltlib: waiting for {holder} to finish building {what} (lock {lock}; at most "
                        f"{wait_s:.0f} s, then the PyTorch path)")
                    said = True
                sleep(POLL_S)
            except OSError:                       # no locks on this filesystem
                break
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"PID {os.getpid()} on host {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)


def _import(ext: Extension, so: Path):
    spec = importlib.util.spec_from_file_location(ext.name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def folder_of(ext: Extension, context: dict[str, str] | None = None) -> Path:
    """The folder ``ext`` is built into here (:func:`key_of` over this process's :func:`build_context`)."""
    return cache_dir() / f"{ext.name}-{key_of(ext, build_context() if context is None else context)}"


def load(ext: Extension, say: Callable[[str], None] = _say, wait_s: float | None = None):
    """``ext``'s module: imported from its key's folder when built, else built there first (one line says so), one
    builder at a time (:func:`hold`). Raises :class:`TimedOut` past the wait bound, and what the compiler raised
    when it cannot build."""
    folder = folder_of(ext)
    so = folder / f"{ext.name}.so"
    if so.exists():
        return _import(ext, so)
    with hold(folder.with_name(folder.name + ".lock"), wait_bound() if wait_s is None else wait_s, ext.what, say):
        if so.exists():                           # built while this process waited
            return _import(ext, so)
        from torch.utils.cpp_extension import load_inline
        say(f"tltlib: building {ext.what} (once per machine and venv, ~20 s on 2 cores) into {folder}")
        with atomic_folder(folder) as tmp:
            module = load_inline(ext.name, cpp_sources=ext.source, functions=list(ext.functions),
                                 extra_cflags=list(ext.cflags), extra_ldflags=list(ext.ldflags),
                                 build_directory=str(tmp))
        return module
