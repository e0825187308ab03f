"""What a verify forward of T tokens costs, in plain decode steps: the ``c_verify(T)`` SD's speedup divides by.

For each batch size, one target forward of T new tokens per row over a ``--context``-token cache, T = 1 (a plain
decode step) and each of ``--tokens``; median of ``--repeats`` after a warm-up, interleaved. Two projection kernels
side by side: ``tltlib.model.linear`` (``weight @ x.T`` for 1-64 rows in CPU float32 inference) and PyTorch's
``F.linear`` (``x @ weight.T``). A verify of a k-token draft is worth it only while ``cost(k+1) / cost(1)`` stays
well below the tokens a step accepts.

    python -m tltlib bench verify_cost --model ~/.cache/tltlib/models/smollm2-135m
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (ensure_malloc_env, interleaved_medians, machine_info, markdown_table, model_suffix,  # noqa: E402
                     write_results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="data/tiny-reasoner")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--tokens", default="2,4,5,9,16,25", help="verify widths T (new tokens per row) besides 1")
    ap.add_argument("--context", type=int, default=200, help="cached tokens per row before the forward")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ensure_malloc_env()

    import torch

    import tltlib.model as tm
    from tltlib.checkpoint import load

    torch.set_num_threads(os.cpu_count() or 1)
    model, _, _ = load(args.model, device=args.device, dtype=args.dtype)
    device = str(model.device)
    widths = [1] + [int(t) for t in args.tokens.split(",")]
    kernels = {"linear": tm.CPU_MM_MIN_ROWS, "F.linear": 1 << 62}     # rows from which W @ x.T is used
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows, results = [], []

    def forward_with(min_rows, tokens, cache):
        def run():
            tm.CPU_MM_MIN_ROWS = min_rows
            model.forward_cached(tokens, cache)             # the same cache slots every call: nothing committed
        return run

    try:
        for b in [int(x) for x in args.batches.split(",")]:
            cache = model.new_cache(b, args.context + max(widths) + 1)
            with torch.inference_mode():
                model.forward_cached(torch.randint(0, vocab, (b, args.context), generator=g).to(device), cache)
                cache.advance(args.context)
                fns = {(k, t): forward_with(min_rows, torch.randint(0, vocab, (b, t), generator=g).to(device), cache)
                       for k, min_rows in kernels.items() for t in widths}
                med = {key: m for key, (m, _) in interleaved_medians(fns, device, args.repeats, warmup=2).items()}
            for t in widths:
                rec = {"batch": b, "tokens": t, **{f"{k}_ms": 1e3 * med[(k, t)] for k in kernels},
                       **{f"{k}_vs_step": med[(k, t)] / med[(k, 1)] for k in kernels}}
                results.append(rec)
                rows.append([b, t, rec["linear_ms"], f"{rec['linear_vs_step']:.2f}", rec["F.linear_ms"],
                             f"{rec['F.linear_vs_step']:.2f}", f"{med[('F.linear', t)] / med[('linear', t)]:.2f}x"])
    finally:
        tm.CPU_MM_MIN_ROWS = kernels["linear"]
    header = ["batch", "tokens", "linear ms", "in decode steps", "F.linear ms", "in decode steps",
              "linear speedup"]
    payload = {"bench": "verify_cost", "machine": machine_info(device), "settings": vars(args), "results": results}
    write_results(f"verify_cost-{device.split(':')[0]}-{args.dtype}{model_suffix(args.model)}", payload,
                  f"Target forward of T new tokens per row over a {args.context}-token cache, model {args.model}, "
                  f"{args.dtype} on {device}, median of {args.repeats} after a warm-up; 'in decode steps' = time / "
                  "the same kernel's 1-token forward\n\n" + markdown_table(header, rows), args.out)


if __name__ == "__main__":
    main()
