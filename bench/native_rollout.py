"""Rollouts with the decoder layers in one C++ call against the Python layers, without SD and with SD.

Notebook 04's rollout by default (the tiny reasoner and its drafter, 12 chain prompts x 8 samples, T=0.9, up to 720
new tokens): each strategy (no SD; fixed SD strategies, run on every iteration) with ``RolloutConfig.native_layers``
off and on, the four rollouts per round interleaved after a warm-up, each seeded alike within a round. Reported:
median seconds per rollout, the C++ layers' speedup per strategy and each strategy's speedup over no SD per layer
path, paired within rounds (``tltlib.stats.paired_ratio``, with a bootstrap 95% interval). The layers compute the
same hidden states bit for bit (tests/test_native_layers.py), so both paths sample the same tokens: the rounds
compare equal work.

    python -m tltlib bench native_rollout                        # notebook 04's rollout, no SD and chain-8
    python -m tltlib bench native_rollout --strategies chain-4,tree-6x4-24 --repeats 5
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_model_flags,
    add_output_flags,
    bench_parser,
    interleaved_medians,
    listed,
    load_models,
    machine_info,
    markdown_table,
    model_suffix,
    parse_bench_args,
    positive_int,
    task_prompts,
    temperature,
    write_results,
)


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, drafter="data/tiny-reasoner-drafter")
    ap.add_argument("--strategies", default="chain-8", type=listed(str, "chain-4,chain-8"),
                    help="SD strategies compared with no SD (each on every decode iteration)")
    ap.add_argument("--prompts", default=12, type=positive_int)
    ap.add_argument("--num-generations", default=8, type=positive_int)
    ap.add_argument("--temperature", default=0.9, type=temperature)
    ap.add_argument("--max-new", default=720, type=positive_int)
    add_output_flags(ap, repeats=3)
    return parse_bench_args(ap, argv)


def main() -> None:
    args = parse_args()
    args.device, args.dtype = "cpu", "float32"
    import torch

    from tltlib.errors import BadInput
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    from tltlib.spec.strategy import SpecStrategy
    from tltlib.stats import paired_ratio
    try:
        strategies = [None] + [SpecStrategy.parse(s).name for s in args.strategies.items]
    except BadInput as e:
        sys.exit(f"error: argument --strategies: {e}")
    model, tok, drafter = load_models(args, drafter=True)
    prompts = task_prompts("chain", tok, args.prompts, seed=2026)
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new)
    engines = {native: RolloutEngine(model, RolloutConfig(sampling, num_generations=args.num_generations,
                                                          native_layers=native), drafter=drafter)
               for native in (False, True)}
    tokens = {}

    def rollout(native: bool, strategy):
        def run():
            out = engines[native].generate(prompts, torch.Generator().manual_seed(0), strategy=strategy)
            tokens[(native, strategy)] = out.tokens
        return run

    label = {None: "no SD"}
    fns = {(n, s): rollout(n, s) for s in strategies for n in (False, True)}
    timing = interleaved_medians(fns, "cpu", args.repeats)
    results = []
    for s in strategies:
        py, cpp = timing[(False, s)], timing[(True, s)]
        speed, lo, hi = paired_ratio(py[1], cpp[1])
        rec = {"strategy": label.get(s, s), "python_s": py[0], "native_s": cpp[0], "native_speedup": speed,
               "native_speedup_ci95": [lo, hi], "python_runs": py[1], "native_runs": cpp[1],
               "identical_tokens": bool(torch.equal(tokens[(False, s)], tokens[(True, s)]))}
        if s is not None:
            for native, key in ((False, "python"), (True, "native")):
                v, lo, hi = paired_ratio(timing[(native, None)][1], timing[(native, s)][1])
                rec[f"{key}_vs_no_sd"], rec[f"{key}_vs_no_sd_ci95"] = v, [lo, hi]
        results.append(rec)
    rows = [[r["strategy"], f"{r['python_s']:.2f}", f"{r['native_s']:.2f}",
             f"{r['native_speedup']:.2f}x [{r['native_speedup_ci95'][0]:.2f}, {r['native_speedup_ci95'][1]:.2f}]",
             f"{r['python_vs_no_sd']:.2f}x" if "python_vs_no_sd" in r else "",
             f"{r['native_vs_no_sd']:.2f}x" if "native_vs_no_sd" in r else "", str(r["identical_tokens"])]
            for r in results]
    text = (f"Rollouts with the layers in one C++ call (native) against the Python layers: {args.model} with "
            f"{args.drafter}, {args.prompts} chain prompts x {args.num_generations}, T={args.temperature}, up to "
            f"{args.max_new} new tokens, each strategy on every iteration; median seconds of {args.repeats} "
            "interleaved rounds after a warm-up, ratios paired within rounds [95% bootstrap interval]:\n\n"
            + markdown_table(["strategy", "Python layers s", "native s", "native speedup", "SD / no SD (Python)",
                              "SD / no SD (native)", "identical tokens"], rows))
    payload = {"bench": "native_rollout", "machine": machine_info("cpu"), "settings": vars(args),
               "results": results}
    write_results(f"native_rollout-cpu-float32{model_suffix(args.model)}", payload, text, args.out)


if __name__ == "__main__":
    main()
