"""This machine's kernel choices, measured afresh: every projection and attention kernel timed for a model's shapes and
bands of rows (``tltlib.kernel_search``), the fastest kept in the machine's kernel table, and a results table naming
the CPU.

Each cell: every candidate timed in interleaved rounds after a warm-up (medians); the choice against the starting
point (the constants measured on the development VM) and against PyTorch's default (``F.linear``, SDPA); then one
decode forward's projections and attention at 1, 16 and 64 rows summed from the cells (chosen vs PyTorch's defaults vs
the starting points). On a busy machine (a candidate's timings spread more than ``kernel_table.MAX_SPREAD``) nothing
is written: it says so and asks for a quiet machine.

    python -m tltlib bench kernels                                              # the tiny reasoner and its drafter
    python -m tltlib bench kernels --model ~/.cache/tltlib/models/smollm2-135m --drafter ''
"""
from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (DRAFTER, add_model_flags, add_output_flags, bench_parser, load_models, machine_info,  # noqa: E402
                     markdown_table, model_suffix, parse_bench_args, positive_int, write_results)

DECODE_ROWS = (1, 16, 64)


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, drafter=DRAFTER, drafter_help="the drafter whose shapes are measured too ('' for none)")
    ap.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds per cell (>= 3)")
    ap.add_argument("--context", type=positive_int, default=512, help="cached positions per row in attention cells")
    add_output_flags(ap, out_help="results folder (default bench/results)")
    args = parse_bench_args(ap, argv)
    if args.rounds < 3:
        ap.error(f"argument --rounds: {args.rounds} is too few; give at least 3 (a median and a spread need them)")
    return args


def main() -> None:
    args = parse_args()
    from tltlib import kernel_search as ks
    from tltlib import kernel_table as kt

    args.device, args.dtype = "cpu", "float32"
    model, _, drafter = load_models(args, drafter=bool(args.drafter))
    config = ks.SearchConfig(rounds=args.rounds, context=args.context)
    linear, attention = ks.search(model, drafter, config=config)
    here = kt.current()
    measured = kt.KernelTable(here.machine, linear, attention, {"search": asdict(config)})
    noisy = measured.noisy()
    if noisy:
        raise ValueError(f"the timings' spread is too high to choose at {len(noisy)} of {measured.size} cells (worst "
                         f"{noisy[0][1]:.0%} at {noisy[0][0]}, the limit is {kt.MAX_SPREAD:.0%}): another process is "
                         "using the CPU; rerun on a quiet machine (nothing was written)")
    table = here.merged(linear, attention, measured.settings)
    kt.save(table, kt.cache_path(table.machine))
    kt.install(table)
    forward = decode_forward(model, linear, attention)
    payload = {"bench": "kernels", "machine": machine_info("cpu"), "model": str(args.model),
               "drafter": args.drafter or None, "settings": vars(args), "table": measured.as_dict(),
               "decode_forward": forward}
    text = (f"Kernel choices on this CPU for {args.model}" + (f" and {args.drafter}" if args.drafter else "")
            + f" (float32, {here.machine.threads} threads; medians of {args.rounds} interleaved rounds; the table is "
            f"saved to {kt.cache_path(table.machine)})\n\n"
            + "One decode forward's projections and attention summed from the cells, ms (chosen / PyTorch's defaults "
              "/ the development VM's constants):\n\n" + _forward_table(forward)
            + "\n\nProjections (ms per call of one weight; the choice inside a rollout, where a packed copy exists, "
              "and without one):\n\n" + _linear_table(measured)
            + "\n\nCached attention (ms per layer):\n\n" + _attention_table(measured))
    name = f"kernels-cpu-{table.machine.slug}{model_suffix(args.model)}"
    write_results(name, payload, text, args.out)


def decode_forward(model, linear: dict, attention: dict) -> list[dict]:
    """One decode forward (one new token per row, rows of unequal lengths) at :data:`DECODE_ROWS` rows, summed from
    the cells: every layer's projections, the LM head and the attention, by the chosen kernels (a rollout's: packed
    copies at hand, the ragged kernel when built), PyTorch's defaults and the starting points."""
    from tltlib import kernel_search as ks
    from tltlib import kernel_table as kt
    c = model.config
    counts = {shape: len(ws) for shape, ws in ks.projection_weights(model).items()}
    kernel = ks.ragged_kernel() is not None
    table = kt.KernelTable(None, linear, attention)
    out = []
    for rows in DECODE_ROWS:
        b = kt.band(rows)
        total = {"chosen": 0.0, "defaults": 0.0, "starting points": 0.0}
        for (n, k), count in counts.items():
            t = linear[kt.linear_key(n, k, b)].seconds
            chosen = table.linear_kernel(n, k, rows, True) or "linear"
            total["chosen"] += count * t[chosen]
            total["defaults"] += count * t["linear"]
            total["starting points"] += count * t[kt.linear_start(kt.band_size(b), True)]
        t = attention[kt.attention_key(c.num_heads, c.num_kv_heads, c.dim_head, 0, kt.band(rows, 7), True)].seconds
        chosen = table.attention_kernel(c.num_heads, c.num_kv_heads, c.dim_head, 1, rows, True, kernel) or "sdpa"
        start = kt.attention_start(rows, 1, True, kernel)
        for key, kind in (("chosen", chosen), ("defaults", "sdpa"), ("starting points", start)):
            total[key] += c.num_layers * t[kind]
        out.append({"rows": rows, **{f"{k}_ms": v * 1e3 for k, v in total.items()}})
    return out


def _forward_table(forward: list[dict]) -> str:
    rows = [[f["rows"], f["chosen_ms"], f["defaults_ms"], f["starting points_ms"],
             f"{f['defaults_ms'] / f['chosen_ms']:.2f}x", f"{f['starting points_ms'] / f['chosen_ms']:.2f}x"]
            for f in forward]
    return markdown_table(["rows", "chosen", "PyTorch defaults", "dev-VM constants", "vs defaults",
                           "vs constants"], rows)


def _linear_table(table) -> str:
    from tltlib import kernel_table as kt
    rows = []
    for key in sorted(table.linear, key=lambda k: (k.split("/")[0], int(k.split("/r")[1]))):
        shape, b = key.split("/r")
        n, k = map(int, shape.split("x"))
        t, size = table.linear[key], kt.band_size(int(b))
        chosen = table.linear_kernel(n, k, size, True) or "linear"
        ms = [f"{t.seconds[c] * 1e3:.4f}" if c in t.seconds else "" for c in kt.LINEAR_KERNELS]
        rows.append([shape, _band_label(int(b)), *ms, chosen, table.linear_kernel(n, k, size, False) or "linear",
                     kt.linear_start(size, True), f"{t.seconds['linear'] / t.seconds[chosen]:.2f}x"])
    return markdown_table(["weight", "rows", *kt.LINEAR_KERNELS, "chosen", "chosen without packs", "dev-VM constant",
                           "chosen vs F.linear"], rows)


def _attention_table(table) -> str:
    from tltlib import kernel_search as ks
    from tltlib import kernel_table as kt
    kernel = ks.ragged_kernel() is not None
    rows = []
    for key in sorted(table.attention):
        shape, q, r, kind = key.split("/")
        heads, rest = shape.split("h")
        kv, dim = rest.removesuffix("d").split("kv")
        qn, rn = kt.band_size(int(q[1:])), kt.band_size(int(r[1:]))
        t = table.attention[key]
        chosen = table.attention_kernel(int(heads), int(kv), int(dim), qn, rn, kind == "ragged", kernel) or "sdpa"
        ms = [f"{t.seconds[c] * 1e3:.4f}" if c in t.seconds else "" for c in kt.ATTENTION_KERNELS]
        rows.append([shape, _band_label(int(q[1:])), _band_label(int(r[1:])), kind, *ms, chosen,
                     kt.attention_start(rn, qn, kind == "ragged", kernel), f"{t.seconds['sdpa'] / t.seconds[chosen]:.2f}x"])
    return markdown_table(["heads", "queries", "rows", "lengths", *kt.ATTENTION_KERNELS, "chosen", "dev-VM constant",
                           "chosen vs SDPA"], rows)


def _band_label(b: int) -> str:
    lo, hi = (1 << (b - 1)) + 1 if b else 1, 1 << b
    return str(hi) if lo == hi else f"{lo}-{hi}"


if __name__ == "__main__":
    main()
