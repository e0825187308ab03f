"""Notebook 07's figures: the paper's number, the simulator's projection and this project's measurement, side by side
(on the same axes where their units agree); the legend says what each point is (markers: star = paper, line =
simulated, filled circle = measured here) and a line under the figure names the files and runs it was drawn from.

Paper: TLT Table 3 / Fig. 11, Table 4, Fig. 14, Table 6, Fig. 7, Fig. 1b. Departures: none (figures).
"""
from __future__ import annotations

from ..lab.plots import _finish, _log_x
from .numbers import PAPER

PAPER_STYLE = {"marker": "*", "markersize": 12, "linestyle": "none"}
MEASURED_STYLE = {"marker": "o", "markersize": 7, "linestyle": "none"}


def _axes(n: int, width: float = 11.0, height: float = 3.8):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, n, figsize=(width, height))
    return fig, axes


def _sources(fig, *texts: str):
    """A line under the figure naming where its data come from (kept by ``savefig(bbox_inches="tight")``)."""
    shown = "; ".join(t for t in texts if t)
    if shown:
        fig.text(0.01, -0.01, f"Data: {shown}", fontsize=6.5, color="0.35", ha="left", va="top")
    return fig


def e2e_speedup(projection: dict[str, list[dict]], measured: dict):
    """(a) Left: TLT's step speedup by nodes of 8 H100 per model, the paper's Table 3 and the simulator's
    projection (``{model: project() rows}``). Right: what was measured here by workers (one process, 2 workers) with
    TRL's speed relative to the tltlib baseline (:func:`tltlib.paper.reproduce.measured_e2e`)."""
    fig, (ax, bx) = _axes(2)
    colors = {"qwen2.5-7b": "#4C72B0", "qwen2.5-32b": "#C44E52"}
    for model, rows in projection.items():
        c = colors.get(model, "0.3")
        fit = [r for r in rows if "oom" not in r]
        ax.plot([r["nodes"] for r in fit], [r["speedup"] for r in fit], color=c, label=f"{model}: simulated")
        paper = [(n, v) for n, v in PAPER["table3"].get(model, {}).items() if v]
        ax.plot(*zip(*paper), color=c, label=f"{model}: paper (Table 3)", **PAPER_STYLE)
        for r in rows:
            if "oom" in r:
                ax.annotate("OOM", (r["nodes"], 1.0), color=c, ha="center", fontsize=8)
    ax.axhline(1.0, color="0.5", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], labels=["1", "2", "4", "8"])
    _finish(fig, ax, "End to end at the paper's scale", "nodes (8 H100 each)", "step speedup over the baseline",
            legend={"fontsize": 7})
    workers = sorted(measured["tlt"])
    bx.plot(workers, [measured["tlt"][w] for w in workers], color="#55A868", label="TLT: measured here",
            **MEASURED_STYLE)
    for i, (name, speed) in enumerate(measured["trl"].items()):
        bx.plot([1], [speed], color=("#8172B2", "#937860")[i % 2], label=f"{name} (its speed): measured here",
                **{**MEASURED_STYLE, "marker": "s"})
    bx.axhline(1.0, color="0.5", linewidth=0.8)
    bx.set_xticks([1, 2], labels=["1 process", "2 workers"])
    bx.set_xlim(0.5, 2.5)
    _finish(fig, bx, "Measured here: tiny reasoner, 2-core CPU", "workers",
            "step speed relative to the tltlib baseline", legend={"fontsize": 7})
    return _sources(fig, "simulated: tltlib.paper.project (roofline presets, lengths from bench e2e_grpo)",
                    measured.get("source", ""))


def sd_by_batch(simulated: dict[int, dict[int, float]], measured: dict[str, dict[str, dict[int, float]]],
                source: str = ""):
    """(b) SD speedup by batch size: the paper's Table 4 and the simulation of its setting per tokens to verify
    (left), and this project's measurements per strategy and device (right; ``{device label: measure_sd()}``);
    ``source``: the files the measurements come from."""
    import matplotlib
    fig, (ax, bx) = _axes(2)
    cmap = matplotlib.colormaps["viridis"]
    verify = PAPER["table4_verify"]
    batches = sorted(PAPER["table4"])
    for i, v in enumerate(verify):
        c = cmap(i / max(1, len(verify) - 1))
        ax.plot(batches, [PAPER["table4"][b][i] for b in batches], color=c, label=f"verify {v}: paper", **PAPER_STYLE)
        if v in simulated:
            ax.plot(sorted(simulated[v]), [simulated[v][b] for b in sorted(simulated[v])], color=c,
                    label=f"verify {v}: simulated")
    _log_x(ax)
    ax.axhline(1.0, color="0.5", linewidth=0.8)
    _finish(fig, ax, "Qwen2.5-32B, TP 4, H100 (Table 4)", "batch size", "SD speedup", legend={"fontsize": 6,
                                                                                            "ncol": 2})
    styles = ["-", "--", ":", "-."]
    for j, (device, per_strategy) in enumerate(measured.items()):
        for k, (name, by_batch) in enumerate(per_strategy.items()):
            b = sorted(by_batch)
            bx.plot(b, [by_batch[x] for x in b], marker="o", markersize=4, linestyle=styles[j % 4],
                    color=matplotlib.colormaps["tab10"](k % 10), label=f"{name}, {device}")
    _log_x(bx)
    bx.axhline(1.0, color="0.5", linewidth=0.8)
    _finish(fig, bx, "Measured here (T=0.9)", "batch size", "SD speedup", legend={"fontsize": 6})
    return _sources(fig, "simulated: tltlib.paper.simulated_sd (H100 roofline)", source)


def case_study(simulated: dict, measured: dict | None, threshold: int = 32):
    """(c) Running requests over the rollout (time as a share of the plain rollout's), without SD and with SD at or
    below ``threshold``: simulated at the paper's case (left) and measured here (right: ``{"plain": timeline,
    "tlt": timeline}``)."""
    fig, (ax, bx) = _axes(2)
    end = simulated["plain"].time_s
    for name, sim, c in (("no SD", simulated["plain"], "0.4"), ("TLT", simulated["tlt"], "#55A868")):
        t = [0.0] + [x / end for x, _, _ in sim.timeline]
        rows = [sim.timeline[0][1]] + [r for _, r, _ in sim.timeline]
        ax.step(t, rows, where="pre", color=c, label=f"{name}: simulated")
    ax.axhline(threshold, color="k", linestyle="--", linewidth=1, label=f"threshold {threshold}")
    ax.set_yscale("log")
    _finish(fig, ax, f"Qwen2.5-32B TP 4, 128 requests: simulated {simulated['speedup']:.2f}x, paper "
            f"{PAPER['case_study']['rollout_speedup']:.2f}x", "time / no-SD rollout time", "running requests",
            legend={"fontsize": 7})
    if measured:
        from .reproduce import timeline_rows
        end = timeline_rows(measured["plain"])[0][-1]
        for name, key, c in (("no SD", "plain", "0.4"), ("TLT", "tlt", "#55A868")):
            t, rows, on = timeline_rows(measured[key])
            bx.step(t / end, rows, where="post", color=c, label=f"{name}: measured here")
            if on.any():
                bx.plot(t[on] / end, rows[on], ".", color=c, markersize=3)
        bx.axhline(threshold, color="k", linestyle="--", linewidth=1)
        bx.set_yscale("log")
    _finish(fig, bx, f"Tiny reasoner, CPU: measured {measured['speedup']:.2f}x" if measured else "",
            "time / no-SD rollout time", "running requests", legend={"fontsize": 7})
    return _sources(fig, "simulated: tltlib.paper.simulated_case_study", (measured or {}).get("source", ""))


def drift(measured: dict):
    """(d) Accept length per RL step of the drafter trained online and kept frozen (measured here), and the paper's
    Table 6 pair (its model, after RL)."""
    fig, (ax, bx) = _axes(2, 10.0, 3.6)
    ax.plot(measured["step"], measured["online"], marker="o", color="#55A868", label="trained online: measured here")
    ax.plot(measured["step"], measured["frozen"], marker="o", color="0.4", label="frozen: measured here")
    _finish(fig, ax, "Tiny reasoner, drifted warm-up drafter", "RL step", "accept length (chain-8)",
            legend={"fontsize": 7})
    p = measured["paper"]
    bx.bar(["frozen\n(pre-RL target)", "adaptive"], [p["frozen"], p["adaptive"]], color=["0.6", "#55A868"])
    for i, v in enumerate((p["frozen"], p["adaptive"])):
        bx.annotate(f"{v:.2f}", (i, v), ha="center", va="bottom")
    _finish(fig, bx, "Paper, Table 6 (Qwen2.5-7B after RL)", None, "accept length")
    return _sources(fig, measured.get("source", ""))


def idle_vs_workers(simulated: dict, measured: dict):
    """(f) Idle share of the baseline's rollout and the share of it the spot trainer harvests, by rollout workers:
    simulated at the paper's setting and measured here."""
    fig, ax = _axes(1, 6.5, 3.8)
    ax.plot(simulated["workers"], simulated["idle"], color="#C44E52", marker=".", label="idle share: simulated")
    ax.plot(simulated["workers"], simulated["harvested"], color="#55A868", marker=".",
            label="harvested share of it: simulated")
    ax.plot([1] + measured["workers"], [0.0] + measured["idle"], color="#C44E52", label="idle share: measured here",
            **MEASURED_STYLE)
    ax.plot(measured["workers"], measured["harvested"], color="#55A868", label="harvested: measured here",
            **MEASURED_STYLE)
    ax.set_xscale("log", base=2)
    ticks = sorted(set([1] + simulated["workers"] + measured["workers"]))
    ax.set_xticks(ticks, labels=[str(t) for t in ticks])
    ax.set_ylim(-0.02, 1.05)
    _finish(fig, ax, "Idle rollout workers and what the spot trainer harvests", "rollout workers",
            "share", legend={"fontsize": 7})
    return _sources(fig, "simulated: tltlib.paper.simulated_idle (Qwen2.5-7B, TP 4)", measured.get("source", ""))

