"""Plain decoding on a GPU: eager vs CUDA graphs, against the memory-bandwidth bound, with each KV cache.

At batch 1 a decode step must read every weight once (and the KV cache): bytes / bandwidth is the floor. The
bandwidth is measured here (a large device-to-device copy, bytes read + written). For each batch size and each KV
cache of ``--kv`` (the engine's paged cache; the dense cache, which reads each row's slots in place) the same greedy
rollout (every row decodes ``--new-tokens`` tokens, EOS ignored) runs eagerly and with CUDA graphs, interleaved after
a warm-up; the tokens must be identical (eager vs graphs, and across the caches). Long prompts (``--prompt-len``)
make the cache's reads count: the paged cache's cost over the dense one is the goal of ``--kv paged,dense``.

    python -m tltlib bench graphs --preset gpu-24l          # random weights (speed does not depend on them)
    python -m tltlib bench graphs --model /path/to/checkpoint --batches 1,8,32
"""
from __future__ import annotations

import re
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
    machine_info,
    markdown_table,
    parse_bench_args,
    positive_int,
    write_results,
)


def copy_bandwidth(device, gib: float = 2.0, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of ``repeats`` copies."""
    import statistics

    import torch
    n = int(gib * 2 ** 30) // 2
    src, dst = torch.randn(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * n * 2 / statistics.median(times)


def forward_replay_ms(model, rows: int, length: int, g, replays: int = 50, kind: str = "paged") -> float:
    """Milliseconds of one replay of the captured decode forward alone (no sampling, no bookkeeping) at ``rows`` rows
    over ``length`` cached tokens in a ``kind`` KV cache: the engine's step time minus this is its per-step host
    overhead."""
    import torch

    from tltlib.kv.paged import KVConfig
    from tltlib.model.cudagraph import GraphPool
    cache = model.new_cache(rows, length + 8, KVConfig(kind=kind))
    dev = model.device
    with torch.no_grad():
        model.forward_cached(torch.randint(2, model.config.vocab_size, (rows, length), generator=g).to(dev), cache)
        cache.advance(length)
        pool = GraphPool([cache])
        tok = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        pool.run("decode", lambda x: model.forward_cached(x, cache), cache, 1, (tok,))
        graph = next(iter(pool._entries.values()))[0]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
    return a.elapsed_time(b) / replays


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, model=None, model_help="checkpoint folder (default: --preset with random weights)")
    ap.add_argument("--preset", default="gpu-24l")
    add_device_flags(ap, device="cuda", dtype="bfloat16")
    ap.add_argument("--batches", default="1,4,16,64", type=listed(positive_int, "1,4,16,64"))
    ap.add_argument("--prompt-len", type=positive_int, default=32)
    ap.add_argument("--new-tokens", type=positive_int, default=128)
    ap.add_argument("--kv", default="paged", type=listed(_kind, "paged,dense"),
                    help="the KV caches to run side by side (default: the engine's, paged)")
    add_output_flags(ap, repeats=5)
    args = parse_bench_args(ap, argv, malloc=False)
    if not re.fullmatch(r"cuda(:\d+)?", args.device):
        ap.error(f"argument --device: {args.device!r} is not a GPU; give cuda or cuda:N (CUDA graphs need one)")
    return args


def _kind(text: str) -> str:
    from tltlib.kv.paged import KINDS
    if text not in KINDS:
        import argparse
        raise argparse.ArgumentTypeError(f"{text!r} is not a KV cache ({' or '.join(KINDS)})")
    return text


def main() -> None:
    args = parse_args()
    import torch

    from tltlib.model.weights import parse_dtype
    if not torch.cuda.is_available():
        raise SystemExit("bench graphs needs a CUDA device (CUDA graphs do not exist on a CPU)")
    dtype = parse_dtype(args.dtype)
    model = _model(args, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(args.device)
    measured = []
    for kind in args.kv.items:
        engines = _engines(model, args.new_tokens, kind)
        g = torch.Generator().manual_seed(0)                  # the same prompts for every cache
        measured += [_measure_batch(model, engines, b, args, dtype, weight_bytes, bw, g, kind)
                     for b in args.batches.items]
        del engines
        torch.cuda.empty_cache()
    results, rows = [rec for rec, _ in measured], [row for _, row in measured]
    _same_tokens(results)
    header = ["KV cache", "batch", "eager ms/step", "graphs ms/step", "graphs speed-up", "forward replay ms",
              "bandwidth floor ms", "graphs / floor", "graphs tok/s", "identical tokens"]
    name = args.model or f"{args.preset} (random weights)"
    payload = {"bench": "graphs", "machine": machine_info(args.device), "model": name, "dtype": args.dtype,
               "parameters": sum(p.numel() for p in model.parameters()), "weight_bytes": weight_bytes,
               "copy_bandwidth_bytes_s": bw, "settings": vars(args), "results": results}
    write_results(f"graphs-{args.dtype}", payload,
                  f"Plain greedy decoding of {name} ({payload['parameters'] / 1e9:.2f} B parameters, {args.dtype}), "
                  f"{args.new_tokens} new tokens per row after {args.prompt_len}, eager vs CUDA graphs (median of "
                  f"{args.repeats}); floor = (weights + KV cache) / measured copy bandwidth {bw / 1e12:.2f} TB/s\n\n"
                  + markdown_table(header, rows), args.out)


def _model(args, dtype):
    """``--model`` loaded, else the ``--preset`` shape with seeded random weights."""
    import torch

    from tltlib.model.decoder import Transformer, preset
    from tltlib.model.weights import load_model
    if args.model:
        return load_model(args.model, dtype=dtype, device=args.device)
    torch.manual_seed(0)
    cfg = preset(args.preset, eos_token_ids=(1,))
    return Transformer(cfg).to(device=args.device, dtype=dtype).eval()


def _engines(model, n: int, kind: str = "paged") -> dict:
    """The greedy ``n``-token engines over a ``kind`` KV cache, eager and with CUDA graphs (kept for every batch
    size: captures are reused)."""
    from tltlib.kv.paged import KVConfig
    from tltlib.model.cudagraph import GraphConfig
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    return {name: RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=n),
                                                     ignore_eos=True, graphs=GraphConfig(enabled=on),
                                                     kv=KVConfig(kind=kind)))
            for name, on in (("eager", False), ("graphs", True))}


def _same_tokens(results: list[dict]) -> None:
    """Mark each record whether its tokens equal the first cache's at the same batch (greedy: they must)."""
    first = {}
    for rec in results:
        tokens = rec.pop("tokens")
        ref = first.setdefault(rec["batch"], tokens)
        rec["same_tokens_as_first_kv"] = bool(tokens == ref)


def _measure_batch(model, engines: dict, b: int, args, dtype, weight_bytes: int, bw: float, g,
                   kind: str = "paged") -> tuple[dict, list]:
    """Eager vs graphs on ``b`` random prompts (from ``g``), interleaved, beside the bandwidth floor, over a ``kind``
    KV cache: the result record (with its tokens, for the comparison across caches) and its table row."""
    import torch
    cfg, n = model.config, args.new_tokens
    prompts = torch.randint(2, cfg.vocab_size, (b, args.prompt_len), generator=g).tolist()
    out = {}
    fns = {name: (lambda e=e, name=name: out.__setitem__(name, e.generate(prompts))) for name, e in engines.items()}
    timing = interleaved_medians(fns, args.device, args.repeats, warmup=2)
    identical = bool(torch.equal(out["eager"].tokens, out["graphs"].tokens))
    fwd_ms = forward_replay_ms(model, b, args.prompt_len + n // 2, g, kind=kind)
    # floor per step: every weight once + the KV cache read at the mean length (K and V, all layers)
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_head * dtype.itemsize * b * (args.prompt_len + n / 2)
    floor = (weight_bytes + kv) / bw
    rec = {"kv": kind, "batch": b, "tokens": out["graphs"].tokens.tolist(), "eager_s": timing["eager"][0],
           "graphs_s": timing["graphs"][0],
           "eager_step_ms": timing["eager"][0] / n * 1e3, "graphs_step_ms": timing["graphs"][0] / n * 1e3,
           "floor_step_ms": floor * 1e3, "identical_tokens": identical, "forward_replay_ms": fwd_ms,
           "graphs_tok_s": b * n / timing["graphs"][0], "speedup": timing["eager"][0] / timing["graphs"][0]}
    rec["graphs_over_floor"] = rec["graphs_step_ms"] / rec["floor_step_ms"]
    row = [kind, b, rec["eager_step_ms"], rec["graphs_step_ms"], f"{rec['speedup']:.2f}x", fwd_ms, rec["floor_step_ms"],
           f"{rec['graphs_over_floor']:.2f}x", rec["graphs_tok_s"], identical]
    return rec, row


if __name__ == "__main__":
    main()
