"""The Triton paged attention on CUDA against gather + SDPA and a dense cache: one layer's attention, timed.

Per cell (``--rows`` x ``--spans`` x ``--new`` new tokens per row) one layer's attention at the head shapes given
(default SmolLM2-135M's: 9 heads, 3 KV heads, head dim 64) over rows whose committed lengths spread over the upper
half of the span (ragged, as after SD steps), pages scattered in the pool as a long rollout leaves them, causal over
the new tokens, the mask as a captured graph builds it (a fixed span): ``triton``, the kernel reading the pages in
place (:func:`tltlib.kernels.triton_attention.paged_attention`); ``gathered``, what ``PagedKVCache`` did on CUDA before
it (the rows' pages gathered over the span, then SDPA); ``dense``, a dense cache's attention over contiguous keys and
values of the same lengths (SDPA). Outputs are checked against each other first. Time: microseconds per call, median
of ``--repeats`` interleaved timings of ``--calls`` calls, each competitor captured in a CUDA graph (how the engine
runs up to 64 rows) and eagerly (launches included); the Triton kernel's KV bandwidth (bytes of the rows' own
entries read / time).

    python -m tltlib bench triton_attention                    # on a GPU, ~30 s
    python -m tltlib bench triton_attention --heads 12 --kv-heads 2 --head-dim 128   # Qwen2.5-1.5B's heads
    python -m tltlib bench triton_attention --compile-only     # anywhere with triton: sm_90 registers and spills

On a machine without CUDA it refuses, except ``--compile-only``: the kernel compiled for sm_90 without a GPU, the
registers, spills and shared memory ``ptxas`` reports for the model shapes of
:data:`tltlib.kernels.triton_attention.REPORT_CASES` and the ones given here.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_output_flags,
    bench_parser,
    interleaved_medians,
    listed,
    machine_info,
    markdown_table,
    parse_bench_args,
    positive_int,
    result_name,
    write_results,
)

TOLERANCE = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-4}


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    ap.add_argument("--rows", default="1,16,64", type=listed(positive_int, "1,16,64"))
    ap.add_argument("--spans", default="512,2048", type=listed(positive_int, "512,2048"),
                    help="attention spans (a captured graph's span bucket)")
    ap.add_argument("--new", default="1,9", type=listed(positive_int, "1,9"),
                    help="new tokens per row: 1 (decode), a verify's width")
    ap.add_argument("--heads", type=positive_int, default=9)
    ap.add_argument("--kv-heads", type=positive_int, default=3)
    ap.add_argument("--head-dim", type=positive_int, default=64)
    ap.add_argument("--page-size", type=positive_int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
    ap.add_argument("--calls", type=positive_int, default=20, help="calls per timing")
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU needed: compile the kernel for sm_90 and report ptxas's registers and spills")
    add_output_flags(ap, repeats=15, out_help="results folder (default bench/results)")
    args = parse_bench_args(ap, argv)
    if args.heads % args.kv_heads:
        ap.error(f"argument --heads: {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    return args


def main() -> None:
    args = parse_args()
    import torch

    from tltlib.kernels import triton_attention as ta
    if not args.compile_only and not torch.cuda.is_available():
        raise SystemExit("error: bench triton_attention times the Triton kernel on CUDA and this machine has no GPU: "
                         "run it on the GPU machine, or give --compile-only for the sm_90 resource use from ptxas")
    reason = ta.unavailable_reason()
    if reason and not (args.compile_only and reason == f"{ta.ENV}=0"):        # compiling needs triton, not the switch
        fix = f"unset {ta.ENV}" if reason == f"{ta.ENV}=0" else "install triton (pip install triton==3.6.0)"
        raise SystemExit(f"error: the Triton kernel cannot run here ({reason}); {fix}")
    if args.compile_only:
        return compile_only(args, ta)
    t0 = time.perf_counter()
    results, rows_md = [], []
    for b in args.rows.items:
        for span in args.spans.items:
            for new in args.new.items:
                rec = cell(args, b, span, new)
                results.append(rec)
                rows_md.append(_row(rec))
                print(f"rows {b:3d}, span {span:5d}, {new:2d} new: " + ", ".join(
                    f"{k} {rec['graphed_us'][k]:.1f} us" for k in rec["graphed_us"]), file=sys.stderr, flush=True)
    import triton
    payload = {"bench": "triton_attention", "machine": machine_info("cuda"), "triton": triton.__version__,
               "settings": vars(args), "results": results, "wall_s": time.perf_counter() - t0}
    header = ["rows", "span", "new", "triton us", "gathered us", "dense us", "gathered / triton", "dense / triton",
              "triton GB/s", "eager triton us", "eager gathered us", "eager dense us", "max diff"]
    write_results(result_name("triton_attention", "cuda", args.dtype, _shape(args)), payload,
                  f"One layer's attention, {args.heads} heads / {args.kv_heads} KV heads / head dim {args.head_dim}, "
                  f"{args.dtype}, pages of {args.page_size} scattered, committed lengths in the span's upper half, "
                  f"causal over the new tokens, a fixed-span mask; microseconds per call, median of {args.repeats} "
                  f"interleaved timings of {args.calls} calls in a CUDA graph (eager: launched from Python). triton: "
                  "the paged kernel in place; gathered: the pages gathered over the span, then SDPA (PagedKVCache on "
                  "CUDA before it); dense: SDPA over contiguous keys and values. GB/s: the rows' own K/V bytes / "
                  "the triton time.\n\n" + markdown_table(header, rows_md), args.out)


def _shape(args) -> str:
    return f"-h{args.heads}-kv{args.kv_heads}-d{args.head_dim}"


def _row(rec: dict) -> list:
    g, e = rec["graphed_us"], rec["eager_us"]
    return [rec["rows"], rec["span"], rec["new"], f"{g['triton']:.1f}", f"{g['gathered']:.1f}", f"{g['dense']:.1f}",
            f"{g['gathered'] / g['triton']:.2f}x", f"{g['dense'] / g['triton']:.2f}x", f"{rec['triton_gb_s']:.0f}",
            f"{e['triton']:.1f}", f"{e['gathered']:.1f}", f"{e['dense']:.1f}", f"{rec['max_abs_diff']:.1e}"]


def inputs(args, b: int, span: int, new: int, g, device: str = "cuda"):
    """One cell's tensors on ``device``: q, the pool's pages, the block tables, committed lengths, the fixed-span
    mask (as :func:`tltlib.kv.dense.attention_mask` builds it under a captured graph)."""
    import torch

    from tltlib.kv.dense import attention_mask
    dtype, ps, kvh, d = getattr(torch, args.dtype), args.page_size, args.kv_heads, args.head_dim
    width = -(-span // ps)
    lengths = torch.randint(span // 2, span - new + 1, (b,), generator=g).to(device)
    k_pages, v_pages = (torch.randn(kvh, b * width + 1, ps, d, generator=g).to(device, dtype) for _ in range(2))
    table = torch.randperm(b * width, generator=g).view(b, width).contiguous().to(device)
    q = torch.randn(b, args.heads, new, d, generator=g).to(device, dtype)
    index = torch.zeros(b, new, kvh, dtype=torch.long, device=device)
    mask = attention_mask(index, lengths, span, new, None, 0, -1, span - new, fixed=True).mask
    return q, k_pages, v_pages, table, lengths, mask


def competitors(args, b: int, span: int, new: int, device: str = "cuda") -> tuple[dict, float, int]:
    """``({name: call}, largest difference from dense, the rows' own K/V bytes)`` of one cell; refused when the
    outputs differ beyond the dtype's tolerance."""
    import torch

    from tltlib.kernels import triton_attention as ta
    from tltlib.kernels.dispatch import gqa_sdpa
    from tltlib.kv.paged import PagedKVCache
    g = torch.Generator().manual_seed(b + span + new)
    q, k_pages, v_pages, table, lengths, mask = inputs(args, b, span, new, g, device)
    where = SimpleNamespace(table=table, span=span)
    k_dense, v_dense = (PagedKVCache._gather(p, where).contiguous() for p in (k_pages, v_pages))
    bounds, memo = ta.row_bounds(mask, lengths, span), {}
    fns = {"triton": lambda: ta.paged_attention(q, k_pages, v_pages, table, *bounds, memo=memo),
           "gathered": lambda: gqa_sdpa(q, PagedKVCache._gather(k_pages, where), PagedKVCache._gather(v_pages, where),
                                        mask),
           "dense": lambda: gqa_sdpa(q, k_dense, v_dense, mask)}
    outs = {k: fn().float() for k, fn in fns.items()}
    diff = max(float((outs[k] - outs["dense"]).abs().max()) for k in outs)
    if diff > TOLERANCE[args.dtype] * max(1.0, float(outs["dense"].abs().max())):
        raise SystemExit(f"error: rows {b}, span {span}, {new} new: the competitors differ by {diff:.3g} (beyond "
                         f"{TOLERANCE[args.dtype]} for {args.dtype}): the kernel is wrong here, report it")
    return fns, diff, int(bounds[1].sum()) * args.kv_heads * args.head_dim * 2 * k_pages.element_size()


def cell(args, b: int, span: int, new: int) -> dict:
    """Check, then time the three competitors at ``b`` rows, ``span`` slots and ``new`` new tokens per row."""
    fns, diff, kv_bytes = competitors(args, b, span, new)
    graphed, notes = {}, {}
    for name, fn in fns.items():
        graphed[name], notes[name] = _graphed(fn, args.calls)
    timing = interleaved_medians(graphed, "cuda", args.repeats)
    eager = interleaved_medians({k: _calls(fn, args.calls) for k, fn in fns.items()}, "cuda", args.repeats)
    graphed_us = {k: v[0] / args.calls * 1e6 for k, v in timing.items()}
    return {"rows": b, "span": span, "new": new, "graphed_us": graphed_us,
            "eager_us": {k: v[0] / args.calls * 1e6 for k, v in eager.items()}, "max_abs_diff": diff,
            "kv_bytes": kv_bytes, "triton_gb_s": kv_bytes / (graphed_us["triton"] * 1e-6) / 1e9,
            "capture": {k: v for k, v in notes.items() if v}}


def _graphed(fn, calls: int):
    """``(replay, note)``: ``calls`` calls of ``fn`` captured in one CUDA graph (warmed up on a side stream first);
    where the capture fails, the eager calls and why (the note)."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as e:
        print(f"CUDA graph capture failed, timing eagerly: {e}", file=sys.stderr)
        return _calls(fn, calls), f"capture failed: {str(e).strip()[:200]}"
    return graph.replay, ""


def _calls(fn, calls: int):
    def go():
        for _ in range(calls):
            fn()
    return go


def compile_only(args, ta) -> None:
    """The kernel compiled for sm_90 (no GPU needed): ptxas's registers and spills, and Triton's shared memory."""
    group = args.heads // args.kv_heads
    cases = list(ta.REPORT_CASES) + [(args.dtype, args.head_dim, group, new) for new in args.new.items]
    report = ta.resource_report(list(dict.fromkeys(cases)))
    rows = [[r["dtype"], r["head_dim"], r["group"], r["new"], r["split"], r["config"]["BLOCK_M"],
             r["config"]["BLOCK_N"], r["config"]["num_warps"], r["registers"], r["spill_stores"], r["spill_loads"],
             r["shared_bytes"]] for r in report]
    import triton
    payload = {"bench": "triton_attention --compile-only", "machine": machine_info("cpu"), "triton": triton.__version__,
               "ptxas": report[0]["ptxas"] if report else None, "settings": vars(args), "results": report}
    header = ["dtype", "head dim", "G", "new", "split", "BLOCK_M", "BLOCK_N", "warps", "registers", "spill stores B",
              "spill loads B", "shared B"]
    write_results(f"triton_attention-compile-{report[0]['arch'] if report else 'sm_90a'}", payload,
                  f"The Triton paged attention compiled for {report[0]['arch'] if report else 'sm_90a'} without a GPU "
                  f"(triton {triton.__version__}, {payload['ptxas']} -v): registers per thread, spills, Triton's "
                  "shared memory; G: query heads per KV head.\n\n" + markdown_table(header, rows), args.out)


if __name__ == "__main__":
    main()
