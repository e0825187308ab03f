"""Where a plain decode step's time goes on this machine, beside its memory floor, for tltlib's Python layers; the step
of its layers in one C++ call (:mod:`tltlib.model.native`, ``RolloutConfig(native_layers=True)``) beside it, and with
``--compile`` the compiled layers' step.

Greedy decoding of ``--rows`` prompts (EOS ignored, every row decodes ``--new-tokens``), timed by wall clocks wrapped
around what a step calls: the cached **attention** (the paged cache's ``attend``: K/V written into the pages and the
attention kernel; or its ``attend_qkv``, the same and the rotary of q and k in one C++ call), the **projections**
(every ``linear`` of the layers and the LM head, by the kernel table's choices), the rest of each decoder layer
(**small ops and dispatch**: RMSNorm, RoPE where the attention did not, SiLU-and-multiply, residual adds, views, the
Python that calls them) and everything **outside the layers** (embedding, rotary tables, the cache's
bookkeeping, sampling, the engine). The timers themselves cost ~1 us per call (about 0.2 ms of a SmolLM2 step: in the
small-ops share). A step is the difference between a rollout of ``--new-tokens`` and one of a single token (the
prefill), divided by the steps between; median over ``--repeats`` interleaved rounds. The parts are timed on the
Python layers (``RolloutConfig(native_layers=False)``: the timers cannot see inside the C++ stack); the **native
step** is the same rollout's step with the C++ stack, untimed inside, in the same rounds.

The **memory floor** is what one step must read divided by this machine's bandwidth: every weight the step uses
once (the layers, the final norm and the LM head; the embedding only where it is the head) plus each row's cached
K/V at the step's mean length, at the read bandwidth measured here (``_common.read_bandwidth``: the faster of a
sum and the stream kernel's read; as ``bench kernels``
measures its one-row floor) just before and just after the rollouts it is set against: on a shared VM the bandwidth
moves with the neighbours' load (20-29 GB/s within a minute, 22.8-44.9 within one run on an AMD EPYC), so a step
over the floor is taken round by round, each step against the mean of the floors at the two reads around it, and
the median of those ratios reported. A one-row step cannot beat
it. Where the loader put the weights on huge pages (:mod:`tltlib.kernels.huge_pages`), the bandwidth is measured on
huge pages too, and the native step is also timed on a copy of the model on the allocator's pages (**native step
on 4 KiB pages**, in the same rounds): what the huge pages are worth.

    python -m tltlib bench decode_breakdown                         # SmolLM2-135M, 1 / 16 / 64 rows
    python -m tltlib bench decode_breakdown --model data/tiny-reasoner --task chain
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    BANDWIDTH_READS,
    SMOLLM2,
    TASK_HELP,
    add_model_flags,
    add_output_flags,
    bandwidth_reader,
    bench_parser,
    listed,
    load_models,
    machine_info,
    markdown_table,
    model_suffix,
    parse_bench_args,
    positive_int,
    read_bandwidth,
    result_name,
    task_prompts,
    weight_bytes,
    write_results,
)

PARTS = ("attention", "projections", "small ops and dispatch", "outside the layers")

TIMED = ("eager", "native", "native-small-pages", "compiled")
"""The engines a round may time, in their order (the bandwidth read before, between and after them): the Python
layers, the native step, it on 4 KiB pages, the compiled layers."""


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, model=SMOLLM2,
                    model_help="model folder (default SmolLM2-135M: python -m tltlib get-model smollm2-135m)")
    ap.add_argument("--task", default="words", choices=["chain", "words"], help=TASK_HELP)
    ap.add_argument("--rows", default="1,16,64", type=listed(positive_int, "1,16,64"))
    ap.add_argument("--new-tokens", type=positive_int, default=64)
    ap.add_argument("--compile", action="store_true", help="also the compiled layers' step time (side by side)")
    add_output_flags(ap, repeats=5)
    ap.set_defaults(device="cpu", dtype="float32")          # the breakdown is of a CPU float32 step
    return parse_bench_args(ap, argv)


class Timers:
    """Seconds spent inside wrapped functions, by part; nested calls are charged to the innermost part only (a
    projection inside a layer counts as a projection, not as the layer's small ops)."""

    def __init__(self):
        self.spent = dict.fromkeys(("attention", "projections", "layer"), 0.0)
        self.calls = dict.fromkeys(self.spent, 0)
        self._inner = [0.0]

    def wrap(self, part: str, fn):
        def timed(*args, **kw):
            self.calls[part] += 1
            self._inner.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                took = time.perf_counter() - t0
                inner = self._inner.pop()
                self.spent[part] += took - inner
                self._inner[-1] += took
        return timed


@contextmanager
def instrumented(timers: Timers):
    """The decoder's projections, the paged cache's attention (``attend``, and ``attend_qkv``, its one-call step with
    the rotary: a declined call costs ~1 us, charged to attention) and the decoder layers wrapped by ``timers``."""
    from tltlib.kv.paged import PagedKVCache
    from tltlib.model import decoder
    saved = decoder.linear, PagedKVCache.attend, PagedKVCache.attend_qkv, decoder.DecoderLayer.forward
    decoder.linear = timers.wrap("projections", saved[0])
    PagedKVCache.attend = timers.wrap("attention", saved[1])
    PagedKVCache.attend_qkv = timers.wrap("attention", saved[2])
    decoder.DecoderLayer.forward = timers.wrap("layer", saved[3])
    try:
        yield
    finally:
        decoder.linear, PagedKVCache.attend, PagedKVCache.attend_qkv, decoder.DecoderLayer.forward = saved


def step_bytes(model, rows: int, mean_len: float) -> float:
    """Bytes one decode step reads at least: the weights it uses once (no untied input embedding: a gather) plus
    ``rows`` rows of cached K/V at ``mean_len`` tokens."""
    cfg = model.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_head * model.embed.weight.element_size()
    return weight_bytes(model) + rows * mean_len * kv


def _timed_rollout(engine, prompts, timers: Timers | None = None) -> tuple[float, dict]:
    """Seconds of one rollout and (with ``timers``) the seconds of each part within it. Without ``timers`` nothing is
    wrapped (a compiled engine's graph must not trace the timers' clocks)."""
    with instrumented(timers) if timers is not None else nullcontext():
        t0 = time.perf_counter()
        engine.generate(prompts)
        return time.perf_counter() - t0, dict(timers.spent) if timers is not None else {}


def measure_rows(rows: int, args, tok, engines: dict, bandwidth=read_bandwidth) -> dict:
    """One row count: the decode step's parts (the Python layers), its memory floor, the native step and, with
    compiled engines, the compiled step. A step is the difference of a rollout of ``--new-tokens`` and one of a
    single token (the prefill and its first token), divided by the steps between: the prefill's own attention and
    projections drop out. ``bandwidth()`` (bytes per second first) is read before, between and after the engines
    timed in a round: each engine's step is set against the mean of the floors at the two reads around it."""
    prompts = task_prompts(args.task, tok, rows, seed=rows)
    steps = args.new_tokens - 1
    for engine in engines.values():                              # warm-up (and the compile, for compiled)
        engine.generate(prompts)
    names = [n for n in TIMED if n in engines]
    times = {n: [] for n in names}
    parts, probes = [], []
    for _ in range(args.repeats):                                  # interleaved rounds
        probe = [bandwidth()[0]]
        for name in names:
            if name == "eager":
                wall_n, spent_n = _timed_rollout(engines["eager"], prompts, Timers())
                wall_1, spent_1 = _timed_rollout(engines["eager-1"], prompts, Timers())
                parts.append({k: (spent_n[k] - spent_1[k]) / steps for k in spent_n})
            else:
                wall_n = _timed_rollout(engines[name], prompts)[0]
                wall_1 = _timed_rollout(engines[f"{name}-1"], prompts)[0]
            times[name].append((wall_n - wall_1) / steps)
            probe.append(bandwidth()[0])
        probes.append(probe)
    eager, native, small, compiled = (times.get(n, []) for n in TIMED)
    step = statistics.median(eager)
    part = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    outside = max(step - part["attention"] - part["projections"] - part["layer"], 0.0)
    mean_len = statistics.mean(map(len, prompts)) + args.new_tokens / 2
    weight = step_bytes(engines["eager"].model, rows, mean_len)
    floors = {n: [bracketed_floor(weight, p[i], p[i + 1]) for p in probes] for i, n in enumerate(names)}
    over = lambda n: statistics.median(t / f for t, f in zip(times[n], floors[n]))    # each against its own floor
    rec = {"rows": rows, "step_ms": step * 1e3, "attention_ms": part["attention"] * 1e3,
           "projections_ms": part["projections"] * 1e3, "small_ops_ms": part["layer"] * 1e3,
           "outside_ms": outside * 1e3, "floor_ms": statistics.median(floors["native"]) * 1e3,
           "step_over_floor": over("eager"), "floors_ms": [f * 1e3 for f in floors["native"]],
           "eager_floors_ms": [f * 1e3 for f in floors["eager"]],
           "probes_gb_s": [[rate / 1e9 for rate in p] for p in probes],
           "eager_steps_ms": [s * 1e3 for s in eager], "native_step_ms": statistics.median(native) * 1e3,
           "native_steps_ms": [s * 1e3 for s in native], "native_over_floor": over("native"),
           "native_speedup": step / statistics.median(native)}
    if small:                                   # the same step, the weights on the allocator's 4 KiB pages
        rec.update(small_pages_step_ms=statistics.median(small) * 1e3, small_pages_steps_ms=[s * 1e3 for s in small],
                   huge_pages_speedup=statistics.median(a / b for a, b in zip(small, native)))
    if compiled:
        rec.update(compiled_step_ms=statistics.median(compiled) * 1e3, compiled_steps_ms=[s * 1e3 for s in compiled],
                   compiled_speedup=step / statistics.median(compiled))
    return rec


def bracketed_floor(step_bytes: float, before: float, after: float) -> float:
    """Seconds a step reading ``step_bytes`` takes at the read bandwidths (bytes per second) measured just before and
    just after it: the mean of the two floors. On a shared VM the rate moves within seconds (22.8-44.9 GB/s in one
    AMD EPYC run), so a floor read several engines away from the step it is set against misjudges it."""
    return (step_bytes / before + step_bytes / after) / 2


def main() -> None:
    args = parse_args()
    from tltlib.kernels import huge_pages
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    model, tok, _ = load_models(args)
    config = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=args.new_tokens), ignore_eos=True)
    one = replace(config, sampling=replace(config.sampling, max_new_tokens=1))
    python, native = (lambda c: replace(c, native_layers=False)), (lambda c: replace(c, native_layers=True))
    engines = {"eager": RolloutEngine(model, python(config)), "eager-1": RolloutEngine(model, python(one)),
               "native": RolloutEngine(model, native(config)), "native-1": RolloutEngine(model, native(one))}
    placed, weights = huge_pages.huge_bytes(list(model.parameters()))
    if placed:                                  # a copy on the allocator's pages: what the huge pages are worth
        plain = copy.deepcopy(model)                    # the allocator's memory (huge only under THP "always")
        plain_huge = huge_pages.huge_bytes(list(plain.parameters()))[0]
        engines.update({"native-small-pages": RolloutEngine(plain, native(config)),
                        "native-small-pages-1": RolloutEngine(plain, native(one))})
    if args.compile:
        engines.update(compiled=RolloutEngine(model, replace(config, compile_layers=True)),
                       **{"compiled-1": RolloutEngine(model, replace(one, compile_layers=True))})
    bandwidth = bandwidth_reader()                      # read around every step: one buffer for the run
    results = [measure_rows(r, args, tok, engines, bandwidth) for r in args.rows.items]
    rates = [rate for r in results for probe in r["probes_gb_s"] for rate in probe]
    bw = statistics.median(rates)
    header = ["rows", "Python layers' step ms", *(f"{p} ms (share)" for p in PARTS), "memory floor ms",
              "step / floor", "native step ms", "native / floor", "native speedup"]
    if placed:
        header += ["native step on 4 KiB pages ms", "huge pages' speedup"]
    if args.compile:
        header += ["compiled step ms", "compiled speedup"]
    rows = []
    for r in results:
        share = lambda ms: f"{ms:.2f} ({ms / r['step_ms']:.0%})"
        row = [r["rows"], r["step_ms"], share(r["attention_ms"]), share(r["projections_ms"]),
               share(r["small_ops_ms"]), share(r["outside_ms"]), r["floor_ms"], f"{r['step_over_floor']:.2f}x",
               r["native_step_ms"], f"{r['native_over_floor']:.2f}x", f"{r['native_speedup']:.2f}x"]
        if placed:
            row += [r["small_pages_step_ms"], f"{r['huge_pages_speedup']:.2f}x"]
        if args.compile:
            row += [r["compiled_step_ms"], f"{r['compiled_speedup']:.2f}x"]
        rows.append(row)
    payload = {"bench": "decode_breakdown", "machine": machine_info("cpu"), "model": str(args.model),
               "settings": vars(args), "bandwidth_gb_s": bw, "bandwidth_range_gb_s": [min(rates), max(rates)],
               "floor_bracketed": True, "bandwidth_read": BANDWIDTH_READS,
               "huge_pages": {"thp": huge_pages.thp_mode(), "on": huge_pages.enabled(), "weight_bytes": weights,
                              "weight_bytes_on_huge_pages": placed,
                              "copy_bytes_on_huge_pages": plain_huge if placed else None},
               "results": results}
    where = (f"; the weights {placed / weights:.0%} on huge pages (the native step on a copy on 4 KiB pages beside "
             f"it), the floor's buffer too" if placed else "; the weights and the floor's buffer on 4 KiB pages")
    write_results(result_name("decode_breakdown", "cpu", "float32", model_suffix(args.model)), payload,
                  f"Where a plain decode step goes, model {args.model}, {args.task} prompts, {args.new_tokens} new "
                  f"tokens per row, float32 on this CPU (median of {args.repeats} rollouts after a warm-up); memory "
                  f"floor at the read bandwidth ({BANDWIDTH_READS}) measured just before and just after each "
                  f"step's rollouts (median {bw:.1f} GB/s, {min(rates):.1f}-{max(rates):.1f}), each step over the "
                  f"mean of its two floors"
                  f"{where}\n\n" + markdown_table(header, rows),
                  args.out)


if __name__ == "__main__":
    main()
