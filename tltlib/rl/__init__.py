"""RL with TLT: GRPO (TRL's names), the trainer whose step is rollout, reward, update and the online drafter, where a
step runs (one process or W torchrun workers), the spot trainer on idle workers, the curriculum, the memory check,
checkpoints."""
from .checkpoint import load_weights
from .config import TLTConfig
from .curriculum import CurriculumConfig
from .grpo import GRPOConfig, accuracy_reward, format_reward, reward_funcs_named
from .memory import MeasuredLengths
from .scheduler import SchedulerConfig
from .trainer import GRPOTrainer
from .world import DistributedWorld, World

__all__ = ["CurriculumConfig", "DistributedWorld", "GRPOConfig", "GRPOTrainer", "MeasuredLengths", "SchedulerConfig",
           "TLTConfig", "World", "accuracy_reward", "format_reward", "load_weights", "reward_funcs_named"]
