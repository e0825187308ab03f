"""What a calibration of this machine must satisfy before the simulator uses it (:mod:`tltlib.lab.calibrate`): forward
costs that grow with rows, cached context and new tokens; an engine that costs something beyond its forwards, never
less; an SD step at least as costly as the forwards it runs; a measurement quiet enough to tell these apart.

Every measured table comes from two passes over the same cells (the second in the opposite order), so that a slow
spell of a shared machine shows as the two disagreeing (:func:`pass_noise`). A violation within that noise (at least
:data:`MIN_TOLERANCE`) is moved to its bound and reported in the returned notes; a violation beyond it, or passes
that disagree by more than :data:`NOISE_LIMIT`, is refused with a :class:`CalibrationError` that names the value,
the bound and where, and says to rerun on a quiet machine. A calibration is never fitted on numbers that cannot be
true: an earlier version silently accepted a negative per-iteration overhead and an SD step at 0.56x of its own
forwards (an Intel Xeon with another process running for a minute), then used them for every prediction.

Departures: none (checks of measurements).
"""
from __future__ import annotations

import numpy as np

from ..errors import BadInput

QUIET = "rerun on a quiet machine (no other process using the CPU while it measures)"
MIN_TOLERANCE = 0.03
"""The smallest share by which a measured value may cross its physical bound and be moved onto it (timer and
interpolation noise of a quiet machine)."""
NOISE_LIMIT = 0.5
"""The most two passes over the same forwards may disagree (the 90th percentile of the cells' relative difference).
On the 2-core development VM (a shared host whose speed drifts) quiet runs gave 11-22% (tiny reasoner, 192 cells,
about 40 s apart); with another process on both cores for one minute of the measurement, 143% (its worst cell 32x:
a multi-threaded forward then waits a scheduler quantum at its barriers)."""


class CalibrationError(BadInput):
    """A calibration that cannot be physical or was measured on a machine too busy to tell; the message names what
    is violated and says to rerun on a quiet machine."""


def pass_noise(first, second) -> float:
    """The noise of a measurement taken twice: the 90th percentile over the cells of ``|first / second - 1|``
    (arrays of the same shape, seconds)."""
    a, b = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if a.shape != b.shape or not a.size or not ((a > 0) & (b > 0)).all():
        raise BadInput(f"pass_noise needs two passes of positive seconds of one shape, got {a.shape} and {b.shape}")
    return float(np.percentile(np.abs(a / b - 1), 90))


def tolerance(noise: float) -> float:
    """How far a value may cross its bound and be moved onto it: the measured noise (a cost known to within that
    share), at least :data:`MIN_TOLERANCE`."""
    return max(MIN_TOLERANCE, noise)


def check_quiet(noise: float, what: str, limit: float | None = None) -> None:
    """Refuse a measurement whose two passes disagree by more than ``limit`` (:func:`pass_noise`; default
    :data:`NOISE_LIMIT`)."""
    _at_most(noise, limit, lambda lim: f"{what}: two passes over the same cells disagree by {noise:.0%} (90th "
                                       f"percentile; a quiet machine stays within {lim:.0%}): the machine's speed "
                                       "changed while it measured")


def check_drift(drift: float, what: str, limit: float | None = None) -> None:
    """Refuse a fit to runs during which the machine's speed had moved by more than ``limit`` (default
    :data:`NOISE_LIMIT`) from its speed while the costs were measured (``drift``: ``|probe factor - 1|``, the
    largest over the runs; :class:`tltlib.lab.calibrate.Drift`)."""
    _at_most(drift, limit, lambda lim: f"{what}: the machine ran {drift:.0%} faster or slower than while its "
                                       f"forwards were timed (a quiet machine stays within {lim:.0%})")


def _at_most(value: float, limit: float | None, why) -> None:
    """A :class:`CalibrationError` (``why(limit)``, then :data:`QUIET`) when ``value`` exceeds ``limit`` (default
    :data:`NOISE_LIMIT`)."""
    limit = NOISE_LIMIT if limit is None else limit
    if value > limit:
        raise CalibrationError(f"{why(limit)}; {QUIET}")


def monotone(table, axes: list[tuple[str, tuple]], what: str, tol: float) -> tuple[np.ndarray, list[str]]:
    """``table`` (seconds; one array axis per entry of ``axes``: its name and its values) made non-decreasing along
    every axis. A value below the one before it along an axis by at most ``tol`` of that one is raised to it (a
    note says where); by more, a :class:`CalibrationError` names the two cells. Returns (the table, the notes)."""
    t = np.array(table, dtype=np.float64)
    notes = []
    for ax, (name, values) in enumerate(axes):
        view = np.moveaxis(t, ax, 0)                       # a view: writes go to t
        for i in range(1, view.shape[0]):
            prev, cur = view[i - 1], view[i]
            fall = (prev - cur) / prev
            if not (fall > 0).any():
                continue
            worst = np.unravel_index(int(np.argmax(fall)), fall.shape)
            if fall[worst] > tol:
                others = [(n, v) for j, (n, v) in enumerate(axes) if j != ax]
                where = ", ".join(f"{n} {v[k]}" for (n, v), k in zip(others, worst))
                raise CalibrationError(
                    f"{what} is not monotone in {name}: {1e3 * prev[worst]:.3g} ms at {name} {values[i - 1]} but "
                    f"{1e3 * cur[worst]:.3g} ms at {name} {values[i]} ({where}): {fall[worst]:.0%} less time for more "
                    f"work, beyond the measurement's noise ({tol:.0%}); {QUIET}")
            notes.append(f"{what}: {int((fall > 0).sum())} value(s) at {name} {values[i]} raised to the one at "
                         f"{values[i - 1]} (at most {fall.max():.1%} below it, within the noise)")
            view[i] = np.maximum(cur, prev)
    return t, notes


def nondecreasing_fit(xs, ys, weights) -> np.ndarray:
    """The weighted least-squares non-decreasing fit of ``ys`` over increasing ``xs`` (pool-adjacent-violators):
    a smooth of per-band medians that keeps what is physical, a cost that does not fall as the rows grow."""
    blocks = []                                           # [value, weight, count]
    for y, w in zip(np.asarray(ys, dtype=np.float64), np.asarray(weights, dtype=np.float64)):
        blocks.append([y, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (y2, w2, n2), (y1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(y1 * w1 + y2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([np.full(n, y) for y, _, n in blocks])


def at_least(values, bound: float, scale, tol: float, what: str, unit: str, labels) -> tuple[np.ndarray, list[str]]:
    """``values`` checked against a lower ``bound``: one below it by at most ``tol`` of its ``scale`` (what it is
    measured against, e.g. the forward's seconds for an overhead, 1 for a ratio) is moved onto the bound (noted);
    further below, a :class:`CalibrationError` names it at its ``labels`` entry (``"12 rows"``). ``unit``: ``"s"``
    (shown in ms) or a suffix such as ``"x"``."""
    v = np.array(values, dtype=np.float64)
    s = np.broadcast_to(np.asarray(scale, dtype=np.float64), v.shape)
    notes = []
    for i in np.flatnonzero(v < bound):
        gap = (bound - v[i]) / s[i]
        if gap > tol:
            raise CalibrationError(f"{what} came out {_fmt(v[i], unit)} at {labels[i]}, below {_fmt(bound, unit)} "
                                   f"(by {gap:.0%} of {_fmt(s[i], unit)}, beyond the measurement's noise {tol:.0%}): "
                                   f"the isolated forwards were timed slower than the same work inside the "
                                   f"rollouts; {QUIET}")
        notes.append(f"{what} {_fmt(v[i], unit)} at {labels[i]} set to {_fmt(bound, unit)} (within the noise)")
        v[i] = bound
    return v, notes


def _fmt(x: float, unit: str) -> str:
    return f"{1e3 * x:.3g} ms" if unit == "s" else f"{x:.2f}{unit}"
