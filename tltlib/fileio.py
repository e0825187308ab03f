"""Atomic file and folder writes: a reader never sees a half-written model, drafter, dataset or metrics file.

Departures: none (tooling).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike):
    """Yield a temporary folder beside ``path``; on success it replaces ``path``, keeping files of the old folder
    that were not rewritten (e.g. a tokenizer next to re-saved weights); on error nothing changes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            for f in path.iterdir():
                if not (tmp / f.name).exists():
                    (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp / f.name)
        tmp.chmod(0o755)                                  # mkdtemp makes it private; these folders are shared
        for f in tmp.iterdir():
            if f.is_file():
                f.chmod(0o644)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
