"""tltlib: TLT ("Taming the Long-Tail", ASPLOS 2026) for RL training of reasoning LLMs, small and honest.

Importing the package changes no global state and imports nothing heavy: ``python -m tltlib setup`` must run on a
bare Python before torch is installed. Import the modules you need (``from tltlib.rollout.engine import RolloutEngine``)
or use the lazy attributes below.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "ModelConfig": "model.decoder", "Transformer": "model.decoder",
    "load": "model.loading", "load_model": "model.weights", "save_model": "model.weights",
    "PairBuffer": "drafting.pairs",
    "KVCache": "kv.dense",
    "SamplingConfig": "model.sampling",
    "RolloutConfig": "rollout.engine", "RolloutEngine": "rollout.engine", "RolloutResult": "rollout.engine",
    "ChainTaskConfig": "tasks.datasets", "Problem": "tasks.problem", "load_problems": "tasks.datasets",
    "generate_problems": "tasks.datasets",
    "GRPOConfig": "rl.grpo", "GRPOTrainer": "rl.trainer", "TLTConfig": "rl.trainer",
    "load_tokenizer": "tasks.tokenizer",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tltlib' has no attribute {name!r}")


__all__ = sorted(_LAZY)
