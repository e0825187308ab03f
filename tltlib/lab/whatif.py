"""Notebook 04's what-if explorer: what another SD threshold, arm set or tuner rule would have done to the rollout this
machine just measured, answered in milliseconds by the adaptive controller itself (its switch, tuner and rule:
:class:`tltlib.rollout.adaptive.AdaptiveController`) deciding over a simulated rollout: the measured response lengths,
the measured cost model's forward times, the drafter's acceptance per depth as the measured run found it.

The simulated rollout advances every running row together (as :func:`tltlib.sim.simulate.simulate_rollout`): a plain
iteration emits one token per row, an SD step the arm's expected tokens under that acceptance
(:func:`tltlib.spec.acceptance.expected_tokens`); while more rows run than the threshold allows, plain iterations are
counted in one stretch up to the next response end; under it every iteration asks the controller for its strategy,
takes the cost model's time for it (times a seeded log-normal noise, the spread of real rewards) and reports it back
with the rows' expected histogram of accepted drafts, as the engine reports a real iteration. The answer is the
median over a few seeds.

Paper: TLT §5.2 (the adaptive switch and BEG-MAB); the same cost model the tuner's prior and the simulator read.

Departures: expected tokens per step, not sampled acceptances (a rollout's luck is not modelled); the rows stay at
one length (the ragged attention after an SD step, which the engine pays, is not charged); the catch-up is charged
through the controller's switch cost and the cost model's SD step.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from ..errors import BadInput
from ..rollout.adaptive import AdaptiveConfig, AdaptiveController, TunerConfig
from ..sim.costs import iteration_time
from ..spec.acceptance import expected_tokens
from ..spec.strategy import OFF, SpecStrategy


def accepted_histogram(rates: Sequence[float], depth: int, rows: int) -> np.ndarray:
    """``[depth + 1]`` expected rows accepting exactly k drafts of a chain of ``depth``, each depth d kept with
    probability ``rates[d - 1]`` given d - 1 was (the last rate repeats)."""
    rates = (list(rates) + [rates[-1]] * depth)[:depth]
    reach = np.cumprod([1.0] + rates)                     # reach[k]: chance of accepting at least k drafts
    exact = reach[:-1] * (1 - np.asarray(rates))
    return rows * np.append(exact, reach[-1])


def _family_rates(acceptance: dict, arm: SpecStrategy) -> list[float]:
    return acceptance["ngram" if arm.kind in ("ngram", "suffix") else "learned"]


def simulate_adaptive(costs, lengths: Sequence[int], prompt_len: int, config: AdaptiveConfig, acceptance: dict,
                      seed: int = 0, noise: float = 0.1, controller: AdaptiveController | None = None) -> dict:
    """One simulated rollout of responses of ``lengths`` under ``config`` (threshold, tuner arms and rule) with the
    cost model ``costs`` and the acceptance per depth ``acceptance`` (``{"learned": rates, "ngram": rates}``);
    ``controller``: one that already tuned (earlier rollouts), else a new one. Returns ``time_s``, ``timeline``
    ([(seconds, running rows, strategy name)] per iteration or stretch), ``played`` (SD iterations per arm) and
    the ``controller``."""
    lengths = np.sort(np.asarray(lengths, dtype=np.float64))
    if lengths.size == 0 or prompt_len < 1:
        raise BadInput("a simulated rollout needs at least one response length and a prompt of 1+ tokens")
    ctl = controller or AdaptiveController(config, costs)
    g = np.random.default_rng(seed)
    n, t, gen, done, since_sd = lengths.size, 0.0, 0.0, 0, 0
    out = {"timeline": [], "played": Counter()}
    while done < n:
        active = n - done
        context = prompt_len + gen
        if active > config.threshold:                                # plain up to the next response end
            k = max(1, math.ceil(lengths[done] - gen))
            t += k * iteration_time(costs, active, context + k / 2, OFF)
            gen, since_sd = gen + k, since_sd + k
            out["timeline"].append((t, active, "off"))
        else:
            arm = ctl.choose(0, active, backlog=since_sd + 1)
            tokens = 1.0 if not arm.enabled else expected_tokens(arm, _family_rates(acceptance, arm))
            seconds = iteration_time(costs, active, context, arm) * math.exp(g.normal(0.0, noise))
            hist = accepted_histogram(_family_rates(acceptance, arm), arm.depth, active) \
                if arm.kind in ("chain", "ngram") else None
            ctl.observe(arm, active, tokens * active, seconds, context=context, accepted=hist)
            t, gen = t + seconds, gen + tokens
            since_sd = since_sd + 1 if not arm.enabled else 0
            out["played"][arm.name] += arm.enabled
            out["timeline"].append((t, active, arm.name))
        done = int(np.searchsorted(lengths, gen, side="right"))
    return {**out, "time_s": t, "controller": ctl}


def simulate_plain(costs, lengths: Sequence[int], prompt_len: int) -> float:
    """Seconds of the same rollout without SD (every iteration plain)."""
    return simulate_adaptive(costs, lengths, prompt_len, AdaptiveConfig(threshold=0), {"learned": [0.0],
                                                                                       "ngram": [0.0]})["time_s"]


def what_if(costs, lengths: Sequence[int], prompt_len: int, threshold: int, arms: Sequence[str], rule: str,
            acceptance: dict, tuning: int = 1, seeds: int = 3, noise: float = 0.1) -> dict:
    """The adaptive rollout of ``lengths`` at ``threshold`` with the tuner's ``arms`` and ``rule``, after ``tuning``
    simulated rollouts that taught its controller (as earlier RL steps do), for ``seeds`` seeds: ``adaptive_s``
    (median seconds), ``plain_s``, ``speedup`` (plain over adaptive), ``sd_share`` (share of the adaptive rollout's
    time in SD steps), ``played`` (SD iterations per arm, summed over seeds) and one seed's ``timeline``."""
    if threshold < 0 or seeds < 1 or tuning < 0:
        raise BadInput(f"what_if needs threshold >= 0, seeds >= 1 and tuning >= 0, got {threshold}, {seeds}, "
                       f"{tuning}")
    if not arms:
        raise BadInput("what_if needs at least one arm (off is always among them)")
    plain = simulate_plain(costs, lengths, prompt_len)
    runs, played = [], Counter()
    for s in range(seeds):
        config = AdaptiveConfig(threshold=threshold, tuner=TunerConfig(arms=tuple(arms), rule=rule, seed=s))
        ctl = None
        for k in range(tuning):
            ctl = simulate_adaptive(costs, lengths, prompt_len, config, acceptance, 1000 * s + k + 1, noise,
                                    ctl)["controller"]
        runs.append(simulate_adaptive(costs, lengths, prompt_len, config, acceptance, 1000 * s, noise, ctl))
        played.update(runs[-1]["played"])
    times = [r["time_s"] for r in runs]
    mid = runs[int(np.argsort(times)[len(times) // 2])]
    sd = sum(b[0] - a[0] for a, b in zip([(0.0, 0, "")] + mid["timeline"], mid["timeline"]) if b[2] != "off")
    return {"adaptive_s": float(np.median(times)), "plain_s": plain, "speedup": plain / float(np.median(times)),
            "sd_share": sd / mid["time_s"], "played": dict(played), "timeline": mid["timeline"]}
