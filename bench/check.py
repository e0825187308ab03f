"""python -m tltlib check on a model and its drafter, timed, then each fault it must catch injected on purpose.

First the whole check (lossless, pays, drafter) at ``--temperature``, as a user runs it: its verdicts and its wall
time. Then each fault of :mod:`tltlib.lab.check.faults`, with the test that should catch it: a swapped residual
(the chi-square test, at ``--fault-temperature``), a greedy verify that keeps one wrong draft (greedy identity, with a
drafter whose drafts are wrong so that the fault has something to accept), a draft vocabulary mapped off by one and
a drafter the sync never reached (the drafter's top-1 against its card).

    python -m tltlib bench check --fault-temperature 2.0
    python -m tltlib bench check --model ~/.cache/tltlib/models/smollm2-135m-words-sft \\
        --drafter data/smollm2-135m-drafter --temperature 0.7 --max-new-tokens 384
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DRAFTER,
    add_device_flags,
    add_model_flags,
    add_output_flags,
    bench_parser,
    listed,
    load_models,
    machine_info,
    markdown_table,
    model_suffix,
    parse_bench_args,
    positive_int,
    result_name,
    temperature,
    write_results,
)


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, drafter=DRAFTER)
    add_device_flags(ap, device="cpu")
    ap.add_argument("--dataset", default="", help="prompts: chain, words or a file (default: chain for the tiny "
                    "reasoner, words otherwise)")
    ap.add_argument("--temperature", type=temperature, default=1.0, help="the check's sampling temperature")
    ap.add_argument("--fault-temperature", type=temperature, default=0.0,
                    help="temperature of the faults' chi-square test (default: --temperature)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=256)
    ap.add_argument("--prompts", type=positive_int, default=8)
    ap.add_argument("--rows", default="1,4,16", type=listed(positive_int, "1,4,16"))
    ap.add_argument("--seed", type=int, default=0)
    add_output_flags(ap)
    return parse_bench_args(ap, argv)


def fault_rows(model, tokenizer, drafter, prompts, cfg, fault_t: float) -> list[dict]:
    """Each injected fault and what the check said of it."""
    from dataclasses import replace

    from tltlib.lab.check import faults, lossless
    from tltlib.lab.check.drafter import card_numbers, quality
    from tltlib.model.sampling import SamplingConfig
    from tltlib.spec.strategy import SpecStrategy

    chain = SpecStrategy.parse("chain-4")
    hot = replace(cfg, temperature=fault_t)
    s = SamplingConfig(fault_t, cfg.top_k, cfg.top_p, max_new_tokens=cfg.max_new_tokens)
    plain = lossless.rollout(model, None, prompts, s, None, 1, cfg.seed + 3)
    rows = [(plain.prompt_ids[i], plain.response_ids(i)) for i in range(plain.num_sequences)]
    contexts = lossless.entropic_contexts(model, rows, s, cfg.first_tokens, cfg.windows)
    out = []
    for name, run in (("none", lambda: lossless.first_tokens_chi2(model, drafter, contexts, chain, hot)),
                      ("swapped residual", lambda: _under(faults.swapped_residual, lossless.first_tokens_chi2,
                                                          model, drafter, contexts, chain, hot))):
        out.append(_row(name, run()))
    wrong = faults.off_by_one(drafter)
    out.append(_row("none (drafts wrong)", lossless.greedy_identity(model, wrong, prompts, chain, cfg)))
    out.append(_row("greedy verify keeps a wrong draft", _under(faults.lenient_greedy_verify,
                                                                lossless.greedy_identity, model, wrong, prompts,
                                                                chain, cfg)))
    card = card_numbers(drafter.source) if getattr(drafter, "source", None) else {}
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, max_new_tokens=min(cfg.max_new_tokens, 128))
    for name, d in (("none", drafter), ("draft vocabulary off by one", wrong),
                    ("drafter not synced", faults.unsynced(drafter, cfg.seed))):
        p = lossless.rollout(model, None, prompts, sampling, None, 2, cfg.seed)
        sp = lossless.rollout(model, d, prompts, sampling, chain, 2, cfg.seed + 1)
        verdicts, numbers = quality(model, tokenizer, d, p, sp, chain.name, card)
        out.append({**_row(name, verdicts[0]), "accept_len_mean": numbers["accept_len_mean"]})
    return out


def _under(fault, test, *args):
    with fault():
        return test(*args)


def _row(fault: str, v) -> dict:
    n = v.numbers
    return {"fault": fault, "test": v.name, "status": v.status, "pvalue": n.get("pvalue"),
            "top_two_margin": n.get("top_two_margin"), "position": n.get("position"), "line": v.line}


def main() -> None:
    args = parse_args()
    import time

    from tltlib.lab.check import CheckConfig, card_numbers, run_check
    from tltlib.lab.check.inputs import CheckInputs, check_prompts

    model, tok, drafter = load_models(args, drafter=True)
    drafter.source = args.drafter
    cfg = CheckConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens, prompts=args.prompts,
                      rows=args.rows.items, seed=args.seed)
    prompts = check_prompts(CheckInputs(args.model, args.drafter, args.dataset, "", cfg), tok, args.seed)
    t = time.perf_counter()
    report = run_check(model, tok, drafter, prompts, cfg, card=card_numbers(args.drafter),
                       log=lambda s: print(s, file=sys.stderr, flush=True))
    wall = time.perf_counter() - t
    faults = fault_rows(model, tok, drafter, prompts, cfg, args.fault_temperature or args.temperature)
    table = markdown_table(["injected fault", "test", "verdict", "p", "evidence"],
                           [[f["fault"], f["test"], f["status"], "—" if f["pvalue"] is None else f"{f['pvalue']:.2g}",
                             f["line"]] for f in faults])
    payload = {"settings": {**vars(args), "rows": str(args.rows)}, "machine": machine_info(str(model.device)),
               "check": report.to_dict(), "check_wall_s": wall, "faults": faults}
    write_results(result_name("check", str(model.device), args.dtype, model_suffix(args.model)), payload,
                  f"check: {wall:.0f} s, lossless: {report.lossless}\n\n" + table, args.out)


if __name__ == "__main__":
    main()
