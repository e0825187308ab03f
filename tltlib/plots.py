"""The figures the notebooks draw; each function returns a matplotlib Figure (the caller saves or shows it).

Paper: Fig. 2 (response-length distribution with its long tail), Fig. 14 (running requests over time), Fig. 1b
(workers idle while the longest responses finish).

Departures: none.
"""
from __future__ import annotations

import numpy as np


def _fig(width=6.0, height=3.6):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(width, height))
    return fig, ax


def _log_x(ax):
    """Log x axis labelled with plain numbers (10, 20, 50, 100, ...)."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    lo, hi = ax.get_xlim()
    ax.set_xticks([t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
                   if lo <= t <= hi])


def length_histogram(lengths, title: str = "Response lengths"):
    """Histogram of response lengths on log-spaced bins (log x), with the median and p99 marked."""
    x = np.asarray(lengths, dtype=float)
    fig, ax = _fig()
    bins = np.logspace(np.log10(max(1.0, x.min())), np.log10(x.max() + 1), 30)
    ax.hist(x, bins=bins, color="#4C72B0", edgecolor="white")
    _log_x(ax)
    for q, style in ((50, "--"), (99, ":")):
        v = np.percentile(x, q)
        ax.axvline(v, color="k", linestyle=style, linewidth=1, label=f"p{q} = {v:.0f}")
    ax.set_xlabel("response length (tokens, log scale)")
    ax.set_ylabel("responses")
    ax.set_title(title)
    ax.legend()
    return fig


def length_cdf(lengths, title: str = "CDF of response lengths"):
    """Empirical CDF of response lengths (log x)."""
    x = np.sort(np.asarray(lengths, dtype=float))
    fig, ax = _fig()
    ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", color="#4C72B0")
    _log_x(ax)
    ax.set_xlabel("response length (tokens, log scale)")
    ax.set_ylabel("fraction of responses <= length")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    return fig


def active_over_time(time_s, active, total_rows: int, title: str = "Running requests during the rollout",
                     sd_on=None):
    """Running requests vs wall time (a step curve), with the 10% and 25% levels; ``sd_on`` (bool per step)
    shades the steps where speculative decoding ran."""
    t = np.concatenate([[0.0], np.asarray(time_s, dtype=float)])
    a = np.asarray(active, dtype=float)
    fig, ax = _fig()
    ax.step(t[:-1], a, where="post", color="#4C72B0", label="running requests")
    for frac, style in ((0.25, "--"), (0.10, ":")):
        ax.axhline(frac * total_rows, color="grey", linestyle=style, linewidth=1, label=f"{frac:.0%} of the batch")
    if sd_on is not None:
        on = np.asarray(sd_on, dtype=bool)
        for i in np.flatnonzero(on):
            ax.axvspan(t[i], t[i + 1], color="#DD8452", alpha=0.25, linewidth=0)
    ax.set_xlabel("time since rollout start (s)")
    ax.set_ylabel("running requests")
    ax.set_title(title)
    ax.legend()
    return fig


def worker_timeline(lengths, workers: int, title: str | None = None):
    """Per worker (responses split contiguously over ``workers``), the share of its responses still decoding at
    every decode step: dark = busy, white = idle. Idle white at the right end is a worker waiting for the slowest
    one; pale bands are a worker decoding a nearly empty batch (step-count model, see tltlib.profiling)."""
    x = np.asarray(lengths, dtype=int)
    parts = np.array_split(x, workers)
    end = x.max()
    steps = np.arange(end)
    running = np.stack([(p[:, None] > steps[None, :]).mean(0) for p in parts])
    fig, ax = _fig(6.0, 0.35 * workers + 1.4)
    im = ax.imshow(running, aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest",
                   extent=(0, end, workers - 0.5, -0.5))
    ax.set_yticks(range(workers), [f"worker {w}" for w in range(workers)])
    ax.set_xlabel("decode steps")
    fig.colorbar(im, ax=ax, label="share of its responses still decoding")
    busy = np.array([p.max() for p in parts])
    idle = 1 - busy.mean() / end
    empty = 1 - x.mean() / end
    ax.set_title(title or f"{workers} workers: {idle:.0%} of worker-time idle, {empty:.0%} of row-slots empty")
    return fig
