"""tltlib: TLT ("Taming the Long-Tail", ASPLOS 2026) for RL training of reasoning LLMs, small and honest.

Importing the package changes no global state and imports nothing heavy: ``python -m tltlib setup`` must run on a
bare Python before torch is installed. Import the modules you need (``from tltlib.rollout import RolloutEngine``) or
use the lazy attributes below.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "ModelConfig": "model", "Transformer": "model",
    "load": "loading", "load_model": "checkpoint", "save_model": "checkpoint",
    "PairBuffer": "pairs",
    "KVCache": "kvcache",
    "SamplingConfig": "sampling",
    "RolloutConfig": "rollout", "RolloutEngine": "rollout", "RolloutResult": "rollout",
    "ChainTaskConfig": "tasks", "Problem": "problem", "load_problems": "tasks", "generate_problems": "tasks",
    "GRPOConfig": "grpo", "GRPOTrainer": "trainer", "TLTConfig": "trainer",
    "load_tokenizer": "tokenizer",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tltlib' has no attribute {name!r}")


__all__ = sorted(_LAZY)
