"""The simulator run at the paper's settings (:func:`project`), beside the paper's numbers
(:mod:`tltlib.paper.numbers`).

**The projection** (:func:`project`): :func:`tltlib.sim.simulate.compare_policies` at the paper's settings — Qwen2.5-7B
(TP 4) and Qwen2.5-32B (TP 8) on 1/2/4/8 nodes of 8 H100 (the roofline preset, checked against Tables 2 and 7),
64 prompts x 8, at most 32K tokens, the paper's adaptive policy (:func:`paper_policy`: SD at <= 32 running rows,
BEG-MAB's batch-size buckets 1 / 2-4 / 5-20 / 21+ verifying 48 / 32 / 16 / 8 tokens) — against the paper's Table 3.
Its assumptions, each a parameter:

1. Response lengths: a log-normal through a measured median and 99th percentile, scaled to the 32K cap
   (:func:`lengths_from_bench`: the tiny reasoner's, whose 720-token cap is scaled by 32768 / 720); the paper gives
   no length percentiles for its runs.
2. Acceptance: one per-level acceptance of the drafter's top path, fitted so that a depth-10 chain accepts 6.53
   tokens per step (Table 6/7's adaptive drafter); a tree accepts as a chain of its depth (Table 1: top-k 4 to 16
   changes the accept length by < 5%). TLT-Base (the n-gram drafter only) accepts ``ngram_accept`` (1.04-1.3 here).
3. The update: the roofline preset's model-FLOPs utilisation (35%) over every device, one log-prob pass, a weight
   sync to the rollout engine; nothing else (no evaluation, no checkpoint) is in the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BadInput, NotFound
from ..fileio import read_json
from ..model.decoder import preset
from ..sim.costs import hardware
from ..sim.simulate import DoesNotFit, LengthDistribution, SDPolicy, StepConfig, compare_policies
from ..spec.acceptance import expected_tokens
from ..spec.strategy import SpecStrategy
from .numbers import PAPER


# ------------------------------------------------------------------------------------- the adaptive policy
def fit_acceptance(accept_length: float, depth: int) -> float:
    """The per-level acceptance ``a`` with which a chain of ``depth`` drafts accepts ``accept_length`` tokens per SD
    step (bonus token included: 1 + a + a^2 + ... + a^depth)."""
    if not 1 < accept_length < depth + 1:
        raise BadInput(f"an accept length must lie in (1, depth + 1) = (1, {depth + 1}); got {accept_length}")
    chain, lo, hi = SpecStrategy.parse(f"chain-{depth}"), 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(chain, mid) < accept_length else (lo, mid)
    return (lo + hi) / 2


def paper_policy(accept_length: float = 6.53, depth: int = 10, branch: int = 8, threshold: int = 32,
                 buckets: tuple = (1, 2, 5, 21), verify: tuple = (48, 32, 16, 8)) -> SDPolicy:
    """TLT's adaptive policy as the paper runs it: SD at or below ``threshold`` running rows, a tree of ``branch``
    and ``depth`` (capped at the bucket's verify budget) verifying ``verify[i]`` tokens in the batch-size bucket
    starting at ``buckets[i]``; each accepts as a chain of its depth at the acceptance :func:`fit_acceptance` finds
    for ``accept_length`` at ``depth``."""
    if len(buckets) != len(verify):
        raise BadInput(f"give one verify budget per bucket: {len(buckets)} buckets, {len(verify)} budgets")
    a = fit_acceptance(accept_length, depth)
    names = [f"tree-{min(depth, v)}x{branch}-{v}" for v in verify]
    accept = {n: expected_tokens(SpecStrategy.parse(f"chain-{SpecStrategy.parse(n).depth}"), a) for n in names}
    return SDPolicy(threshold=threshold, buckets=tuple(zip(buckets, names)), accept=tuple(accept.items()))


def ngram_policy(accept_length: float, threshold: int = 32, depth: int = 4) -> SDPolicy:
    """TLT-Base: the n-gram drafter only (no drafter forward), at or below ``threshold`` rows."""
    name = f"ngram-{depth}"
    return SDPolicy(threshold=threshold, buckets=((1, name),), accept=((name, accept_length),))


# ---------------------------------------------------------------------------------------- response lengths
def lengths_from_bench(path: str | Path, cap: int = 32768) -> LengthDistribution:
    """A log-normal through the median over RL steps of a ``bench e2e_grpo`` results file's baseline rollouts'
    median and 99th-percentile lengths, scaled from the bench's ``max_new`` to ``cap``."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"{path}: no such results file; run `python -m tltlib bench e2e_grpo` to write it")
    fix = "run `python -m tltlib bench e2e_grpo` again to rewrite it"
    d = read_json(path, fix)
    d = d if isinstance(d, dict) else {}
    steps = _baseline_steps(d)
    p50 = [s["rollout/len_p50"] for s in steps if _positive(s.get("rollout/len_p50"))]
    p99 = [s["rollout/len_p99"] for s in steps if _positive(s.get("rollout/len_p99"))]
    if not p50 or not p99:
        raise BadInput(f"{path}: no baseline rollout lengths (runs.baseline[].steps[] with rollout/len_p50 and "
                       "rollout/len_p99 > 0); is it a bench e2e_grpo results file? Pass one as --lengths-from")
    max_new = d.get("settings", {}).get("max_new") if isinstance(d.get("settings"), dict) else None
    if not _positive(max_new):
        raise BadInput(f"{path}: settings.max_new (the bench's longest completion, which its lengths are scaled "
                       f"from) must be a number > 0, got {'none' if max_new is None else repr(max_new)}; {fix}")
    if np.median(p99) < np.median(p50):
        raise BadInput(f"{path}: its baseline's rollout/len_p99 ({np.median(p99)}) lies below its rollout/len_p50 "
                       f"({np.median(p50)}); {fix}")
    scale = cap / max_new
    return LengthDistribution(median=float(np.median(p50)) * scale, p99=float(np.median(p99)) * scale, cap=cap)


def _baseline_steps(d: dict) -> list[dict]:
    """The steps of a ``bench e2e_grpo`` results file's baseline runs (``runs.baseline[].steps[]``); what is not
    shaped so is left out."""
    runs = d.get("runs")
    baseline = runs.get("baseline") if isinstance(runs, dict) else None
    if not isinstance(baseline, list):
        return []
    steps = [run.get("steps") for run in baseline if isinstance(run, dict)]
    return [s for run in steps if isinstance(run, list) for s in run if isinstance(s, dict)]


def _positive(x) -> bool:
    """A finite number > 0 (not a bool) read from a JSON file."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# ------------------------------------------------------------------------------------------- the projection
@dataclass(frozen=True)
class ProjectionConfig:
    """The paper's end-to-end setting, simulated (see the module docstring for the assumptions)."""

    model: str = "qwen2.5-7b"
    """A model preset of :mod:`tltlib.model.decoder` (``qwen2.5-7b``, ``qwen2.5-32b``, ``llama-3.3-70b``)."""
    tp: int = 4
    nodes: tuple = (1, 2, 4, 8)
    hardware: str = "h100"
    prompts: int = 64
    num_generations: int = 8
    prompt_len: int = 512
    lengths: LengthDistribution = field(default_factory=lambda: LengthDistribution(median=2060, p99=23900))
    """Default: the tiny reasoner's baseline rollouts in ``bench e2e_grpo`` (median 45, p99 525 of at most 720
    tokens), scaled to 32K: :func:`lengths_from_bench` of ``bench/results/e2e_grpo-cpu-float32.json``."""
    accept_length: float = 6.53
    ngram_accept: float = 1.3
    micro_step_s: float = 0.1
    seeds: int = 3
    """Independent draws of the lengths; the step times are their means."""

    def __post_init__(self):
        if self.seeds < 1 or not self.nodes or min(self.nodes) < 1:
            raise BadInput(f"ProjectionConfig: seeds >= 1 and node counts >= 1; got seeds {self.seeds}, nodes "
                           f"{self.nodes}")


def project(cfg: ProjectionConfig = ProjectionConfig()) -> list[dict]:
    """One row per node count: the simulated baseline, TLT-Base and TLT steps (seconds, means over ``seeds`` length
    draws), TLT's step and rollout speedups, the baseline's rollout share, idle and harvested shares, the paper's
    Table 3 value; a configuration that does not fit in memory gives ``{"nodes", "oom": the error}``."""
    tlt, base = paper_policy(cfg.accept_length), ngram_policy(cfg.ngram_accept)
    model = preset(cfg.model, tie_word_embeddings=False)
    rows = []
    for nodes in cfg.nodes:
        sims = []
        try:
            for seed in range(cfg.seeds):
                step = StepConfig(model, hardware(cfg.hardware), nodes=nodes, tp=cfg.tp, prompts=cfg.prompts,
                                  num_generations=cfg.num_generations, prompt_len=cfg.prompt_len, lengths=cfg.lengths,
                                  micro_step_s=cfg.micro_step_s, seed=seed)
                sims.append(compare_policies(step, tlt, base))
        except DoesNotFit as e:
            rows.append({"nodes": nodes, "oom": str(e), "paper": PAPER["table3"].get(cfg.model, {}).get(nodes)})
            continue
        rows.append(_row(nodes, step, sims, PAPER["table3"].get(cfg.model, {}).get(nodes)))
    return rows


def _row(nodes: int, step: StepConfig, sims: list[dict], paper: float | None) -> dict:
    """Means over the seeds of one node count's simulated steps."""
    def mean(policy, attr):
        return float(np.mean([getattr(s[policy], attr) for s in sims]))
    b, t, n = (mean(p, "step_s") for p in ("baseline", "tlt", "tlt-base"))
    return {"nodes": nodes, "workers": step.workers,
            "rows_per_worker": step.prompts * step.num_generations // step.workers,
            "baseline_s": b, "tlt_base_s": n, "tlt_s": t, "speedup": b / t, "tlt_base_speedup": b / n,
            "rollout_speedup": mean("baseline", "rollout_s") / mean("tlt", "rollout_s"),
            "rollout_share": mean("baseline", "rollout_s") / b,
            "sd_time_share": float(np.mean([sd_time_share(w) for s in sims for w in s["tlt"].workers])),
            "idle_frac": float(np.mean([s["baseline"].idle_frac for s in sims])),
            "harvested": _mean_or_nan([s["tlt"].harvested(step.micro_step_s) for s in sims]),
            "memory_gb": max(s["tlt"].memory_gb for s in sims), "paper": paper}


def sd_time_share(rollout) -> float:
    """Share of a simulated rollout's (:class:`tltlib.sim.simulate.RolloutSim`) time spent in SD steps."""
    ends = np.array([t for t, _, _ in rollout.timeline])
    spans = np.diff(np.concatenate([[0.0], ends]))
    on = np.array([name != "off" for _, _, name in rollout.timeline])
    return float(spans[on].sum() / rollout.time_s)


def _mean_or_nan(values: list[float]) -> float:
    """The mean of the values that are not NaN (a step without idle time harvests nothing: NaN); NaN if none."""
    kept = [v for v in values if not math.isnan(v)]
    return float(np.mean(kept)) if kept else float("nan")


def table3(rows_by_model: dict[str, list[dict]]) -> str:
    """A markdown table: the projection's speedups beside the paper's Table 3, per model and node count."""
    lines = ["| model | nodes | rollout workers x rows | baseline step s | rollout share | TLT-Base | TLT "
             "(simulated) | paper | rollout speedup | SD share of TLT's rollout | idle share | harvested |",
             "|" + "---|" * 12]
    for name, rows in rows_by_model.items():
        for r in rows:
            paper = "OOM" if name in PAPER["table3"] and r.get("paper") is None else (
                f"{r['paper']:.2f}x" if r.get("paper") else "—")
            if "oom" in r:
                need = r["oom"].split(" need ")[1].split(" per device")[0] if " need " in r["oom"] else "?"
                lines.append(f"| {name} | {r['nodes']} | — | — | — | — | OOM (needs {need} per GPU) | {paper} "
                             "| — | — | — | — |")
                continue
            lines.append(f"| {name} | {r['nodes']} | {r['workers']} x {r['rows_per_worker']} | {r['baseline_s']:.0f} | "
                         f"{r['rollout_share']:.0%} | {r['tlt_base_speedup']:.2f}x | **{r['speedup']:.2f}x** | {paper} "
                         f"| {r['rollout_speedup']:.2f}x | {r['sd_time_share']:.0%} | {r['idle_frac']:.0%} | "
                         + ("—" if math.isnan(r["harvested"]) else f"{r['harvested']:.0%}") + " |")
    return "\n".join(lines) + "\n"
