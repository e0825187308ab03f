"""The TRL tables: ``bench trl_tlt`` (TRL's GRPOTrainer with its own generation, with tltlib's rollout and SD off,
and with TLT through ``rollout_func``): phases, the comparison against its Amdahl bound, reward curves, held-out
accuracy, and the two-process run's harvested idle time.

Departures: none (tooling).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

from .format import md_table, pct, x, x_vs

ARMS = (("trl", "TRL tuned, its own generation"), ("tlt-off", "TRL + tltlib rollout, SD off"),
        ("tlt", "**TRL + tltlib rollout, TLT**"))
GENERATION_GOAL = 3.0
"""The issue's goal: TRL + TLT's generation phase >= 3x TRL tuned's own generation on this CPU."""
BOUND_GOAL = 0.9
"""The step speedup at >= 90% of its Amdahl bound."""


def _s(v) -> str:
    return "—" if v is None else f"{v:.2f}"


def _ms(v) -> str:
    return "—" if not v else f"{1000 * v:.1f} ms"


def phases(stem: str) -> Callable:
    """Median seconds per RL step by phase of each arm, and each arm against TRL's own generation."""
    def render(r) -> str:
        s = r.json(stem)["summary"]
        trl = s.get("trl")
        rows = [[label, _s(s[k]["generate"]), _s(s[k]["rollout"]), _s(s[k]["drafter"] or None),
                 _ms(s[k]["weight_sync"]), _s(s[k]["step"]), _s(s[k]["accept_len"]), _s(s[k].get("first_step_extra")),
                 x(trl["generate"] / s[k]["generate"]) if trl else "—", x(trl["step"] / s[k]["step"]) if trl else "—"]
                for k, label in ARMS if k in s]
        return md_table(["arm", "generation phase (s)", "rollout", "drafter training", "weight sync", "step",
                         "accept length", "first step's generation: extra", "generation vs TRL's", "step vs TRL's"],
                        rows)
    return render


def numbers(stem: str) -> Callable:
    """TLT against TRL's own generation and against SD off: generation speedup (the goal beside it), the step against
    its Amdahl bound, reward bands' overlap and held-out accuracy (Welch's p over the seeds)."""
    def render(r) -> str:
        s = r.json(stem)["summary"]
        rows = []
        for base, label in ARMS[:2]:
            c = s["comparison"].get(base)
            if c is None:
                continue
            held = f"{statistics.mean(s[base]['held_out']):.3f} / {statistics.mean(s['tlt']['held_out']):.3f}"
            p = c.get("held_out_welch_p")
            met = "met" if c["generation_speedup"] >= GENERATION_GOAL else "not met"
            goal = f" (goal {x(GENERATION_GOAL, 0)}: {met})" if base == "trl" else ""
            rows.append([label.strip("*"), x_vs(c["generation_speedup"], GENERATION_GOAL) + goal,
                         x(c["amdahl_bound"]), x(c["step_speedup"]), pct(c["of_bound"]) + (
                             f" ({'met' if c['of_bound'] >= BOUND_GOAL else 'not met'})" if base == "trl" else ""),
                         pct(c["reward_curves_overlap_frac"]), held + ("" if p is None else f" (p = {p:.2f})")])
        return md_table(["TLT against", "generation phase speedup", "Amdahl bound", "step speedup",
                         "step / bound (goal 90%)", "steps whose reward bands overlap",
                         "held-out accuracy, it / TLT (Welch p)"], rows)
    return render


def rewards(stem: str) -> Callable:
    """Reward per RL step, mean +- std over the seeds, per arm."""
    def render(r) -> str:
        s = r.json(stem)["summary"]
        arms = [(k, label) for k, label in ARMS if k in s]

        def band(v):
            v = [a for a in v if a is not None]
            m = statistics.mean(v)
            return f"{m:.3f} +- {statistics.pstdev(v):.3f}"
        steps = len(s[arms[0][0]]["reward_by_step"])
        return md_table(["step", *(label.strip("*") for _, label in arms)],
                        [[k + 1, *(band(s[a]["reward_by_step"][k]) for a, _ in arms)] for k in range(steps)])
    return render


def two_processes(stem: str) -> Callable:
    """The TLT arm as two processes: per step the idle share of the processes' rollout time and the share the spot
    trainer harvested for the drafter."""
    def render(r) -> str:
        d = r.json(stem)
        two = d.get("two_processes")
        if not two:
            return "(no two-process run in this file)"
        rows = [[k + 1, pct(st.get("sched/idle_frac", 0.0)), pct(st.get("sched/harvested", 0.0)),
                 f"{st.get('sched/micro_steps', 0):.0f}", f"{st.get('sched/preempt_micro_steps', 0):.2f}"]
                for k, st in enumerate(t for t in two["sched"] if t)]
        return md_table(["step", "idle share of rollout time", "harvested by the spot trainer", "drafter micro-steps",
                         "preemption (micro-steps)"], rows)
    return render


RENDERERS: dict[str, Callable] = {
    **{f"trl_tlt{tag}_{name}": make(f"trl_tlt-cpu-float32{stem}")
       for tag, stem in (("", ""), ("_smollm2", "-smollm2"))
       for name, make in (("phases", phases), ("numbers", numbers), ("rewards", rewards),
                          ("two", two_processes))},
}
"""The TRL renderers a doc can name (``<!-- report: NAME -->``)."""
