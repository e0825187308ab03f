"""The adaptive rollout engine: GRPO groups sampled with a shrinking batch, plain decoding while many rows run and
speculative decoding in the tail (the switch and the tuner of ``adaptive``, the bandit), admission by memory, the
buffers an engine keeps between rollouts."""
from .adaptive import AdaptiveConfig, AdaptiveController, default_threshold, timed_rollout
from .bandit import TunerConfig
from .config import RolloutConfig
from .engine import RolloutEngine
from .prior import load_prior, save_prior
from .result import RolloutResult

__all__ = ["AdaptiveConfig", "AdaptiveController", "RolloutConfig", "RolloutEngine", "RolloutResult", "TunerConfig",
           "default_threshold", "load_prior", "save_prior", "timed_rollout"]
