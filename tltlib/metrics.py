"""The metric vocabulary: every statistic tltlib returns is keyed by one of :data:`METRICS` (namespaced
``rollout/``, ``spec/``, ``drafter/``, ``sched/``, ``rl/``, ``update/``, ``time/``, ``eval/``, ``e2e/``,
``adaptive/``, ``alarm/``); notebooks write them to ``metrics.json``, ``train-grpo`` to ``metrics.jsonl``, and tests
read them back (:func:`is_metric`). The statistics themselves are computed in :mod:`tltlib.stats` (rollouts) and by the
components that own them.

Departures: none (a vocabulary).
"""
from __future__ import annotations

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
    "rollout/graph_fallbacks": "CUDA graph captures that failed during the rollout: those row/span buckets ran eagerly "
                               "(each also a RuntimeWarning; 0 when every graphed forward replays)",
    "sched/idle_frac": "share of the workers' rollout time spent idle, waiting for the last worker (measured by the "
                       "scheduler; the step-count model in stats.split_idle_fraction)",
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
    "adaptive/whatif_speedup": "the what-if simulator's speedup over no SD at the measured run's own settings "
                               "(beside adaptive/speedup_vs_no_sd: the gap is the simulator's error)",
    "spec/ngram_match_rate": "share of n-gram draft requests that found an earlier occurrence of the suffix",
    "spec/suffix_match_rate": "share of suffix-drafter requests that found a recurring suffix (a non-empty tree)",
    "spec/suffix_nodes": "draft nodes the suffix drafter proposed per request (before padding to the budget)",
    "spec/chi2_pvalue": "chi-square p-value of plain vs speculative samples (large = same distribution)",
    "spec/toy_alpha": "notebook 02's toy: the chance a draft is kept, sum of min(p, q)",
    "spec/toy_chi2_pvalue": "notebook 02's toy: chi-square p-value of tokens drawn by Leviathan's rule against p",
    "spec/traced_rejection_step": "notebook 02: the traced SD step with the first rejection (-1: none)",
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
    "drafter/version": "the drafter's weight version: +1 each time the drafter the rollout drafts with is replaced by "
                       "a trained one (once per RL step in which it trained: after the one-process micro-steps, or "
                       "when the workers' drafters are merged), whatever the number of workers or micro-steps",
    "drafter/buffer_pairs": "(hidden, token) pairs held in the drafter's buffer",
    "drafter/micro_steps": "drafter micro-steps this worker ran in the RL step (after the rollout, or the spot "
                           "trainer's in the idle window): the online drafter's compute",
    "drafter/trained": "1 when the drafter the rollout drafts with was replaced by a trained one in this RL step",
    "drafter/accept_vs_best": "accept length of the step's learned-drafter SD steps over its reference, "
                              "row-weighted over strategies: drafter_train on_drift's anchor while learning, its "
                              "bests while resting (it trains under 1 - drift_margin); always's best (nan: nothing "
                              "to compare)",
    "drafter/learning": "1 while drafter_train: on_drift is in a learning phase (the drafter trains every step until "
                        "its acceptance plateaus)",
    "alarm/accept_floor": "1 in the step the accept-length alarm fired: the learned drafter's SD steps accepted "
                          "fewer tokens per row than the floor over the last patience SD steps",
    "alarm/sd_slower": "1 in the step the speed alarm fired: consecutive SD steps ran slower than plain decoding at "
                       "their rows (under slower_ratio)",
    "alarm/drafter_stale": "1 in the step the stale-drafter alarm fired: the policy changed but the drafter's version "
                           "did not although the online drafter was due to train",
    "alarm/drafter_mismatch": "1 in the step the mismatch alarm fired: after a sync or merge the drafter the engine "
                              "drafts with does not hold the trained weights (fingerprints differ)",
    "alarm/floor": "the accept-length floor the accept_floor alarm compares with (tokens per row per SD step)",
    "update/tokens": "tokens through the policy's forward and backward (all iterations)",
    "update/padding_frac": "share of the update's forward tokens that were padding",
    "update/tokens_per_s": "update tokens per second",
    "update/weights_moved": "share of the policy's weights the step's AdamW update changed (a bf16/fp16 policy: "
                            "AdamW steps float32 master weights, whose rounding it decodes with; 0 for a float16 step "
                            "skipped on overflow; nan for a float32 policy, its own master)",
    "time/rollout_s": "RL step phase: rollout (s)",
    "time/reward_s": "RL step phase: rewards and advantages (s)",
    "time/logprob_s": "RL step phase: reference / old-policy log-probabilities (s)",
    "time/update_s": "RL step phase: policy update (s)",
    "time/drafter_s": "RL step phase: drafter training (s)",
    "time/weight_sync_s": "seconds copying the policy's weights from the trainer's model into the rollout's (the TRL "
                          "rollout: once per optimizer step)",
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


def is_metric(key: str) -> bool:
    """Whether ``key`` belongs to the vocabulary (``rl/reward/<function>`` keys are open-ended)."""
    return key in METRICS or key.startswith("rl/reward/")
