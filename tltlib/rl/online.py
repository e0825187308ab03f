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
from ..fileio import resolve
from ..model.weights import fingerprint
from ..rollout.adaptive import AdaptiveConfig, AdaptiveController, TunerConfig, default_threshold
from ..rollout.alarms import AlarmConfig, Alarms, WatchedSource, card_acceptance, card_floor
from ..rollout.prior import load_prior
from ..sim.measure import measure_costs
from ..spec.strategy import SpecStrategy
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
    the cost model measured here for up to ``max_rows`` rows. With ``tlt.prior`` (a tuner prior file of this model,
    drafter and machine: ``python -m tltlib check --prior``) the cost model and the measured acceptance are read from
    it instead, and its recommended threshold is used when ``tlt.threshold`` is 0."""
    if tlt.speculative != "adaptive":
        return None
    prior = load_prior(resolve(tlt.prior), model, drafter) if tlt.prior else None
    threshold = tlt.threshold or (prior.threshold if prior is not None else 0) or default_threshold(model.device)
    arms = tuple(a for a in tlt.arms if drafter is not None or not SpecStrategy.parse(str(a)).uses_drafter)
    if not arms:
        raise BadInput("speculative='adaptive' without a drafter needs model-free arms (ngram-D, suffix-D-N)")
    costs = prior.costs if prior is not None else measure_costs(model, drafter, max_batch=max(1, min(threshold,
                                                                                                  max_rows)))
    controller = AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(arms=arms, seed=seed),
                                                   on_drafter_change=tlt.on_drafter_change), costs, drafter)
    for family, state in (prior.accept if prior is not None else {}).items():
        controller.accept[family].load_state_dict(state)
    return controller


def strategy(tlt: TLTConfig, controller, alarms: Alarms | None = None):
    """What a rollout is given: the controller, a fixed strategy name, or None (plain decoding); with ``alarms``,
    the first two wrapped so that every decode iteration feeds them (:class:`~tltlib.rollout.alarms.WatchedSource`;
    keep it across rollouts: it remembers plain decoding's recent speed)."""
    source = controller if controller is not None else None if tlt.speculative == "off" else tlt.speculative
    return WatchedSource(source, alarms) if alarms is not None and source is not None else source


def alarms_for(tlt: TLTConfig, model, drafter) -> Alarms | None:
    """The run's alarms (None with ``tlt.alarms`` off or SD off): the accept floor from ``tlt.accept_floor``, else
    the one ``tlt.prior`` recommends (the check measured it at the run's settings; the file is checked against this
    model, drafter and machine, whatever the strategy), else from the card of the folder the drafter was loaded
    from (none without one)."""
    if not tlt.alarms or tlt.speculative == "off":
        return None
    config = AlarmConfig(accept_floor=tlt.accept_floor or None, patience=tlt.alarm_patience)
    prior = load_prior(resolve(tlt.prior), model, drafter) if tlt.prior else None
    if prior is not None and prior.accept_floor is not None and not tlt.accept_floor:
        return Alarms(config, prior.accept_floor, f"the check's prior file {tlt.prior}")
    card = card_acceptance(getattr(drafter, "source", None))
    where = "the drafter's card: " + ", ".join(f"{k} {v:.2f}" for k, v in card.items())
    return Alarms(config, card_floor(card, config.floor_share), where)


def watch_drafter(alarms: Alarms | None, held, drafter, version, policy_moved: bool, due: bool, world=None) -> None:
    """After a step's drafter training (or a weight sync): the ``drafter_stale`` and ``drafter_mismatch`` alarms.
    ``held``: the drafters the rollout's engines draft with; ``drafter``: the one trained, whose version was
    ``version`` before; ``due``: it was due to train. Fingerprints are taken when its version moved (several
    workers: at every step, gathered, as every worker must then hold the same merged drafter)."""
    if alarms is None or drafter is None:
        return
    moved = drafter.version != version
    alarms.after_update(policy_moved, moved, due, drafter.version)
    workers = world.gather_objects(fingerprint(drafter)) if world is not None and world.distributed else None
    if moved or workers:
        for h in held:
            alarms.check_drafter(h, drafter, workers)


def version_before(spot: SpotTrainer, window: SpotWindow | None, drafter) -> int | None:
    """The drafter's version before this step's training: with the spot trainer, before the idle window's sync (which
    already moved it when any worker trained there), else its version now (:func:`train_drafter` is to come)."""
    if spot.active and window is not None and window.version is not None:
        return window.version
    return getattr(drafter, "version", None)


def train_drafter(spot: SpotTrainer, tlt: TLTConfig, window: SpotWindow | None = None, clock=None,
                  train: bool = True) -> dict:
    """The online drafter's training after a rollout: none when the spot trainer trained it in the idle window (its
    ``drafter/*`` statistics are returned); else ``tlt.drafter_steps`` micro-steps on the buffer (none when
    ``train`` is False: ``drafter_train: on_drift`` found no drift), merged over the workers; the drafter's version
    moves by one when it trained. ``drafter/micro_steps``: the micro-steps this worker ran in the step."""
    trainer, buffer, world = spot.drafter_trainer, spot.buffer, spot.world
    if spot.active:
        stats = window.stats if window is not None else {}
        return {**stats, "drafter/micro_steps": float(window.steps)} if window is not None and trainer else stats
    t = time.time()
    drafter = trainer.drafter if trainer is not None else None
    version = getattr(drafter, "version", 0)
    steps = tlt.drafter_steps if trainer is not None and train and buffer.sequences() else 0
    stats: dict = {}
    for _ in range(steps):
        stats = trainer.micro_step(buffer.sample(tlt.drafter_batch))
    if world.size > 1 and trainer is not None:
        spot.sync(steps, version)
    elif stats:
        drafter.version = version + 1          # one new drafter for the next rollout (drafter/version)
    if clock is not None:
        clock.span("drafter", t)
    return {**stats, "drafter/micro_steps": float(steps)} if trainer is not None else stats
