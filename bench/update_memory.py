"""Peak memory and speed of the GRPO update on a real model, by micro-batch budget and LM-head chunk, against the
estimate the trainer checks before a run (:mod:`tltlib.rl.memory`).

Each configuration runs in a fresh process (so its peak resident memory, VmHWM, is its own): load the model, build
the trainer (AdamW, engine), roll out the word problems' prompts (the chain task's on a model without a chat
template), ``--rows`` completions of exactly ``--length`` tokens (forced lengths: the KV
cache the engine keeps through the update), then one RL update (old log-probs skipped: ``num_iterations`` 1). Peak
memory is VmHWM minus the resident memory after loading; tokens/s counts the update's prompt + completion tokens.
The last table is what the estimate allows on ``--budget-gib``: the most prompts x group of completions of each
length that fit, at the micro-batch budget given.

    python -m tltlib bench update_memory --model ~/.cache/tltlib/models/smollm2-135m
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
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
    parse_bench_args,
    positive_float,
    positive_int,
    resolve,
    result_name,
    write_results,
)

GIB = 1 << 30


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap)
    add_device_flags(ap, device="cpu")
    ap.add_argument("--rows", type=positive_int, default=32, help="completions in the update")
    ap.add_argument("--length", type=positive_int, default=384, help="tokens per completion (forced)")
    ap.add_argument("--micro", default="512,1024,2048,4096,8192", type=listed(positive_int, "1024,4096"),
                    help="micro_batch_tokens budgets (with the default chunk)")
    ap.add_argument("--chunks", default="512,2048,8192,65536", type=listed(positive_int, "512,2048"),
                    help="logprob_chunk sizes (with --chunk-micro)")
    ap.add_argument("--chunk-micro", type=positive_int, default=2048)
    ap.add_argument("--budget-gib", type=positive_float, default=24.0,
                    help="the memory the last table fits runs into")
    add_num_generations(ap, 8, "completions per prompt in the last table")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    add_output_flags(ap)
    args = parse_bench_args(ap, argv)
    if not args.child:
        _check_workload(ap, args)
    return args


GROUP = 4
"""Completions per prompt in the measured update (``--rows`` of them form whole groups)."""


def _check_workload(ap, args) -> None:
    """Before any child process starts: ``--rows`` forms whole groups, and ``--length`` fits the model's context."""
    from tltlib.fileio import read_json
    if args.rows % GROUP:
        ap.error(f"argument --rows: {args.rows} completions cannot form the update's groups of {GROUP}; give a "
                 f"multiple of {GROUP} (e.g. 32)")
    context = read_json(resolve(args.model) / "config.json").get("max_position_embeddings")
    if isinstance(context, int) and args.length >= context:
        ap.error(f"argument --length: {args.length} tokens per completion leave no room for a prompt in the "
                 f"model's context of {context} tokens (max_position_embeddings); give a shorter --length")


def _rss(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field))


def child(args) -> None:
    """One configuration: print its measurement as one JSON line."""
    import time

    import torch

    from tltlib.rl.grpo import GRPOConfig
    from tltlib.rl.memory import worker_kv, worker_memory
    from tltlib.rl.trainer import GRPOTrainer
    from tltlib.tasks.datasets import generate_task
    from tltlib.tasks.prompts import encode_prompts
    micro, chunk = json.loads(args.child)
    model, tok, _ = load_models(args)
    base = _rss("VmRSS:")
    g = args.rows // GROUP
    problems = generate_task("words" if getattr(tok, "chat_template", None) else "chain", g, seed=7)
    cfg = GRPOConfig(num_generations=GROUP, generation_batch_size=args.rows, max_completion_length=args.length,
                     micro_batch_tokens=micro, logprob_chunk=chunk, learning_rate=1e-6)
    tr = GRPOTrainer(model, tok, problems, cfg)
    shape = tr.worker_shape()
    est = worker_memory(model.config, cfg, shape, worker_kv(model.config, cfg, shape)[0])
    res = tr.engine.generate(encode_prompts(problems, tok), torch.Generator().manual_seed(0),
                             lengths=torch.full((args.rows,), args.length))
    batch = tr.score(problems, res)
    t = time.perf_counter()
    tr.update(batch)
    dt = time.perf_counter() - t
    tokens = sum(batch.lengths)
    print("RESULT " + json.dumps({"micro": micro, "chunk": chunk, "peak_gib": (_rss("VmHWM:") - base) / GIB,
                                  "estimate_gib": sum(est.values()) / GIB, "parts_gib": {k: v / GIB for k, v in
                                                                                          est.items()},
                                  "update_s": dt, "tokens": tokens, "tokens_per_s": tokens / dt,
                                  "micro_batches": len(batch.micro_batches)}), flush=True)


def main() -> None:
    args = parse_args()
    if args.child:
        return _run_child(args)
    configs = [(m, 2048) for m in args.micro.items] + [(args.chunk_micro, c) for c in args.chunks.items
                                                         if c != 2048 or args.chunk_micro not in args.micro.items]
    results = []
    for micro, chunk in configs:
        results.append(_measure(args, micro, chunk))
        r = results[-1]
        print(f"micro {micro:6d} chunk {chunk:6d}: peak {r['peak_gib']:.2f} GiB (estimate {r['estimate_gib']:.2f}), "
              f"{r['tokens_per_s']:.0f} tokens/s", flush=True)
    fits = _fits(args)
    table = _tables(results, fits, args)
    payload = {"bench": "update_memory", "machine": machine_info(args.device), "settings": vars(args),
               "results": results, "fits": fits}
    write_results(result_name("update_memory", args.device, args.dtype, model_suffix(args.model)), payload, table,
                  args.out)


def _run_child(args) -> None:
    """:func:`child`; an error raised on purpose goes to the parent as one line (``ERROR`` and JSON: its type and
    message), which the parent raises as its own, without the child's traceback."""
    from tltlib.errors import TLTError
    try:
        child(args)
    except TLTError as e:
        print("ERROR " + json.dumps({"type": type(e).__name__, "message": str(e)}), flush=True)
        sys.exit(1)


def _measure(args, micro: int, chunk: int) -> dict:
    """One configuration measured in a fresh process (:func:`child`); its error raised here as one line."""
    from tltlib import errors
    cmd = [sys.executable, __file__, "--model", args.model, "--device", args.device, "--dtype", args.dtype,
           "--rows", str(args.rows), "--length", str(args.length), "--child", json.dumps([micro, chunk])]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    lines = out.stdout.splitlines()
    line = next((ln for ln in lines if ln.startswith("RESULT ")), None)
    if line is not None:
        return json.loads(line[len("RESULT "):])
    failed = next((json.loads(ln[len("ERROR "):]) for ln in lines if ln.startswith("ERROR ")), None)
    if failed is None:                                    # a bug: the child's traceback
        raise SystemExit(f"micro {micro} chunk {chunk} failed:\n{out.stderr[-2000:]}")
    kind = getattr(errors, failed["type"], None)
    kind = kind if isinstance(kind, type) and issubclass(kind, errors.TLTError) else errors.Refused
    raise kind(f"the update at micro_batch_tokens {micro}, logprob_chunk {chunk} (--rows {args.rows}, --length "
               f"{args.length}): {failed['message']}")


def _fits(args) -> list[dict]:
    """The most prompts per step (x ``--num-generations``) whose estimate fits ``--budget-gib``, per completion
    length."""
    from tltlib.rl.grpo import GRPOConfig
    from tltlib.rl.memory import HEADROOM, grpo_memory
    model, tok, _ = load_models(args, all_cores=False, kernels=False)
    params = sum(p.numel() for p in model.parameters())
    elem = next(model.parameters()).element_size()
    weights = params * elem
    out = []
    for length in (256, 512, 1024, 2048):
        best = 0
        for prompts in range(1, 513):
            cfg = GRPOConfig(num_generations=args.num_generations, generation_batch_size=prompts * args.num_generations,
                             max_completion_length=length, micro_batch_tokens=args.chunk_micro)
            need = sum(grpo_memory(model.config, cfg, 128, prompts * args.num_generations, elem, params).values())
            if need + weights > HEADROOM * args.budget_gib * GIB:
                break
            best = prompts
        out.append({"length": length, "prompts": best, "completions": best * args.num_generations})
    return out


def _tables(results, fits, args) -> str:
    rows = [[r["micro"], r["chunk"], r["micro_batches"], f"{r['peak_gib']:.2f}", f"{r['estimate_gib']:.2f}",
             f"{r['parts_gib']['update activations']:.2f}", f"{r['update_s']:.1f}", f"{r['tokens_per_s']:.0f}"]
            for r in results]
    text = (f"The GRPO update on {args.rows} completions of {args.length} tokens (+ prompts), {args.dtype} on "
            f"{args.device}: peak resident memory above the loaded model (fresh process per row) against the "
            "trainer's estimate, and the update's speed\n\n" + markdown_table(
                ["micro_batch_tokens", "logprob_chunk", "micro-batches", "peak GiB", "estimate GiB",
                 "of which activations", "update s", "tokens/s"], rows))
    text += (f"\n\nWhat fits in {args.budget_gib:g} GiB by the estimate (weights included, {args.num_generations} "
             f"completions "
             f"per prompt, prompts of 128 tokens, micro_batch_tokens {args.chunk_micro}):\n\n"
             + markdown_table(["completion length", "prompts per step", "completions per step"],
                              [[f["length"], f["prompts"], f["completions"]] for f in fits]))
    return text


if __name__ == "__main__":
    main()
