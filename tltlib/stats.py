"""Long-tail statistics of rollouts as pure functions: response lengths, running rows over time, decode time by
batch-size bucket, the idle share of workers that wait for the slowest, and paired speed ratios. They take lengths,
timelines and finish times and return plain numbers or dicts keyed by :data:`tltlib.metrics.METRICS`.

Paper: TLT §2 / Fig. 1-2 (rollout is ~85% of a step; a few responses reach the maximum length); Fig. 14 (active
requests over time, SD switching on when few remain).

Departures:
1. Idle worker time is estimated with a step-count model (a worker's rollout lasts as many decode steps as its
   longest response; decode steps cost about the same at small batch), not measured on W real workers; the spot
   trainer (:mod:`tltlib.rl.scheduler`) measures it for real.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import BadInput


def length_stats(lengths: Sequence[int] | np.ndarray) -> dict[str, float]:
    """``rollout/len_*`` statistics of response lengths (tokens, EOS included)."""
    x = np.asarray(lengths, dtype=np.float64)
    if x.size == 0:
        raise BadInput("length_stats needs at least one response length")
    p50 = float(np.percentile(x, 50))
    out = {"rollout/len_mean": float(x.mean()), "rollout/len_p50": p50,
           "rollout/len_p90": float(np.percentile(x, 90)), "rollout/len_p99": float(np.percentile(x, 99)),
           "rollout/len_max": float(x.max())}
    out["rollout/p99_over_p50"] = out["rollout/len_p99"] / max(p50, 1.0)
    out["rollout/max_over_p50"] = out["rollout/len_max"] / max(p50, 1.0)
    return out


def tail_time_share(iter_time: Sequence[float], active: Sequence[int], total_rows: int, fraction: float) -> float:
    """Share of decode time spent in iterations where at most ``fraction`` of ``total_rows`` were still running.

    Args:
        iter_time: ``[S]`` seconds of each decode iteration.
        active: ``[S]`` rows still generating during each iteration.
        total_rows: rows at the start of the rollout.
    """
    t = np.asarray(iter_time, dtype=np.float64)
    a = np.asarray(active, dtype=np.float64)
    if t.size == 0 or t.sum() <= 0:
        return 0.0
    return float(t[a <= fraction * total_rows].sum() / t.sum())


def time_by_bucket(iter_time: Sequence[float], active: Sequence[int], bounds: Sequence[int]) -> np.ndarray:
    """Decode time spent in each batch-size bucket: ``out[i]`` sums the iterations with
    ``bounds[i] <= active < bounds[i + 1]`` (the last bucket is open-ended).

    Args:
        iter_time: ``[S]`` seconds of each decode iteration.
        active: ``[S]`` rows still generating during each iteration.
        bounds: ``[K]`` lower bounds of the buckets, strictly increasing (e.g. a tuner's ``buckets``).
    Returns: ``[K]`` seconds."""
    b = np.asarray(bounds)
    if b.size == 0 or np.any(np.diff(b) <= 0):
        raise BadInput(f"bucket bounds must be non-empty and strictly increasing, got {list(bounds)}")
    t = np.asarray(iter_time, dtype=np.float64)
    idx = np.searchsorted(b, np.asarray(active), side="right") - 1
    keep = idx >= 0                                    # iterations below the first bound belong to no bucket
    return np.bincount(idx[keep], weights=t[keep], minlength=b.size)


def per_bucket_oracle(bucket_times: dict[str, Sequence[float]]) -> tuple[float, list[str | None]]:
    """The hindsight bound of a per-bucket tuner: given each policy's decode time per bucket (``[K]`` each, from
    :func:`time_by_bucket`), the total time if every bucket ran its fastest policy, and that policy per bucket
    (None for a bucket no policy spent time in).

    No tuner that picks one policy per batch-size bucket can beat this on the same workload (up to run-to-run
    noise), so ``best fixed total / oracle total`` is the most an adaptive tuner could gain over the best fixed
    policy."""
    if not bucket_times:
        raise BadInput("per_bucket_oracle needs at least one policy's bucket times")
    names = list(bucket_times)
    tab = np.array([np.asarray(bucket_times[n], dtype=np.float64) for n in names])
    best = tab.argmin(0)
    return float(tab.min(0).sum()), [names[i] if tab[:, k].max() > 0 else None for k, i in enumerate(best)]


def paired_ratio(base: Sequence[float], other: Sequence[float], level: float = 0.95,
                 resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """How much faster ``other`` ran than ``base`` when each ran once per round: the median over rounds of
    ``base[i] / other[i]`` (> 1: ``other`` is faster), with a bootstrap confidence interval of that median.

    Pairing within a round cancels what the round shares (a slow spell of the machine, a longer tail drawn with the
    round's seed); the interval says how far the rounds left can be trusted: on a VM whose rollouts move ±20% from
    one round to the next, a 2% claim needs the interval, not the median alone.

    Args:
        base, other: ``[R]`` seconds per round, ``R >= 1`` (same length).
        level: the interval's coverage, in (0, 1).
        resamples: bootstrap resamples (rounds drawn with replacement); ``seed`` seeds them.
    Returns: ``(median, low, high)``; ``low == high == median`` for one round."""
    b, o = np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if b.shape != o.shape or b.ndim != 1 or b.size == 0:
        raise BadInput(f"paired_ratio needs two equally long, non-empty lists of times, got {b.shape} and {o.shape}")
    if not 0 < level < 1:
        raise BadInput(f"level must lie in (0, 1), got {level}")
    if np.any(b <= 0) or np.any(o <= 0):
        raise BadInput("paired_ratio needs positive times")
    r = b / o
    med = float(np.median(r))
    if r.size == 1:
        return med, med, med
    idx = np.random.default_rng(seed).integers(0, r.size, size=(resamples, r.size))
    boot = np.median(r[idx], axis=1)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return med, float(lo), float(hi)


def split_idle_fraction(lengths: Sequence[int] | np.ndarray, workers: int) -> float:
    """Idle share of worker-time if the responses were split contiguously over ``workers`` workers.

    Step-count model: worker w is busy for ``max(lengths of its share)`` decode steps and the rollout ends with the
    slowest worker, so idle = 1 - mean_w(busy_w) / max_w(busy_w). Contiguous shares keep GRPO groups together, as
    verl's data-parallel dispatch does."""
    x = np.asarray(lengths, dtype=np.float64)
    if workers < 1:
        raise BadInput(f"workers must be >= 1, got {workers}")
    if x.size < workers:
        raise BadInput(f"cannot split {x.size} responses over {workers} workers; use fewer workers")
    busy = np.array([part.max() for part in np.array_split(x, workers)])
    return float(1.0 - busy.mean() / busy.max())


def empty_slot_fraction(lengths: Sequence[int] | np.ndarray) -> float:
    """Share of the (response x decode step) slots of a batch that runs until its longest response which are empty
    because their response already finished: ``1 - mean(lengths) / max(lengths)``. Independent of how the batch is
    split over workers."""
    x = np.asarray(lengths, dtype=np.float64)
    return float(1.0 - x.mean() / x.max())


def active_over_time(finish_time: Sequence[float], total_time: float, points: int = 200):
    """Curve of running requests vs time from per-sequence finish times: ``(t [points], active [points])``."""
    f = np.sort(np.asarray(finish_time, dtype=np.float64))
    t = np.linspace(0.0, total_time, points)
    return t, f.size - np.searchsorted(f, t, side="right")


def rollout_stats(lengths, iter_time, active, total_rows: int, truncated, time_s: float,
                  prefill_s: float) -> dict[str, float]:
    """All ``rollout/*`` statistics of one rollout (``truncated``: per-response bool, cut by the token budget)."""
    x = np.asarray(lengths)
    out = {"rollout/num_sequences": float(x.size), "rollout/tokens": float(x.sum()), "rollout/time_s": time_s,
           "rollout/prefill_s": prefill_s, "rollout/iterations": float(len(iter_time)),
           "rollout/tokens_per_s": float(x.sum() / time_s) if time_s > 0 else 0.0,
           "rollout/truncated_frac": float(np.mean(truncated))}
    out.update(length_stats(x))
    out["rollout/tail_time_frac_10"] = tail_time_share(iter_time, active, total_rows, 0.10)
    out["rollout/tail_time_frac_25"] = tail_time_share(iter_time, active, total_rows, 0.25)
    return out


def spec_stats(timeline: dict) -> dict[str, float]:
    """``spec/*`` statistics of a rollout from its timeline (empty when no iteration was an SD step)."""
    strategy = np.asarray(timeline["strategy"])
    on = strategy != "off"
    if not on.any():
        return {"spec/steps": 0.0, "spec/time_frac": 0.0}
    active = np.asarray(timeline["active"], dtype=np.float64)[on]
    iter_time = np.asarray(timeline["iter_time"], dtype=np.float64)
    hist = np.asarray(timeline["accept_hist"])[on].sum(0).astype(np.float64)
    rows = hist.sum()
    out = {"spec/steps": float(on.sum()), "spec/time_frac": float(iter_time[on].sum() / max(iter_time.sum(), 1e-12)),
           "spec/accept_len_mean": float((np.asarray(timeline["accepted"])[on].sum() + active.sum()) / active.sum()),
           "spec/draft_time_s": float(np.asarray(timeline["draft_s"])[on].sum()),
           "spec/verify_time_s": float(np.asarray(timeline["verify_s"])[on].sum())}
    for d in range(1, len(hist)):
        out[f"spec/accept_ge_{d}"] = float(hist[d:].sum() / rows) if rows else 0.0
    return out


def long_tail_report(stats: dict, lengths, workers: int, rewards=None) -> dict:
    """A rollout's ``rollout/*`` stats plus the W-worker idle estimate and, given rewards, ``rl/*``."""
    out = dict(stats)
    out["sched/workers"] = float(workers)
    out["sched/idle_frac"] = split_idle_fraction(lengths, workers)
    out["sched/empty_slot_frac"] = empty_slot_fraction(lengths)
    if rewards is not None:
        r = np.asarray(rewards, dtype=np.float64)
        out["rl/reward_mean"] = float(r.mean())
        out["rl/accuracy"] = float((r >= 1.0).mean())
    return out
