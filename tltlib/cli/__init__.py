"""``python -m tltlib ...``: the command line."""
from .app import build_parser, main

__all__ = ["build_parser", "main"]
