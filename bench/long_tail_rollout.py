"""A GRPO-sized rollout with a long tail, under every SD policy: no SD, always-SD with each fixed strategy,
threshold + fixed strategy, and adaptive (threshold + the tuner), with the learned EAGLE drafter and with the
model-free n-gram drafter. Total rollout time, ratios, and token identity at temperature 0.

Workload: ``--prompts`` held-out chain problems x ``--num-generations`` samples at ``--temperature`` on the tiny
reasoner (the notebook-01 rollout: a few responses run ~15x longer than the median). Every policy runs the same prompts
with the same seed, side by side in one process, after a common warm-up; the adaptive controllers first tune on
``--tune-rollouts`` rollouts of other prompts (as they would on the previous RL steps: the controller lives across the
whole RL run), then are timed. Time = wall time of ``RolloutEngine.generate`` (median of ``--repeats``, policies
interleaved, each round in its own shuffled order; each repeat samples with its own seed, shared by all policies,
so the median also spans different draws of the long tail: at temperature > 0 SD and plain decoding draw different,
equally distributed, responses; the guarantee line compares within rounds). ``--same-lengths`` takes the draw of
lengths out: every round first runs no SD untimed and gives its response lengths to every policy (EOS ignored), so
all run one schedule of running rows and the within-round ratios measure the policies alone. "best fixed" = the
fastest policy that plays one strategy (always, or below the threshold) with the same drafter family.
"per-bucket oracle" = in hindsight, the fastest of no-SD and each always-strategy (with --no-always: each threshold
strategy) in every batch-size bucket of the tuner, summed: the most any per-bucket tuner could achieve here.

    python -m tltlib bench long_tail_rollout                 # CPU, ~15 min
    python -m tltlib bench long_tail_rollout --prompts 16    # the paper's Fig. 14 case study size: 128 requests
    python -m tltlib bench long_tail_rollout --device cuda --dtype bfloat16

An ``off`` arm (default) lets the tuner play plain steps where no SD strategy pays; it is not run as a fixed policy
(that is "no SD"). ``--no-always`` skips the always-SD policies, which on a real model on a CPU spend most of the
run's time at batch sizes where SD loses.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DRAFTER,
    TASK_HELP,
    add_device_flags,
    add_model_flags,
    add_num_generations,
    add_output_flags,
    bench_parser,
    listed,
    load_models,
    machine_info,
    markdown_table,
    model_suffix,
    nonnegative_int,
    parse_bench_args,
    positive_int,
    result_name,
    strategy,
    task_prompts,
    temperature,
    timed,
    write_results,
)


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, drafter=DRAFTER)
    add_device_flags(ap)
    ap.add_argument("--task", default="chain", choices=["chain", "words"], help=TASK_HELP)
    ap.add_argument("--prompts", type=positive_int, default=64)
    add_num_generations(ap, 8)
    ap.add_argument("--temperature", type=temperature, default=0.9)
    ap.add_argument("--max-new", type=positive_int, default=720)
    ap.add_argument("--arms", default="off;chain-4;chain-8;chain-16;chain-32;tree-6x4-24;ngram-4",
                    type=listed(strategy, "off;chain-4;ngram-4", sep=";"),
                    help="';'-separated strategies of the learned-drafter adaptive policy (each SD one also runs "
                         "fixed); 'off' lets the tuner fall back to plain steps, as TLTConfig.arms does")
    ap.add_argument("--ngram-arms", default="off;ngram-4;suffix-6-12;suffix-12-24",
                    type=listed(strategy, "off;ngram-4;suffix-8-16", sep=";"),
                    help="arms of the model-free adaptive policy (no learned drafter): ngram-D chains and suffix-D-N "
                         "trees (each SD one also runs fixed)")
    ap.add_argument("--revisit", action="store_true",
                    help="GRPO's later epochs: the suffix drafter keeps the responses of a first rollout of the timed "
                         "prompts (and of the earlier repeats); default: a single pass (its history is cleared "
                         "before every timed rollout)")
    ap.add_argument("--threshold", type=nonnegative_int, default=None,
                    help="adaptive SD threshold (default: per device)")
    ap.add_argument("--fixed-threshold", type=nonnegative_int, default=32,
                    help="threshold of the threshold + fixed policies")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--tune-rollouts", type=nonnegative_int, default=3,
                    help="rollouts of other prompts the adaptive controllers learn on before they are timed")
    ap.add_argument("--same-lengths", action="store_true",
                    help="every round, give each policy the response lengths of that round's no-SD rollout (EOS "
                         "ignored): one schedule of running rows for all, so the paired ratios measure the policies, "
                         "not the lengths drawn (SD at T > 0 samples other tokens than plain decoding)")
    ap.add_argument("--guarantee-rounds", type=nonnegative_int, default=0,
                    help="after the timed rounds, this many more rounds of only no SD, the best policy in hindsight "
                         "and the two adaptive ones, run back to back (adjacent runs share the machine's state more "
                         "closely than a whole round does); the guarantee line pools their within-round ratios with "
                         "the timed rounds' and gives a 95%% bootstrap interval")
    ap.add_argument("--no-identity", action="store_true", help="skip the temperature-0 identity check")
    ap.add_argument("--no-always", action="store_true",
                    help="skip the always-SD policies (slow where SD loses at large batches); the per-bucket oracle "
                         "then takes the threshold policies, equal to always-SD below the threshold")
    add_output_flags(ap)
    args = parse_bench_args(ap, argv)
    _check_arms(ap, args.arms.items, args.ngram_arms.items)
    return args


def _check_arms(ap, arms, ngram_arms) -> None:
    """Each drafter family needs a fixed policy to compare its adaptive one with; the n-gram policy has no drafter."""
    if not any(a.uses_drafter for a in arms):
        ap.error("argument --arms: no chain or tree strategy; the learned-drafter policies need one, e.g. "
                 "off;chain-4;ngram-4")
    if any(a.uses_drafter for a in ngram_arms):
        ap.error("argument --ngram-arms: chain and tree strategies need the learned drafter; give off, ngram-DEPTH "
                 "and suffix-DEPTH-BUDGET strategies only, e.g. off;ngram-4;suffix-8-16")
    if not any(a.kind in ("ngram", "suffix") for a in (*arms, *ngram_arms)):
        ap.error("argument --ngram-arms: no ngram or suffix strategy (nor in --arms); the model-free policies need "
                 "one, e.g. off;ngram-4;suffix-8-16")


class Policy(NamedTuple):
    """One way to run the rollout. ``family`` picks the engine: "learned" (with the drafter), "ngram" or "none"
    (without); ``kind``: "plain", "fixed" or "adaptive"; ``factory`` makes its strategy source (None: adaptive, whose
    controller lives across the whole run)."""

    name: str
    family: str
    kind: str
    factory: Callable | None


def main() -> None:
    args = parse_args()
    import numpy as np

    from tltlib.rollout.adaptive import TunerConfig, default_threshold
    from tltlib.sim.measure import measure_costs
    target, tok, drafter = load_models(args, drafter=True)
    device = str(target.device)
    prompts = task_prompts(args.task, tok, args.prompts, seed=2026)
    tune_sets = [task_prompts(args.task, tok, args.prompts, seed=7 + i) for i in range(max(1, args.tune_rollouts))]
    threshold = args.threshold if args.threshold is not None else default_threshold(device)
    t0 = time.perf_counter()
    costs = measure_costs(target, drafter, max_batch=max(threshold, args.fixed_threshold))
    cost_s = time.perf_counter() - t0
    print(f"cost model measured in {cost_s:.1f} s")
    policies, fixed_arms = _policies(args, threshold)
    runner = Runner(target, drafter, device, args, _controllers(policies, args, threshold, costs, drafter))
    hot = runner.engines(args.temperature)
    tuned = _warm_up_and_tune(runner, hot, policies, tune_sets, args)
    if args.revisit:                                      # the previous epoch's rollout of the same prompts
        runner.run(hot, Policy("no SD", "none", "plain", lambda: None), prompts, seed=99)
    buckets = TunerConfig().buckets
    times, by_bucket, results = _time_policies(runner, hot, policies, prompts, args.repeats, buckets,
                                               args.same_lengths)
    paired_times = _guarantee_rounds(runner, hot, policies, prompts, times, args)
    identical = {} if args.no_identity else _identity(runner, policies, prompts)
    med = {k: float(np.median(v)) for k, v in times.items()}
    best_fixed = {fam: min((med[p.name], p.name) for p in policies if p.family == fam and p.kind == "fixed")[1]
                  for fam in ("learned", "ngram")}
    out, rows = _records(policies, med, times, by_bucket, buckets, results, identical, runner.controllers,
                         best_fixed)
    summary = _summary(args, policies, fixed_arms, med, times, by_bucket, buckets, identical, runner.controllers,
                       best_fixed, paired_times)
    rows.append(["per-bucket oracle (hindsight bound)", "learned", summary["oracle_s"], summary["oracle_vs_no_sd"],
                 f"{summary['oracle_vs_best_fixed']:.2f}x", "-", "-", "-"])
    payload = {"bench": "long_tail_rollout", "machine": machine_info(device), "settings": vars(args),
               "threshold": threshold, "cost_model": costs.to_dict(), "cost_model_s": cost_s,
               "tuning_rollout_s": tuned, "results": out, "summary": summary}
    shape = "" if (args.prompts, args.num_generations) == (64, 8) else f"-{args.prompts}x{args.num_generations}"
    shape += model_suffix(args.model) + ("" if args.task == "chain" else f"-{args.task}")
    shape += "-revisit" if args.revisit else ""
    shape += "-same-lengths" if args.same_lengths else ""
    shape += "" if args.drafter == DRAFTER else "-" + Path(args.drafter).expanduser().resolve().name
    write_results(result_name("long_tail_rollout", device, args.dtype, shape), payload,
                  _table(args, device, rows, results["no SD"], summary, best_fixed, cost_s), args.out)


def _policies(args, threshold: int) -> tuple[list[Policy], list]:
    """No SD, then per SD strategy (the learned-drafter arms, then the n-gram arms not among them) always-SD (unless
    ``--no-always``) and threshold + strategy, then the two adaptive policies; and those fixed strategies."""
    from tltlib.spec.strategy import SpecStrategy
    arms, ngram_arms = args.arms.items, args.ngram_arms.items
    policies = [Policy("no SD", "none", "plain", lambda: None)]
    fixed_arms = [a for a in arms if a.enabled] + [x for x in ngram_arms if x.enabled and not x.uses_drafter
                                                   and x not in arms]
    for a in fixed_arms:                          # an "off" arm is the no-SD policy, already in the list
        fam = "learned" if a.uses_drafter else "ngram"
        if not args.no_always:
            policies.append(Policy(f"always {a.name}", fam, "fixed", lambda a=a: a))
        thr = args.fixed_threshold
        policies.append(Policy(f"<= {thr} rows: {a.name}", fam, "fixed",
                               lambda a=a, thr=thr: (lambda step, active: a if active <= thr else SpecStrategy())))
    from tltlib.rollout.adaptive import TunerConfig
    rule = {"epsilon-greedy": "BEG-MAB", "thompson": "Thompson"}.get(TunerConfig().rule, TunerConfig().rule)
    policies += [Policy(f"adaptive (<= {threshold} rows, {rule} over {len(arms)} arms)", "learned", "adaptive", None),
                 Policy(f"adaptive model-free (<= {threshold} rows, {len(ngram_arms)} arms)", "ngram", "adaptive",
                        None)]
    return policies, fixed_arms


def _controllers(policies: list[Policy], args, threshold: int, costs, drafter) -> dict:
    """A tuner (the default rule) per adaptive policy: over ``--arms`` with the drafter, or ``--ngram-arms``
    without."""
    from tltlib.rollout.adaptive import AdaptiveConfig, AdaptiveController, TunerConfig

    def make(family):
        if family == "learned":
            return AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(arms=args.arms.items)),
                                      costs, drafter)
        return AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(arms=args.ngram_arms.items)),
                                  costs)
    return {p.name: make(p.family) for p in policies if p.kind == "adaptive"}


class Runner:
    """Runs one policy's rollout: the engine of its family, its strategy source, a seeded generator."""

    def __init__(self, target, drafter, device: str, args, controllers: dict):
        self.target, self.drafter, self.device, self.args, self.controllers = target, drafter, device, args, controllers

    def engines(self, temp: float) -> tuple:
        """(engine with the learned drafter, engine without) sampling at ``temp``."""
        from tltlib.model.sampling import SamplingConfig
        from tltlib.rollout.engine import RolloutConfig, RolloutEngine
        from tltlib.spec.suffix import SuffixConfig
        cfg = RolloutConfig(SamplingConfig(temperature=temp, max_new_tokens=self.args.max_new),
                            num_generations=self.args.num_generations)
        suffix = SuffixConfig() if self.args.revisit else None      # a single pass keeps no history
        learned = RolloutEngine(self.target, cfg, drafter=self.drafter, suffix=suffix)
        free = RolloutEngine(self.target, cfg, suffix=suffix)
        free.suffix_history = learned.suffix_history          # one history: a prompt's earlier responses
        return learned, free

    def run(self, engines: tuple, policy: Policy, prompts, seed: int = 0, lengths=None):
        import torch
        eng = engines[1] if policy.family in ("ngram", "none") else engines[0]
        g = torch.Generator(device=self.device).manual_seed(seed)
        source = self.controllers[policy.name] if policy.name in self.controllers else policy.factory()
        return eng.generate(prompts, g, strategy=source, lengths=lengths)


def _warm_up_and_tune(runner: Runner, hot: tuple, policies: list[Policy], tune_sets: list, args) -> dict:
    """A common warm-up, then ``--tune-rollouts`` rollouts of other prompts per adaptive policy (its controller
    learns on them); returns their seconds by policy."""
    warm_prompts = tune_sets[0]
    print("warm-up ...")
    runner.run(hot, Policy("no SD", "none", "plain", lambda: None), warm_prompts[:8])
    runner.run(hot, Policy("warm", "learned", "fixed", lambda: args.arms.items[0]), warm_prompts[:8])
    tuned = {}
    for p in policies:
        if p.kind == "adaptive":
            tuned[p.name] = [timed(lambda: runner.run(hot, p, ps, seed=1 + i), runner.device)
                             for i, ps in enumerate(tune_sets[: args.tune_rollouts])]
            print(f"{p.name}: tuning rollouts " + ", ".join(f"{t:.1f}" for t in tuned[p.name]) + " s")
    return tuned


def _time_policies(runner: Runner, hot: tuple, policies: list[Policy], prompts, repeats: int, buckets,
                   same_lengths: bool = False):
    """``repeats`` rounds over every policy, each round with its own seed (and with ``same_lengths``, the lengths of
    an untimed no-SD rollout with that seed): seconds and decode time per batch-size bucket by policy, and each
    policy's last result."""
    from tltlib.stats import time_by_bucket
    times = {p.name: [] for p in policies}
    by_bucket = {p.name: [] for p in policies}
    results = {}
    import numpy as np
    for rep in range(repeats):
        lengths = runner.run(hot, policies[0], prompts, seed=100 + rep).lengths if same_lengths else None
        order = np.random.default_rng(rep).permutation(len(policies))   # each round in its own order: no policy
        for p in (policies[i] for i in order):            # always runs after the same (slow, cache-cold) neighbour
            box = {}
            t = timed(lambda: box.__setitem__("r", runner.run(hot, p, prompts, 100 + rep, lengths)), runner.device)
            times[p.name].append(t)
            results[p.name] = box["r"]
            tl = box["r"].timeline
            by_bucket[p.name].append(time_by_bucket(tl["iter_time"], tl["active"], buckets))
            print(f"[{rep + 1}/{repeats}] {p.name}: {t:.2f} s")
    return times, by_bucket, results


def _hindsight(policies: list[Policy], times: dict) -> str:
    """The policy a user would have picked in hindsight: the fastest by median of no SD and the learned-drafter
    fixed policies."""
    import numpy as np
    return min(["no SD"] + [p.name for p in policies if p.family == "learned" and p.kind == "fixed"],
               key=lambda n: float(np.median(times[n])))


def _guarantee_rounds(runner: Runner, hot: tuple, policies: list[Policy], prompts, times: dict, args) -> dict:
    """The timed rounds' seconds by policy, extended by ``--guarantee-rounds`` rounds of only no SD, the best policy
    in hindsight and the two adaptive policies, back to back in a rotated order (seeds after the timed rounds')."""
    names = ["no SD", _hindsight(policies, times), *(p.name for p in policies if p.kind == "adaptive")]
    chosen = [p for n in dict.fromkeys(names) for p in policies if p.name == n]
    out = {p.name: list(times[p.name]) for p in chosen}
    for i in range(args.guarantee_rounds):
        seed = 100 + args.repeats + i
        lengths = runner.run(hot, policies[0], prompts, seed=seed).lengths if args.same_lengths else None
        for k in range(len(chosen)):
            p = chosen[(i + k) % len(chosen)]
            out[p.name].append(timed(lambda: runner.run(hot, p, prompts, seed, lengths), runner.device))
        print(f"[guarantee {i + 1}/{args.guarantee_rounds}] " + ", ".join(f"{n}: {v[-1]:.2f} s"
                                                                         for n, v in out.items()))
    return out


def _identity(runner: Runner, policies: list[Policy], prompts) -> dict:
    """Whether every policy at temperature 0 produces the tokens of the first (no SD)."""
    import torch
    cold = runner.engines(0.0)
    ref, identical = None, {}
    for p in policies:
        r = runner.run(cold, p, prompts)
        ref = r if ref is None else ref
        identical[p.name] = bool(torch.equal(r.tokens, ref.tokens) and torch.equal(r.lengths, ref.lengths))
        print(f"T=0 {p.name}: identical={identical[p.name]}")
    return identical


def _records(policies, med, times, by_bucket, buckets, results, identical, controllers, best_fixed):
    """The result record and table row of every policy."""
    import numpy as np
    base = med["no SD"]
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
    return out, rows


def _summary(args, policies, fixed_arms, med, times, by_bucket, buckets, identical, controllers, best_fixed,
             paired_times: dict | None = None) -> dict:
    """The headline ratios: adaptive vs no SD and vs the best fixed policy, the per-bucket oracle, and the
    guarantee (paired: the median over rounds of the ratio within a round, whose policies share a seed, so a slow
    spell of the machine or a longer tail drawn in one round cancels): adaptive >= 0.98x of no SD (learned and
    model-free) and >= 0.97x of the best policy in hindsight, no SD included. ``paired_times``: the rounds the
    guarantee reads (the timed rounds plus ``--guarantee-rounds``; default: the timed rounds), each ratio with its
    95% bootstrap interval."""
    import numpy as np

    from tltlib.stats import paired_ratio, per_bucket_oracle
    base = med["no SD"]
    ad, adn = [p.name for p in policies if p.name in controllers]
    # hindsight bound of any per-bucket tuner over the learned-drafter arms: fastest of no SD / always-arm per bucket
    cands = ["no SD"] + [f"<= {args.fixed_threshold} rows: {a.name}" if args.no_always else f"always {a.name}"
                         for a in fixed_arms if a.uses_drafter]
    bucket_med = {n: np.median(by_bucket[n], axis=0) for n in cands}
    oracle_decode, oracle_pick = per_bucket_oracle(bucket_med)
    # decode time only (the buckets hold decode steps): add the median prefill + first-token time of the candidates
    overhead = float(np.median([med[n] - bucket_med[n].sum() for n in cands]))
    oracle = oracle_decode + overhead
    pt = paired_times or times
    hindsight = _hindsight(policies, times)
    ratios = {key: paired_ratio(pt[slow], pt[fast]) for key, slow, fast in (
        ("adaptive_vs_no_sd", "no SD", ad), ("adaptive_vs_best_in_hindsight", hindsight, ad),
        ("ngram_adaptive_vs_no_sd", "no SD", adn))}
    guarantee = {"rounds": len(pt["no SD"]), "best_in_hindsight": hindsight}
    for key, (m, lo, hi) in ratios.items():
        guarantee[f"{key}_paired"] = m
        guarantee[f"{key}_paired_ci95"] = [lo, hi]
    guarantee["met"] = (guarantee["adaptive_vs_no_sd_paired"] >= 0.98 and guarantee["ngram_adaptive_vs_no_sd_paired"]
                        >= 0.98 and guarantee["adaptive_vs_best_in_hindsight_paired"] >= 0.97)
    return {"guarantee": guarantee, "adaptive_vs_no_sd": base / med[ad],
            "adaptive_vs_best_fixed": med[best_fixed["learned"]] / med[ad],
            "oracle_s": oracle, "oracle_vs_no_sd": base / oracle,
            "oracle_vs_best_fixed": med[best_fixed["learned"]] / oracle,
            "oracle_pick": {f"{lo}+": p for lo, p in zip(buckets, oracle_pick) if p is not None},
            "adaptive_vs_oracle": oracle / med[ad],
            "best_fixed": best_fixed, "ngram_adaptive_vs_no_sd": base / med[adn],
            "ngram_adaptive_vs_best_fixed": med[best_fixed["ngram"]] / med[adn],
            "goal_adaptive_vs_no_sd_1.8x": base / med[ad] >= 1.8,
            "goal_adaptive_vs_best_fixed_1.1x": med[best_fixed["learned"]] / med[ad] >= 1.1,
            "all_identical_at_t0": all(identical.values()) if identical else None}


def _table(args, device: str, rows: list, r0, summary: dict, best_fixed: dict, cost_s: float) -> str:
    import numpy as np
    header = ["policy", "drafter", "rollout s", "vs no SD", "vs best fixed", "time in SD", "accept len",
              "identical at T=0"]
    oracle_of = f"'<= {args.fixed_threshold} rows' strategy" if args.no_always else "always-strategy"
    g = summary["guarantee"]
    same = "; every policy given the lengths of the round's no-SD rollout" if args.same_lengths else ""
    return (f"Long-tail rollout: {args.prompts} prompts x {args.num_generations} samples, temperature "
            f"{args.temperature}, "
            f"max {args.max_new} new tokens, {args.dtype} on {device}; {int(r0.lengths.sum()):,} tokens, response "
            f"length median {int(np.median(r0.lengths.numpy()))} / max {int(r0.lengths.max())}; median of "
            f"{args.repeats}{same}"
            f"; adaptive policies tuned on {args.tune_rollouts} earlier rollouts of other prompts; "
            f"cost model measured in {cost_s:.1f} s\n\n" + markdown_table(header, rows)
            + f"\n\nAdaptive vs no SD: **{summary['adaptive_vs_no_sd']:.2f}x**; vs best fixed "
              f"({best_fixed['learned']}): **{summary['adaptive_vs_best_fixed']:.2f}x**. Model-free (n-gram, "
              f"suffix): adaptive vs no SD {summary['ngram_adaptive_vs_no_sd']:.2f}x, vs best fixed model-free "
              f"({best_fixed['ngram']}) "
              f"{summary['ngram_adaptive_vs_best_fixed']:.2f}x. Per-bucket oracle (the fastest of no SD and each "
              f"{oracle_of} in every tuner bucket, in hindsight): {summary['oracle_vs_no_sd']:.2f}x over no SD, "
              f"{summary['oracle_vs_best_fixed']:.2f}x over the best fixed policy; adaptive reaches "
              f"{summary['adaptive_vs_oracle']:.2f}x of it. Oracle's pick by bucket: "
              + ", ".join(f"{k}: {v.removeprefix('always ')}" for k, v in summary["oracle_pick"].items()) + "."
            + f"\n\nGuarantee (paired: median over {g['rounds']} rounds of the ratio within a round, same seed; "
              "95% bootstrap interval in brackets): adaptive vs no SD "
              f"**{g['adaptive_vs_no_sd_paired']:.2f}x** {_ci(g, 'adaptive_vs_no_sd')}, model-free adaptive vs no SD "
              f"**{g['ngram_adaptive_vs_no_sd_paired']:.2f}x** {_ci(g, 'ngram_adaptive_vs_no_sd')}, adaptive vs the "
              f"best policy in hindsight ({g['best_in_hindsight']}) "
              f"**{g['adaptive_vs_best_in_hindsight_paired']:.2f}x** {_ci(g, 'adaptive_vs_best_in_hindsight')}: "
              + ("met" if g["met"] else "not met") + " (>= 0.98x of no SD, >= 0.97x of the best in hindsight).")


def _ci(g: dict, key: str) -> str:
    lo, hi = g[f"{key}_paired_ci95"]
    return f"[{lo:.2f}, {hi:.2f}]"


if __name__ == "__main__":
    main()
