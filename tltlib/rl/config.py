"""What TLT adds to a GRPO run: :class:`TLTConfig` (speculative rollout and the online drafter), beside TRL's
:class:`tltlib.rl.grpo.GRPOConfig`.

Departures: none (settings).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInput
from ..rollout.adaptive import DEFAULT_ARMS, AdaptiveConfig
from ..spec.strategy import SpecStrategy


@dataclass(frozen=True)
class TLTConfig:
    """What TLT adds to the RL step: speculative rollout and the online drafter."""

    speculative: str = "adaptive"
    """``"adaptive"`` (SD switch + BEG-MAB), ``"off"`` (plain decoding: the baseline), or one strategy name used at
    every decode iteration (``"chain-8"``)."""
    threshold: int = 0
    """SD runs at or below this many running rows (0 = the measured default for the device)."""
    arms: tuple = ("off", *DEFAULT_ARMS)
    """The adaptive tuner's strategies; ``off`` lets it keep plain decoding where no SD strategy pays (a drafter
    that RL has left behind, or a compute-bound batch)."""
    on_drafter_change: str = "discount"
    """What the adaptive tuner does when the online drafter has trained: ``"discount"`` keeps part of the weight of
    the drafter arms' evidence, ``"reset"`` re-explores them, ``"keep"`` keeps it whole (see
    :class:`~tltlib.rollout.adaptive.AdaptiveConfig`)."""
    online_drafter: bool = True
    """Train the drafter on every rollout's pairs (False: the drafter stays as loaded, "frozen")."""
    drafter_steps: int = 6
    """Drafter micro-steps after each rollout (the one-process training budget)."""
    drafter_lr: float = 3e-4
    """Drafter AdamW learning rate (constant after 10 warm-up steps)."""
    drafter_batch: int = 4
    """Sequences per drafter micro-step (of similar length; see PairBuffer.sample)."""
    buffer_tokens: int = 1 << 20
    """Pairs the drafter's buffer holds."""
    buffer_decay: float = 0.5
    """Sampling weight of pairs from a step ``a`` RL steps ago: ``decay ** a``."""

    def __post_init__(self):
        if self.speculative not in ("adaptive", "off"):
            SpecStrategy.parse(self.speculative)     # raises with the syntax
        if self.drafter_steps < 0:
            raise BadInput(f"drafter_steps is the drafter-training budget per RL step and must be >= 0, got "
                           f"{self.drafter_steps}")
        AdaptiveConfig(on_drafter_change=self.on_drafter_change)     # raises naming the allowed values
        if not 0 < self.buffer_decay <= 1 or self.buffer_tokens < 2:
            raise BadInput(f"buffer_decay must be in (0, 1] and buffer_tokens >= 2 pairs, got {self.buffer_decay}, "
                           f"{self.buffer_tokens}")
        if self.threshold < 0 or self.drafter_batch < 1 or not self.drafter_lr > 0:
            raise BadInput("threshold must be >= 0, drafter_batch >= 1 and drafter_lr > 0")
