"""The GPU machine's Python, as far as imports go: the packages its image lacks (gguf, papermill and the notebook
stack, trl, datasets) are not found in this venv's site-packages, only in folders a call installs carried wheels
into (``importlib.util.find_spec`` says None, an import raises ModuleNotFoundError, as there).
tests/test_campaign.py puts this folder first on PYTHONPATH for the rehearsal of the device calls, so a step that
would need one of them there fails here too."""
import importlib.machinery
import sys

ABSENT = {"gguf", "papermill", "nbformat", "nbclient", "ipykernel", "jupyter_client", "trl", "datasets"}


class _DeviceImagePathFinder(importlib.machinery.PathFinder):
    """The path finder, blind to site-packages for the top-level packages in :data:`ABSENT`."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None and name in ABSENT:
            path = [p for p in sys.path if "site-packages" not in p]
        return super().find_spec(name, path, target)


sys.meta_path[:] = [_DeviceImagePathFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
