"""Drafters side by side on one target: what a speedup rests on, before and after a training recipe.

For each drafter: top-1 agreement with the target's argmax by draft depth (predicted features, true tokens) on
held-out responses, and the accepted tokens per SD step (the bonus token included) of one speculative rollout of
``--prompts`` held-out prompts at each temperature and strategy; with the training time and data from the drafter's
``train_log.json``. Quality, not speed: nothing here is timed, so it may run beside other work.

Held-out responses: the last ``--n-eval`` rows of ``--responses`` (a ``sample-responses`` file: choose rows that no
compared drafter trained on). Held-out prompts: the task's acceptance prompts (seed + 4000, as ``train-drafter``).

    python -m tltlib bench drafters --model ~/.cache/tltlib/models/smollm2-135m --task words \\
        --drafters "data/smollm2-135m-drafter;runs/drafters/smollm2-cpu-v2" \\
        --responses data/smollm2-135m-responses/words-heldout-64.jsonl.gz
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_device_flags,
    add_output_flags,
    bench_parser,
    existing_file,
    folder,
    listed,
    load_models,
    machine_info,
    markdown_table,
    model_suffix,
    parse_bench_args,
    positive_int,
    resolve,
    result_name,
    strategy_name,
    temperature,
    write_results,
)


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    ap.add_argument("--model", required=True, type=folder("model", "~/.cache/tltlib/models/smollm2-135m"))
    ap.add_argument("--drafters", required=True, type=listed(folder("drafter", "data/smollm2-135m-drafter"),
                                                             "data/a;runs/b", sep=";"))
    ap.add_argument("--responses", required=True, type=existing_file, help="held-out responses (its last --n-eval)")
    ap.add_argument("--task", default="words", choices=["chain", "words"])
    ap.add_argument("--n-eval", type=positive_int, default=64)
    ap.add_argument("--depth", type=positive_int, default=5)
    ap.add_argument("--prompts", type=positive_int, default=16, help="held-out prompts of the acceptance rollouts")
    ap.add_argument("--max-new", type=positive_int, default=256)
    ap.add_argument("--temperatures", default="0,0.9", type=listed(temperature, "0,0.9"))
    ap.add_argument("--strategies", default="chain-3;chain-4;chain-6;tree-4x2-8;tree-6x4-24",
                    type=listed(strategy_name, "chain-4;tree-6x4-24", sep=";"))
    add_device_flags(ap, device="cpu")
    add_output_flags(ap)
    return parse_bench_args(ap, argv)


def main() -> None:
    args = parse_args()
    import torch

    from tltlib.drafting.train import autocast_to_target, depth_accuracy
    from tltlib.drafting.warmup import measure_acceptance, rows_pairs
    from tltlib.model.drafter import load_drafter
    from tltlib.spec.strategy import SpecStrategy
    from tltlib.tasks.datasets import generate_task, read_responses

    args.drafter = None
    target, tok, _ = load_models(args)
    held = rows_pairs(target, tok, read_responses(args.responses, target.config.vocab_size)[-args.n_eval:])
    batch = held.batch(held.sequences())
    prompts = generate_task(args.task, args.prompts, 4000)
    rows, results = [], []
    for path in args.drafters.items:
        drafter = load_drafter(resolve(path), target)
        with torch.no_grad(), autocast_to_target(drafter):
            acc = depth_accuracy(drafter, batch, args.depth)
        rec = {"drafter": path, "top1_by_depth": acc, "accept": {}, **_training(path)}
        for t in args.temperatures.items:
            for st in args.strategies.items:
                s = measure_acceptance(target, drafter, tok, prompts, SpecStrategy.parse(st), t, args.max_new)
                rec["accept"][f"{st}@T={t:g}"] = s["spec/accept_len_mean"]
                print(f"{path} {st} T={t:g}: {s['spec/accept_len_mean']:.2f} tokens per step", flush=True)
        results.append(rec)
        rows.append([path, *(f"{a:.1%}" for a in acc), *(f"{v:.2f}" for v in rec["accept"].values()),
                     rec["train"]])
    keys = list(results[0]["accept"])
    header = ["drafter", *(f"top-1 d{d + 1}" for d in range(args.depth)), *keys, "training"]
    payload = {"bench": "drafters", "machine": machine_info(str(target.device)), "settings": vars(args),
               "results": results}
    write_results(result_name("drafters", str(target.device), args.dtype, model_suffix(args.model)), payload,
                  f"Drafters of {args.model}: top-1 agreement with the target's argmax by draft depth on the last "
                  f"{args.n_eval} responses of {args.responses}; accepted tokens per SD step (bonus included) over "
                  f"{args.prompts} held-out {args.task} prompts, at most {args.max_new} new tokens, one rollout each "
                  "(`strategy@T=temperature`)\n\n" + markdown_table(header, rows), args.out)


def _training(path: str) -> dict:
    """Training time and data of a drafter, from its ``train_log.json`` (when it has one)."""
    log_file = Path(path) / "train_log.json"
    if not log_file.exists():
        return {"train": "-"}
    d = json.loads(log_file.read_text())
    steps, secs, rec = len(d["log"].get("step", [])), d["log"].get("train_seconds"), d.get("recipe", {})
    return {"train": f"{steps} steps, {secs / 60:.1f} min, unroll {rec.get('unroll', 1)}" if secs else f"{steps} steps",
            "data": d.get("data")}


if __name__ == "__main__":
    main()
