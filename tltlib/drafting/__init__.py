"""The drafter's training: the buffer of (hidden, token) pairs the rollout streams, the EAGLE loss and the
preemptible trainer, the offline warm-up of a new drafter and its data (the target's own sampled responses)."""
from .pairs import PairBuffer, PairBufferConfig
from .responses import sample_responses
from .train import DrafterTrainConfig, DrafterTrainer, train_offline
from .warmup import measure_acceptance, rollout_dataset, train_warm_drafter

__all__ = ["DrafterTrainConfig", "DrafterTrainer", "PairBuffer", "PairBufferConfig", "measure_acceptance",
           "rollout_dataset", "sample_responses", "train_offline", "train_warm_drafter"]
