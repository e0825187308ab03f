"""What a notebook, a bench or a job loads: the policy, its tokenizer and (optionally) its drafter, from local folders.

Paths are resolved against the project root when they do not exist as given (``data/tiny-reasoner`` works from
``notebooks/``); every check of the files is the strict loaders' (:func:`tltlib.model.weights.load_model`,
:func:`tltlib.model.drafter.load_drafter`).

Departures: none (tooling).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..fileio import resolve
from ..tasks.tokenizer import load_tokenizer
from .decoder import Transformer
from .drafter import load_drafter
from .weights import load_model, parse_dtype, pick_device


class Loaded(NamedTuple):
    """What :func:`load` returns: ``model, tokenizer, drafter = load(...)``."""

    model: Transformer
    tokenizer: object
    drafter: object


def load(model_path: str | os.PathLike, drafter_path: str | os.PathLike | None = None, device: str = "auto",
         dtype: str | torch.dtype = "float32") -> Loaded:
    """The policy, its tokenizer and (optionally) its drafter, as notebooks, benches and the CLI load them.

    Paths are resolved against the project root when they do not exist as given (``data/tiny-reasoner`` works
    from ``notebooks/``); ``device`` is ``auto``/``cpu``/``cuda[:N]``; the drafter is attached to the model."""
    dev, dt = pick_device(device), parse_dtype(dtype)
    path = resolve(model_path)
    model = load_model(path, dtype=dt, device=dev)
    drafter = load_drafter(resolve(drafter_path), model) if drafter_path else None
    return Loaded(model, load_tokenizer(path), drafter)
