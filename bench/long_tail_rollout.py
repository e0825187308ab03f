"""A GRPO-sized rollout with a long tail, under every SD policy: no SD, always-SD with each fixed strategy,
threshold + fixed strategy, and adaptive (threshold + BEG-MAB), with the learned EAGLE drafter and with the
model-free n-gram drafter. Total rollout time, ratios, and token identity at temperature 0.

Workload: ``--prompts`` held-out chain problems x ``--group`` samples at ``--temperature`` on the tiny reasoner
(the notebook-01 rollout: a few responses run ~15x longer than the median). Every policy runs the same prompts with
the same seed, side by side in one process, after a common warm-up; the adaptive controllers first tune on
``--tune-rollouts`` rollouts of other prompts (as they would on the previous RL steps: the controller lives across
the whole RL run), then are timed. Time = wall time of ``RolloutEngine.generate`` (median of ``--repeats``,
policies interleaved; each repeat samples with its own seed, shared by all policies, so the median also spans
different draws of the long tail: at temperature > 0 SD and plain decoding draw different, equally distributed,
responses). "best fixed" = the fastest policy that plays one strategy (always, or below the threshold)
with the same drafter family. "per-bucket oracle" = in hindsight, the fastest of no-SD and each always-strategy
(with --no-always: each threshold strategy) in every batch-size bucket of the tuner, summed: the most any per-bucket
tuner could achieve on this workload.

    python -m tltlib bench long_tail_rollout                 # CPU, ~15 min
    python -m tltlib bench long_tail_rollout --prompts 16    # the paper's Fig. 14 case study size: 128 requests
    python -m tltlib bench long_tail_rollout --device cuda --dtype bfloat16

An ``off`` arm (default) lets BEG-MAB play plain steps where no SD strategy pays; it is not run as a fixed policy
(that is "no SD"). ``--no-always`` skips the always-SD policies, which on a real model on a CPU spend most of the
run's time at batch sizes where SD loses.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TASK_HELP, ensure_malloc_env, machine_info, markdown_table, model_suffix, task_prompts, timed, write_results  # noqa: E402,E501


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="data/tiny-reasoner")
    ap.add_argument("--drafter", default="data/tiny-reasoner-drafter")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--task", default="chain", choices=["chain", "words"], help=TASK_HELP)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--max-new", type=int, default=720)
    ap.add_argument("--arms", default="off;chain-4;chain-8;chain-16;chain-32;tree-6x4-24;ngram-4",
                    help="';'-separated strategies of the learned-drafter adaptive policy (each SD one also runs "
                         "fixed); 'off' lets the tuner fall back to plain steps, as TrainerConfig.arms does")
    ap.add_argument("--ngram-arms", default="off;ngram-2;ngram-4",
                    help="arms of the n-gram-only adaptive policy (no learned drafter)")
    ap.add_argument("--threshold", type=int, default=None, help="adaptive SD threshold (default: per device)")
    ap.add_argument("--fixed-threshold", type=int, default=32, help="threshold of the threshold + fixed policies")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tune-rollouts", type=int, default=3,
                    help="rollouts of other prompts the adaptive controllers learn on before they are timed")
    ap.add_argument("--no-identity", action="store_true", help="skip the temperature-0 identity check")
    ap.add_argument("--no-always", action="store_true",
                    help="skip the always-SD policies (slow where SD loses at large batches); the per-bucket oracle "
                         "then takes the threshold policies, equal to always-SD below the threshold")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ensure_malloc_env()

    import numpy as np
    import torch

    from tltlib.adaptive import AdaptiveConfig, AdaptiveController, TunerConfig, default_threshold, measure_costs
    from tltlib.checkpoint import load
    from tltlib.profiling import per_bucket_oracle, time_by_bucket
    from tltlib.rollout import RolloutConfig, RolloutEngine
    from tltlib.sampling import SamplingConfig
    from tltlib.speculative import SpecStrategy

    torch.set_num_threads(os.cpu_count() or 1)
    target, tok, drafter = load(args.model, args.drafter, device=args.device, dtype=args.dtype)
    device = str(target.device)
    prompts = task_prompts(args.task, tok, args.prompts, seed=2026)
    tune_sets = [task_prompts(args.task, tok, args.prompts, seed=7 + i) for i in range(max(1, args.tune_rollouts))]
    warm_prompts = tune_sets[0]
    threshold = args.threshold if args.threshold is not None else default_threshold(device)
    arms = [SpecStrategy.parse(a) for a in args.arms.split(";")]
    ngram_arms = [SpecStrategy.parse(a) for a in args.ngram_arms.split(";")]

    t0 = time.perf_counter()
    costs = measure_costs(target, drafter, max_batch=max(threshold, args.fixed_threshold))
    cost_s = time.perf_counter() - t0
    print(f"cost model measured in {cost_s:.1f} s")

    def engines(temp):
        cfg = RolloutConfig(SamplingConfig(temperature=temp, max_new_tokens=args.max_new), group_size=args.group)
        return RolloutEngine(target, cfg, drafter=drafter), RolloutEngine(target, cfg)

    def make_adaptive(family):
        if family == "learned":
            return AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(arms=tuple(arms))),
                                      costs, drafter)
        return AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(arms=tuple(ngram_arms))),
                                  costs)

    # (name, family, kind, strategy factory); family picks the engine (learned drafter or none)
    policies = [("no SD", "none", "plain", lambda: None)]
    fixed_arms = [a for a in arms if a.enabled] + [x for x in ngram_arms if x.kind == "ngram" and x not in arms]
    for a in fixed_arms:                          # an "off" arm is the no-SD policy, already in the list
        fam = "learned" if a.uses_drafter else "ngram"
        if not args.no_always:
            policies.append((f"always {a.name}", fam, "fixed", lambda a=a: a))
        thr = args.fixed_threshold
        policies.append((f"<= {thr} rows: {a.name}", fam, "fixed",
                         lambda a=a, thr=thr: (lambda step, active: a if active <= thr else SpecStrategy())))
    policies += [(f"adaptive (<= {threshold} rows, BEG-MAB over {len(arms)} arms)", "learned", "adaptive", None),
                 (f"adaptive n-gram only (<= {threshold} rows, {len(ngram_arms)} arms)", "ngram", "adaptive", None)]
    controllers = {name: make_adaptive(fam) for name, fam, kind, _ in policies if kind == "adaptive"}

    def source(name, factory):
        return controllers[name] if name in controllers else factory()

    def run(eng_pair, name, fam, factory, ps, seed=0):
        eng = eng_pair[1] if fam in ("ngram", "none") else eng_pair[0]
        g = torch.Generator(device=device).manual_seed(seed)
        return eng.generate(ps, g, strategy=source(name, factory))

    hot = engines(args.temperature)
    print("warm-up ...")
    run(hot, "no SD", "none", lambda: None, warm_prompts[:8])
    run(hot, "warm", "learned", lambda: arms[0], warm_prompts[:8])
    tuned = {}
    for name, fam, kind, factory in policies:
        if kind == "adaptive":
            tuned[name] = [timed(lambda: run(hot, name, fam, factory, ps, seed=1 + i), device)
                           for i, ps in enumerate(tune_sets[: args.tune_rollouts])]
            print(f"{name}: tuning rollouts " + ", ".join(f"{t:.1f}" for t in tuned[name]) + " s")

    buckets = TunerConfig().buckets
    times = {name: [] for name, *_ in policies}
    by_bucket = {name: [] for name, *_ in policies}
    results = {}
    for rep in range(args.repeats):
        for name, fam, kind, factory in policies:
            box = {}
            t = timed(lambda: box.__setitem__("r", run(hot, name, fam, factory, prompts, seed=100 + rep)), device)
            times[name].append(t)
            results[name] = box["r"]
            tl = box["r"].timeline
            by_bucket[name].append(time_by_bucket(tl["step_time"], tl["active"], buckets))
            print(f"[{rep + 1}/{args.repeats}] {name}: {t:.2f} s")

    identical = {}
    if not args.no_identity:
        cold = engines(0.0)
        ref = None
        for name, fam, kind, factory in policies:
            r = run(cold, name, fam, factory, prompts)
            ref = r if ref is None else ref
            identical[name] = bool(torch.equal(r.tokens, ref.tokens) and torch.equal(r.lengths, ref.lengths))
            print(f"T=0 {name}: identical={identical[name]}")

    med = {k: float(np.median(v)) for k, v in times.items()}
    base = med["no SD"]
    best_fixed = {}
    for fam in ("learned", "ngram"):
        cands = [(med[n], n) for n, f, kind, _ in policies if f == fam and kind == "fixed"]
        best_fixed[fam] = min(cands)[1]
    rows, out = [], []
    for name, fam, kind, _ in policies:
        r = results[name]
        vs_best = med[best_fixed[fam]] / med[name] if fam in best_fixed else None
        rec = {"policy": name, "drafter": fam, "kind": kind, "time_s": med[name], "times_s": times[name],
               "tokens": int(r.lengths.sum()), "speedup_vs_no_sd": base / med[name], "vs_best_fixed": vs_best,
               "spec_time_frac": r.stats.get("spec/time_frac", 0.0),
               "accept_len": r.stats.get("spec/accept_len_mean", float("nan")),
               "identical_at_t0": identical.get(name),
               "bucket_times_s": dict(zip(map(str, buckets), np.median(by_bucket[name], axis=0).tolist()))}
        if name in controllers:
            rec["tuner"] = controllers[name].tuner.summary()
            rec["arm_steps"] = {a: int((r.timeline["strategy"] == a).sum()) for a in set(r.timeline["strategy"])}
        out.append(rec)
        rows.append([name, fam, med[name], base / med[name], "-" if vs_best is None else f"{vs_best:.2f}x",
                     f"{100 * rec['spec_time_frac']:.0f}%", f"{rec['accept_len']:.2f}",
                     "-" if name not in identical else identical[name]])
    ad, adn = [n for n, *_ in policies if n in controllers]
    # hindsight bound of any per-bucket tuner over the learned-drafter arms: fastest of no SD / always-arm per bucket
    cands = ["no SD"] + [f"<= {args.fixed_threshold} rows: {a.name}" if args.no_always else f"always {a.name}"
                         for a in fixed_arms if a.uses_drafter]
    bucket_med = {n: np.median(by_bucket[n], axis=0) for n in cands}
    oracle_decode, oracle_pick = per_bucket_oracle(bucket_med)
    # decode time only (the buckets hold decode steps): add the median prefill + first-token time of the candidates
    overhead = float(np.median([med[n] - bucket_med[n].sum() for n in cands]))
    oracle = oracle_decode + overhead
    summary = {"adaptive_vs_no_sd": base / med[ad], "adaptive_vs_best_fixed": med[best_fixed["learned"]] / med[ad],
               "oracle_s": oracle, "oracle_vs_no_sd": base / oracle,
               "oracle_vs_best_fixed": med[best_fixed["learned"]] / oracle,
               "oracle_pick": {f"{lo}+": p for lo, p in zip(buckets, oracle_pick) if p is not None},
               "adaptive_vs_oracle": oracle / med[ad],
               "best_fixed": best_fixed, "ngram_adaptive_vs_no_sd": base / med[adn],
               "ngram_adaptive_vs_best_fixed": med[best_fixed["ngram"]] / med[adn],
               "goal_adaptive_vs_no_sd_1.8x": base / med[ad] >= 1.8,
               "goal_adaptive_vs_best_fixed_1.1x": med[best_fixed["learned"]] / med[ad] >= 1.1,
               "all_identical_at_t0": all(identical.values()) if identical else None}
    rows.append(["per-bucket oracle (hindsight bound)", "learned", oracle, base / oracle,
                 f"{med[best_fixed['learned']] / oracle:.2f}x", "-", "-", "-"])
    header = ["policy", "drafter", "rollout s", "vs no SD", "vs best fixed", "time in SD", "accept len",
              "identical at T=0"]
    r0 = results["no SD"]
    oracle_of = f"'<= {args.fixed_threshold} rows' strategy" if args.no_always else "always-strategy"
    table = (f"Long-tail rollout: {args.prompts} prompts x {args.group} samples, temperature {args.temperature}, "
             f"max {args.max_new} new tokens, {args.dtype} on {device}; {int(r0.lengths.sum()):,} tokens, response "
             f"length median {int(np.median(r0.lengths.numpy()))} / max {int(r0.lengths.max())}; median of "
             f"{args.repeats}; adaptive policies tuned on {args.tune_rollouts} earlier rollouts of other prompts; "
             f"cost model measured in {cost_s:.1f} s\n\n" + markdown_table(header, rows)
             + f"\n\nAdaptive vs no SD: **{summary['adaptive_vs_no_sd']:.2f}x**; vs best fixed "
               f"({best_fixed['learned']}): **{summary['adaptive_vs_best_fixed']:.2f}x**. n-gram only: adaptive vs "
               f"no SD {summary['ngram_adaptive_vs_no_sd']:.2f}x, vs best fixed n-gram ({best_fixed['ngram']}) "
               f"{summary['ngram_adaptive_vs_best_fixed']:.2f}x. Per-bucket oracle (the fastest of no SD and each "
               f"{oracle_of} in every tuner bucket, in hindsight): {summary['oracle_vs_no_sd']:.2f}x over no SD, "
               f"{summary['oracle_vs_best_fixed']:.2f}x over the best fixed policy; adaptive reaches "
               f"{summary['adaptive_vs_oracle']:.2f}x of it. Oracle's pick by bucket: "
               + ", ".join(f"{k}: {v.removeprefix('always ')}" for k, v in summary["oracle_pick"].items()) + ".")
    payload = {"bench": "long_tail_rollout", "machine": machine_info(device), "settings": vars(args),
               "threshold": threshold, "cost_model": costs.to_dict(), "cost_model_s": cost_s,
               "tuning_rollout_s": tuned, "results": out, "summary": summary}
    shape = "" if (args.prompts, args.group) == (64, 8) else f"-{args.prompts}x{args.group}"
    shape += model_suffix(args.model) + ("" if args.task == "chain" else f"-{args.task}")
    write_results(f"long_tail_rollout-{device.split(':')[0]}-{args.dtype}{shape}", payload, table, args.out)


if __name__ == "__main__":
    main()
