"""Atomic file and folder writes, JSON reads that name the file, and where relative paths resolve: a reader never
sees a half-written model, drafter, dataset, run folder or metrics file, and a broken file is reported by its path.

Every writer of a folder goes through :func:`atomic_folder`: the content is written into a hidden temporary folder
beside the destination (``.NAME.PID.tmp-XXXX``) and renamed over it only when complete. What a killed writer left
(SIGKILL, power loss) is handled by the next writer of the same destination from what is on disk, never from whether
a PID lives (a restarted container reuses PIDs): a complete copy of a replacement killed between its renames is put
back, and a temporary folder is removed once no process holds its writer's lock (``flock``, released by the kernel
when the writer ends).

Departures: none (tooling).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .errors import AlreadyThere, BadInput, NoPermission, NotAFolder, NotFound

ROOT = Path(__file__).resolve().parent.parent
"""The project root (notebooks, params, data, runs live under it)."""


def cache_root() -> Path:
    """tltlib's cache outside the repo (built extensions, kernel tables, imported models, compiled code):
    ``$TLTLIB_CACHE``, default ``~/.cache/tltlib``."""
    return Path(os.environ.get("TLTLIB_CACHE") or Path.home() / ".cache" / "tltlib")


def resolve(path: str | os.PathLike) -> Path:
    """A path as given if it exists (or is absolute), else relative to the project root (so notebooks work from
    ``notebooks/`` in JupyterLab and from the root under papermill)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    return ROOT / p


def output_path(path: str | os.PathLike) -> Path:
    """Where an output goes: an absolute path as given, a relative one under the project root, whatever the working
    directory (a notebook's kernel runs in ``notebooks/``: its ``runs/...`` is the project's, not
    ``notebooks/runs``)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else ROOT / p


def read_json(path: str | os.PathLike, fix: str = "fix or replace the file"):
    """Parse a JSON file; a syntax error names the file, the line and column, and ``fix``."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BadInput(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); {fix}") from None
    except UnicodeDecodeError:
        raise BadInput(f"{path} is not a UTF-8 text file; {fix}") from None


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary path beside ``path`` to write; on success it is renamed over ``path``, on error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked(folder: Path, wait: bool = True):
    """Hold an exclusive lock (``flock``) on ``folder``; yields whether it is held. The kernel releases it when the
    holder ends, whatever PID a later process gets. Without ``wait``, yields False when another holds it; on a
    filesystem without locks, yields None (and holds nothing)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            held = False
        except OSError:                                   # no locks here (some network filesystems)
            held = None
        yield held
    finally:
        os.close(fd)


def _ours(d: Path, name: str) -> bool:
    """``d`` is a ``.NAME.PID.*tmp-*`` folder written for the destination ``name`` (not for ``NAME.x``)."""
    pid = d.name[len(name) + 2:].split(".", 1)[0]
    return d.is_dir() and pid.isdigit()


def _writer_file(tmp: Path) -> Path:
    """The lock file of the writer of the temporary folder ``tmp`` (beside it: a lock on the folder itself would
    block a write nested inside it, such as a notebook's figures inside the runner's output folder)."""
    return tmp.with_name(tmp.name + ".writer")


def _writer_gone(d: Path, name: str) -> bool:
    """No process is writing the temporary folder ``d``: its writer holds a lock on ``d``'s writer file until it
    ends (a PID says nothing: a restarted container reuses them, PID 1 first); a folder without one was left by a
    writer that is gone. Without locks on this filesystem: its PID is gone."""
    f = _writer_file(d)
    if not f.is_file():
        return True
    with _locked(f, wait=False) as held:
        if held is None:
            return not _pid_alive(int(d.name[len(name) + 2:].split(".", 1)[0]))
        return held


def _complete_copies(path: Path, kind: str) -> list[Path]:
    """The complete copies (``kind``: ``new`` or ``old``) a replacement of ``path`` left beside it."""
    return [d for d in sorted(path.parent.glob(f".{path.name}.*.tmp-{kind}")) if _ours(d, path.name)]


def _recover(path: Path) -> Path | None:
    """:func:`recover_interrupted` under the lock of ``path``'s folder."""
    if path.exists():
        return None
    for kind in ("new", "old"):
        for d in _complete_copies(path, kind):
            d.rename(path)
            return path
    return None


def recover_interrupted(path: str | os.PathLike) -> Path | None:
    """Put back a folder whose replacement was killed between its renames: ``path`` is gone but a complete copy
    lies beside it, the new one (``.NAME.PID.*.tmp-new``) or else the old one (``.tmp-old``). What is on disk
    decides, not whether the PID lives: a replacement renames under a lock of the folder, so a copy seen here is
    never one a live writer is moving. Returns the path restored, or None when there was nothing to restore."""
    path = Path(path)
    if path.exists() or not path.parent.is_dir():
        return None
    with _locked(path.parent):
        return _recover(path)


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Put back a complete copy when ``path`` itself is gone (:func:`recover_interrupted`), then remove what other
    writers of ``path`` left beside it: complete copies that were not needed, and ``.NAME.PID.tmp-*`` folders no
    live process is writing (the writer holds a lock on its folder); returns what was removed."""
    path = Path(path)
    removed = []
    if not path.parent.is_dir():
        return removed
    with _locked(path.parent):
        _recover(path)
        for d in path.parent.glob(f".{path.name}.*.tmp-*"):
            if d.name.endswith(".writer") and not d.with_name(d.name[: -len(".writer")]).exists():
                d.unlink(missing_ok=True)                 # a writer's file whose folder was moved or removed
                continue
            if not _ours(d, path.name):
                continue
            copy = d.name.endswith((".tmp-new", ".tmp-old"))
            if (copy and path.exists()) or (not copy and _writer_gone(d, path.name)):
                shutil.rmtree(d, ignore_errors=True)
                _writer_file(d).unlink(missing_ok=True)
                removed.append(d)
    return removed


def _replace_folder(src: Path, dest: Path) -> None:
    """Move the complete folder ``src`` (``.NAME.PID.tmp-XXXX``) to ``dest``, replacing what is there, under the lock
    of their folder. Each move is a rename, and at every moment one complete copy exists under a name
    :func:`recover_interrupted` knows: ``src`` is first renamed ``.NAME.PID.XXXX.tmp-new`` (complete), the old
    ``dest`` ``.NAME.PID.XXXX.tmp-old``, then the new one takes ``dest``. The names are this write's own, so a
    copy left by an earlier writer with the same PID never blocks the rename."""
    token = src.name.rsplit(".tmp-", 1)[-1]
    done = dest.with_name(f".{dest.name}.{os.getpid()}.{token}.tmp-new")
    with _locked(dest.parent):
        src.rename(done)
        if dest.exists():
            old = dest.with_name(f".{dest.name}.{os.getpid()}.{token}.tmp-old")
            dest.rename(old)
            done.rename(dest)
            shutil.rmtree(old)
        else:
            done.rename(dest)


def check_writable(path: str | os.PathLike, what: str = "output") -> Path:
    """Fail now, not after the work, when ``path``'s folder cannot be created or written (a probe file is made)."""
    path = Path(path)
    parent = path.parent
    blocker = next((a for a in (path, *path.parents) if a.exists() and not a.is_dir()), None)
    if blocker is not None and blocker != path:
        raise NotAFolder(f"cannot write the {what} {str(path)!r}: {str(blocker)!r} is a file, not a folder; "
                         "choose another path")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise NoPermission(f"cannot write the {what} {str(path)!r}: {e.strerror or e} in {str(parent)!r}; "
                           "choose a folder you can write to") from None
    if path.exists() and not path.is_dir():
        raise AlreadyThere(f"the {what} {str(path)!r} exists and is a file, not a folder; choose another path")
    return path


def check_file_writable(path: str | os.PathLike, what: str = "output file") -> Path:
    """Fail now, not after the work, when the file ``path`` could not be written there later (atomically: a
    temporary file beside it, renamed over it): ``path`` is a folder, a folder on its way is a file, or the folder
    cannot be written (a probe file is made and removed). An existing file is fine: it will be replaced."""
    path = Path(path)
    if path.is_dir():
        raise NotAFolder(f"the {what} {str(path)!r} is a folder; name a file (e.g. {str(path / 'out.json')!r})")
    blocker = next((a for a in path.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise NotAFolder(f"cannot write the {what} {str(path)!r}: {str(blocker)!r} is a file, not a folder; "
                         "choose another path")
    if not path.parent.is_dir():
        raise NotFound(f"cannot write the {what} {str(path)!r}: its folder {str(path.parent)!r} does not exist; "
                       "create it or choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.probe-", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise NoPermission(f"cannot write the {what} {str(path)!r}: {e.strerror or e} in {str(path.parent)!r}; "
                           "choose a folder you can write to") from None
    return path


def check_output_folder(path: str | os.PathLike, overwrite: bool, is_ours: Callable[[Path], bool],
                        what: str, hint: str = "") -> Path:
    """Before any work: ``path`` can be written, and replacing it loses nothing that was not asked for.

    A non-empty existing folder is replaced only with ``overwrite`` and only if ``is_ours(path)`` says it holds a
    ``what`` (never, say, a model folder passed by mistake). Errors say what to pass instead (``hint``: how this
    command replaces or continues one; default ``--overwrite``)."""
    path = Path(path)
    check_writable(path, what)
    if path.is_dir() and any(path.iterdir()):
        if not is_ours(path):
            raise AlreadyThere(f"{str(path)!r} exists and does not hold a {what}; refusing to replace it: choose a "
                               "new or empty folder")
        if not overwrite:
            hint = hint or "pass --overwrite (overwrite=True) to replace it"
            raise AlreadyThere(f"{str(path)!r} already holds a {what}; {hint}, or choose another folder")
    return path


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, keep_existing: bool | Callable[[Path], bool] = False,
                  failed_to: str | os.PathLike | None = None):
    """Yield a temporary folder beside ``path``; on success it replaces ``path`` as a whole.

    Args:
        path: the destination folder.
        keep_existing: carry files of the old folder that were not rewritten into the new one: ``True`` for all,
            or a predicate on the old file's path (e.g. keep a tokenizer beside re-saved weights). Default: the new
            folder holds only what was written, so no file of an older run sits beside the new ones.
        failed_to: on error, move the partial folder here (replacing an older one) instead of deleting it, so it
            can be inspected; ``path`` is left untouched either way.
    """
    path = Path(path).resolve()
    if path.exists() and not path.is_dir():
        raise AlreadyThere(f"{str(path)!r} is a file; a folder is written there: choose another path")
    if Path.cwd().resolve().is_relative_to(path):
        raise BadInput(f"refusing to replace {str(path)!r}: it holds the working directory; write to a folder of "
                       "its own")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp, lock = _start_temporary(path)
    try:
        yield tmp
        if keep_existing and path.is_dir():
            for f in path.iterdir():
                if not (tmp / f.name).exists() and (keep_existing is True or keep_existing(f)):
                    (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp / f.name)
        tmp.chmod(0o755)                                  # mkdtemp makes it private; these folders are shared
        for f in tmp.rglob("*"):
            if f.is_file():
                f.chmod(0o644)
        _replace_folder(tmp, path)
    except BaseException:
        if failed_to is not None and tmp.is_dir():
            tmp.chmod(0o755)
            _replace_folder(tmp, Path(failed_to))
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
        _writer_file(tmp).unlink(missing_ok=True)


def _start_temporary(path: Path) -> tuple[Path, int]:
    """A new temporary folder beside ``path`` (``.NAME.PID.tmp-XXXX``), its writer file locked by this writer before
    another writer can see it (:func:`_writer_gone`); returns it and the descriptor holding the lock (closing it
    releases it)."""
    with _locked(path.parent):
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.tmp-", dir=path.parent))
        fd = os.open(_writer_file(tmp), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass                                          # no locks on this filesystem: the PID in its name tells
    return tmp, fd
