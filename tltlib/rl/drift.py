"""When the online drafter trains: after every RL step (``tlt.drafter_train: always``, the paper's), or only while
training pays (``on_drift``): while the drafter is still learning the policy, and again once the acceptance measured
on the current policy has fallen by ``tlt.drift_margin`` from its best.

*The acceptance measured on the current policy* is the accept length (tokens per row per SD step, bonus included)
of this RL step's SD steps with the learned drafter, per strategy (chain-4's and tree-6x4-24's are not comparable;
the tuner mixes them differently from step to step), from the rollout's timeline (:func:`accept_by_strategy`); a
strategy counts when it ran at least ``min_rows`` row-steps. Against a reference (per strategy) it is the
row-weighted mean of ``accept_s / reference_s`` (:func:`accept_vs_best`). The rollout of policy k drafts with the
drafter trained up to step k-1, so the measure is what the last training did for the policy it is about to train for.

``on_drift`` alternates two phases:

1. **Learning** (the run starts in it): the drafter trains after every step. The first measurement is the anchor;
   each later one, over the anchor, is a point of the learning curve. The phase ends when the curve's last
   ``window`` points (at least ``min_points``) show a plateau (:func:`plateaued`): a least-squares slope whose upper
   bound (slope + 2 standard errors, the points' spread at least ``noise``) is under ``min_gain`` per step. A drafter
   still learning its policy (SmolLM2's warm one doubles its acceptance in 20 steps, by gains under one step's noise)
   keeps training: resting it on noise cost 28% of its acceptance.
2. **Resting**: no training; the first measurement sets the bests, each later one raises them; when one falls under
   ``1 - margin`` of its bests the drafter trains and a new learning phase starts, anchored there.

A step with no measurement (no learned-drafter SD step: the tuner kept SD off) trains: it cannot tell, and a drafter
that RL left behind is one the tuner stops using. The spot trainer's idle windows (several workers) train whenever
there is idle time, as that compute is otherwise wasted; ``on_drift`` gates the training on the step's critical path
(one process: ``drafter_steps`` micro-steps after the update); a drafter trained there while resting restarts the
bests.

Paper: none (TLT trains the drafter at every step). Departures: this is an addition.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import BadInput
from ..spec.strategy import SpecStrategy

MODES = ("always", "on_drift")


def accept_by_strategy(timeline: dict, min_rows: int = 1) -> dict[str, tuple[float, int]]:
    """``{strategy: (accept length, row-steps)}`` of a rollout's learned-drafter SD steps (from its ``timeline``:
    ``strategy``, ``accepted``, ``active`` per decode iteration), for strategies with at least ``min_rows``
    row-steps."""
    names = np.asarray(timeline["strategy"])
    accepted = np.asarray(timeline["accepted"], dtype=np.float64)
    active = np.asarray(timeline["active"], dtype=np.float64)
    out = {}
    for name in sorted(set(names.tolist())):
        if name == "off" or not SpecStrategy.parse(name).uses_drafter:
            continue
        on = names == name
        rows = float(active[on].sum())
        if rows >= min_rows:
            out[name] = ((float(accepted[on].sum()) + rows) / rows, int(rows))
    return out


def accept_vs_best(measured: dict[str, tuple[float, int]], best: dict[str, float]) -> float:
    """Row-weighted mean of ``accept / best`` over the strategies of ``measured`` that have a ``best`` (nan: none
    has)."""
    both = [(a, n, best[s]) for s, (a, n) in measured.items() if s in best and best[s] > 0]
    rows = sum(n for _, n, _ in both)
    return sum(n * a / b for a, n, b in both) / rows if rows else math.nan


def plateaued(points, min_gain: float, noise: float, min_points: int, z: float = 2.0) -> bool:
    """Whether a learning curve (acceptance over its anchor after each trained step, shape (n,)) has flattened:
    n >= ``min_points`` and the least-squares slope per step plus ``z`` standard errors is under ``min_gain``, the
    residuals' standard deviation at least ``noise`` (one step's measure is no finer). Resting a drafter that still
    learns costs more than training one that does not, so the evidence asked is of the flat curve."""
    y = np.asarray(points, dtype=np.float64)
    n = y.size
    if n < max(min_points, 3):
        return False
    x = np.arange(n, dtype=np.float64) - (n - 1) / 2.0
    sxx = float((x * x).sum())
    slope = float((x * (y - y.mean())).sum()) / sxx
    resid = y - y.mean() - slope * x
    sd = max(math.sqrt(float((resid * resid).sum()) / (n - 2)), noise)
    return slope + z * sd / math.sqrt(sxx) < min_gain


class DriftGate:
    """Whether the online drafter trains after this RL step (see the module's docstring).

    Args:
        mode: ``"always"`` or ``"on_drift"``.
        margin: the relative fall from the best that makes a resting ``on_drift`` drafter train (0.1: 10%).
        min_rows: row-steps a strategy needs in a rollout to be measured.
        min_gain: the gain of acceptance per trained step (over the anchor) under which learning has plateaued.
        noise: the least standard deviation of one step's measure (relative) the plateau test assumes.
        window: the latest points of the learning curve the plateau test fits.
        min_points: points the plateau test needs.
    """

    def __init__(self, mode: str = "always", margin: float = 0.1, min_rows: int = 8, min_gain: float = 0.01,
                 noise: float = 0.02, window: int = 8, min_points: int = 4):
        if mode not in MODES:
            raise BadInput(f"drafter_train must be one of {MODES}, got {mode!r}")
        if not 0.0 < margin < 1.0:
            raise BadInput(f"drift_margin is a relative fall of the accept length, in (0, 1); got {margin}")
        if window < min_points or min_points < 3:
            raise BadInput(f"the plateau test fits a line: min_points >= 3 and window >= min_points, got "
                           f"{min_points}, {window}")
        self.mode, self.margin, self.min_rows = mode, margin, min_rows
        self.min_gain, self.noise, self.window, self.min_points = min_gain, noise, window, min_points
        self.best: dict[str, float] = {}
        """Resting: per strategy, the best accept length since the phase began."""
        self.learning = True
        """Whether the drafter is in a learning phase (it trains after every step until its curve plateaus)."""
        self.anchor: dict[str, float] | None = None
        """Learning: per strategy, the accept length the phase started from (None: not measured yet)."""
        self.curve: list[float] = []
        """Learning: the acceptance over the anchor after each trained step of the phase."""
        self.ratio = math.nan
        """The last measured acceptance over its reference (the anchor while learning, the bests while resting)."""

    def decide(self, timeline: dict) -> bool:
        """Whether to train after the rollout whose ``timeline`` this is; moves the phase."""
        measured = accept_by_strategy(timeline, self.min_rows)
        accepts = {s: a for s, (a, _) in measured.items()}
        if self.mode == "always" or not self.learning:      # against the bests, which this measurement raises
            self.ratio = accept_vs_best(measured, self.best)
            for s, a in accepts.items():
                self.best[s] = max(self.best.get(s, 0.0), a)
        if self.mode == "always":
            return True
        if not measured:                                     # it cannot tell: train
            self.ratio = math.nan
            return True
        if self.learning:
            if self.anchor is None:
                self.anchor, self.ratio = accepts, 1.0
                return True
            self.ratio = accept_vs_best(measured, self.anchor)
            if math.isnan(self.ratio):                       # other strategies than the anchor's: re-anchor
                self.anchor.update(accepts)
                return True
            self.curve.append(self.ratio)
            if not plateaued(self.curve[-self.window:], self.min_gain, self.noise, self.min_points):
                return True
            self.learning, self.best = False, accepts        # flat: rest, from the bests it reached
            return False
        if not math.isnan(self.ratio) and self.ratio < 1.0 - self.margin:
            self.learning, self.anchor, self.curve = True, accepts, []       # fallen: learn again, from here
            return True
        return False

    def trained(self) -> None:
        """The drafter changed: while resting (the spot trainer trained it), its bests start again from the next
        rollout's; a learning phase goes on."""
        if not self.learning:
            self.best = {}

    def metrics(self) -> dict:
        """``drafter/accept_vs_best``: the step's measured acceptance over its reference (nan: not measured);
        ``drafter/learning``: 1 in an ``on_drift`` learning phase, 0 resting (nan with ``always``, which has none)."""
        learning = float(self.learning) if self.mode == "on_drift" else math.nan
        return {"drafter/accept_vs_best": self.ratio, "drafter/learning": learning}

    def state_dict(self) -> dict:
        return {"best": dict(self.best), "learning": self.learning, "anchor": self.anchor, "curve": list(self.curve)}

    def load_state_dict(self, d: dict | None) -> None:
        d = d or {}
        self.best = dict(d.get("best", {}))
        self.learning = bool(d.get("learning", not d))       # a state from before the phases: resting
        self.anchor = dict(d["anchor"]) if d.get("anchor") is not None else None
        self.curve = [float(v) for v in d.get("curve", [])]
