"""What TLT adds to a GRPO run: :class:`TLTConfig` (speculative rollout and the online drafter), beside TRL's
:class:`tltlib.rl.grpo.GRPOConfig`.

Departures: none (settings).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInput
from ..rollout.adaptive import DEFAULT_ARMS, AdaptiveConfig
from ..rollout.alarms import AlarmConfig
from ..rollout.config import fitting_strategy
from .drift import DriftGate


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
    prior: str = ""
    """A tuner prior file (``python -m tltlib check --prior FILE``) of this model, drafter and machine: the tuner
    starts from its cost model and measured acceptance instead of measuring, and ``threshold: 0`` takes its
    recommended threshold; a file measured for another model, drafter or machine is refused ("" = measure here)."""
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
    drafter_train: str = "always"
    """When the online drafter trains after a rollout: ``"always"`` (every RL step), or ``"on_drift"``: while it is
    still learning the policy (until the accept length of the step's learned-drafter SD steps plateaus), then again
    once that accept length has fallen by ``drift_margin`` from its best (:mod:`tltlib.rl.drift`); the spot
    trainer's idle windows train whenever there are some."""
    drift_margin: float = 0.1
    """``on_drift``: the relative fall of the accept length (from its best) that makes a resting drafter train."""
    alarms: bool = True
    """Warn (:class:`~tltlib.rollout.alarms.AlarmWarning`, and ``alarm/*`` metrics) when SD or the online drafter
    fails silently: accept length under a floor, SD slower than plain, drafter stale or not the trained one
    (:mod:`tltlib.rollout.alarms`)."""
    accept_floor: float = 0.0
    """The accept length (tokens per row per SD step, bonus included) under which the learned drafter's SD steps
    raise the ``accept_floor`` alarm; 0: from the drafter's card (a share of what it accepted when trained), none
    without a card."""
    alarm_patience: int = 5
    """SD steps the accept-length and speed alarms judge over (they fire at the earliest this many SD steps after
    the fault)."""

    def __post_init__(self):
        if self.speculative not in ("adaptive", "off"):        # raise with the syntax or the room, before loading
            fitting_strategy(self.speculative, "tlt.speculative")
        for i, arm in enumerate(self.arms):
            fitting_strategy(arm, f"tlt.arms[{i}]")
        if self.drafter_steps < 0:
            raise BadInput(f"drafter_steps is the drafter-training budget per RL step and must be >= 0, got "
                           f"{self.drafter_steps}")
        AdaptiveConfig(on_drafter_change=self.on_drafter_change)     # raises naming the allowed values
        if not 0 < self.buffer_decay <= 1 or self.buffer_tokens < 2:
            raise BadInput(f"buffer_decay must be in (0, 1] and buffer_tokens >= 2 pairs, got {self.buffer_decay}, "
                           f"{self.buffer_tokens}")
        if self.threshold < 0 or self.drafter_batch < 1 or not self.drafter_lr > 0:
            raise BadInput("threshold must be >= 0, drafter_batch >= 1 and drafter_lr > 0")
        DriftGate(self.drafter_train, self.drift_margin)          # raises naming the allowed values
        AlarmConfig(accept_floor=self.accept_floor or None, patience=self.alarm_patience)     # the same
        if self.prior and (self.speculative == "off" or (self.speculative != "adaptive" and not self.alarms)):
            raise BadInput(f"tlt.prior {self.prior!r} would not be read: the adaptive tuner starts from its costs "
                           "and the alarms take its accept floor, but this run has "
                           + ("SD off" if self.speculative == "off" else f"the fixed strategy {self.speculative} "
                              "and alarms off") + ": drop tlt.prior, or use speculative: adaptive")
        if self.drafter_train == "on_drift" and not self.online_drafter:
            raise BadInput("drafter_train: on_drift decides when the online drafter trains, but online_drafter is "
                           "false (the drafter stays as loaded): drop drafter_train, or set online_drafter: true")

    def check_drafter(self, has_drafter: bool, where: str) -> None:
        """Refuse the settings that act only on a learned drafter when the run has none (they would be ignored
        without a word); ``where`` names the run ("params.yaml", "tlt_rollout_func")."""
        if has_drafter:
            return
        for name, set_ in (("drafter_train: on_drift", self.drafter_train == "on_drift"),
                           (f"accept_floor: {self.accept_floor}", self.accept_floor > 0)):
            if set_:
                raise BadInput(f"{where}: tlt.{name} acts on the learned drafter's training or its SD steps, but "
                               "this run has no drafter: give a drafter, or drop the setting")
