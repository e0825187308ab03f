"""The metric vocabulary and long-tail statistics of rollouts.

Every statistic tltlib returns uses a key from :data:`METRICS` (namespaced ``rollout/``, ``spec/``, ``drafter/``,
``sched/``, ``rl/``); notebooks write them to ``metrics.json`` and tests read them back. The functions here are pure:
they take lengths, per-step timelines and finish times and return plain dicts of floats.

Paper: TLT §2 / Fig. 1-2 (rollout is ~85% of a step; a few responses reach the maximum length); Fig. 14 (active
requests over time, SD switching on when few remain).

Departures:
1. Idle worker time is estimated with a step-count model (a worker's rollout lasts as many decode steps as its
   longest response; decode steps cost about the same at small batch), not measured on W real workers; the
   scheduler (a later issue) measures it for real.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import numpy as np

METRICS: dict[str, str] = {
    "rollout/num_sequences": "responses generated (prompts x group size)",
    "rollout/tokens": "response tokens generated (EOS included)",
    "rollout/time_s": "wall time of the rollout, prefill included (s)",
    "rollout/prefill_s": "wall time of the prefill (s)",
    "rollout/iterations": "decode iterations (target forwards after the prefill: plain or SD steps)",
    "rollout/tokens_per_s": "response tokens per second of rollout wall time",
    "rollout/len_mean": "mean response length (tokens)",
    "rollout/len_p50": "median response length",
    "rollout/len_p90": "90th percentile response length",
    "rollout/len_p99": "99th percentile response length",
    "rollout/len_max": "longest response",
    "rollout/p99_over_p50": "p99 / median response length (long-tail ratio)",
    "rollout/max_over_p50": "max / median response length",
    "rollout/tail_time_frac_10": "share of decode time with <= 10% of the rows still running",
    "rollout/tail_time_frac_25": "share of decode time with <= 25% of the rows still running",
    "rollout/truncated_frac": "share of responses cut at max_new_tokens",
    "rollout/kv_peak_bytes": "most bytes the KV caches held at once (paged: pages in use, transient ones included; "
                             "dense: the allocation)",
    "rollout/kv_pool_bytes": "bytes the KV caches take (the paged pools, or the dense caches)",
    "rollout/preempted": "rows taken out of the batch because the KV budget could not hold their next tokens "
                         "(admission by memory; each re-admitted later by recomputing its tokens)",
    "rollout/recomputed_tokens": "tokens prefilled again to re-admit preempted rows",
    "rollout/graph_replays": "CUDA graph replays (decode, verify and draft forwards; CUDA only)",
    "rollout/graph_captures": "CUDA graphs captured during the rollout (first use of a row/span bucket)",
    "rollout/graph_capture_s": "seconds spent capturing CUDA graphs (included in rollout/time_s)",
    "sched/idle_frac": "share of the workers' rollout time spent idle, waiting for the last worker (measured by the "
                       "scheduler; the step-count model in profiling)",
    "sched/workers": "W, the number of data-parallel workers (or of workers in the idle-time estimate)",
    "sched/rollout_worker_s": "worker-seconds of the rollout phase: W x (last rollout end - start), summed",
    "sched/idle_s": "idle worker-seconds: each worker's wait from its rollout end to the last one's, summed",
    "sched/train_s": "seconds of drafter training inside the idle windows, summed over workers",
    "sched/harvested": "share of the idle worker-time spent training the drafter (sched/train_s / sched/idle_s)",
    "sched/micro_steps": "spot-trainer micro-steps in the step, summed over workers",
    "sched/micro_step_s": "median seconds of one spot-trainer micro-step",
    "sched/preempt_s": "seconds from the last rollout's end until the spot trainer stopped (worst worker)",
    "sched/preempt_micro_steps": "preemption latency over the length of the micro-step it interrupted (<= 1: "
                                 "stopped within one micro-step)",
    "sched/signal_s": "seconds for the end of the last rollout to reach a waiting worker",
    "sched/sync_s": "seconds of the drafter sync after the idle window (worst worker)",
    "sched/overhead_s": "what the spot trainer adds to the step's critical path: from the last rollout's end until "
                        "every worker holds the merged drafter (signal, interrupted micro-step, sync)",
    "sched/timeline": "per worker, the (phase, start s, end s) spans of the step",
    "sched/empty_slot_frac": "share of row x decode-step slots of a static batch left empty by finished responses",
    "spec/steps": "SD steps: decode iterations that ran speculative decoding",
    "spec/time_frac": "share of decode time spent in SD steps",
    "spec/accept_len_mean": "mean tokens emitted per row per SD step (accepted drafts + 1, bonus included)",
    "spec/draft_time_s": "time spent drafting (drafter extend + draft forwards)",
    "spec/verify_time_s": "time spent verifying (target forward + acceptance)",
    **{f"spec/accept_ge_{d}": f"share of speculative row-steps accepting at least {d} drafts" for d in range(1, 65)},
    "drafter/loss": "drafter training loss (w_v SmoothL1 + w_p soft CE)",
    "drafter/vloss": "SmoothL1 of the predicted next hidden state",
    "drafter/ploss": "soft cross-entropy against the target's next-token distribution",
    **{f"drafter/acc_{d}": f"top-1 agreement with the target at draft depth {d}" for d in range(1, 17)},
    "drafter/pairs": "training pairs (hidden, token) used",
    "drafter/train_s": "drafter training wall time (s)",
    "adaptive/threshold": "SD switch threshold (running rows at or below which SD runs)",
    "adaptive/arms": "strategies the BEG-MAB tuner chooses among",
    "adaptive/rollout_s": "wall time of the adaptive rollout (after its tuning rollouts on other prompts)",
    "adaptive/speedup_vs_no_sd": "rollout time without SD / with the adaptive engine",
    "adaptive/speedup_vs_fixed": "rollout time with a fixed strategy / with the adaptive engine",
    "adaptive/explored_arms": "distinct strategies the adaptive rollout played",
    "spec/ngram_match_rate": "share of n-gram draft requests that found an earlier occurrence of the suffix",
    "spec/suffix_match_rate": "share of suffix-drafter requests that found a recurring suffix (a non-empty tree)",
    "spec/suffix_nodes": "draft nodes the suffix drafter proposed per request (before padding to the budget)",
    "spec/chi2_pvalue": "chi-square p-value of plain vs speculative samples (large = same distribution)",
    "rl/reward_mean": "mean reward of the rollout's responses",
    "rl/accuracy": "share of responses whose final answer is correct",
    "rl/step": "RL steps done",
    "rl/reward_std": "standard deviation of the rollout's rewards",
    "rl/loss": "GRPO loss of the update (mean over iterations)",
    "rl/kl": "mean per-token KL to the reference policy (beta > 0)",
    "rl/clip_frac": "share of completion tokens whose ratio was clipped",
    "rl/grad_norm": "policy gradient norm before clipping",
    "rl/completion_len_mean": "mean completion length (tokens)",
    **{f"rl/reward/{name}": f"mean reward of the reward function {name}" for name in ("accuracy_reward",
                                                                                      "format_reward")},
    "rl/curriculum_level": "the curriculum level opened last (the step draws from it and, cumulative, those before)",
    "drafter/version": "drafter weight version (moves with every training micro-step)",
    "drafter/buffer_pairs": "(hidden, token) pairs held in the drafter's buffer",
    "update/tokens": "tokens through the policy's forward and backward (all iterations)",
    "update/padding_frac": "share of the update's forward tokens that were padding",
    "update/tokens_per_s": "update tokens per second",
    "time/rollout_s": "RL step phase: rollout (s)",
    "time/reward_s": "RL step phase: rewards and advantages (s)",
    "time/logprob_s": "RL step phase: reference / old-policy log-probabilities (s)",
    "time/update_s": "RL step phase: policy update (s)",
    "time/drafter_s": "RL step phase: drafter training (s)",
    "time/step_s": "RL step wall time (s)",
    "eval/accuracy": "held-out accuracy (greedy decoding)",
    "eval/accuracy_before": "held-out accuracy of the initial policy (greedy decoding)",
    "eval/accuracy_baseline": "held-out accuracy of the baseline runs (mean over seeds)",
    "eval/accuracy_tlt": "held-out accuracy of the TLT runs (mean over seeds)",
    "e2e/step_speedup": "baseline RL step time / TLT RL step time",
    "e2e/rollout_speedup": "baseline rollout time / TLT rollout time",
    "e2e/amdahl_bound": "step speedup if only the rollout got faster: 1 / ((1 - share) + share / rollout speedup)",
    "e2e/rollout_share": "share of the baseline RL step spent in the rollout",
    "e2e/drafter_share": "share of the TLT RL step spent training the drafter",
    "e2e/reward_overlap": "share of RL steps whose baseline and TLT reward means lie within their summed stds",
    "spec/accept_len_online_last": "accepted length of the online drafter after the last RL step (probe)",
    "spec/accept_len_frozen_last": "accepted length of the frozen warm drafter after the last RL step (probe)",
    "spec/accept_len_ngram_last": "accepted length of the n-gram drafter after the last RL step (probe)",
    "eval/len_mean": "held-out mean response length (greedy decoding)",
    "sched/overhead_share": "spot-trainer overhead on the critical path as a share of the step (mean over steps)",
    **{f"sched/idle_frac_model_w{w}": f"idle share with {w} workers (step-count model on one rollout's lengths)"
       for w in (1, 2, 4, 8, 16, 32, 64, 128)},
    "spec/accept_len_warm_initial": "accepted length of the warm drafter on the initial policy (probe)",
    "spec/accept_len_spot_last": "accepted length of the spot-trained drafter on the final policy (probe)",
}


def call_times(fn, repeats: int, device) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after one warm-up call, CUDA synchronised around each call
    when ``device`` (a ``torch.device``) is a GPU."""
    sync = None
    if getattr(device, "type", str(device)) == "cuda":
        import torch
        sync = lambda: torch.cuda.synchronize(device)                      # noqa: E731
    fn()
    out = []
    for _ in range(repeats):
        if sync:
            sync()
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append(time.perf_counter() - t)
    return out


def machine_info(device: str = "cpu") -> dict:
    """The machine a measurement ran on, for a results file: CPU model, threads, versions, the GPU on ``cuda``."""
    import os
    import platform

    import torch
    import transformers

    from .machine import cpu_name
    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "device": device, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "cpu": cpu_name()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def is_metric(key: str) -> bool:
    """Whether ``key`` belongs to the vocabulary (``rl/reward/<function>`` keys are open-ended)."""
    return key in METRICS or key.startswith("rl/reward/")


def length_stats(lengths: Sequence[int] | np.ndarray) -> dict[str, float]:
    """``rollout/len_*`` statistics of response lengths (tokens, EOS included)."""
    x = np.asarray(lengths, dtype=np.float64)
    if x.size == 0:
        raise ValueError("length_stats needs at least one response length")
    p50 = float(np.percentile(x, 50))
    out = {"rollout/len_mean": float(x.mean()), "rollout/len_p50": p50,
           "rollout/len_p90": float(np.percentile(x, 90)), "rollout/len_p99": float(np.percentile(x, 99)),
           "rollout/len_max": float(x.max())}
    out["rollout/p99_over_p50"] = out["rollout/len_p99"] / max(p50, 1.0)
    out["rollout/max_over_p50"] = out["rollout/len_max"] / max(p50, 1.0)
    return out


class StepClock:
    """Where one RL step's time went on this worker: phase durations (``time/<phase>_s``, from
    ``time.perf_counter``) and wall-clock spans (``time.time``: comparable across workers, for ``sched/timeline``)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the enclosed block as phase ``name``."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = time.perf_counter() - t

    def span(self, name: str, start: float, end: float | None = None) -> None:
        """Record the wall-clock span ``start``-``end`` (default: now) as ``name``."""
        self.spans.append((name, start, time.time() if end is None else end))

    def last(self, name: str) -> tuple[float, float]:
        """(start, end) of the last span called ``name``."""
        return next((a, b) for n, a, b in reversed(self.spans) if n == name)

    def metrics(self) -> dict[str, float]:
        """``time/<phase>_s`` of every phase and ``time/step_s`` (since the clock started)."""
        return {**{f"time/{k}_s": v for k, v in self.phases.items()}, "time/step_s": time.perf_counter() - self.t0}


def tail_time_share(iter_time: Sequence[float], active: Sequence[int], total_rows: int, fraction: float) -> float:
    """Share of decode time spent in iterations where at most ``fraction`` of ``total_rows`` were still running.

    Args:
        iter_time: ``[S]`` seconds of each decode iteration.
        active: ``[S]`` rows still generating during each iteration.
        total_rows: rows at the start of the rollout.
    """
    t = np.asarray(iter_time, dtype=np.float64)
    a = np.asarray(active, dtype=np.float64)
    if t.size == 0 or t.sum() <= 0:
        return 0.0
    return float(t[a <= fraction * total_rows].sum() / t.sum())


def time_by_bucket(iter_time: Sequence[float], active: Sequence[int], bounds: Sequence[int]) -> np.ndarray:
    """Decode time spent in each batch-size bucket: ``out[i]`` sums the iterations with
    ``bounds[i] <= active < bounds[i + 1]`` (the last bucket is open-ended).

    Args:
        iter_time: ``[S]`` seconds of each decode iteration.
        active: ``[S]`` rows still generating during each iteration.
        bounds: ``[K]`` lower bounds of the buckets, strictly increasing (e.g. a tuner's ``buckets``).
    Returns: ``[K]`` seconds."""
    b = np.asarray(bounds)
    if b.size == 0 or np.any(np.diff(b) <= 0):
        raise ValueError(f"bucket bounds must be non-empty and strictly increasing, got {list(bounds)}")
    t = np.asarray(iter_time, dtype=np.float64)
    idx = np.searchsorted(b, np.asarray(active), side="right") - 1
    keep = idx >= 0                                    # iterations below the first bound belong to no bucket
    return np.bincount(idx[keep], weights=t[keep], minlength=b.size)


def per_bucket_oracle(bucket_times: dict[str, Sequence[float]]) -> tuple[float, list[str | None]]:
    """The hindsight bound of a per-bucket tuner: given each policy's decode time per bucket (``[K]`` each, from
    :func:`time_by_bucket`), the total time if every bucket ran its fastest policy, and that policy per bucket
    (None for a bucket no policy spent time in).

    No tuner that picks one policy per batch-size bucket can beat this on the same workload (up to run-to-run
    noise), so ``best fixed total / oracle total`` is the most an adaptive tuner could gain over the best fixed
    policy."""
    if not bucket_times:
        raise ValueError("per_bucket_oracle needs at least one policy's bucket times")
    names = list(bucket_times)
    tab = np.array([np.asarray(bucket_times[n], dtype=np.float64) for n in names])
    best = tab.argmin(0)
    return float(tab.min(0).sum()), [names[i] if tab[:, k].max() > 0 else None for k, i in enumerate(best)]


def paired_ratio(base: Sequence[float], other: Sequence[float], level: float = 0.95,
                 resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """How much faster ``other`` ran than ``base`` when each ran once per round: the median over rounds of
    ``base[i] / other[i]`` (> 1: ``other`` is faster), with a bootstrap confidence interval of that median.

    Pairing within a round cancels what the round shares (a slow spell of the machine, a longer tail drawn with the
    round's seed); the interval says how far the rounds left can be trusted: on a VM whose rollouts move ±20% from
    one round to the next, a 2% claim needs the interval, not the median alone.

    Args:
        base, other: ``[R]`` seconds per round, ``R >= 1`` (same length).
        level: the interval's coverage, in (0, 1).
        resamples: bootstrap resamples (rounds drawn with replacement); ``seed`` seeds them.
    Returns: ``(median, low, high)``; ``low == high == median`` for one round."""
    b, o = np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if b.shape != o.shape or b.ndim != 1 or b.size == 0:
        raise ValueError(f"paired_ratio needs two equally long, non-empty lists of times, got {b.shape} and {o.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if np.any(b <= 0) or np.any(o <= 0):
        raise ValueError("paired_ratio needs positive times")
    r = b / o
    med = float(np.median(r))
    if r.size == 1:
        return med, med, med
    idx = np.random.default_rng(seed).integers(0, r.size, size=(resamples, r.size))
    boot = np.median(r[idx], axis=1)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return med, float(lo), float(hi)


def split_idle_fraction(lengths: Sequence[int] | np.ndarray, workers: int) -> float:
    """Idle share of worker-time if the responses were split contiguously over ``workers`` workers.

    Step-count model: worker w is busy for ``max(lengths of its share)`` decode steps and the rollout ends with the
    slowest worker, so idle = 1 - mean_w(busy_w) / max_w(busy_w). Contiguous shares keep GRPO groups together, as
    verl's data-parallel dispatch does."""
    x = np.asarray(lengths, dtype=np.float64)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if x.size < workers:
        raise ValueError(f"cannot split {x.size} responses over {workers} workers; use fewer workers")
    busy = np.array([part.max() for part in np.array_split(x, workers)])
    return float(1.0 - busy.mean() / busy.max())


def empty_slot_fraction(lengths: Sequence[int] | np.ndarray) -> float:
    """Share of the (response x decode step) slots of a batch that runs until its longest response which are empty
    because their response already finished: ``1 - mean(lengths) / max(lengths)``. Independent of how the batch is
    split over workers."""
    x = np.asarray(lengths, dtype=np.float64)
    return float(1.0 - x.mean() / x.max())


def active_over_time(finish_time: Sequence[float], total_time: float, points: int = 200):
    """Curve of running requests vs time from per-sequence finish times: ``(t [points], active [points])``."""
    f = np.sort(np.asarray(finish_time, dtype=np.float64))
    t = np.linspace(0.0, total_time, points)
    return t, f.size - np.searchsorted(f, t, side="right")


def rollout_stats(lengths, iter_time, active, total_rows: int, truncated, time_s: float,
                  prefill_s: float) -> dict[str, float]:
    """All ``rollout/*`` statistics of one rollout (``truncated``: per-response bool, cut by the token budget)."""
    x = np.asarray(lengths)
    out = {"rollout/num_sequences": float(x.size), "rollout/tokens": float(x.sum()), "rollout/time_s": time_s,
           "rollout/prefill_s": prefill_s, "rollout/iterations": float(len(iter_time)),
           "rollout/tokens_per_s": float(x.sum() / time_s) if time_s > 0 else 0.0,
           "rollout/truncated_frac": float(np.mean(truncated))}
    out.update(length_stats(x))
    out["rollout/tail_time_frac_10"] = tail_time_share(iter_time, active, total_rows, 0.10)
    out["rollout/tail_time_frac_25"] = tail_time_share(iter_time, active, total_rows, 0.25)
    return out


def spec_stats(timeline: dict) -> dict[str, float]:
    """``spec/*`` statistics of a rollout from its timeline (empty when no iteration was an SD step)."""
    strategy = np.asarray(timeline["strategy"])
    on = strategy != "off"
    if not on.any():
        return {"spec/steps": 0.0, "spec/time_frac": 0.0}
    active = np.asarray(timeline["active"], dtype=np.float64)[on]
    iter_time = np.asarray(timeline["iter_time"], dtype=np.float64)
    hist = np.asarray(timeline["accept_hist"])[on].sum(0).astype(np.float64)
    rows = hist.sum()
    out = {"spec/steps": float(on.sum()), "spec/time_frac": float(iter_time[on].sum() / max(iter_time.sum(), 1e-12)),
           "spec/accept_len_mean": float((np.asarray(timeline["accepted"])[on].sum() + active.sum()) / active.sum()),
           "spec/draft_time_s": float(np.asarray(timeline["draft_s"])[on].sum()),
           "spec/verify_time_s": float(np.asarray(timeline["verify_s"])[on].sum())}
    for d in range(1, len(hist)):
        out[f"spec/accept_ge_{d}"] = float(hist[d:].sum() / rows) if rows else 0.0
    return out


def long_tail_report(stats: dict, lengths, workers: int, rewards=None) -> dict:
    """A rollout's ``rollout/*`` stats plus the W-worker idle estimate and, given rewards, ``rl/*``."""
    out = dict(stats)
    out["sched/workers"] = float(workers)
    out["sched/idle_frac"] = split_idle_fraction(lengths, workers)
    out["sched/empty_slot_frac"] = empty_slot_fraction(lengths)
    if rewards is not None:
        r = np.asarray(rewards, dtype=np.float64)
        out["rl/reward_mean"] = float(r.mean())
        out["rl/accuracy"] = float((r >= 1.0).mean())
    return out
