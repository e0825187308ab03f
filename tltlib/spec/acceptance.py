"""What acceptance buys: the tokens an SD step emits per row from its acceptance per draft depth
(:func:`expected_tokens`, the tuner's prior and the simulator), a chain's expected tokens and speedup from its
per-token acceptance rate, drafter cost and verify cost (:func:`chain_speedup`; Leviathan et al.'s with a verify as
dear as a decode forward: the prediction every SD bench reports beside its measurement), and the rate behind a
measured accept length.

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


def chain_tokens(alpha: float, depth: int) -> float:
    """Expected tokens one chain SD step emits (bonus included) when each draft is accepted with probability
    ``alpha`` independently: 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) for ``depth`` = k drafts."""
    if alpha >= 1.0:
        return depth + 1.0
    return (1 - alpha ** (depth + 1)) / (1 - alpha)


def chain_speedup(alpha: float, depth: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Expected speedup of a chain SD step over plain decoding: :func:`chain_tokens` per step over the step's cost in
    plain decode forwards, ``depth`` drafter forwards of ``draft_cost`` each plus one verify forward of ``verify_cost``
    (about 1 while a forward is bound by memory traffic and launches, as at a few rows; growing with the rows as the
    forward becomes compute-bound: where SD stops paying)."""
    return chain_tokens(alpha, depth) / (depth * draft_cost + verify_cost)


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. Thm 3.8: expected wall-time speedup (1 - a^(g+1)) / ((1 - a)(g c + 1)): :func:`chain_speedup`
    with a verify as dear as a decode forward."""
    return chain_speedup(alpha, gamma, c, 1.0)


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
