"""This machine's kernel choices, measured afresh: every projection and attention kernel timed for a model's shapes and
bands of rows (``tltlib.kernels.search``), the fastest kept in the machine's kernel table, and a results table naming
the CPU.

Each cell: every candidate timed in interleaved rounds after a warm-up (medians); the choice against the starting
point (the constants measured on the development VM) and against PyTorch's default (``F.linear``, SDPA); then the
model's own decode forward at 1, 16 and 64 rows timed under this machine's table, PyTorch's defaults and the
development VM's constants, interleaved. A cell whose timings spread more than ``kernel_table.MAX_SPREAD`` is left
to PyTorch's default and named; on a busy machine (more than :data:`BUSY_SHARE` of the cells so) nothing is written:
it says so and asks for a quiet machine.

    python -m tltlib bench kernels                                              # the tiny reasoner and its drafter
    python -m tltlib bench kernels --model ~/.cache/tltlib/models/smollm2-135m --drafter ''
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    BANDWIDTH_READS,
    DRAFTER,
    add_model_flags,
    add_output_flags,
    bench_parser,
    load_models,
    machine_info,
    markdown_table,
    model_suffix,
    parse_bench_args,
    positive_int,
    read_bandwidth,
    weight_bytes,
    write_results,
)

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


BUSY_SHARE = 0.05
"""The share of cells that may be too noisy to choose (left to PyTorch's default, as the first rollout leaves them)
before the bench calls the machine busy and writes nothing: a shared VM's few-second hiccup spoils one or two of
~110 cells on a quiet run."""


def check_quiet(noisy: list[tuple[str, float]], size: int) -> None:
    """Refuse (``ValueError``, nothing written) when more than :data:`BUSY_SHARE` of the ``size`` cells were too
    noisy to choose (``noisy``: ``(key, spread)``, worst first, as :meth:`KernelTable.noisy` gives them)."""
    from tltlib.errors import BadInput
    from tltlib.kernels import table as kt
    if len(noisy) > BUSY_SHARE * size:
        raise BadInput(f"the timings' spread is too high to choose at {len(noisy)} of {size} cells (worst "
                       f"{noisy[0][1]:.0%} at {noisy[0][0]}; the limit is {kt.MAX_SPREAD:.0%} per cell, in at most "
                       f"{BUSY_SHARE:.0%} of the cells): another process is using the CPU; rerun on a quiet machine "
                       "(nothing was written)")


def main() -> None:
    args = parse_args()
    from tltlib.errors import BadInput
    from tltlib.kernels import search as ks
    from tltlib.kernels import table as kt

    if not kt.enabled():
        raise BadInput(f"{kt.ENV}=0 turns this machine's kernel table off; unset it (or set it to 1) to measure it")
    args.device, args.dtype = "cpu", "float32"
    model, _, drafter = load_models(args, drafter=bool(args.drafter), kernels=False)
    config = ks.SearchConfig(rounds=args.rounds, context=args.context)
    start = time.perf_counter()
    linear, attention = ks.search(model, drafter, config=config)
    search_s = time.perf_counter() - start
    here = kt.current()
    measured = kt.KernelTable(here.machine, linear, attention, {"search": asdict(config)})
    noisy = measured.noisy()
    check_quiet(noisy, measured.size)
    table = ks.keep(linear, attention, config)
    forward = decode_forward(model, args.rounds)
    floor = weights_floor(model)
    payload = {"bench": "kernels", "machine": machine_info("cpu"), "model": str(args.model),
               "drafter": args.drafter or None, "settings": vars(args), "search_s": search_s, "cells": measured.size,
               "table": measured.as_dict(), "decode_forward": forward, "weights_floor": floor}
    text = (f"Kernel choices on this CPU for {args.model}" + (f" and {args.drafter}" if args.drafter else "")
            + f" (float32, {here.machine.threads} threads; medians of {args.rounds} interleaved rounds; "
              f"{measured.size} "
            f"cells measured in {search_s:.0f} s; the table is saved to {kt.cache_path(table.machine)})\n\n"
            + "One decode forward of the model, ms (one token per row after 128-384 cached, packed weights at hand; "
              "medians of interleaved rounds):\n\n" + _forward_table(forward)
            + f"\n\nThe one-row floor: the weights a one-row forward reads ({floor['weight_bytes'] / 1e6:,.0f} MB) at "
              f"this machine's memory read rate ({floor['read_gb_s']:.1f} GB/s, {BANDWIDTH_READS}, medians of 5 "
              f"over {floor['buffer_bytes'] >> 20:,} MiB) take {floor['floor_ms']:.2f} ms; the table's one-row "
              f"forward is {forward[0]['chosen_ms'] / floor['floor_ms']:.2f}x that"
            + (f"\n\n{len(noisy)} of {measured.size} cells spread more than {kt.MAX_SPREAD:.0%} even after "
               "retries and are left to PyTorch's default (measured again by the next process): "
               + ", ".join(f"{k} ({v:.0%})" for k, v in noisy) if noisy else "")
            + "\n\nProjections (ms per call of one weight; the choice inside a rollout, where a packed copy exists, "
              "and without one):\n\n" + _linear_table(measured)
            + "\n\nCached attention (ms per layer):\n\n" + _attention_table(measured))
    name = f"kernels-cpu-{table.machine.slug}{model_suffix(args.model)}"
    write_results(name, payload, text, args.out)


def decode_forward(model, rounds: int) -> list[dict]:
    """One decode forward of the model itself (one new token per row after 256 cached ones, the rows' lengths
    spread over 128-384 as after SD steps; packed weights at hand, as in a rollout) at :data:`DECODE_ROWS` rows
    under this machine's table, PyTorch's defaults and the development VM's constants, interleaved in an order
    rotated each round (``rounds`` rounds of 10 forwards each after a warm-up); median ms per forward."""
    import statistics

    import torch

    from tltlib.kernels import table as kt
    from tltlib.kernels.dispatch import WeightPacks, packed_weights
    tables = {"chosen": kt.current(), "defaults": kt.EMPTY, "constants": kt.StartingPoints()}
    packs, vocab, out = WeightPacks.of(model).current(), model.config.vocab_size, []
    g = torch.Generator().manual_seed(0)
    for rows in DECODE_ROWS:
        cache = model.new_cache(rows, 400)
        lengths = torch.linspace(128, 384, rows).round().long() if rows > 1 else torch.tensor([256])
        times = {name: [] for name in tables}
        with torch.no_grad(), packed_weights(packs):
            model.forward_cached(torch.randint(0, vocab, (rows, 384), generator=g), cache,
                                 logits_at=lengths - 1)
            cache.advance(lengths)
            step = torch.randint(0, vocab, (rows, 1), generator=g)
            names = list(tables)
            for r in range(rounds + 1):                         # the order rotated each round: none always first
                for name in names[r % 3:] + names[:r % 3]:
                    with kt.using(tables[name]):
                        t0 = time.perf_counter()
                        for _ in range(10):
                            model.forward_cached(step, cache)
                        if r:                                   # the first round is the warm-up
                            times[name].append((time.perf_counter() - t0) / 10)
        out.append({"rows": rows, **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}})
    return out


def weights_floor(model, repeats: int = 5) -> dict:
    """What bounds a one-row decode forward from below on this machine: every weight it reads once
    (:func:`_common.weight_bytes`) over the memory's read rate (:func:`_common.read_bandwidth`). Returns
    ``{weight_bytes, read_gb_s, buffer_bytes, floor_ms}``."""
    weights = weight_bytes(model)
    rate, buffer = read_bandwidth(repeats)
    return {"weight_bytes": weights, "read_gb_s": rate / 1e9, "buffer_bytes": buffer, "floor_ms": 1e3 * weights / rate,
            "read": BANDWIDTH_READS}


def _forward_table(forward: list[dict]) -> str:
    rows = [[f["rows"], f["chosen_ms"], f["defaults_ms"], f["constants_ms"],
             f"{f['defaults_ms'] / f['chosen_ms']:.2f}x", f"{f['constants_ms'] / f['chosen_ms']:.2f}x"]
            for f in forward]
    return markdown_table(["rows", "this machine's table", "PyTorch defaults", "dev-VM constants",
                           "table vs defaults", "table vs constants"], rows)


def _linear_table(table) -> str:
    from tltlib.kernels import table as kt
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
    from tltlib.kernels import search as ks
    from tltlib.kernels import table as kt
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
                     kt.attention_start(rn, qn, kind == "ragged", kernel),
                     f"{t.seconds['sdpa'] / t.seconds[chosen]:.2f}x"])
    return markdown_table(["heads", "queries", "rows", "lengths", *kt.ATTENTION_KERNELS, "chosen", "dev-VM constant",
                           "chosen vs SDPA"], rows)


def _band_label(b: int) -> str:
    lo, hi = (1 << (b - 1)) + 1 if b else 1, 1 << b
    return str(hi) if lo == hi else f"{lo}-{hi}"


if __name__ == "__main__":
    main()
