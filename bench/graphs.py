"""Plain decoding on a GPU: eager vs CUDA graphs, against the memory-bandwidth bound.

At batch 1 a decode step must read every weight once (and the KV cache): bytes / bandwidth is the floor. The
bandwidth is measured here (a large device-to-device copy, bytes read + written). For each batch size the same
greedy rollout (every row decodes ``--new-tokens`` tokens, EOS ignored) runs eagerly and with CUDA graphs,
interleaved after a warm-up; the tokens must be identical.

    python -m tltlib bench graphs --preset gpu-24l          # random weights (speed does not depend on them)
    python -m tltlib bench graphs --model /path/to/checkpoint --batches 1,8,32
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_medians, machine_info, markdown_table, write_results  # noqa: E402


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


def forward_replay_ms(model, rows: int, length: int, g, replays: int = 50) -> float:
    """Milliseconds of one replay of the captured decode forward alone (no sampling, no bookkeeping) at ``rows`` rows
    over ``length`` cached tokens: the engine's step time minus this is its per-step host overhead."""
    import torch

    from tltlib.cudagraph import GraphPool
    cache = model.new_cache(rows, length + 8)
    dev = model.device
    with torch.no_grad():
        model.forward_cached(torch.randint(2, model.config.vocab_size, (rows, length), generator=g).to(dev), cache)
        cache.advance(length)
        pool = GraphPool([cache])
        tok = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        pool.run("decode", lambda span, x: model.forward_cached(x, cache, span=span), rows, cache, length + 1, (tok,))
        graph = next(iter(pool._entries.values()))[0]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
    return a.elapsed_time(b) / replays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: --preset with random weights)")
    ap.add_argument("--preset", default="gpu-24l")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from tltlib.checkpoint import load_model, parse_dtype
    from tltlib.cudagraph import GraphConfig
    from tltlib.model import Transformer, preset
    from tltlib.rollout import RolloutConfig, RolloutEngine
    from tltlib.sampling import SamplingConfig

    if not torch.cuda.is_available():
        raise SystemExit("bench graphs needs a CUDA device (CUDA graphs do not exist on a CPU)")
    dtype = parse_dtype(args.dtype)
    if args.model:
        model = load_model(args.model, dtype=dtype, device=args.device)
    else:
        torch.manual_seed(0)
        cfg = preset(args.preset, eos_token_ids=(1,))
        model = Transformer(cfg).to(device=args.device, dtype=dtype).eval()
    cfg, n = model.config, args.new_tokens
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(args.device)
    engines = {name: RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=n),
                                                        ignore_eos=True, graphs=GraphConfig(enabled=on)))
               for name, on in (("eager", False), ("graphs", True))}
    g = torch.Generator().manual_seed(0)
    rows, results = [], []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = torch.randint(2, cfg.vocab_size, (b, args.prompt_len), generator=g).tolist()
        out = {}
        fns = {name: (lambda e=e, name=name: out.__setitem__(name, e.generate(prompts)))
               for name, e in engines.items()}
        timing = interleaved_medians(fns, args.device, args.repeats, warmup=2)
        identical = bool(torch.equal(out["eager"].tokens, out["graphs"].tokens))
        fwd_ms = forward_replay_ms(model, b, args.prompt_len + n // 2, g)
        # floor per step: every weight once + the KV cache read at the mean length (K and V, all layers)
        kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_head * dtype.itemsize * b * (args.prompt_len + n / 2)
        floor = (weight_bytes + kv) / bw
        rec = {"batch": b, "eager_s": timing["eager"][0], "graphs_s": timing["graphs"][0],
               "eager_step_ms": timing["eager"][0] / n * 1e3, "graphs_step_ms": timing["graphs"][0] / n * 1e3,
               "floor_step_ms": floor * 1e3, "identical_tokens": identical, "forward_replay_ms": fwd_ms,
               "graphs_tok_s": b * n / timing["graphs"][0], "speedup": timing["eager"][0] / timing["graphs"][0]}
        rec["graphs_over_floor"] = rec["graphs_step_ms"] / rec["floor_step_ms"]
        results.append(rec)
        rows.append([b, rec["eager_step_ms"], rec["graphs_step_ms"], f"{rec['speedup']:.2f}x", fwd_ms, rec["floor_step_ms"],
                     f"{rec['graphs_over_floor']:.2f}x", rec["graphs_tok_s"], identical])
    header = ["batch", "eager ms/step", "graphs ms/step", "graphs speed-up", "forward replay ms", "bandwidth floor ms",
              "graphs / floor",
              "graphs tok/s", "identical tokens"]
    name = args.model or f"{args.preset} (random weights)"
    payload = {"bench": "graphs", "machine": machine_info(args.device), "model": name, "dtype": args.dtype,
               "parameters": sum(p.numel() for p in model.parameters()), "weight_bytes": weight_bytes,
               "copy_bandwidth_bytes_s": bw, "settings": vars(args), "results": results}
    write_results(f"graphs-{args.dtype}", payload,
                  f"Plain greedy decoding of {name} ({payload['parameters'] / 1e9:.2f} B parameters, {args.dtype}), "
                  f"{n} new tokens per row after {args.prompt_len}, eager vs CUDA graphs (median of {args.repeats}); "
                  f"floor = (weights + KV cache) / measured copy bandwidth {bw / 1e12:.2f} TB/s\n\n"
                  + markdown_table(header, rows), args.out)


if __name__ == "__main__":
    main()
