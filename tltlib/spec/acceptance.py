"""What acceptance buys: the tokens an SD step emits per row from its acceptance per draft depth
(:func:`expected_tokens`, the tuner's prior and the simulator), Leviathan et al.'s expected speedup of a chain from
its per-token acceptance rate and draft/target cost ratio (the prediction every SD bench reports beside its
measurement), and the rate behind a measured accept length.

Departures: none (closed forms; Leviathan et al., 2023, Thm 3.8).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .strategy import SpecStrategy


def expected_tokens(arm: SpecStrategy, accept: Sequence[float] | float) -> float:
    """Expected tokens emitted per row per step (bonus included): 1 + sum_j prod_{i<=j} a_i, where a tree level
    with w candidates (w = the tree's branch, at most budget / depth) is accepted with 1 - (1 - a)^w."""
    if not arm.enabled:
        return 1.0
    rates = [float(accept)] * arm.depth if np.isscalar(accept) else [float(a) for a in accept]
    rates = (rates + [rates[-1]] * arm.depth)[: arm.depth]
    if arm.kind in ("tree", "hybrid", "suffix"):
        w = max(1, min(arm.branch, arm.verify_tokens // arm.depth))
        rates = [1 - (1 - a) ** w for a in rates]
    total, run = 1.0, 1.0
    for a in rates:
        run *= a
        total += run
    return total


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. Thm 3.8: expected wall-time speedup (1 - a^(g+1)) / ((1 - a)(g c + 1))."""
    if alpha >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def alpha_from_accept_length(mean_len: float, gamma: int, tol: float = 1e-9) -> float:
    """The per-token acceptance rate a whose expected tokens per step (1 - a^(g+1)) / (1 - a) equals
    ``mean_len`` (bonus included), by bisection."""
    target = min(max(mean_len, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        val = (1 - mid ** (gamma + 1)) / (1 - mid) if mid < 1 else gamma + 1.0
        lo, hi = (mid, hi) if val < target else (lo, mid)
    return (lo + hi) / 2
