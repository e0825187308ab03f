"""What a verify forward of T tokens costs, in plain decode steps: the ``c_verify(T)`` SD's speedup divides by.

For each batch size, one target forward of T new tokens per row over a ``--context``-token cache, T = 1 (a plain
decode step) and each of ``--tokens``; median of ``--repeats`` after a warm-up, interleaved. Two sets of kernels
side by side: this machine's kernel table (``tltlib.kernels.table``, measured here on first use) and PyTorch's
defaults (``F.linear``, SDPA). A verify of a k-token draft is worth it only while ``cost(k+1) / cost(1)`` stays well
below the tokens a step accepts.

    python -m tltlib bench verify_cost --model ~/.cache/tltlib/models/smollm2-135m
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
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
    result_name,
    write_results,
)


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap)
    add_device_flags(ap, device="cpu")
    ap.add_argument("--batches", default="1,4", type=listed(positive_int, "1,4"))
    ap.add_argument("--tokens", default="2,4,5,9,16,25", type=listed(positive_int, "2,4,9"),
                    help="verify widths T (new tokens per row) besides 1")
    ap.add_argument("--context", type=positive_int, default=200, help="cached tokens per row before the forward")
    add_output_flags(ap, repeats=15)
    return parse_bench_args(ap, argv)


def main() -> None:
    args = parse_args()
    import torch

    from tltlib.kernels import table as kt
    from tltlib.kernels.search import ensure

    model, _, _ = load_models(args)
    device = str(model.device)
    widths = [1, *args.tokens.items]
    kernels = {"table": ensure(model), "defaults": kt.EMPTY}          # this machine's choices vs PyTorch's
    g = torch.Generator().manual_seed(0)
    rows, results = [], []
    for b in args.batches.items:
        med = _batch_medians(model, b, widths, kernels, g, args, device)
        for t in widths:
            rec = {"batch": b, "tokens": t, **{f"{k}_ms": 1e3 * med[(k, t)] for k in kernels},
                   **{f"{k}_vs_step": med[(k, t)] / med[(k, 1)] for k in kernels}}
            results.append(rec)
            rows.append([b, t, rec["table_ms"], f"{rec['table_vs_step']:.2f}", rec["defaults_ms"],
                         f"{rec['defaults_vs_step']:.2f}", f"{med[('defaults', t)] / med[('table', t)]:.2f}x"])
    header = ["batch", "tokens", "kernel table ms", "in decode steps", "PyTorch defaults ms", "in decode steps",
              "table speedup"]
    payload = {"bench": "verify_cost", "machine": machine_info(device), "settings": vars(args), "results": results,
               "kernel_table": kernels["table"].as_dict()}
    write_results(result_name("verify_cost", device, args.dtype, model_suffix(args.model)), payload,
                  f"Target forward of T new tokens per row over a {args.context}-token cache, model {args.model}, "
                  f"{args.dtype} on {device}, median of {args.repeats} after a warm-up; 'in decode steps' = time / "
                  "the same kernel's 1-token forward\n\n" + markdown_table(header, rows), args.out)


def _batch_medians(model, b: int, widths: list[int], kernels: dict, g, args, device: str) -> dict:
    """Median seconds of a ``b``-row forward of each width over a ``--context`` cache, per kernel table (random tokens
    from ``g``): ``{(kernels, width): seconds}``. The same cache slots every call: nothing is committed."""
    import torch

    from tltlib.kernels import table as kt
    vocab = model.config.vocab_size

    def forward_with(table, tokens, cache):
        def run():
            with kt.using(table):
                model.forward_cached(tokens, cache)
        return run

    cache = model.new_cache(b, args.context + max(widths) + 1)
    with torch.inference_mode():
        model.forward_cached(torch.randint(0, vocab, (b, args.context), generator=g).to(device), cache)
        cache.advance(args.context)
        fns = {(k, t): forward_with(table, torch.randint(0, vocab, (b, t), generator=g).to(device), cache)
               for k, table in kernels.items() for t in widths}
        return {key: m for key, (m, _) in interleaved_medians(fns, device, args.repeats, warmup=2).items()}


if __name__ == "__main__":
    main()
