"""When the online drafter trains: after every RL step (``tlt.drafter_train: always``, the paper's), or only when
the acceptance measured on the current policy has fallen by ``tlt.drift_margin`` from its best since the drafter
last trained (``on_drift``).

*The acceptance measured on the current policy* is the accept length (tokens per row per SD step, bonus included)
of this RL step's SD steps with the learned drafter, per strategy (chain-4's and tree-6x4-24's are not comparable;
the tuner mixes them differently from step to step), from the rollout's timeline (:func:`accept_by_strategy`); a
strategy counts when it ran at least ``min_rows`` row-steps. Its fall is the row-weighted mean of ``accept_s /
best_s`` over the strategies with a best since the drafter last trained (:func:`accept_vs_best`); the drafter trains
when it is under ``1 - margin``. The rollout of policy k drafts with the drafter trained up to step k-1, so the
measure is what the drafter does on the policy it is about to be trained for.

1. A step with no such measurement (no learned-drafter SD step: the tuner kept SD off) trains: it cannot tell,
   and a drafter that RL left behind is one the tuner stops using.
2. The first measured step after the drafter trained (and the first of the run) sets the bests and does not train.
3. The spot trainer's idle windows (several workers) train whenever there is idle time, as that compute is
   otherwise wasted; ``on_drift`` gates the training on the step's critical path (one process: ``drafter_steps``
   micro-steps after the update).

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


class DriftGate:
    """Whether the online drafter trains after this RL step (see the module's docstring).

    Args:
        mode: ``"always"`` or ``"on_drift"``.
        margin: the relative fall from the best that makes an ``on_drift`` drafter train (0.1: 10%).
        min_rows: row-steps a strategy needs in a rollout to be measured.
    """

    def __init__(self, mode: str = "always", margin: float = 0.1, min_rows: int = 8):
        if mode not in MODES:
            raise BadInput(f"drafter_train must be one of {MODES}, got {mode!r}")
        if not 0.0 < margin < 1.0:
            raise BadInput(f"drift_margin is a relative fall of the accept length, in (0, 1); got {margin}")
        self.mode, self.margin, self.min_rows = mode, margin, min_rows
        self.best: dict[str, float] = {}
        """Per strategy, the best accept length since the drafter last trained."""
        self.ratio = math.nan
        """The last measured acceptance over its best (nan: not measured)."""

    def decide(self, timeline: dict) -> bool:
        """Whether to train after the rollout whose ``timeline`` this is; updates the bests."""
        measured = accept_by_strategy(timeline, self.min_rows)
        self.ratio = accept_vs_best(measured, self.best)
        for s, (a, _) in measured.items():
            self.best[s] = max(self.best.get(s, 0.0), a)
        if self.mode == "always" or not measured:
            return True
        return not math.isnan(self.ratio) and self.ratio < 1.0 - self.margin

    def trained(self) -> None:
        """The drafter changed: its bests start again from the next rollout's."""
        self.best = {}

    def metrics(self) -> dict:
        """``drafter/accept_vs_best``: the step's measured acceptance over its best (nan: not measured)."""
        return {"drafter/accept_vs_best": self.ratio}

    def state_dict(self) -> dict:
        return {"best": dict(self.best)}

    def load_state_dict(self, d: dict | None) -> None:
        self.best = dict((d or {}).get("best", {}))
