"""Alarms: one clear warning, and an ``alarm/*`` metric, when speculative decoding or the online drafter fails
silently during a run. SD is lossless, so such a failure leaves every output correct and only makes the rollout
slower: a drafter whose weights never reach the engine after a sync, one trained for another policy, a tuner kept
on SD where plain decoding is faster.

Four alarms, each fired once (a :class:`AlarmWarning` through :func:`warnings.warn` and ``alarm/<name> = 1`` in the
metrics of the RL step it fired in) and re-armed only when its condition has cleared:

* ``accept_floor``: the learned drafter's SD steps (n-gram and suffix steps are not judged) accepted fewer tokens
  than the floor: over the last ``patience`` such SD steps, holding at least ``min_rows`` row-steps, the
  row-weighted mean accept length (bonus token included) is under ``accept_floor`` by ``confidence_z`` standard
  errors (:func:`floor_breached`). A drafter that does not fit its policy accepts about nothing at every row-step,
  which a handful of steps shows; a fitting one that meets a hard stretch (one long response's computed digits, the
  last row of a tail) accepts little there but unevenly, and its window's spread keeps it clear of the alarm. The
  floor is given, or comes from the drafter's card (:func:`card_floor`: ``1 + floor_share x`` (the lowest accept
  length measured when it was trained ``- 1``)).
* ``sd_slower``: SD is on but slower than plain decoding at the current rows: over the last ``patience``
  consecutive SD steps of the arm a tuner exploits (its exploration tries arms it doubts, slower ones among them:
  the price of learning, not a fault; a fixed strategy is always exploited), the geometric mean speedup is under
  ``slower_ratio`` by ``confidence_z`` standard errors of the steps' log-speedups (:func:`slower_than`); a plain step
  between restarts the count (a tuner that switched SD off has done its job).
  A step's speedup is its speed over plain decoding's, each speed measured
  over the cost model's plain rate at its rows and context (the adaptive tuner's reward,
  :func:`tltlib.rollout.adaptive.iteration_speedup`): against the plain steps measured recently at about as many
  rows (power-of-two buckets), else at any rows (another process's load slows them all), else the cost model.
  Without a cost model only against plain steps at about as many rows, in tokens per row per second. A load that
  starts on a shared machine during a run of SD steps looks like slow SD: the alarm says so once.
* Both judge only SD steps with at least ``min_active`` running rows. The last row of a tail is one response, and
  a hard stretch of it (text the policy samples at high entropy) slows SD there whatever the drafter's fit: the
  tiny reasoner's shipped drafter, 4.85 tokens per step on its card, accepted 1.44 over a last row's 16 steps, where
  chain-16 ran at 0.63x plain. The tuner, which averages over many responses, is the judge at one row.
* ``drafter_stale``: the policy changed but the drafter's version did not although the online drafter was due to
  train (a skipped training step or sync): checked once per RL step or weight sync (:meth:`Alarms.after_update`).
* ``drafter_mismatch``: after a drafter sync or merge, the drafter the engine drafts with does not hold the trained
  weights (:func:`tltlib.model.weights.fingerprint` of each; several workers: the merged drafters differ between
  workers) (:meth:`Alarms.check_drafter`).

SD steps reach the alarms through :class:`WatchedSource`, a strategy source that wraps the rollout's own (the
adaptive controller, or a fixed strategy) and feeds every decode iteration to :meth:`Alarms.sd_step`. The alarms cost
a few host operations per decode iteration; fingerprints hash the drafter's weights only after a sync or merge.

Paper: none (operations: the silent failures users of SD in RL report). Departures: none.
"""
from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import BadInput
from ..fileio import read_json
from ..model.weights import fingerprint
from ..spec.strategy import SpecStrategy, StrategySource
from .adaptive import iteration_speedup

NAMES = ("accept_floor", "sd_slower", "drafter_stale", "drafter_mismatch")
CARD_FILE = "train_log.json"
"""The file of a drafter folder whose ``acceptance`` (strategy -> ``spec/*``) the warm-up writes with its card."""


class AlarmWarning(UserWarning):
    """An alarm of :class:`Alarms`: SD or the online drafter is failing silently (outputs stay correct)."""


@dataclass(frozen=True)
class AlarmConfig:
    """Which alarms watch a run, and their thresholds."""

    accept_floor: float | None = None
    """Tokens per row per SD step (bonus included) under which the learned drafter's SD steps raise
    ``accept_floor``; None: from the drafter's card (:func:`card_floor`), or no floor alarm without one."""
    floor_share: float = 0.3
    """The card's floor: ``1 + floor_share x (lowest accept length on the card - 1)``: this share of the tokens the
    drafter added per step when it was trained (a random drafter adds none)."""
    patience: int = 5
    """SD steps the floor and the speed are judged over: an alarm fires at the earliest at this many SD steps after
    the fault."""
    min_rows: int = 16
    """Row-steps the floor's window holds at least (with fewer rows per step it reaches further back): one-row
    steps accept 0 drafts by chance often enough to fool a 5-step window."""
    min_active: int = 2
    """Running rows an SD step needs to be judged by ``accept_floor`` and ``sd_slower`` (fewer: neither counted nor
    breaking a run of steps): a tail's last row is one response, whose hard stretch says nothing of the drafter or of
    SD at these rows. 1: judge every step."""
    confidence_z: float = 3.0
    """Standard errors by which the window's mean accept length must lie under the floor (:func:`floor_breached`),
    and its mean log-speedup under ``log(slower_ratio)`` (:func:`slower_than`). Both are judged at every SD step of a
    run, thousands of times: one-sided 3 sigma (p = 0.0013 per judgement) keeps a good drafter's hard stretches, where
    SD accepts and gains unevenly for a few steps, quiet. 0: the means alone."""
    slower_ratio: float = 0.75
    """Geometric mean speedup over plain decoding under which (by ``confidence_z`` standard errors) ``patience``
    consecutive SD steps raise ``sd_slower`` (below 1 by a margin: one step's timing is noisy)."""
    floor: bool = True
    """Watch the accept length."""
    speed: bool = True
    """Watch SD's speed against plain decoding (needs a cost model: the adaptive controller's)."""
    stale: bool = True
    """Watch that the drafter's version moves when the policy does and the online drafter is due to train."""
    mismatch: bool = True
    """Compare the fingerprints of the trained drafter and the one the engine drafts with after each sync."""

    def __post_init__(self):
        if self.accept_floor is not None and not self.accept_floor >= 1.0:
            raise BadInput(f"accept_floor is tokens per row per SD step, bonus included, so >= 1; got "
                           f"{self.accept_floor} (None: from the drafter's card)")
        if not 0.0 < self.floor_share < 1.0:
            raise BadInput(f"floor_share must be in (0, 1), got {self.floor_share}")
        if not self.confidence_z >= 0.0:
            raise BadInput(f"confidence_z is standard errors (>= 0; 0: the mean alone), got {self.confidence_z}")
        if self.patience < 1 or self.min_rows < 1 or self.min_active < 1:
            raise BadInput(f"patience, min_rows and min_active must be >= 1, got {self.patience}, {self.min_rows}, "
                           f"{self.min_active}")
        if not 0.0 < self.slower_ratio <= 1.0:
            raise BadInput(f"slower_ratio must be in (0, 1] (a speedup over plain decoding), got {self.slower_ratio}")


# ------------------------------------------------------------------------------------------------ the floor
def card_acceptance(folder) -> dict[str, float]:
    """The accept length per strategy recorded when the drafter in ``folder`` was trained (its card's
    ``train_log.json``: ``acceptance[strategy]["spec/accept_len_mean"]``); empty without one."""
    if folder is None or not (Path(folder) / CARD_FILE).is_file():
        return {}
    path = Path(folder) / CARD_FILE
    d = read_json(path, "retrain the drafter (python -m tltlib train-drafter) or set tlt.accept_floor")
    acc = d.get("acceptance") if isinstance(d, dict) else None
    return {k: float(v["spec/accept_len_mean"]) for k, v in (acc or {}).items()
            if isinstance(v, dict) and "spec/accept_len_mean" in v}


def card_floor(accept: dict[str, float], share: float) -> float | None:
    """The floor from a card's accept lengths (:func:`card_acceptance`): ``1 + share x (lowest - 1)``; None when
    the card measured none."""
    return 1.0 + share * (min(accept.values()) - 1.0) if accept else None


def accept_moments(hist) -> tuple[int, float, float]:
    """(row-steps, their tokens, their squared tokens) of an SD step from its histogram of rows by accepted drafts
    (``hist[k]``: rows that accepted k drafts, shape (depth+1,); a row-step's tokens include the bonus token). Summed
    over steps they give the window's mean and spread (:func:`floor_breached`)."""
    h = np.asarray(hist, dtype=np.float64)
    tokens = 1.0 + np.arange(h.size)
    return int(h.sum()), float(h @ tokens), float(h @ (tokens * tokens))


def floor_breached(n: int, total: float, total_sq: float, floor: float, z: float) -> tuple[bool, float, int]:
    """Whether ``n`` row-steps that accepted ``total`` tokens (``total_sq``: the sum of their squares; see
    :func:`accept_moments`) accepted fewer tokens per row-step than ``floor`` by ``z`` standard errors:
    ``mean + z * se < floor``, with ``se = sqrt(max(var, 1/4) / n)`` (the variance at least a quarter token squared:
    a few row-steps that happen to accept alike are no proof of a spread of zero). Returns (breached, mean, n)."""
    if n <= 0:
        return False, 0.0, 0
    mean = total / n
    var = max(total_sq - n * mean * mean, 0.0) / max(n - 1.0, 1.0)
    return mean + z * math.sqrt(max(var, 0.25) / n) < floor, mean, int(n)


def _bucket(active: int) -> int:
    return int(active).bit_length()


def slower_than(log_speedups, ratio: float, z: float, noise: float = 0.1) -> tuple[bool, float]:
    """Whether SD steps whose log-speedups over plain decoding are ``log_speedups`` (shape (n,)) ran slower than
    ``ratio`` x plain by ``z`` standard errors: ``mean + z * sd / sqrt(n) < log(ratio)``, the sample standard
    deviation at least ``noise`` (a step's timing on a shared machine is no better than 10%). Returns (slower,
    geometric mean speedup)."""
    x = np.asarray(log_speedups, dtype=np.float64)
    m = float(x.mean())
    sd = max(float(x.std(ddof=1)) if x.size > 1 else 0.0, noise)
    return m + z * sd / math.sqrt(x.size) < math.log(ratio), math.exp(m)


# ------------------------------------------------------------------------------------------------ the alarms
class Alarms:
    """The alarms of one run (see the module's docstring), fed per decode iteration (:meth:`sd_step`,
    :meth:`plain_step`, by :class:`WatchedSource`), per RL step or weight sync (:meth:`after_update`) and after
    every drafter sync or merge (:meth:`check_drafter`); :meth:`metrics` says what fired since it was last read.

    Args:
        config: :class:`AlarmConfig`.
        floor: the accept-length floor when ``config.accept_floor`` is None (e.g. :func:`card_floor` of the drafter's
            card); None: no floor alarm.
        floor_source: where ``floor`` came from, for the warning (``"the drafter's card: chain-4 4.85"``).
    """

    def __init__(self, config: AlarmConfig | None = None, floor: float | None = None, floor_source: str = ""):
        self.config = c = config or AlarmConfig()
        given = c.accept_floor is not None
        self.floor = c.accept_floor if given else floor
        self.floor_source = "tlt.accept_floor" if given else floor_source or "given"
        self.sd_steps = 0
        """SD steps seen (all rollouts)."""
        self.fired_at: dict[str, list[int]] = {n: [] for n in NAMES}
        """Per alarm, :attr:`sd_steps` at each time it fired."""
        self._window: deque = deque()            # accept_moments of the learned drafter's latest SD steps
        self._speed: deque = deque(maxlen=c.patience)   # log-speedups of the latest consecutive SD steps
        self._armed = dict.fromkeys(NAMES, True)
        self._clear = dict.fromkeys(NAMES, 0)
        self._new: set[str] = set()

    # ---------------------------------------------------------------------------------------- per SD step
    def sd_step(self, strategy: SpecStrategy, accepted=None, speedup: float | None = None,
                active: int | None = None) -> None:
        """One SD step of ``strategy`` at ``active`` rows (None: the rows of ``accepted``, else unknown): its
        histogram of rows by accepted drafts (``accepted``) and its speedup over plain decoding (None: unknown, or not
        judged: a tuner's exploration)."""
        self.sd_steps += 1
        c = self.config
        if active is None and accepted is not None:
            active = int(np.sum(accepted))
        if active is not None and active < c.min_active:
            return
        if c.floor and self.floor is not None and strategy.uses_drafter and accepted is not None:
            self._judge_floor(accept_moments(accepted))
        if c.speed and speedup is not None and speedup > 0:
            self._speed.append(math.log(speedup))
            if len(self._speed) == c.patience:
                slow, g = slower_than(self._speed, c.slower_ratio, c.confidence_z)
                where = f", at {active} rows" if active is not None else ""
                self._set("sd_slower", slow, lambda: (
                    f"the last {c.patience} SD steps ({strategy.name} the latest{where}) ran at {g:.2f}x "
                    f"plain decoding's speed (under {c.slower_ratio} by more than {c.confidence_z:g} standard "
                    "errors): SD is on where plain decoding is faster. Use speculative: adaptive with 'off' among "
                    "tlt.arms (the tuner then turns SD off there) or a lower tlt.threshold"), c.patience)

    def plain_step(self) -> None:
        """A plain decode iteration: SD is off, so the run of consecutive SD steps the speed is judged on ends."""
        self._speed.clear()

    def _judge_floor(self, moments: tuple[int, float, float]) -> None:
        c, w = self.config, self._window
        if moments[0] < 1:
            return
        w.append(moments)
        total = sum(m[0] for m in w)
        while len(w) > c.patience and total - w[0][0] >= c.min_rows:
            total -= w.popleft()[0]
        if len(w) < c.patience or total < c.min_rows:
            return
        low, acc, n = floor_breached(total, sum(m[1] for m in w), sum(m[2] for m in w), self.floor, c.confidence_z)
        self._set("accept_floor", low, lambda: (
            f"the learned drafter's last {len(w)} SD steps ({n} row-steps) accepted {acc:.2f} tokens per row per "
            f"step, under the floor {self.floor:.2f} ({self.floor_source}) by more than {c.confidence_z:g} standard "
            "errors: the drafter does not fit this policy (trained for another policy, random, or left behind by "
            "RL); SD stays exact but slow. Warm-start a drafter for this model (python -m tltlib train-drafter), "
            "keep tlt.online_drafter on, or set tlt.accept_floor"), c.patience)

    # --------------------------------------------------------------------------------- per step and sync
    def after_update(self, policy_moved: bool, drafter_moved: bool, due: bool, version=None) -> None:
        """After an RL step (or a weight sync): the policy changed (``policy_moved``), the drafter's version did
        (``drafter_moved``, now ``version``), and the online drafter was due to train (``due``: on, with pairs,
        and not skipped on purpose by ``drafter_train: on_drift``)."""
        if not self.config.stale:
            return
        self._set("drafter_stale", policy_moved and due and not drafter_moved, lambda: (
            f"the policy changed but the drafter's version stayed at {version} although the online drafter was due "
            "to train: its new weights never reached the rollout (a skipped drafter training step or sync), so SD "
            "drafts for an older policy. Check drafter/micro_steps and the drafter's sync after training"))

    def check_drafter(self, held, trained, workers: list[str] | None = None) -> None:
        """After a drafter sync or merge: the engine's drafter ``held`` must hold the weights of the ``trained`` one
        (fingerprints compared, unless they are one module); ``workers``: every worker's fingerprint of its merged
        drafter (several workers: they must be equal)."""
        if not self.config.mismatch or trained is None:
            return
        differ = sorted(set(workers)) if workers and len(set(workers)) > 1 else []
        mine = theirs = ""                  # one module holds its own weights: nothing to hash
        if held is not trained:
            mine, theirs = fingerprint(trained), "none" if held is None else fingerprint(held)
        self._set("drafter_mismatch", theirs != mine or bool(differ), lambda: (
            f"the drafter the engine drafts with (fingerprint {theirs}) is not the one just trained ({mine})"
            if theirs != mine else f"the workers' merged drafters differ (fingerprints {', '.join(differ)})")
            + ": the trained weights did not reach the rollout, which drafts with old ones (SD stays exact but "
            "slows down). Give the engine the trained drafter module (RolloutEngine(drafter=...)) or sync its "
            "weights after each training")

    # ------------------------------------------------------------------------------------------- firing
    def _set(self, name: str, condition: bool, message, rearm_after: int = 1) -> None:
        """Fire ``name`` (the warning from ``message()``) when ``condition`` holds and it is armed; re-arm it after
        ``rearm_after`` checks in a row found the condition clear."""
        if not condition:
            self._clear[name] += 1
            if self._clear[name] >= rearm_after:
                self._armed[name] = True
            return
        self._clear[name] = 0
        if self._armed[name]:
            self._armed[name] = False
            self.fired_at[name].append(self.sd_steps)
            self._new.add(name)
            warnings.warn(f"tltlib alarm {name}: {message()}", AlarmWarning, stacklevel=3)

    def metrics(self) -> dict:
        """``alarm/<name>``: 1.0 for each alarm that fired since the last call, else 0.0 (and ``alarm/floor``, the
        accept-length floor, when there is one)."""
        out = {f"alarm/{n}": float(n in self._new) for n in NAMES}
        if self.floor is not None:
            out["alarm/floor"] = float(self.floor)
        self._new = set()
        return out


class WatchedSource(StrategySource):
    """A strategy source (the adaptive controller, a fixed strategy) whose decode iterations also feed
    :class:`Alarms`: ``RolloutEngine.generate(..., strategy=WatchedSource(source, alarms))``.

    Args:
        source: what the engine takes as a strategy (:func:`tltlib.spec.strategy.strategy_source`).
        alarms: the run's :class:`Alarms`.
        costs: the cost model for SD's speed where no plain step was measured at that many rows (default: the
            source's, e.g. the adaptive controller's; None: the speed is judged only against measured plain steps).
    """

    def __init__(self, source, alarms: Alarms, costs=None):
        from ..spec.strategy import strategy_source
        self.source, self.alarms = strategy_source(source), alarms
        self.costs = costs if costs is not None else getattr(self.source, "costs", None)
        self.wants_context = bool(getattr(self.source, "wants_context", False) or self.costs is not None)
        self.wants_backlog = bool(getattr(self.source, "wants_backlog", False))
        self._plain: dict[int, deque] = {}       # rows bucket -> recent plain iterations' speeds
        self._recent: deque = deque(maxlen=32)   # the latest plain iterations' speeds at any rows

    def choose(self, iteration: int, active: int, **kwargs) -> SpecStrategy:
        return self.source.choose(iteration, active, **kwargs)

    def observe(self, strategy: SpecStrategy, active: int, tokens: int, seconds: float, rows: int | None = None,
                context: float | None = None, accepted=None) -> None:
        exploits = getattr(self.source, "exploits", None)         # judged before the tuner learns from this step
        exploited = exploits is None or not strategy.enabled or exploits(strategy, active)
        self.source.observe(strategy, active, tokens, seconds, rows, context=context, accepted=accepted)
        # the iteration's speed over what the cost model predicts for plain decoding at these rows (without one:
        # tokens per row per second), so that iterations at different rows and contexts compare
        speed = iteration_speedup(self.costs, active, tokens, seconds, rows, context)
        if speed is not None and self.costs is None:
            speed /= active
        if not strategy.enabled:
            if speed is not None:
                self._plain.setdefault(_bucket(active), deque(maxlen=16)).append(speed)
                self._recent.append(speed)
            self.alarms.plain_step()
            return
        self.alarms.sd_step(strategy, accepted, self._speedup(speed, active) if exploited else None, active)

    def _speedup(self, speed: float | None, active: int) -> float | None:
        """An SD step's ``speed`` over plain decoding's: the plain steps measured at about as many rows (at least
        3), else (with a cost model) the recent plain steps at any rows, as the machine's load moves them all, else
        the cost model's prediction itself; None without either."""
        if speed is None:
            return None
        plain = self._plain.get(_bucket(active), ())
        if len(plain) >= 3:
            return speed / float(np.median(plain))
        if self.costs is None:
            return None
        return speed / float(np.median(self._recent)) if self._recent else speed
