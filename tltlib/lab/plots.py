"""The figures the notebooks draw; each function returns a matplotlib Figure (the caller saves or shows it).

Paper: Fig. 2 (response-length distribution with its long tail), Fig. 14 (running requests over time), Fig. 1b
(workers idle while the longest responses finish).

Departures: none.
"""
from __future__ import annotations

import numpy as np

from ..sim.costs import predicted_speedup


def _fig(width=6.0, height=3.6):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(width, height))
    return fig, ax


def _finish(fig, ax, title: str, xlabel: str | None = None, ylabel: str | None = None, legend: dict | None = None):
    """Labels, title, legend (``legend``: its keyword arguments; None = no legend) and a tight layout."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend is not None:
        ax.legend(**legend)
    fig.tight_layout()
    return fig


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
    """Histogram of response lengths on log-spaced bins (log x), with the median and p99 marked; every response
    counted (the outer edges pinned to the shortest and one past the longest: a log-spaced first edge can round
    above the shortest length and drop those responses; a 0-token response is drawn at 1)."""
    x = np.maximum(np.asarray(lengths, dtype=float), 1.0)
    fig, ax = _fig()
    bins = np.logspace(np.log10(x.min()), np.log10(x.max() + 1), 30)
    bins[0], bins[-1] = x.min(), x.max() + 1
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
    one; pale bands are a worker decoding a nearly empty batch (step-count model, see tltlib.stats)."""
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


def drafter_training(log: dict, title: str = "Drafter warm-up"):
    """Loss, top-1 accuracy by depth, and (when logged) accepted length, against training steps."""
    import matplotlib.pyplot as plt
    extra = [e.get("spec/accept_len_mean") for e in log.get("eval_extra", [])]
    panels = 3 if any(v is not None for v in extra) else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
    axes[0].plot(log["step"], log["loss"], color="#4C72B0", linewidth=0.8)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step")
    axes[0].set_title("training loss")
    acc = np.asarray(log["eval_acc"])
    for d in range(acc.shape[1]):
        axes[1].plot(log["eval_step"], acc[:, d], marker="o", markersize=3, label=f"depth {d + 1}")
    axes[1].set_ylim(0, 1.02)
    axes[1].set_xlabel("step")
    axes[1].set_title("top-1 accuracy (held out)")
    axes[1].legend(fontsize=7)
    if panels == 3:
        steps = [s for s, v in zip(log["eval_step"], extra) if v is not None]
        axes[2].plot(steps, [v for v in extra if v is not None], marker="o", color="#2CA02C")
        axes[2].set_xlabel("step")
        axes[2].set_title("accepted length (tokens per SD step)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def adaptive_timeline(timeline: dict, threshold: int, title: str = "Adaptive rollout: running rows and SD strategy"):
    """Running rows over time (log y) with each step coloured by the strategy it ran; SD-on steps shaded and the
    switch threshold drawn."""
    fig, ax = _fig(7.0, 3.8)
    t = np.asarray(timeline["time"], dtype=float)
    active = np.asarray(timeline["active"], dtype=float)
    strategy = np.asarray(timeline["strategy"]).astype(str)
    ax.step(t, active, where="post", color="0.6", linewidth=1, zorder=1)
    on = strategy != "off"
    if on.any():
        ax.axvspan(t[on.argmax()] - float(np.asarray(timeline["iter_time"])[on.argmax()]), t[-1], color="#55A868",
                   alpha=0.08, label="SD on")
    names = sorted(set(strategy), key=lambda n: (n != "off", n))
    cmap = __import__("matplotlib").colormaps["tab10"]
    for i, name in enumerate(names):
        sel = strategy == name
        ax.scatter(t[sel], active[sel], s=9, color="0.3" if name == "off" else cmap(i % 10), label=name, zorder=2)
    ax.axhline(threshold, color="k", linestyle="--", linewidth=1, label=f"threshold = {threshold}")
    ax.set_yscale("log")
    return _finish(fig, ax, title, "time since rollout start (s)", "running rows (log)",
                   legend={"fontsize": 7, "ncol": 2, "loc": "upper right"})


def arm_rewards(log: dict, buckets, title: str = "BEG-MAB rewards per arm and batch-size bucket"):
    """Median reward of each arm in each bucket: the step's tokens/s over the cost model's plain tokens/s at that
    batch size. It ranks arms within a bucket; its absolute value is below the real speedup when the rollout's
    contexts are longer than the cost model's (a plain step over a long context is slower than the model's), so no
    "= plain" line is drawn."""
    fig, ax = _fig(7.0, 3.6)
    active = np.asarray(log["active"], dtype=float)
    arms = np.asarray(log["arm"]).astype(str)
    reward = np.asarray(log["reward"], dtype=float)
    buckets = list(buckets)
    b_idx = np.searchsorted(buckets, active, side="right") - 1
    used = sorted(set(b_idx.tolist()))
    names = sorted(set(arms.tolist()))
    width = 0.8 / max(1, len(names))
    cmap = __import__("matplotlib").colormaps["tab10"]
    for j, name in enumerate(names):
        med = [np.median(reward[(arms == name) & (b_idx == b)]) if ((arms == name) & (b_idx == b)).any() else np.nan
               for b in used]
        ax.bar(np.arange(len(used)) + (j - (len(names) - 1) / 2) * width, med, width, color=cmap(j % 10), label=name)
    labels = [f"{buckets[b]}-{buckets[b + 1] - 1}" if b + 1 < len(buckets) else f"{buckets[b]}+" for b in used]
    ax.set_xticks(range(len(used)), labels)
    return _finish(fig, ax, title, "running rows (bucket)", "median reward\n(tokens/s / cost-model plain)",
                   legend={"fontsize": 7, "ncol": 3})


def policy_times(times: dict, title: str = "Total rollout time by policy"):
    """Horizontal bars of rollout seconds per policy, each labelled with its speedup over the first entry."""
    names = list(times)
    vals = np.array([times[n] for n in names], dtype=float)
    fig, ax = _fig(7.0, 0.5 + 0.42 * len(names))
    colors = ["0.55" if i == 0 else ("#C44E52" if "adaptive" in n else "#4C72B0") for i, n in enumerate(names)]
    ax.barh(range(len(names)), vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {vals[0] / v:.2f}x", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, vals.max() * 1.18)
    ax.set_xlabel("rollout time (s)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def what_if_panels(result: dict, threshold: int, measured: dict | None = None, total_rows: int | None = None):
    """Notebook 04's what-if (:func:`tltlib.lab.whatif.what_if`): left, the simulated rollout's running rows over time
    (log scale), shaded where SD ran, the threshold dashed; right, rollout seconds of no SD and the adaptive policy as
    simulated, beside ``measured`` (``{"no SD": s, "adaptive": s}`` at the run's own settings, when given)."""
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11.0, 3.4), gridspec_kw={"width_ratios": [1.6, 1]})
    t0 = 0.0
    for t, rows, arm in result["timeline"]:
        a.plot([t0, t], [rows, rows], color="#C44E52" if arm != "off" else "0.45", linewidth=2)
        if arm != "off":
            a.axvspan(t0, t, color="#C44E52", alpha=0.08, linewidth=0)
        t0 = t
    a.axhline(max(threshold, 1), color="black", linestyle="--", linewidth=0.8, label=f"threshold {threshold}")
    a.set_yscale("log")
    a.set_ylim(0.8, (total_rows or max(r for _, r, _ in result["timeline"])) * 1.3)
    a.set_xlabel("simulated seconds")
    a.set_ylabel("running rows")
    a.set_title(f"SD {result['sd_share']:.0%} of the time; arms played: "
                + ", ".join(f"{k} {v}" for k, v in sorted(result["played"].items(), key=lambda kv: -kv[1]) if v)[:60],
                fontsize=9)
    a.legend(fontsize=8)
    names, vals = ["no SD (simulated)", "adaptive (simulated)"], [result["plain_s"], result["adaptive_s"]]
    if measured:
        names += [f"{k} (measured)" for k in measured]
        vals += list(measured.values())
    colors = ["0.55", "#C44E52", "0.75", "#E8A0A2"][: len(names)]
    b.barh(range(len(names)), vals, color=colors)
    for i, v in enumerate(vals):
        b.text(v, i, f" {v:.1f} s", va="center", fontsize=8)
    b.set_yticks(range(len(names)), names, fontsize=8)
    b.invert_yaxis()
    b.set_xlim(0, max(vals) * 1.3)
    b.set_xlabel("rollout seconds")
    b.set_title(f"adaptive {result['speedup']:.2f}x no SD (simulated)", fontsize=10)
    fig.tight_layout()
    return fig


def predicted_speedups(costs, arms, accept, batches=None, title: str = "Cost model: predicted SD speedup"):
    """The cost model's predicted speedup of each arm over plain decoding against batch size (log x)."""
    fig, ax = _fig()
    b = np.asarray(batches if batches is not None else np.unique(np.geomspace(1, costs.rows[-1], 40).round()))
    for arm in arms:
        acc = accept(arm) if callable(accept) else accept
        ax.plot(b, [predicted_speedup(costs, arm, int(x), acc) for x in b], label=arm.name)
    ax.axhline(1.0, color="k", linewidth=1, linestyle=":")
    ax.set_xscale("log", base=2)
    return _finish(fig, ax, title, "running rows", "predicted speedup over plain", legend={"fontsize": 7})


def step_time_bars(phases: dict[str, dict], title: str = "Time of one RL step by phase"):
    """Stacked bars, one per policy: ``phases = {policy: {"rollout": s, "logprob": s, "update": s, "drafter": s,
    "reward": s}}``; the rollout's share is written on its segment. With ``"step"`` and ``"spread": {"step": [q25,
    q75]}`` (:func:`tltlib.lab.e2e.summarize`) the median step and its interquartile range are drawn as a whisker.
    Policies more than 20x slower than the fastest (a peer such as TRL on a CPU) get a panel of their own, so every
    panel keeps a linear scale."""
    import matplotlib.pyplot as plt
    colors = {"rollout": "#4C72B0", "reward": "#8172B3", "logprob": "#CCB974", "update": "#DD8452",
              "drafter": "#55A868"}
    total = {n: sum(float(v) for k, v in phases[n].items() if k in colors) for n in phases}
    fastest = min(total.values())
    groups = [[n for n in phases if total[n] <= 20 * fastest], [n for n in phases if total[n] > 20 * fastest]]
    groups = [g for g in groups if g]
    fig, axes = plt.subplots(1, len(groups), figsize=(6.4, 3.6), squeeze=False,
                             gridspec_kw={"width_ratios": [len(g) for g in groups]})
    for ax, names in zip(axes[0], groups):
        bottom = np.zeros(len(names))
        for part, color in colors.items():
            vals = np.array([float(phases[n].get(part, 0.0)) for n in names])
            ax.bar(names, vals, bottom=bottom, color=color, label=part)
            if part == "rollout":
                for i, (v, n) in enumerate(zip(vals, names)):
                    ax.text(i, v / 2, f"{v / total[n]:.0%}", ha="center", va="center", color="white", fontsize=8)
            bottom += vals
        for i, n in enumerate(names):
            lo_hi = phases[n].get("spread", {}).get("step")
            if lo_hi and "step" in phases[n]:
                med = float(phases[n]["step"])
                ax.errorbar(i, med, yerr=[[med - lo_hi[0]], [lo_hi[1] - med]], fmt="_", color="k", capsize=4,
                            label="step: median, IQR" if i == 0 else None)
        ax.set_ylabel("seconds per step")
    fig.suptitle(title, fontsize=11)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def reward_curves(reward_by_step: dict[str, list[list[float]]], title: str = "Reward per RL step (mean +- std over "
                                                                             "seeds)"):
    """One line per policy with a band of one standard deviation: ``{policy: [[reward of each seed] per step]}``."""
    fig, ax = _fig()
    for name, rows in reward_by_step.items():
        r = np.asarray(rows, dtype=float)
        x = np.arange(1, len(r) + 1)
        mean, std = r.mean(1), r.std(1)
        ax.plot(x, mean, marker="o", markersize=3, label=name)
        ax.fill_between(x, mean - std, mean + std, alpha=0.25)
    return _finish(fig, ax, title, "RL step", "mean reward", legend={"fontsize": 8})


def acceptance_curves(acceptance: list[dict], strategy: str = "chain-8",
                      title: str = "Accepted length per RL step: the drafter the policy leaves behind",
                      online_label: str = "online drafter (trained each step)"):
    """Accepted tokens per SD step after every RL step, for the drafters the rows hold: ``online``, ``frozen``,
    ``ngram``, ``one_process`` (the one-process online drafter beside a spot-trained one)."""
    fig, ax = _fig()
    steps = [a["step"] for a in acceptance]
    for key, label, style in (("online", online_label, "-o"), ("one_process", "one-process online drafter", "-.d"),
                              ("frozen", "frozen warm drafter", "--s"), ("ngram", "n-gram drafter", ":^")):
        if all(a.get(key) is not None for a in acceptance):
            ax.plot(steps, [a[key] for a in acceptance], style, markersize=3, label=label)
    ax.set_ylim(bottom=1.0)
    return _finish(fig, ax, title, "RL step", f"accepted length ({strategy}, bonus included)",
                   legend={"fontsize": 7})


PHASE_COLORS = {"rollout": "tab:blue", "training": "tab:green", "sync": "tab:red", "update": "tab:gray",
                "update sync": "tab:orange", "drafter": "tab:olive"}


def worker_gantt(timeline: list[list], title: str = "One RL step on every worker"):
    """Gantt chart of one step: per worker (rank) the spans ``(phase, start_s, end_s)`` of its rollout, the spot
    trainer's drafter training in the idle window, the drafter sync and the update (``sched/timeline``)."""
    fig, ax = _fig(7.0, 1.4 + 0.55 * len(timeline))
    seen = set()
    for r, events in enumerate(timeline):
        for name, a, b in events:
            ax.barh(r, b - a, left=a, height=0.6, color=PHASE_COLORS.get(name, "black"),
                    label=None if name in seen else name, edgecolor="white", linewidth=0.3)
            seen.add(name)
        end = max(b for n, a, b in events if n == "rollout")
        last = max(max(b for n, a, b in ev if n == "rollout") for ev in timeline)
        if last > end:
            ax.plot([end, last], [r - 0.38, r - 0.38], color="black", lw=0.8)    # the idle window
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in range(len(timeline))])
    ax.invert_yaxis()
    return _finish(fig, ax, title, "seconds since the step's rollout started", legend={
        "fontsize": 7, "ncol": 6, "loc": "upper center", "bbox_to_anchor": (0.5, -0.45), "frameon": False})


def harvest_bars(steps: list[dict], title: str = "Idle worker-time and what the spot trainer harvested"):
    """Per RL step: the workers' idle seconds (summed over ranks) and the seconds of it spent training the drafter,
    with the harvested share on top."""
    fig, ax = _fig()
    x = np.arange(1, len(steps) + 1)
    idle = [m["sched/idle_s"] for m in steps]
    train = [m["sched/train_s"] for m in steps]
    ax.bar(x, idle, color="lightgray", label="idle worker-seconds")
    ax.bar(x, train, width=0.5, color="tab:green", label="drafter training in them")
    for xi, i, t in zip(x, idle, train):
        if i > 0:
            ax.text(xi, i, f"{t / i:.0%}", ha="center", va="bottom", fontsize=7)
    return _finish(fig, ax, title, "RL step", "seconds (summed over workers)", legend={"fontsize": 7})


def idle_share_curve(estimated: dict, measured: dict | None = None,
                     title: str = "Idle share of the rollout vs data-parallel workers"):
    """Idle share of worker-time against W: ``estimated`` {W: share} (the step-count model on measured response
    lengths) as a line, ``measured`` {W: share} (data-parallel runs) as points."""
    fig, ax = _fig()
    ws = sorted(estimated)
    ax.plot(ws, [100 * estimated[w] for w in ws], "-o", markersize=3, label="step-count model, measured lengths")
    if measured:
        ax.plot(sorted(measured), [100 * measured[w] for w in sorted(measured)], "s", color="tab:red",
                label="measured (wall time, data-parallel run)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ws, [str(w) for w in ws])
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, title, "workers W (whole GRPO groups per worker)", "idle share of worker-time (%)",
                   legend={"fontsize": 7})


def accept_bars(values: dict, strategy: str = "chain-8", title: str = "Accepted length of the drafters"):
    """One bar per drafter/policy pairing: ``{label: accepted length}``."""
    fig, ax = _fig()
    labels = list(values)
    bars = ax.bar(range(len(labels)), [values[k] for k in labels], color=["tab:gray", "tab:orange", "tab:green",
                                                                           "tab:blue"][:len(labels)])
    for b, k in zip(bars, labels):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{values[k]:.2f}", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    return _finish(fig, ax, title, ylabel=f"accepted length ({strategy}, bonus included)")


def drift_panels(evals: list[dict], acceptance: list[dict], labels: list[str], strategy: str = "chain-6",
                 title: str = "A long RL run: held-out accuracy and the drafters' accepted length"):
    """Two panels by RL step: the held-out greedy accuracy (``evals``: ``{"step", "eval/accuracy"}``) and the
    accepted length of the drafters ``labels`` of the probe rows (``online``, ``frozen``, ``online@<step>``: a copy
    of the online drafter frozen after that step, drawn from the step it was taken)."""
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10.0, 3.6))
    a.plot([e["step"] for e in evals], [e["eval/accuracy"] for e in evals], "-o", markersize=3)
    a.set_xlabel("RL step")
    a.set_ylabel("held-out greedy accuracy")
    a.set_title("Held-out accuracy", fontsize=9)
    names = {"online": "online drafter (trained each step)", "frozen": "warm drafter, frozen"}
    for k in labels:
        pts = [(r["step"], r[k]) for r in acceptance if r.get(k) is not None]
        b.plot(*zip(*pts), "-o" if k == "online" else "--s", markersize=3,
               label=names.get(k, f"online drafter frozen after step {k.partition('@')[2]}"))
    b.set_ylim(bottom=1.0)
    b.set_xlabel("RL step")
    b.set_ylabel(f"accepted length ({strategy}, bonus included)")
    b.set_title("Accepted length on the current policy", fontsize=9)
    b.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
