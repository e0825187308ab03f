"""Sampling one token per row from a vocabulary-sized distribution: speed and exactness of three samplers.

Side by side, interleaved, medians of ``--repeats`` after a warm-up, for each vocabulary size and batch:
``torch.multinomial`` on the float32 probabilities (what the rollout used before), an inverse CDF on a float32
cumulative sum with float32 uniforms (what the chain drafter used before), and tltlib's sampler
(``tltlib.model.sampling.sample``: an inverse CDF on a float64 cumulative sum with float64 uniforms). Exactness: the
total variation between ``probs`` and what each inverse-CDF sampler draws, exactly, from every uniform its grid
holds (k / 2^24 for float32, k / 2^53 for float64; each token's boundaries found by bisection on the sampler
itself). Distributions: softmax of standard-normal logits x ``--scale`` (peaked, like a language model's).
With ``--model``, also a whole rollout without SD (word problems, ``--prompts`` x 8 at T=0.9, ``--max-new``
tokens) with plain sampling by ``torch.multinomial`` and by tltlib's sampler, interleaved, medians of
``--rollouts``.

    python -m tltlib bench sampling
    python -m tltlib bench sampling --model ~/.cache/tltlib/models/smollm2-135m
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_output_flags,
    bench_parser,
    folder,
    interleaved_medians,
    listed,
    machine_info,
    markdown_table,
    parse_bench_args,
    positive_float,
    positive_int,
    task_prompts,
    write_results,
)

MAX_SCALE = 1000.0
"""The largest ``--scale``: already at ~50 every distribution puts all its mass on one token, and far beyond, the
logits overflow float32 (softmax of inf is NaN)."""


def logit_scale(text: str) -> float:
    """``--scale`` (an argparse ``type``): a number in (0, :data:`MAX_SCALE`]."""
    value = positive_float(text)
    if value > MAX_SCALE:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_SCALE:g}: the logits would overflow float32 "
                                         "(every distribution is one token long before that); give e.g. 4")
    return value


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    ap.add_argument("--vocabs", default="74,49152,151936", type=listed(positive_int, "74,49152"),
                    help="vocabulary sizes (the tiny reasoner's, SmolLM2's, Qwen2.5's)")
    ap.add_argument("--batches", default="1,16,64,128", type=listed(positive_int, "1,16"))
    ap.add_argument("--scale", default=4.0, type=logit_scale, help="logits = scale x standard normal, in (0, "
                    f"{MAX_SCALE:g}]")
    ap.add_argument("--model", default=None, type=folder("model", "~/.cache/tltlib/models/smollm2-135m"),
                    help="also time a rollout of this model with each plain sampler")
    ap.add_argument("--prompts", default=4, type=positive_int, help="--model: word problems, 8 responses each")
    ap.add_argument("--max-new", default=320, type=positive_int, help="--model: most new tokens per response")
    ap.add_argument("--rollouts", default=2, type=positive_int, help="--model: timed rollouts per sampler")
    add_output_flags(ap, repeats=15)
    return parse_bench_args(ap, argv)


def float32_cdf(probs, u):
    """The former drafter sampler: float32 cumulative sum, float32 uniforms ``u [B, K]``."""
    import torch
    cum = probs.cumsum(-1)
    total = cum[:, -1:]
    return torch.searchsorted(cum, torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total))),
                              right=True)


def total_variation(probs, sampler: str) -> float:
    """TV between ``probs [V]`` and the distribution ``sampler`` ('float32' or 'float64') draws from its uniforms,
    exactly: a uniform is k / 2^bits (24 or 53 bits), so token i is drawn for the k between two boundaries; each
    boundary is found by bisection on k, for every token at once, calling the sampler itself."""
    import numpy as np
    import torch

    from tltlib.model.sampling import inverse_cdf
    bits, dtype = (24, torch.float32) if sampler == "float32" else (53, torch.float64)
    draw = (lambda u: float32_cdf(probs[None], u[None])[0]) if sampler == "float32" else \
        (lambda u: inverse_cdf(probs[None], u[None])[0])
    v = probs.numel()
    after = torch.arange(v - 1)                            # boundary i: the smallest k that draws a token > i
    lo, hi = torch.zeros(v - 1, dtype=torch.long), torch.full((v - 1,), 2 ** bits, dtype=torch.long)
    for _ in range(bits):
        mid = (lo + hi) // 2
        beyond = draw(mid.to(torch.float64).div(2 ** bits).to(dtype)) > after
        hi, lo = torch.where(beyond, mid, hi), torch.where(beyond, lo, mid)
    edges = np.concatenate([[0], hi.numpy(), [2 ** bits]]).astype(np.longdouble)
    share = np.diff(edges) / np.longdouble(2 ** bits)
    exact = np.asarray(probs.double().numpy(), dtype=np.longdouble)
    return float(np.abs(share - exact / exact.sum()).sum() / 2)


def _rollouts(args) -> dict:
    """Per plain sampler: median seconds per decode iteration and tokens/s of a rollout without SD."""
    import statistics

    import torch

    import tltlib.model.sampling as sampling
    from tltlib.model.loading import load
    from tltlib.rollout.adaptive import timed_rollout
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    model, tok, _ = load(args.model, device="cpu")
    prompts = task_prompts("words", tok, args.prompts, 0)
    engine = RolloutEngine(model, RolloutConfig(sampling.SamplingConfig(temperature=0.9, max_new_tokens=args.max_new),
                                                num_generations=8))
    samplers = {"multinomial": lambda probs, generator: torch.multinomial(probs, 1, generator=generator)[:, 0],
                "tltlib": sampling.sample}
    runs = {k: [] for k in samplers}
    try:
        timed_rollout(engine, prompts[:1], None, 0)                                   # warm-up
        for r in range(args.rollouts):
            for name, fn in samplers.items():
                sampling.sample = fn
                res, seconds = timed_rollout(engine, prompts, None, r)
                runs[name].append((seconds / len(res.timeline["iter_time"]), float(res.lengths.sum()) / seconds))
    finally:
        sampling.sample = samplers["tltlib"]
    return {k: {"s_per_iteration": statistics.median(x for x, _ in v),
                "tokens_per_s": statistics.median(y for _, y in v)} for k, v in runs.items()}


def main() -> None:
    args = parse_args()
    import torch

    from tltlib.model.sampling import sample
    g = torch.Generator().manual_seed(0)
    rows, results = [], []
    for v in args.vocabs.items:
        probs = torch.softmax(args.scale * torch.randn(max(args.batches.items), v, generator=g), -1)
        tv = {"float32": total_variation(probs[0], "float32"), "float64": total_variation(probs[0], "float64")}
        for b in args.batches.items:
            p = probs[:b].contiguous()
            med = interleaved_medians({
                "multinomial": lambda: torch.multinomial(p, 1, generator=g),
                "float32 CDF": lambda: float32_cdf(p, torch.rand(b, 1, generator=g)),
                "float64 CDF": lambda: sample(p, g),
            }, "cpu", args.repeats)
            ms = {k: 1e3 * m for k, (m, _) in med.items()}
            rec = {"vocab": v, "batch": b, **{f"{k} ms": x for k, x in ms.items()},
                   "float32 CDF total variation": tv["float32"], "float64 CDF total variation": tv["float64"]}
            results.append(rec)
            rows.append([v, b, ms["multinomial"], ms["float32 CDF"], ms["float64 CDF"],
                         f"{ms['multinomial'] / ms['float64 CDF']:.1f}x", f"{tv['float32']:.1e}",
                         f"{tv['float64']:.1e}"])
    rollout = _rollouts(args) if args.model else None
    header = ["vocab", "batch", "multinomial ms", "float32 CDF ms", "float64 CDF ms (tltlib)",
              "tltlib vs multinomial", "float32 CDF: TV per draw", "float64 CDF: TV per draw"]
    table = ("One token per row, medians of " + f"{args.repeats} interleaved rounds after a warm-up (CPU)\n\n"
             + markdown_table(header, rows))
    if rollout:
        per_iter = {k: v["s_per_iteration"] for k, v in rollout.items()}
        table += (f"\n\nA rollout of {args.model} without SD ({args.prompts} word problems x 8, T=0.9, at most "
                  f"{args.max_new} new tokens; medians of {args.rollouts}, interleaved): "
                  + ", ".join(f"{k} {v['s_per_iteration'] * 1e3:.0f} ms per iteration "
                              f"({v['tokens_per_s']:.0f} tokens/s)" for k, v in rollout.items())
                  + f"; tltlib's sampler {per_iter['multinomial'] / per_iter['tltlib']:.2f}x faster.")
    payload = {"bench": "sampling", "machine": machine_info("cpu"), "settings": vars(args), "results": results,
               "rollout": rollout}
    write_results("sampling-cpu", payload, table, args.out)


if __name__ == "__main__":
    main()
