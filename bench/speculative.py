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

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (TASK_HELP, ensure_malloc_env, interleaved_medians, machine_info, markdown_table,  # noqa: E402
                     model_suffix, task_prompts, write_results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="data/tiny-reasoner")
    ap.add_argument("--drafter", default="data/tiny-reasoner-drafter")
    ap.add_argument("--assistant", default="data/tiny-assistant",
                    help="small LM for transformers assisted generation ('none': skip the peer)")
    ap.add_argument("--task", default="chain", choices=["chain", "words"], help=TASK_HELP)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--temperatures", default="0,0.9")
    ap.add_argument("--strategies", default="chain-4;chain-10;chain-16;tree-10x2-16",
                    help="';'-separated strategy names: chain-DEPTH, tree-DEPTHxTOPK-BUDGET, ngram-DEPTH")
    ap.add_argument("--steps", type=int, default=10, help="chain-task steps per problem (11 tokens each)")
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="words task: tokens per response (EOS ignored, so the batch stays at its size)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ensure_malloc_env()

    import numpy as np
    import torch

    from tltlib.checkpoint import load
    from tltlib.rollout import RolloutConfig, RolloutEngine
    from tltlib.sampling import SamplingConfig
    from tltlib.speculative import alpha_from_accept_length, leviathan_speedup
    from tltlib.speculative import SpecStrategy

    torch.set_num_threads(os.cpu_count() or 1)
    target, tok, drafter = load(args.model, args.drafter, device=args.device, dtype=args.dtype)
    device, dtype = str(target.device), target.embed.weight.dtype
    strategies = [SpecStrategy.parse(x) for x in args.strategies.split(";")]
    words = args.task == "words"
    max_new = args.new_tokens if words else args.steps * 11 + 8

    results, rows = [], []
    for temp in [float(t) for t in args.temperatures.split(",")]:
        sampling = SamplingConfig(temperature=temp, max_new_tokens=max_new)
        for b in [int(x) for x in args.batches.split(",")]:
            prompts = task_prompts(args.task, tok, b, seed=100 + b, steps=args.steps)
            eng = RolloutEngine(target, RolloutConfig(sampling, compact_fraction=0.0, ignore_eos=words),
                                drafter=drafter)
            runs = {}

            def run(strategy, key):
                g = torch.Generator(device=device).manual_seed(7)
                runs[key] = eng.generate(prompts, g, strategy=strategy)

            fns = {"plain": lambda: run(None, "plain")}
            fns.update({st.name: (lambda st=st: run(st, st.name)) for st in strategies})
            timing = interleaved_medians(fns, device, args.repeats)
            t_plain = timing["plain"][0]
            plain = runs["plain"]
            plain_tok = int(plain.lengths.sum())
            plain_step = float(np.median(plain.timeline["step_time"]))
            rec = {"temperature": temp, "batch": b, "plain_tok_s": plain_tok / t_plain, "strategies": {}}
            for st in strategies:
                t_sd = timing[st.name][0]
                res = runs[st.name]
                tok_s = int(res.lengths.sum()) / t_sd
                acc_len = res.stats["spec/accept_len_mean"]
                alpha = alpha_from_accept_length(acc_len, st.depth)
                c = res.stats["spec/draft_time_s"] / res.stats["spec/steps"] / st.depth / plain_step
                predicted = leviathan_speedup(alpha, st.depth, c)
                identical = bool(torch.equal(res.tokens, plain.tokens)) if temp == 0 else None
                rec["strategies"][st.name] = {
                    "tok_s": tok_s, "speedup": tok_s / rec["plain_tok_s"], "accept_len": acc_len, "alpha": alpha,
                    "cost_ratio_c": c, "leviathan_predicted": predicted, "identical_to_plain": identical,
                    "draft_s": res.stats["spec/draft_time_s"], "verify_s": res.stats["spec/verify_time_s"]}
                rows.append([temp, b, st.name, rec["plain_tok_s"], tok_s, f"{tok_s / rec['plain_tok_s']:.2f}x",
                             f"{acc_len:.2f}", f"{alpha:.2f}", f"{c:.3f}", f"{predicted:.2f}x",
                             "-" if identical is None else identical])
            results.append(rec)

    peer = _assisted_peer(args, device, dtype, tok, max_new)
    crossover = {}
    for temp in sorted({r["temperature"] for r in results}):
        best = [(r["batch"], max(s["speedup"] for s in r["strategies"].values())) for r in results
                if r["temperature"] == temp]
        paying = [b for b, s in best if s > 1.0]
        crossover[str(temp)] = {"best_speedup_by_batch": dict(best),
                                "largest_batch_where_sd_pays": max(paying) if paying else None,
                                "first_batch_where_sd_loses": next((b for b, s in best if s <= 1.0), None)}
    header = ["T", "batch", "strategy", "plain tok/s", "SD tok/s", "speedup", "accept len", "alpha", "c",
              "Leviathan", "identical"]
    workload = (f"{args.steps}-step chain problems ({max_new - 8 + 4} tokens per response)" if not words else
                f"word problems, {max_new} tokens per response (EOS ignored)")
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
    payload = {"bench": "speculative", "machine": machine_info(device), "settings": vars(args),
               "results": results, "assisted_peer": peer, "crossover": crossover}
    write_results(f"speculative-{device.split(':')[0]}-{args.dtype}{model_suffix(args.model)}", payload, table, args.out)


def _assisted_peer(args, device, dtype, tok, max_new):
    """transformers assisted generation at batch 1 (greedy and sampled) against its own plain generate."""
    import torch
    from transformers import AutoModelForCausalLM

    from tltlib.params import resolve
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
    for temp in [float(t) for t in args.temperatures.split(",")]:
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
