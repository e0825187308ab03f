"""The real-model tables of docs/real-models.md: SmolLM2's drafters, GRPO on SmolLM2 in one process and on 2
workers, the drift RL alone makes, and the memory of the RL update.

Departures: none (tooling).
"""
from __future__ import annotations

from collections.abc import Callable

from .format import bold, md_table, n
from .grpo import (
    acceptance_curve,
    canonical_grpo,
    canonical_spot,
    drafter_train,
    e2e_numbers,
    e2e_phases,
    spot_trainer,
)

DRAFTER_LABELS = {"runs/drafters/smollm2-cpu-v1": "before: the CPU drafter shipped first",
                  "runs/cpu-drafter/smollm2-hour": "CPU hour: 1,216 shipped responses",
                  "data/smollm2-135m-drafter": "**shipped: 12,224 responses, H100**"}


def drafters(stem: str) -> Callable:
    """``bench drafters``: top-1 agreement by draft depth on held-out responses and accepted tokens per SD step."""
    def render(r) -> str:
        rows = []
        for d in r.json(stem)["results"]:
            a = d["accept"]
            rows.append([DRAFTER_LABELS.get(d["drafter"], f"`{d['drafter']}`"),
                         " / ".join(f"{100 * v:.1f}" for v in d["top1_by_depth"]) + "%",
                         f"{a['chain-4@T=0']:.2f} / {a['chain-4@T=0.9']:.2f}",
                         f"{a['tree-6x4-24@T=0']:.2f} / {a['tree-6x4-24@T=0.9']:.2f}", d["train"]])
        return md_table(["drafter", "top-1 at depth 1 / 2 / 3 / 4 / 5", "chain-4, T=0 / 0.9", "tree-6x4-24, T=0 / 0.9",
                         "training"], rows)
    return render


def drift_run(stem: str) -> Callable:
    """``bench drift``: held-out accuracy at each evaluation and the accepted length of the online drafter, the warm
    drafter kept frozen and the online drafter's snapshot, per strategy."""
    def render(r) -> str:
        d = r.json(stem)
        acc = {e["step"]: e["eval/accuracy"] for e in d["eval"]}
        snap = f"online@{d['snapshots'][0]}" if d.get("snapshots") else None
        strategies = sorted({k.split(":")[1] for a in d["acceptance"] for k in a if k.count(":") == 1})
        last = max(acc)

        def cell(a, strategy):
            keys = ["online", "frozen"] + ([snap] if snap else [])
            vals = [a.get(f"{k}:{strategy}") for k in keys]
            return bold(" / ".join("–" if v is None else f"{v:.2f}" for v in vals), a["step"] == last)
        rows = [[a["step"], bold(f"{acc[a['step']]:.3f}", a["step"] == last),
                 *[cell(a, s) for s in strategies]] for a in d["acceptance"] if a["step"] in acc]
        who = "online / frozen warm" + (f" / frozen at {d['snapshots'][0]}" if snap else "")
        return md_table(["RL step", "held-out accuracy", *[f"{s}: {who}" for s in strategies]], rows)
    return render


def update_memory(stem: str) -> Callable:
    """``bench update_memory``: the update's peak memory against the memory check's estimate, and its speed, per
    micro-batch and LM-head chunk size; then what fits the bench's budget by the estimate."""
    def render(r) -> str:
        d = r.json(stem)
        rows = [[n(v["micro"]), n(v["chunk"]), f"{v['peak_gib']:.2f}", f"{v['estimate_gib']:.2f}",
                 f"{round(100 * (v['estimate_gib'] / v['peak_gib'] - 1)):+d}%", n(v["tokens_per_s"])]
                for v in d["results"]]
        table = md_table(["micro_batch_tokens", "logprob_chunk", "peak GiB (above the loaded model)", "estimate GiB",
                          "estimate vs peak", "update tokens/s"], rows)
        s = d["settings"]
        fits = ", ".join(f"{f['prompts']} prompts x {s['group']} of {n(f['length'])} tokens" for f in d["fits"])
        return table + (f"\n\nWhat fits in {s['budget_gib']:.0f} GiB by the estimate (weights included): {fits} per "
                        "step.")
    return render


ONE = "e2e_grpo-cpu-float32-smollm2"
TWO = "e2e_grpo-cpu-float32-w2-smollm2"

RENDERERS: dict[str, Callable] = {
    "smollm2_drafters": drafters("drafters-cpu-float32-smollm2-135m"),
    "smollm2_grpo_phases": e2e_phases(ONE),
    "smollm2_grpo_numbers": e2e_numbers(ONE),
    "smollm2_grpo_curve": acceptance_curve(ONE, (1, 6, 12, 18, 24)),
    "smollm2_w2_phases": e2e_phases(TWO),
    "smollm2_w2_curve": acceptance_curve(TWO, (1, 3, 5, 7, 9, 11, 13, 15),
                                         (("spot-trained drafter (2 workers)", "online"),
                                          ("frozen drafter", "frozen"))),
    "smollm2_w2_spot": spot_trainer(TWO),
    "smollm2_drift": drift_run("drift-cpu-float32-smollm2"),
    "smollm2_drafter_train": drafter_train("drafter_train-cpu-float32-smollm2"),
    "smollm2_canonical_grpo": canonical_grpo("figures/smollm2"),
    "smollm2_canonical_spot": canonical_spot("figures/smollm2"),
    "smollm2_update_memory": update_memory("update_memory-cpu-float32-smollm2-135m"),
}
"""The real-model renderers a doc can name (``<!-- report: NAME -->``)."""
