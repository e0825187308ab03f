"""The project's own error types: an error tltlib (or a bench script) raises on purpose, whose message names the
cause and the fix. The CLI prints these as one line; any other exception is a bug and keeps its traceback.

Each type is also the builtin type it replaces (``BadInput`` is a ``ValueError``, ``NotFound`` a
``FileNotFoundError``, ...), so ``except ValueError`` and ``pytest.raises(ValueError)`` keep working.

Paper: none. Departures: none (tooling).
"""
from __future__ import annotations


class TLTError(Exception):
    """An error raised on purpose: bad input, a missing file, a refused setting; the message says how to fix it."""


class BadInput(TLTError, ValueError):
    """A value, key, flag or file content that cannot be used (the message names it and the fix)."""


class NotFound(TLTError, FileNotFoundError):
    """A file or folder the input names that does not exist or is not what it should hold."""


class AlreadyThere(TLTError, FileExistsError):
    """A path that would be overwritten although it holds something else."""


class NotAFolder(TLTError, NotADirectoryError):
    """A path that must be a folder but is a file."""


class NoPermission(TLTError, PermissionError):
    """A path this process may not write."""


class Refused(TLTError, RuntimeError):
    """An operation refused in the current state (a failed set-up, an engine used after its model changed, ...)."""


class WrongType(TLTError, TypeError):
    """An argument of the wrong kind (the message says what it takes)."""


class MissingDependency(TLTError, ImportError):
    """An optional package that is missing or outside the tested range."""


class TimedOut(TLTError, TimeoutError):
    """Workers that did not arrive in time."""


class NoRoom(TLTError, MemoryError):
    """A run that cannot fit in the device's memory (the message names what shrinks it)."""


class NotFinite(TLTError, FloatingPointError):
    """A loss or weight that became NaN or infinite."""


def kind(exc: BaseException) -> str:
    """The builtin kind of ``exc`` (``TypeError`` for a :class:`WrongType`): what a message that quotes another
    error names, so that the project's own types read as the builtins users know."""
    return next(c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins")
