"""TLT's parts of an RL step that do not depend on whose trainer runs it: the adaptive controller a rollout decodes
with, the online drafter's buffer and trainer, and the drafter's training after a rollout (one process) or in the
idle window (several, :class:`tltlib.rl.scheduler.SpotTrainer`). :class:`tltlib.rl.trainer.GRPOTrainer` and the TRL
rollout (:mod:`tltlib.integrations.trl_rollout`) both build theirs here, so the two run the same TLT.

Paper: TLT §4 (adaptive drafter trained on the rollout's hidden states), §5 (adaptive rollout engine).
Departures: see :mod:`tltlib.rl.trainer` (in one process the drafter trains after the rollout, on the critical path).
"""
from __future__ import annotations

import time

from ..drafting.pairs import PairBuffer, PairBufferConfig
from ..drafting.train import DrafterTrainConfig, DrafterTrainer
from ..errors import BadInput
from ..rollout.adaptive import AdaptiveConfig, AdaptiveController, TunerConfig, default_threshold
from ..sim.measure import measure_costs
from .config import TLTConfig
from .scheduler import SchedulerConfig, SpotTrainer, SpotWindow


def drafter_training(model, drafter, tlt: TLTConfig, sched: SchedulerConfig, world_size: int, seed: int):
    """(pair buffer, drafter trainer) when the online drafter gets a training budget (``tlt.drafter_steps`` after a
    rollout, or the spot trainer with several workers), else (None, None)."""
    budget = tlt.drafter_steps > 0 or (sched.spot_trainer and world_size > 1)
    if drafter is None or not tlt.online_drafter or not budget:
        return None, None
    w = model.embed.weight
    buffer = PairBuffer(model.config.hidden_size, PairBufferConfig(
        max_tokens=tlt.buffer_tokens, decay=tlt.buffer_decay, seed=seed), w.dtype, w.device)
    trainer = DrafterTrainer(drafter, DrafterTrainConfig(
        lr=tlt.drafter_lr, batch_sequences=tlt.drafter_batch, warmup_steps=10, schedule="constant", seed=seed))
    return buffer, trainer


def adaptive_controller(model, drafter, tlt: TLTConfig, max_rows: int, seed: int) -> AdaptiveController | None:
    """The adaptive controller of ``tlt.speculative == "adaptive"`` (None otherwise): SD at or below ``tlt.threshold``
    running rows (0: the device's default), the tuner over ``tlt.arms`` (the drafter arms dropped without a drafter),
    the cost model measured here for up to ``max_rows`` rows."""
    if tlt.speculative != "adaptive":
        return None
    threshold = tlt.threshold or default_threshold(model.device)
    arms = tuple(a for a in tlt.arms if drafter is not None or str(a).startswith(("ngram", "off")))
    if not arms:
        raise BadInput("speculative='adaptive' without a drafter needs n-gram arms (e.g. ngram-4)")
    costs = measure_costs(model, drafter, max_batch=max(1, min(threshold, max_rows)))
    return AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(arms=arms, seed=seed),
                                             on_drafter_change=tlt.on_drafter_change), costs, drafter)


def strategy(tlt: TLTConfig, controller):
    """What a rollout is given: the controller, a fixed strategy name, or None (plain decoding)."""
    if controller is not None:
        return controller
    return None if tlt.speculative == "off" else tlt.speculative


def train_drafter(spot: SpotTrainer, tlt: TLTConfig, window: SpotWindow | None = None, clock=None) -> dict:
    """The online drafter's training after a rollout: none when the spot trainer trained it in the idle window (its
    ``drafter/*`` statistics are returned); else ``tlt.drafter_steps`` micro-steps on the buffer, merged over the
    workers; the drafter's version moves by one when it trained."""
    if spot.active:
        return window.stats if window is not None else {}
    trainer, buffer, world = spot.drafter_trainer, spot.buffer, spot.world
    t = time.time()
    drafter = trainer.drafter if trainer is not None else None
    version = getattr(drafter, "version", 0)
    stats: dict = {}
    if trainer is not None and buffer.sequences():
        for _ in range(tlt.drafter_steps):
            stats = trainer.micro_step(buffer.sample(tlt.drafter_batch))
    if world.size > 1 and trainer is not None:
        spot.sync(tlt.drafter_steps if buffer.sequences() else 0, version)
    elif stats:
        drafter.version = version + 1          # one new drafter for the next rollout (drafter/version)
    if clock is not None:
        clock.span("drafter", t)
    return stats
