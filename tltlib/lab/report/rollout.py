"""The rollout tables: the long tail of the canonical runs, the policies of ``bench long_tail_rollout`` and the
paged KV cache against the dense one.

Departures: none (tooling).
"""
from __future__ import annotations

from collections.abc import Callable

from .format import bold, md_table, median, n, pct, x


def long_tail(folder: str) -> Callable:
    """Notebook 01's response lengths, from the canonical run whose figures are in ``folder``."""
    def render(r) -> str:
        m = r.canonical("01_profile_long_tail", folder)
        return md_table(["median", "p99", "max", "p99 / median", "max / median", "truncated at the cap",
                         "time with <= 25% / <= 10% of rows running", "row-slots left empty", "accuracy"],
                        [[n(m["rollout/len_p50"]), n(m["rollout/len_p99"]), n(m["rollout/len_max"]),
                          f"{m['rollout/p99_over_p50']:.1f}", f"{m['rollout/max_over_p50']:.1f}",
                          pct(m["rollout/truncated_frac"]),
                          f"{pct(m['rollout/tail_time_frac_25'])} / {pct(m['rollout/tail_time_frac_10'])}",
                          pct(m["sched/empty_slot_frac"]), pct(m["rl/accuracy"], 1)]])
    return render



def rollout_policies(stem: str, rule: str = "Thompson") -> Callable:
    """Every policy of a ``bench long_tail_rollout`` file: its median rollout time, against no SD and against the
    best fixed policy, and the per-bucket oracle (the hindsight bound of a per-bucket tuner). ``rule``: the tuner
    the file was measured with (the bench called every adaptive policy "BEG-MAB" until it named the rule)."""
    def render(r) -> str:
        d = r.json(stem)
        name = lambda p: p.replace("BEG-MAB", rule)                                  # noqa: E731
        rows = [[bold(name(p["policy"]), p["policy"].startswith("adaptive") and "model-free" not in p["policy"]
                      and "n-gram" not in p["policy"]), f"{p['time_s']:.2f}", x(p["speedup_vs_no_sd"]),
                 "—" if p.get("vs_best_fixed") is None else x(p["vs_best_fixed"])] for p in d["results"]]
        s = d["summary"]
        rows.append(["per-bucket oracle (hindsight bound)", f"{s['oracle_s']:.2f}", x(s["oracle_vs_no_sd"]),
                     x(s["oracle_vs_best_fixed"])])
        return md_table(["policy", "rollout s (median)", "vs no SD", "vs best fixed"], rows)
    return render



def kv_cache(stem: str) -> Callable:
    """Paged against dense KV cache on one workload (``bench kv_cache``): time, peak KV against the tokens held, the
    memory check's estimate, the same tokens."""
    def render(r) -> str:
        d = r.json(stem)
        rows, refused = [], []
        for v in d["results"]:
            if "refused" in v:
                rows.append([v["kv"], "refused (below)", None, None, None, None, None, None])
                refused.append(f"The {v['kv']} cache refused the rollout before it started: {v['refused']}")
                continue
            est = v.get("estimate_over_peak")
            rows.append([v["kv"], f"{median(v['runs']):.2f}", n(v["tok_s"]), f"{v['kv_peak_bytes'] / 2 ** 20:.1f}",
                         f"{v['held_peak_bytes'] / 2 ** 20:.1f}", x(v["kv_over_held"], 3),
                         None if est is None else x(est, 3), v["identical_tokens"]])
        speed = d.get("paged_over_dense_speed")
        caption = (f"Paged / dense speed {x(speed, 3)} (dense seconds over paged seconds); " if speed else "") + \
            (f"responses mean {d['response_lengths']['mean']:.0f}, max {d['response_lengths']['max']:.0f} tokens; "
             f"process peak RSS {d['max_rss_bytes'] / 2 ** 30:.2f} GiB.")
        return md_table(["KV cache", "rollout s", "tok/s", "peak KV MiB", "held MiB", "peak / held", "estimate / peak",
                         "same tokens"], rows) + "\n\n" + caption + "".join(f"\n\n{t}" for t in refused)
    return render


def kv_attention(stem: str) -> Callable:
    """One layer's attention through block tables: the paged kernels in place against gathering the pages."""
    def render(r) -> str:
        return md_table(["rows", "new tokens", "paged us", "gathered us", "gathered / paged"],
                        [[v["rows"], v["new_tokens"], f"{v['paged_us']:.0f}", f"{v['gathered_us']:.0f}",
                          x(v["gathered_over_paged"])] for v in r.json(stem)["results"]])
    return render



SMOLLM2_ROLLOUT = "long_tail_rollout-cpu-float32-16x8-smollm2-135m-words-same-lengths-smollm2-135m-drafter"


RENDERERS: dict[str, Callable] = {
    "long_tail": long_tail("figures"),
    "smollm2_long_tail": long_tail("figures/smollm2"),
    "rollout_512": rollout_policies("long_tail_rollout-cpu-float32", "BEG-MAB"),
    "rollout_128": rollout_policies("long_tail_rollout-cpu-float32-16x8"),
    "rollout_128_random": rollout_policies("long_tail_rollout-cpu-float32-16x8-same-lengths-tiny-random"),
    "rollout_128_stale": rollout_policies(
        "long_tail_rollout-cpu-float32-16x8-same-lengths-tiny-reasoner-drafter-short"),
    "rollout_128_same": rollout_policies("long_tail_rollout-cpu-float32-16x8-same-lengths"),
    "smollm2_rollout": rollout_policies(SMOLLM2_ROLLOUT),
    "smollm2_rollout_4x8": rollout_policies("long_tail_rollout-cpu-float32-4x8-smollm2-135m-words", "BEG-MAB"),
    "kv_tiny": kv_cache("kv_cache-cpu-float32-amd-epyc-2t-16x8-720"),
    "kv_tiny_chain4": kv_cache("kv_cache-cpu-float32-amd-epyc-2t-16x8-720-chain-4"),
    "kv_smollm2": kv_cache("kv_cache-cpu-float32-amd-epyc-2t-smollm2-135m-8x8-512"),
    "kv_smollm2_long": kv_cache("kv_cache-cpu-float32-amd-epyc-2t-smollm2-135m-32x8-4096"),
    "kv_attention": kv_attention("kv_attention-cpu-float32-amd-epyc-2t"),
}
"""The rollout renderers a doc can name (``<!-- report: NAME -->``)."""
