"""The GRPO tables: ``bench e2e_grpo``'s phases and numbers, TRL as the peer, the drafter's drift, the spot trainer
on 2 workers and notebooks 05 and 06's canonical runs.

Departures: none (tooling).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from .format import bold, md_table, n, pct, x


def _phase(s: dict, key: str) -> str:
    v = s.get(key)
    return "—" if not v else f"{v:.2f}"


def e2e_phases(stem: str) -> Callable:
    """Median seconds per RL step by phase of the baseline and TLT (``bench e2e_grpo``), the step's interquartile
    range in brackets."""
    def render(r) -> str:
        d = r.json(stem)
        s = d["summary"]
        tlt = ("**TLT** (adaptive SD + spot trainer)" if d.get("workers", 1) > 1
               else "**TLT** (adaptive SD + online drafter)")
        rows = []
        for label, key in (("baseline (plain decoding)", "baseline"), (tlt, "tlt"),
                           ("TLT, drafter frozen", "tlt-frozen")):
            if key not in s:
                continue
            p = s[key]
            lo, hi = p.get("spread", {}).get("step", (None, None))
            speed = 1.0 if key == "baseline" else (s["comparison"]["step_speedup"] if key == "tlt"
                                                  else s["comparison-frozen"]["step_speedup"])
            rows.append([label, _phase(p, "rollout"), _phase(p, "update"), _phase(p, "drafter"),
                         f"{p['step']:.2f}" + (f" [{lo:.2f}-{hi:.2f}]" if lo is not None else ""), x(speed),
                         pct(p["rollout"] / p["step"])])
        return md_table(["policy", "rollout", "update", "drafter training", "step", "speedup", "rollout share"], rows)
    return render


def e2e_numbers(stem: str) -> Callable:
    """The comparison's derived numbers: rollout speedup, the Amdahl bound and how much of it the step reached, the
    drafter's share, the reward curves' overlap and the held-out accuracy of both (Welch's p over the seeds)."""
    def render(r) -> str:
        d = r.json(stem)
        s, c = d["summary"], d["summary"]["comparison"]
        held = lambda k: s[k].get("held_out") or []                                  # noqa: E731
        acc = (f"{statistics.mean(held('baseline')):.3f} / {statistics.mean(held('tlt')):.3f}"
               if held("baseline") and held("tlt") else "—")
        p = c.get("held_out_welch_p")
        return md_table(["rollout speedup", "Amdahl bound", "step speedup / bound", "drafter share of TLT's step",
                         "steps whose reward bands overlap", "held-out accuracy, baseline / TLT (Welch p)"],
                        [[x(c["rollout_speedup"]), x(c["amdahl_bound"]), pct(c["of_bound"]),
                          pct(c["drafter_share_of_tlt_step"], 1), pct(c["reward_curves_overlap_frac"]),
                          acc + ("" if p is None else f" (p = {p:.2f})")]])
    return render


TRL_LABELS = {"defaults": "TRL defaults (bf16 autocast, checkpointing, 8-row micro-batches)", "no-bf16": "TRL no-bf16",
              "no-bf16-no-ckpt": "TRL no-bf16-no-ckpt",
              "tuned": "**TRL tuned** (+ 32-row micro-batches, continuous batching)"}


def trl_runs(stem: str) -> Callable:
    """TRL's GRPOTrainer on the bench's workload, one row per setting (median seconds per step by phase) beside
    tltlib's baseline, and its step against the baseline's."""
    def render(r) -> str:
        d = r.json(stem)
        base, runs = d["summary"]["baseline"], d["trl_comparison"]["runs"]
        rows = [["tltlib baseline", f"{base['rollout']:.2f}", None, None, f"{base['update']:.2f}",
                 f"{base['step']:.2f}",
                 x(1.0)]]
        for name, run in runs.items():
            m = run["median"]
            rows.append([TRL_LABELS.get(name, f"TRL {name}"), f"{m['generate']:.2f}", f"{m['loss_forward']:.2f}",
                         f"{m['backward']:.2f}", f"{m['update']:.2f}", f"{m['step']:.2f}",
                         bold(x(run["vs_baseline"]["step"]), name in ("defaults", "tuned"))])
        return md_table(["run", "generate (tltlib: rollout)", "loss forward", "backward",
                         "forward + backward (tltlib: update)", "step", "TRL step / tltlib baseline step"], rows)
    return render


def trl_ladder(stem: str) -> Callable:
    """What each setting costs TRL: each run against the next, phase time before / after."""
    def render(r) -> str:
        ladder = r.json(stem)["trl_comparison"]["ladder"]
        return md_table(["from", "to", "generate", "loss forward", "backward", "step"],
                        [[s["from"], s["to"], x(s["generate"]), x(s["loss_forward"]), x(s["backward"]), x(s["step"])]
                         for s in ladder])
    return render


def acceptance_curve(stem: str, steps: Sequence[int] | None = None,
                     series: Sequence[tuple[str, str]] = (("online drafter", "online"), ("frozen drafter", "frozen"),
                                                          ("n-gram", "ngram"))) -> Callable:
    """Accepted length per RL step of each drafter series (``bench e2e_grpo``'s probe), the last step in bold."""
    def render(r) -> str:
        acc = r.json(stem)["acceptance"]
        kept = [a for a in acc if steps is None or a["step"] in steps]
        header = ["RL step", *[str(a["step"]) for a in kept]]
        rows = [[label, *[bold(f"{a[key]:.2f}", a is kept[-1] and key != "ngram") for a in kept]]
                for label, key in series if key in kept[0]]
        return md_table(header, rows)
    return render


def spot_trainer(stem: str) -> Callable:
    """The spot trainer's schedule on W workers (``bench e2e_grpo --workers W``): idle share, harvested, overhead on
    the critical path, preemption latency, micro-steps."""
    def render(r) -> str:
        s = r.json(stem)["summary"]
        sch = s["schedule"]
        return md_table(["idle share of the workers' rollout time (baseline / TLT)", "harvested for the drafter",
                         "overhead on the critical path", "preemption, worst (micro-steps)",
                         "spot micro-steps per step",
                         "spot-trained / frozen / one-process online drafter, last step"],
                        [[f"{pct(s['schedule_baseline']['idle_frac'])} / {pct(sch['idle_frac'])}",
                          pct(sch["harvested_total"]), pct(sch["overhead_share"], 2),
                          f"{sch['preempt_micro_steps_max']:.2f}", f"{sch['micro_steps']:.0f}",
                          " / ".join("—" if s["accept_last"].get(k) is None else f"{s['accept_last'][k]:.2f}"
                                     for k in ("spot", "frozen", "one_process_online"))]])
    return render


def update_speed(stem: str) -> Callable:
    """The update's tokens/s with length-bucketed micro-batches against padded micro-batches in arrival order."""
    def render(r) -> str:
        u = r.json(stem)["update_speed"]
        return md_table(["micro-batches", "tokens/s", "padded tokens", "micro-batches per update"],
                        [[name, n(v["tokens_per_s"]), n(v["padded_tokens"]), v["micro_batches"]]
                         for name, v in u.items() if isinstance(v, dict)])
    return render


def canonical_grpo(folder: str = "figures") -> Callable:
    """Notebook 05's canonical run (figures and metrics in ``folder``): step and rollout speedups, the bound, the
    drafter's share, the reward bands' overlap and the held-out accuracy."""
    def render(r) -> str:
        m = r.canonical("05_grpo_with_tlt", folder)
        return md_table(["step speedup", "rollout speedup", "Amdahl bound", "drafter share", "reward bands overlap",
                         "held-out accuracy: before / baseline / TLT",
                         "accepted length at the last step: online / frozen"],
                        [[x(m["e2e/step_speedup"]), x(m["e2e/rollout_speedup"]), x(m["e2e/amdahl_bound"]),
                          pct(m["e2e/drafter_share"], 1), pct(m["e2e/reward_overlap"]),
                          f"{m['eval/accuracy_before']:.3f} / {m['eval/accuracy_baseline']:.3f} / "
                          f"{m['eval/accuracy_tlt']:.3f}",
                          f"{m['spec/accept_len_online_last']:.2f} / {m['spec/accept_len_frozen_last']:.2f}"]])
    return render


def canonical_spot(folder: str = "figures") -> Callable:
    """Notebook 06's canonical run (figures and metrics in ``folder``): the spot trainer on 2 workers."""
    def render(r) -> str:
        m = r.canonical("06_idle_time_drafter_training", folder)
        return md_table(["workers", "idle share", "harvested", "overhead on the critical path",
                         "preemption, worst (micro-steps)", "accepted length: spot-trained / frozen"],
                        [[f"{m['sched/workers']:.0f}", pct(m["sched/idle_frac"]), pct(m["sched/harvested"]),
                          pct(m["sched/overhead_share"], 2), f"{m['sched/preempt_micro_steps']:.2f}",
                          f"{m['spec/accept_len_spot_last']:.2f} / {m['spec/accept_len_frozen_last']:.2f}"]])
    return render


def drafter_train(stem: str, steps=(1, 5, 10, 15, 20)) -> Callable:
    """``bench drafter_train``: ``tlt.drafter_train: always`` beside ``on_drift``: the drafter's compute, the accept
    length of the rollouts' SD steps (at some steps, the mean, the last 5), the final probe, the alarms that fired;
    then on_drift over always."""
    def render(r) -> str:
        d = r.json(stem)
        runs, summ, probe = d["runs"], d["summary"], d["settings"]["probe_strategy"]
        f2 = lambda v: "—" if v is None else f"{v:.2f}"                       # noqa: E731
        at = lambda m, k: f2(runs[m]["steps"][k - 1]["spec/accept_len_mean"]) if k <= len(runs[m]["steps"]) else "—"
        rows = [[m, f"{summ[m]['micro_steps']:.0f} in {summ[m]['trained_steps']} of {len(runs[m]['steps'])} steps",
                 f"{summ[m]['drafter_s']:.1f}", *[at(m, k) for k in steps], f2(summ[m]["accept_mean"]),
                 f2(summ[m]["accept_last5"]), f"{summ[m]['probe_first']:.2f} → {summ[m]['probe_last']:.2f}",
                 summ[m]["alarms"]] for m in runs]
        table = md_table(["drafter_train", "drafter micro-steps", "drafter s", *[f"accept, step {k}" for k in steps],
                          "accept, mean", "accept, last 5", f"probe ({probe}), first → last", "alarms"], rows)
        ratio = summ.get("on_drift_vs_always")
        if not ratio:
            return table
        return table + (f"\n\non_drift / always: final probe accept length {ratio['probe_last']:.3f}x, accept length "
                        f"of the last 5 steps {ratio['accept_last5']:.3f}x, for {ratio['micro_steps']:.2f}x the "
                        f"drafter's micro-steps ({ratio['drafter_s']:.2f}x its seconds). Every step: "
                        f"{r.link(stem)}.")
    return render


RENDERERS: dict[str, Callable] = {
    "drafter_train": drafter_train("drafter_train-cpu-float32"),
    "e2e_phases": e2e_phases("e2e_grpo-cpu-float32"),
    "e2e_numbers": e2e_numbers("e2e_grpo-cpu-float32"),
    "e2e_update": update_speed("e2e_grpo-cpu-float32"),
    "trl_runs": trl_runs("e2e_grpo-cpu-float32"),
    "trl_ladder": trl_ladder("e2e_grpo-cpu-float32"),
    "canonical_grpo": canonical_grpo(),
    "drift_curve": acceptance_curve("e2e_grpo-cpu-float32-drift"),
    "drift_phases": e2e_phases("e2e_grpo-cpu-float32-drift"),
    "drift_keep_curve": acceptance_curve("e2e_grpo-cpu-float32-drift-keep"),
    "drift_keep_phases": e2e_phases("e2e_grpo-cpu-float32-drift-keep"),
    "w2_phases": e2e_phases("e2e_grpo-cpu-float32-w2"),
    "w2_spot": spot_trainer("e2e_grpo-cpu-float32-w2"),
    "w2_drift_curve": acceptance_curve("e2e_grpo-cpu-float32-w2-drift", (1, 2, 4, 6, 8, 10),
                                       (("spot-trained drafter", "online"), ("frozen drafter", "frozen"))),
    "w2_drift_phases": e2e_phases("e2e_grpo-cpu-float32-w2-drift"),
    "w2_drift_spot": spot_trainer("e2e_grpo-cpu-float32-w2-drift"),
    "w2_drift_all_curve": acceptance_curve("e2e_grpo-cpu-float32-w2-drift-all", (1, 2, 3, 4, 6, 8, 10),
                                           (("spot-trained drafter, everyone's pairs", "online"),
                                            ("frozen drafter", "frozen"))),
    "w2_drift_all_spot": spot_trainer("e2e_grpo-cpu-float32-w2-drift-all"),
    "canonical_spot": canonical_spot(),
}
"""The GRPO renderers a doc can name (``<!-- report: NAME -->``)."""
