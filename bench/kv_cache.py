"""The paged KV cache against the dense one: rollout time, peak KV memory against the tokens held, token identity.

Workload: ``--prompts`` prompts x ``--num-generations`` samples at ``--temperature``, up to ``--max-new`` new tokens,
one rollout per cache (``--kv paged,dense``), the same prompts and seed for both, so both must give the same tokens (the
paged cache reads the same entries). Time: wall time of ``RolloutEngine.generate``, median of ``--repeats`` after a
warm-up, the caches interleaved. Memory: one more run per cache with a hook after every iteration: the paged pool's
peak (pages held at any moment, a forward's reserved pages included) against the most tokens the rows held at an
iteration's end (a prompt's pages shared by its samples counted once), and the dense cache's allocation against the
same; and the memory check's estimate of the paged peak (:func:`tltlib.rl.memory.kv_estimate`) from the rollout's own
response lengths against the peak measured. A dense cache that cannot fit the budget is refused before its rollout; the
bench records the refusal.

    python -m tltlib bench kv_cache                                    # the tiny reasoner, CPU, ~3 min
    python -m tltlib bench kv_cache --model ~/.cache/tltlib/models/smollm2-135m --drafter data/smollm2-135m-drafter \\
        --task words --prompts 8 --num-generations 8 --max-new 512
    python -m tltlib bench kv_cache --model ~/.cache/tltlib/models/smollm2-135m --drafter data/smollm2-135m-drafter \\
        --task words --prompts 32 --num-generations 8 --max-new 4096 --once   # dense cannot hold it on 24 GB
    python -m tltlib bench kv_cache --attention                        # the paged kernels vs gather + BLAS, ~1 min

``--attention`` times one layer's attention instead, at the model's head shapes, over a grid of rows x new tokens per
row: the CPU's paged C++ kernels reading the pages in place against gathering the rows' pages and the dense path
(:func:`tltlib.kernels.dispatch.cached_attention`), pages scattered as a long rollout leaves them; it is the measurement
behind
``PagedKVCache``'s kernel choice (``tltlib.kv.paged_attention.MASKED_KERNEL_MAX_NEW``) on this CPU.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DRAFTER,
    TASK_HELP,
    add_device_flags,
    add_model_flags,
    add_num_generations,
    add_output_flags,
    bench_parser,
    interleaved_medians,
    listed,
    load_models,
    machine_info,
    markdown_table,
    model_suffix,
    parse_bench_args,
    positive_float,
    positive_int,
    result_name,
    strategy_name,
    task_prompts,
    temperature,
    write_results,
)

KINDS = ("paged", "dense")


def _kind(text: str) -> str:
    if text not in KINDS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a KV cache ({' or '.join(KINDS)})")
    return text


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, drafter=DRAFTER, drafter_help="the drafter (its cache is paged or dense with the target's); "
                    "'none' for no drafter")
    add_device_flags(ap)
    ap.add_argument("--task", default="chain", choices=["chain", "words"], help=TASK_HELP)
    ap.add_argument("--prompts", type=positive_int, default=16)
    add_num_generations(ap, 8)
    ap.add_argument("--temperature", type=temperature, default=0.9)
    ap.add_argument("--max-new", type=positive_int, default=720)
    ap.add_argument("--kv", default="paged,dense", type=listed(_kind, "paged,dense"),
                    help="the caches to run, side by side")
    ap.add_argument("--page-size", type=positive_int, default=16)
    ap.add_argument("--memory", type=positive_float, default=0.5,
                    help="the KV budget: a share of free memory (<= 1) or bytes (KVConfig.memory)")
    ap.add_argument("--strategy", default="off", type=strategy_name,
                    help="SD strategy of every iteration (default off: plain decoding)")
    ap.add_argument("--once", action="store_true",
                    help="one rollout per cache, timed with the memory hook on (no warm-up, no repeats): for "
                         "rollouts too long to run several times; the hook's cost is in the time")
    ap.add_argument("--attention", action="store_true",
                    help="time one layer's attention (paged kernels vs gather + dense path) instead of rollouts")
    add_output_flags(ap, repeats=3, out_help="results folder (default bench/results)")
    return parse_bench_args(ap, argv)


def main() -> None:
    args = parse_args()
    import torch

    from tltlib.machine import this_machine

    use_drafter = args.drafter not in (None, "none") and not args.attention
    model, tok, drafter = load_models(args, drafter=use_drafter)
    if args.attention:
        return attention_grid(model, args)
    device = str(model.device)
    prompts = task_prompts(args.task, tok, args.prompts, seed=1)
    engines, refused = _engines(model, drafter, prompts, args)
    out: dict = {}

    def run(kind):
        def go():
            gen = torch.Generator(device=device).manual_seed(0)
            out[kind] = engines[kind].generate(prompts, gen, strategy=args.strategy)
        return go
    t0 = time.perf_counter()
    timing = (interleaved_medians({k: run(k) for k in engines}, device, args.repeats)
              if engines and not args.once else {})
    memory = {kind: _memory(engines[kind], prompts, args, device, out if args.once else None) for kind in engines}
    if args.once:
        timing = {kind: (memory[kind]["memory_run_s"], [memory[kind]["memory_run_s"]]) for kind in engines}
    results, rows = [], []
    first = next(iter(out.values()), None)
    for kind in args.kv.items:
        if kind in refused:
            results.append({"kv": kind, "refused": refused[kind]})
            rows.append([kind, "refused", "", "", "", "", "", refused[kind][:90]])
            continue
        res, (median, runs), mem = out[kind], timing[kind], memory[kind]
        same = bool(torch.equal(res.tokens, first.tokens) and torch.equal(res.lengths, first.lengths))
        rec = {"kv": kind, "seconds": median, "runs": runs, "tokens": int(res.lengths.sum()),
               "tok_s": int(res.lengths.sum()) / median, "identical_tokens": same, **mem}
        results.append(rec)
        rows.append([kind, f"{median:.2f}", f"{rec['tok_s']:.0f}", f"{mem['kv_peak_bytes'] / 2**20:.1f}",
                     f"{mem['held_peak_bytes'] / 2**20:.1f}", f"{mem['kv_over_held']:.3f}x",
                     f"{mem['estimate_over_peak']:.3f}x" if "estimate_over_peak" in mem else "", same])
    if "paged" in timing and "dense" in timing:
        speed = timing["dense"][0] / timing["paged"][0]
        note = f"paged / dense speed: {speed:.3f}x (dense seconds / paged seconds)"
    else:
        speed, note = None, "one cache only"
    lengths = first.lengths.float() if first is not None else torch.zeros(1)
    payload = {"bench": "kv_cache", "machine": machine_info(device), "model": str(args.model),
               "drafter": args.drafter if use_drafter else None, "dtype": args.dtype, "settings": vars(args),
               "results": results, "paged_over_dense_speed": speed, "wall_s": time.perf_counter() - t0,
               "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "response_lengths": {"mean": float(lengths.mean()), "max": float(lengths.max()),
                                    "median": float(lengths.median())}}
    header = ["KV cache", "rollout s", "tok/s", "peak KV MiB", "held MiB", "peak / held", "estimate / peak",
              "same tokens"]
    where = f"-{this_machine().slug}" if device == "cpu" else ""            # the CPU beside every number
    sd = "" if args.strategy == "off" else f"-{args.strategy}"
    suffix = f"{where}{model_suffix(args.model)}-{args.prompts}x{args.num_generations}-{args.max_new}{sd}"
    write_results(result_name("kv_cache", device, args.dtype, suffix), payload,
                  f"KV cache, model {args.model}, {args.task} prompts, {args.prompts} x {args.num_generations} rows, "
                  f"up to {args.max_new} new tokens at T={args.temperature}, strategy {args.strategy}, pages of "
                  f"{args.page_size}, budget {args.memory} ("
                  + ("one run each, timed with the memory hook" if args.once else
                     f"median of {args.repeats} after a warm-up") + "); responses: "
                  f"mean {payload['response_lengths']['mean']:.0f}, max {payload['response_lengths']['max']:.0f} "
                  f"tokens; {note}; process peak RSS {payload['max_rss_bytes'] / 2**30:.2f} GiB\n\n"
                  + markdown_table(header, rows), args.out)


def _engines(model, drafter, prompts, args) -> tuple[dict, dict]:
    """({cache kind: engine}, {cache kind: why it was refused}): one engine per ``--kv`` kind, its buffers made now
    (the dense cache's memory check runs when they are)."""
    from tltlib.kv.paged import KVConfig
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new)
    engines, refused = {}, {}
    for kind in args.kv.items:
        kv = KVConfig(kind=kind, memory=args.memory, page_size=args.page_size)
        engine = RolloutEngine(model, RolloutConfig(sampling, num_generations=args.num_generations, kv=kv),
                               drafter=drafter)
        try:
            engine.kept.workspace(_Probe(), args.prompts * args.num_generations,
                                  max(map(len, prompts)) + args.max_new + engine.config.draft_margin)
            engines[kind] = engine
        except ValueError as e:
            refused[kind] = str(e)
            print(f"{kind}: refused: {e}", file=sys.stderr)
    return engines, refused


ATTENTION_ROWS = (2, 8, 32, 128)
ATTENTION_NEW = (1, 2, 5, 9, 17, 33)


def attention_grid(model, args) -> None:
    """One layer's attention at ``model``'s head shapes over rows x new tokens (``ATTENTION_ROWS`` x
    ``ATTENTION_NEW``), rows of 200-400 committed positions on scattered pages of ``--page-size``, causal over the
    new tokens: the paged kernel against gather + :func:`tltlib.kernels.dispatch.cached_attention`, median of
    ``--repeats`` timings of a few calls each; the same results checked first."""
    import torch

    from tltlib.kernels import ragged_attention as ra
    from tltlib.kernels.dispatch import cached_attention
    from tltlib.machine import this_machine
    if model.device.type != "cpu" or ra.kernel() is None:
        raise SystemExit("error: --attention times the CPU's paged C++ kernels: run it on a CPU with a C++ compiler "
                         "(the kernel did not build here)")
    cfg, ps = model.config, args.page_size
    heads, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    results, rows_md = [], []
    for b in ATTENTION_ROWS:
        for t in ATTENTION_NEW:
            committed = torch.randint(200, 400, (b,), generator=g)
            span = int(committed.max()) + t
            width = -(-span // ps)
            k_pages, v_pages = (torch.randn(kvh, b * width + 1, ps, d, generator=g) for _ in range(2))
            table = torch.randperm(b * width, generator=g).view(b, width).contiguous()
            q = torch.randn(b, heads, t, d, generator=g)
            rel = torch.arange(span)[None, None, :] - committed[:, None, None]
            mask = ((rel < 0) | (rel <= torch.arange(t)[None, :, None])).contiguous()   # [b, t, span]
            ends, low = committed + t, int(committed.min())

            def gathered():
                k, v = (p[:, table].transpose(0, 1).reshape(b, kvh, width * ps, d)[:, :, :span]
                        for p in (k_pages, v_pages))
                return cached_attention(q, k, v, mask[:, None], low, {}, ends if t == 1 else None)

            def paged():
                if t == 1:
                    return ra.paged_ragged_attention(q, k_pages, v_pages, table, ends)
                return ra.paged_masked_attention(q, k_pages, v_pages, table, ends, mask, low)
            torch.testing.assert_close(paged(), gathered(), atol=1e-4, rtol=1e-4)
            med = interleaved_medians({"paged": _calls(paged), "gathered": _calls(gathered)}, "cpu", args.repeats)
            us = {k: v[0] / CALLS * 1e6 for k, v in med.items()}
            ratio = us["gathered"] / us["paged"]
            results.append({"rows": b, "new_tokens": t, "paged_us": us["paged"], "gathered_us": us["gathered"],
                            "gathered_over_paged": ratio})
            rows_md.append([b, t, f"{us['paged']:.0f}", f"{us['gathered']:.0f}", f"{ratio:.2f}x"])
            print(f"rows {b:4d}, {t:2d} new: paged {us['paged']:8.0f} us, gathered {us['gathered']:8.0f} us "
                  f"({ratio:.2f}x)", file=sys.stderr, flush=True)
    payload = {"bench": "kv_cache --attention", "machine": machine_info("cpu"), "model": str(args.model),
               "heads": heads, "kv_heads": kvh, "head_dim": d, "page_size": ps, "settings": vars(args),
               "results": results}
    write_results(result_name("kv_attention", "cpu", args.dtype, f"-{this_machine().slug}{model_suffix(args.model)}"),
                  payload,
                  f"One layer's attention through block tables, model {args.model} ({heads} heads, {kvh} KV heads, "
                  f"head dim {d}), pages of {ps} scattered, rows of 200-400 committed positions, causal over the new "
                  f"tokens; microseconds per call, median of {args.repeats} interleaved timings of {CALLS} calls. "
                  "paged: the C++ kernels reading the pages in place; gathered: the pages gathered, then the dense "
                  "path.\n\n" + markdown_table(["rows", "new tokens", "paged us", "gathered us", "gathered / paged"],
                                                rows_md), args.out)


CALLS = 10


def _calls(fn):
    def go():
        for _ in range(CALLS):
            fn()
    return go


class _Probe:
    """The owner of buffers made before any rollout (done: the first rollout takes them over)."""
    done = True


def _memory(engine, prompts, args, device, keep: dict | None = None) -> dict:
    """One more rollout with a hook after every iteration: the KV bytes allocated or held at the peak, and the most
    bytes the rows' tokens took at an iteration's end (``keep``: store the result there, under the cache's kind)."""
    import torch
    held = []

    def hook(rollout):
        held.append(sum(c.memory()["held_bytes"] for c in _caches(rollout)))
    gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.perf_counter()
    rollout = engine.start(prompts, gen, strategy=args.strategy, hooks=[hook], progress=args.once)
    result = rollout.finish()
    seconds = time.perf_counter() - t0
    if keep is not None:
        keep[engine.config.kv.kind] = result
    caches = _caches(rollout)
    peak = sum(c.memory()["peak_bytes"] for c in caches)
    top = max(held, default=1)
    out = {"kv_peak_bytes": int(peak), "held_peak_bytes": int(top), "kv_over_held": peak / max(top, 1),
           "iterations": len(held), "memory_run_s": seconds}
    if engine.config.kv.kind == "paged":            # the memory check's estimate, given this rollout's own lengths
        from tltlib.rl.memory import MeasuredLengths, kv_estimate
        per_token = sum(c.bytes_per_page // c.page_size for c in caches)
        est = kv_estimate(per_token, len(result.lengths), args.num_generations, max(map(len, prompts)), args.max_new,
                          MeasuredLengths(tuple(result.lengths.tolist()), args.max_new), args.page_size)
        out.update(estimated_peak_bytes=est.bytes, estimate_over_peak=est.bytes / max(peak, 1))
    return out


def _caches(rollout):
    return [c for c in (rollout.cache, rollout.spec.cache) if c is not None]


if __name__ == "__main__":
    main()
