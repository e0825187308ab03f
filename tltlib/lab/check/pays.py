"""Does SD pay on this machine: each arm's measured speed against plain decoding at a few running-row counts, the
cost model's prediction at the rows between (from the acceptance measured here), the SD threshold and arms that
follow, and the tuner prior file the engine and ``train-grpo`` start from (``tlt.prior``).

Paper: TLT §5.2 (the SD switch at a batch-size threshold, the tuner's arms per batch-size bucket).
Departures: the paper picks its threshold on its GPUs; here it is what this machine measured.
"""
from __future__ import annotations

import numpy as np

from ...model.sampling import SamplingConfig
from ...rollout.adaptive import AdaptiveConfig, AdaptiveController, timed_rollout
from ...rollout.bandit import TunerConfig
from ...rollout.engine import RolloutConfig, RolloutEngine
from ...rollout.prior import save_prior
from ...sim.costs import predicted_speedup
from ...sim.measure import measure_costs
from ...spec.strategy import OFF, FixedStrategy, SpecStrategy
from .config import CheckConfig, Verdict

PAYS = 1.02
"""A speedup counts as paying above this (2% over plain: less is within a rollout's timing noise)."""


class Recorder(FixedStrategy):
    """A fixed strategy that keeps what its SD steps accepted (the histograms the tuner's acceptance reads)."""

    def __init__(self, strategy: SpecStrategy):
        super().__init__(strategy)
        self.hist = np.zeros(strategy.depth + 1)

    def observe(self, strategy, active, tokens, seconds, rows, context=None, accepted=None) -> None:
        if accepted is not None and strategy.enabled:
            h = np.asarray(accepted, dtype=np.float64)
            self.hist[: h.size] += h[: self.hist.size]


def default_arms(drafter) -> tuple[SpecStrategy, ...]:
    names = (("chain-4", "tree-4x2-8") if drafter is not None else ()) + ("ngram-4", "suffix-4-8")
    return tuple(SpecStrategy.parse(n) for n in names)


def _rate(res, seconds: float) -> float:
    """Tokens per second of a timed rollout."""
    return float(res.lengths.sum()) / seconds


def speedups_at(model, drafter, prompts, rows: int, arms, cfg: CheckConfig, rounds: int = 2):
    """({arm: median over ``rounds`` of its speed over plain decoding's in the same round}, {arm: recorder}) of
    ``rows`` rows decoding ``cfg.pay_tokens`` tokens each (EOS ignored, so every row runs to the end) with the arm
    at every iteration; the arms run interleaved with plain decoding after a warm-up round, so a machine whose speed
    drifts shifts both sides of each ratio."""
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, max_new_tokens=cfg.pay_tokens)
    batch = [prompts[i % len(prompts)] for i in range(rows)]
    engines = {a.name: RolloutEngine(model, RolloutConfig(sampling, ignore_eos=True),
                                     drafter=drafter if a.uses_drafter else None) for a in (OFF, *arms)}
    recorders = {a.name: Recorder(a) for a in arms}
    ratios: dict = {a.name: [] for a in arms}
    for r in range(rounds + 1):
        plain = _rate(*timed_rollout(engines[OFF.name], batch, None, cfg.seed + r))
        for a in arms:
            rate = _rate(*timed_rollout(engines[a.name], batch, recorders[a.name], cfg.seed + r))
            if r:                                    # round 0 is the warm-up
                ratios[a.name].append(rate / plain)
    return {a: float(np.median(v)) for a, v in ratios.items()}, recorders


def measure_speedups(model, drafter, prompts, cfg: CheckConfig) -> tuple[dict, dict]:
    """({rows: {arm: measured speedup over plain}}, {arm: accepted-drafts histogram}) on this machine."""
    arms = tuple(SpecStrategy.parse(a) for a in cfg.arms) or default_arms(drafter)
    speed, hists = {}, {a.name: np.zeros(a.depth + 1) for a in arms}
    for rows in cfg.rows:
        speed[rows], recorders = speedups_at(model, drafter, prompts, rows, arms, cfg)
        for name, rec in recorders.items():
            hists[name] = hists[name] + rec.hist
    return speed, hists


def acceptance_rates(hist: np.ndarray) -> list[float]:
    """Chance of accepting depth d given depth d-1 was, d = 1..D, from a histogram of rows by accepted drafts."""
    at_least = hist[::-1].cumsum()[::-1]
    return [float(at_least[d + 1] / at_least[d]) if at_least[d] > 0 else 0.0 for d in range(hist.size - 1)]


def recommend(measured: dict, predicted: dict) -> tuple[int, tuple[str, ...]]:
    """(threshold, arms): the most running rows at which some arm pays (measured where measured, else the cost
    model's prediction; 0 when none does: keep SD off), and ``off`` plus every arm that pays somewhere."""
    table = {**predicted, **measured}
    paying = {r: [a for a, s in arms.items() if s > PAYS] for r, arms in table.items()}
    threshold = max((r for r, arms in paying.items() if arms), default=0)
    arms = sorted({a for arms in paying.values() for a in arms})
    return threshold, ("off", *arms)


def predict(costs, hists: dict, rows) -> dict:
    """{rows: {arm: the cost model's predicted speedup}} with each arm's measured acceptance."""
    out = {}
    for r in rows:
        out[r] = {name: predicted_speedup(costs, SpecStrategy.parse(name), r, acceptance_rates(h) or [0.0])
                  for name, h in hists.items()}
    return out


def pays(model, drafter, prompts, cfg: CheckConfig, prior_path=None, accept_floor: float | None = None
         ) -> tuple[list[Verdict], dict]:
    """The verdicts of the speed part and what it measured; writes the tuner prior file at ``prior_path`` (with
    ``accept_floor``, the alarm floor the drafter part measured, when given)."""
    measured, hists = measure_speedups(model, drafter, prompts, cfg)
    costs = measure_costs(model, drafter, max_batch=max(cfg.rows))
    grid = sorted(set(int(r) for r in costs.rows) | set(cfg.rows))
    predicted = predict(costs, hists, grid)
    threshold, arms = recommend(measured, predicted)
    verdicts = []
    for rows, by_arm in measured.items():
        best = max(by_arm, key=by_arm.get)
        ok = by_arm[best] > PAYS
        verdicts.append(Verdict("pays", f"speed at {rows} rows", "pass" if ok else "warn",
                                f"{rows} running rows: best {best} {by_arm[best]:.2f}x plain"
                                + ("" if ok else " (SD does not pay here)") + "; "
                                + ", ".join(f"{a} {s:.2f}x" for a, s in by_arm.items()), dict(by_arm)))
    verdicts.append(Verdict("pays", "recommendation", "info" if threshold else "warn",
                            f"tlt.threshold: {threshold}, tlt.arms: [{', '.join(arms)}]" if threshold else
                            "no arm pays at any measured row count: keep tlt.speculative: off on this machine",
                            {"threshold": threshold, "arms": list(arms)}))
    if prior_path is not None and threshold:
        ctl = AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(arms=arms)), costs,
                                 drafter if any(SpecStrategy.parse(a).uses_drafter for a in arms) else None)
        for name, h in hists.items():
            family = "learned" if SpecStrategy.parse(name).uses_drafter else "ngram"
            if SpecStrategy.parse(name).kind in ("chain", "ngram"):
                ctl.accept[family].update(h)
        save_prior(prior_path, ctl, model, drafter, recommended={"threshold": threshold, "arms": list(arms),
                                                                 "accept_floor": accept_floor})
        verdicts.append(Verdict("pays", "tuner prior", "info", f"tuner prior file written: {prior_path} "
                                "(tlt.prior in a train-grpo job)", {"path": str(prior_path)}))
    elif prior_path is not None:                  # asked for, not written: said, never a silent rc 0
        verdicts.append(Verdict("pays", "tuner prior", "warn", f"tuner prior file NOT written to {prior_path}: no "
                                "arm pays at any measured row count, so there is no threshold or arm to start a "
                                "tuner from (keep tlt.speculative: off here)", {"path": None}))
    data = {"measured": {str(k): v for k, v in measured.items()},
            "predicted": {str(k): v for k, v in predicted.items()}, "threshold": threshold, "arms": list(arms)}
    return verdicts, data
