"""Speculative decoding vs plain decoding by batch size: tltlib chain and tree SD with the warm EAGLE drafter,
transformers assisted generation (a small assistant model) as the batch-1 peer, and Leviathan's prediction.

Workload per batch size B: B chain problems with the same number of steps, so every row's response has the same
length and the batch stays at B for the whole rollout. Each engine runs the same prompts side by side after a
warm-up; tokens/s = response tokens / wall time (median of ``--repeats``); speedup = SD / plain. Next to each
speedup: Leviathan's prediction (1 - a^(g+1)) / ((1 - a)(g c + 1)) with a solved from the measured accepted length
(g = draft depth) and c = measured drafting time per drafted level / plain step time at that batch size.

    python -m tltlib bench speculative                      # CPU, the tiny reasoner + warm drafter
    python -m tltlib bench speculative --device cuda --batches 1,8,32
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DRAFTER,
    TASK_HELP,
    add_device_flags,
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
    resolve,
    result_name,
    strategy,
    task_prompts,
    temperature,
    write_results,
)
from _vllm import vllm_section, vllm_table  # noqa: E402


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, drafter=DRAFTER)
    ap.add_argument("--assistant", default="data/tiny-assistant",
                    help="small LM for transformers assisted generation ('none': skip the peer)")
    ap.add_argument("--task", default="chain", choices=["chain", "words"], help=TASK_HELP)
    add_device_flags(ap)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512", type=listed(positive_int, "1,8,32"))
    ap.add_argument("--temperatures", default="0,0.9", type=listed(temperature, "0,0.9"))
    ap.add_argument("--strategies", default="chain-4;chain-10;chain-16;tree-10x2-16",
                    type=listed(strategy, "chain-4;tree-10x2-16", sep=";"),
                    help="';'-separated strategy names: chain-DEPTH, tree-DEPTHxTOPK-BUDGET, ngram-DEPTH")
    ap.add_argument("--steps", type=positive_int, default=10, help="chain-task steps per problem (11 tokens each)")
    ap.add_argument("--new-tokens", type=positive_int, default=128,
                    help="words task: tokens per response (EOS ignored, so the batch stays at its size)")
    ap.add_argument("--vllm", default="auto", choices=["auto", "compiled", "eager", "off"],
                    help="vLLM peer (plain and EAGLE with the exported drafter, per chain strategy): auto = compiled "
                         "when vLLM is installed (in .venv-vllm or here), else none")
    add_output_flags(ap, repeats=5)
    return parse_bench_args(ap, argv)


def main() -> None:
    args = parse_args()
    target, tok, drafter = load_models(args, drafter=True)
    device, dtype = str(target.device), target.embed.weight.dtype
    max_new = args.new_tokens if args.task == "words" else args.steps * 11 + 8
    results, rows = [], []
    for temp in args.temperatures.items:
        for b in args.batches.items:
            rec, rec_rows = _measure(target, drafter, tok, args, temp, b, max_new, device)
            results.append(rec)
            rows += rec_rows
    peer = _assisted_peer(args, device, dtype, tok, max_new)
    vllm = vllm_section(args, target, tok, drafter, max_new, results)
    for rec in results:
        rec.pop("plain_responses")
    crossover = _crossover(results)
    payload = {"bench": "speculative", "machine": machine_info(device), "settings": vars(args),
               "results": results, "assisted_peer": peer, "vllm_peer": vllm, "crossover": crossover}
    table = _table(args, device, max_new, rows, peer, crossover)
    if vllm:
        table += "\n\n" + vllm_table(vllm)
    write_results(result_name("speculative", device, args.dtype, model_suffix(args.model)), payload, table, args.out)


def _measure(target, drafter, tok, args, temp: float, b: int, max_new: int, device: str) -> tuple[dict, list]:
    """Plain decoding and every strategy on the same ``b`` prompts at temperature ``temp``, interleaved: the
    record of this (temperature, batch) and one table row per strategy."""
    import numpy as np
    import torch

    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    sampling = SamplingConfig(temperature=temp, max_new_tokens=max_new)
    prompts = task_prompts(args.task, tok, b, seed=100 + b, steps=args.steps)
    eng = RolloutEngine(target, RolloutConfig(sampling, compact_fraction=0.0, ignore_eos=args.task == "words"),
                        drafter=drafter)
    runs = {}

    def run(strategy, key):
        g = torch.Generator(device=device).manual_seed(7)
        runs[key] = eng.generate(prompts, g, strategy=strategy)

    strategies = args.strategies.items
    fns = {"plain": lambda: run(None, "plain")}
    fns.update({st.name: (lambda st=st: run(st, st.name)) for st in strategies})
    timing = interleaved_medians(fns, device, args.repeats)
    plain = runs["plain"]
    rec = {"temperature": temp, "batch": b, "plain_tok_s": int(plain.lengths.sum()) / timing["plain"][0],
           "strategies": {}, "plain_responses": [plain.response_ids(i) for i in range(b)] if temp == 0 else None}
    plain_step = float(np.median(plain.timeline["iter_time"]))
    rows = []
    for st in strategies:
        identical = bool(torch.equal(runs[st.name].tokens, plain.tokens)) if temp == 0 else None
        rec["strategies"][st.name], row = _strategy_record(st, runs[st.name], timing[st.name][0], rec["plain_tok_s"],
                                                           plain_step, identical)
        rows.append([temp, b, *row])
    return rec, rows


def _strategy_record(st, res, t_sd: float, plain_tok_s: float, plain_step: float, identical) -> tuple[dict, list]:
    """One strategy's measured speedup beside Leviathan's prediction from its accepted length and draft cost."""
    from tltlib.spec.acceptance import alpha_from_accept_length, leviathan_speedup
    tok_s = int(res.lengths.sum()) / t_sd
    acc_len = res.stats["spec/accept_len_mean"]
    alpha = alpha_from_accept_length(acc_len, st.depth)
    c = res.stats["spec/draft_time_s"] / res.stats["spec/steps"] / st.depth / plain_step
    predicted = leviathan_speedup(alpha, st.depth, c)
    rec = {"tok_s": tok_s, "speedup": tok_s / plain_tok_s, "accept_len": acc_len, "alpha": alpha,
           "cost_ratio_c": c, "leviathan_predicted": predicted, "identical_to_plain": identical,
           "draft_s": res.stats["spec/draft_time_s"], "verify_s": res.stats["spec/verify_time_s"]}
    row = [st.name, plain_tok_s, tok_s, f"{tok_s / plain_tok_s:.2f}x", f"{acc_len:.2f}", f"{alpha:.2f}", f"{c:.3f}",
           f"{predicted:.2f}x", "-" if identical is None else identical]
    return rec, row


def _crossover(results: list[dict]) -> dict:
    """Per temperature: the best strategy's speedup by batch, the largest batch where SD pays, the first where not."""
    crossover = {}
    for temp in sorted({r["temperature"] for r in results}):
        best = [(r["batch"], max(s["speedup"] for s in r["strategies"].values())) for r in results
                if r["temperature"] == temp]
        paying = [b for b, s in best if s > 1.0]
        crossover[str(temp)] = {"best_speedup_by_batch": dict(best),
                                "largest_batch_where_sd_pays": max(paying) if paying else None,
                                "first_batch_where_sd_loses": next((b for b, s in best if s <= 1.0), None)}
    return crossover


def _table(args, device: str, max_new: int, rows: list, peer, crossover: dict) -> str:
    header = ["T", "batch", "strategy", "plain tok/s", "SD tok/s", "speedup", "accept len", "alpha", "c",
              "Leviathan", "identical"]
    workload = (f"{args.steps}-step chain problems ({max_new - 8 + 4} tokens per response)" if args.task != "words"
                else f"word problems, {max_new} tokens per response (EOS ignored)")
    table = (f"Speculative vs plain decoding, {workload}, model {args.model}, drafter {args.drafter}, {args.dtype} "
             f"on {device}, median of {args.repeats} after a warm-up\n\n"
             + markdown_table(header, rows))
    if peer:
        table += "\n\nBatch-1 peer, transformers `generate` with `assistant_model` (" + peer["assistant"] + "):\n\n"
        table += markdown_table(["T", "HF plain tok/s", "HF assisted tok/s", "HF speedup", "tltlib best speedup"],
                                [[t, v["plain_tok_s"], v["assisted_tok_s"], f"{v['speedup']:.2f}x",
                                  f"{crossover[str(t)]['best_speedup_by_batch'].get(1, float('nan')):.2f}x"]
                                 for t, v in peer["by_temperature"].items()])
    table += "\n\nWhere SD stops paying (best strategy vs plain): " + "; ".join(
        f"T={t}: " + (f"pays up to batch {v['largest_batch_where_sd_pays']}, first loses at batch "
                      f"{v['first_batch_where_sd_loses']}" if v["first_batch_where_sd_loses"] is not None else
                      f"pays at every measured batch (up to {max(v['best_speedup_by_batch'])})")
        for t, v in crossover.items())
    return table


def _assisted_peer(args, device, dtype, tok, max_new):
    """transformers assisted generation at batch 1 (greedy and sampled) against its own plain generate."""
    import torch
    from transformers import AutoModelForCausalLM

    if args.assistant.lower() == "none":
        return None
    path = resolve(args.assistant)
    if not (path / "config.json").is_file():
        return None
    hf = AutoModelForCausalLM.from_pretrained(resolve(args.model), dtype=dtype).to(device).eval()
    asst = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor(task_prompts(args.task, tok, 1, seed=101, steps=args.steps), device=device)
    out = {"assistant": f"{args.assistant}, {sum(p.numel() for p in asst.parameters()) / 1e6:.2f} M parameters",
           "by_temperature": {}}
    for temp in args.temperatures.items:
        kw = dict(do_sample=temp > 0, max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
        if args.task == "words":
            kw.update(min_new_tokens=max_new)          # EOS ignored, as in the tltlib runs
        if temp > 0:
            kw["temperature"] = temp
        counts = {}

        def gen(**extra):
            torch.manual_seed(0)
            with torch.no_grad():
                res = hf.generate(ids, **kw, **extra)
            counts[bool(extra)] = res.shape[1] - ids.shape[1]

        timing = interleaved_medians({"plain": gen, "assisted": lambda: gen(assistant_model=asst)}, device,
                                     args.repeats)
        t_plain, t_asst = timing["plain"][0], timing["assisted"][0]
        out["by_temperature"][temp] = {"plain_tok_s": counts[False] / t_plain, "assisted_tok_s": counts[True] / t_asst,
                                       "speedup": (counts[True] / t_asst) / (counts[False] / t_plain)}
    return out


if __name__ == "__main__":
    main()
