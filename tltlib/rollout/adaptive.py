"""The adaptive rollout engine's control: SD on/off by the running batch size, the tuner that picks the SD strategy
(:mod:`tltlib.rollout.bandit`) per batch size, and the measured cost model that gives it a prior and a scale.

* **The switch.** SD may run only while at most ``threshold`` rows are still generating (the tail); above it every
  decode iteration is plain. Switching on costs no re-prefill: the drafter catches up on its backlog of the target's
  hidden states (:mod:`tltlib.spec.step`). It is re-evaluated every iteration, so SD switches back off if rows grow.
* **The tuner.** Below the threshold a bucketed bandit chooses among the arms, no SD (``off``) always among them, so
  it can fall back to plain decoding wherever SD loses (a weak or stale drafter, too many rows for this device).
  Switching from plain decoding to a drafter arm costs the drafter's catch-up over its backlog once: the tuner is
  charged it, amortised over ``switch_horizon`` steps, when it chooses (not in the arm's reward), so it does not
  explore a doubtful arm at the price of a long catch-up.
  Reward = tokens per second of the decode iteration over plain decoding's tokens per second at that batch size and
  mean context (from the cost model), i.e. the iteration's speedup; this makes rewards from different batch sizes
  and contexts of one bucket comparable. Tokens are counted per row over the rows that keep running: a response's
  last iteration emits only what was left of it, whatever the arm.
* **The prior.** :func:`tltlib.sim.measure.measure_costs` times target forwards of B rows x T tokens (at a short and
  a long cached context) and drafter forwards on the real models (the cost model the simulator reads too); with the
  acceptance per draft depth it predicts each arm's speedup (:func:`tltlib.sim.costs.predicted_speedup`): the tuner's
  prior. The acceptance starts from ``accept_prior`` and then follows what chain SD steps measure, depth by depth, per
  drafter family and batch-size bucket (a bucket's own measurement shrunk towards the family's: the tail's rows are late
  in their responses, where a drafter can be worse than early on). While the rows are at one length, an SD step is also
  charged the masked attention every later plain step pays once it has left them ragged.
  :func:`tltlib.rollout.prior.save_prior` / :func:`~tltlib.rollout.prior.load_prior` keep the costs and the measured
  acceptance for the next run on the same model and machine.
* **Drafter changes.** When the learned drafter's weights change (``drafter.version`` moves) the evidence of the
  arms that use it, and their measured acceptance, keep ``tuner.discount`` of their weight (``"discount"``), or are
  erased (``"reset"``), or kept whole (``"keep"``).

Timing adds no device synchronisation beyond the engine's own: rewards use host timestamps taken at the
per-iteration sync the engine already needs to retire finished rows, and iteration k's reward is used from k+1 on.

Paper: TLT §5.2 (Algorithm 1, BEG-MAB; thresholds [1, 2, 5, 21], epsilon 0.1, window 300, SD at <= 32 requests on
H100). Reference: SGLang fork ``eagle_mab.py`` / ``scheduler.py``. Departures: see :mod:`tltlib.rollout.bandit`; and the
switch is two-way and needs no re-prefill (the reference latches SD on after 10 small batches and re-prefills
every running request).
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import BadInput
from ..sim.costs import MeasuredCosts, iteration_time, plain_rate, predicted_speedup, switch_cost
from ..spec.strategy import OFF, SpecStrategy, StrategySource
from .bandit import BEGMAB, DEFAULT_ARMS, PRIOR_REFRESH, Bandit, TunerConfig

__all__ = ["BEGMAB", "DEFAULT_ARMS", "Bandit", "TunerConfig", "AdaptiveConfig", "AdaptiveController",
           "default_threshold", "timed_rollout"]

# SD on/off threshold (running rows) by device type. CPU: bench/speculative.py measured that SD with the shipped warm
# drafter pays at every batch size it tried (up to 512, the GRPO batch of notebook 04), so the tail switch is set at
# 512 (with a weak drafter or a large model the tuner's ``off`` arm wins where SD does not pay). CUDA: the paper's
# 32 (H100, 7B-70B models); not measured here.
DEFAULT_THRESHOLD = {"cpu": 512, "cuda": 32}


def default_threshold(device: str | torch.device) -> int:
    """The SD switch threshold for a device type (see :data:`DEFAULT_THRESHOLD`)."""
    return DEFAULT_THRESHOLD.get(torch.device(device).type, 32)


# ------------------------------------------------------------------------------------------------ acceptance
class DepthAcceptance:
    """The measured chance of accepting draft depth d given depth d-1 was, for one drafter family: counts of rows
    that reached each depth and accepted it, from chain steps' histograms of accepted drafts, with ``prior`` (rates
    by depth, the last repeating) worth ``weight`` rows per depth."""

    def __init__(self, prior: Sequence[float], weight: float = 4.0, depth: int = 32):
        self.configured = [float(a) for a in prior]
        self.prior = list(self.configured)       # the configured rates, or the estimate when last discounted
        self.weight = weight
        self.reached = np.zeros(depth)
        self.accepted = np.zeros(depth)

    def update(self, hist: np.ndarray) -> None:
        """Add a chain step's histogram: ``hist[k]`` rows accepted exactly k drafts (k = 0..D)."""
        hist = np.asarray(hist, dtype=np.float64)
        at_least = hist[::-1].cumsum()[::-1]             # at_least[k]: rows that accepted >= k drafts
        d = min(hist.size - 1, self.reached.size)        # depths beyond the table are not tracked
        self.reached[:d] += at_least[:d]
        self.accepted[:d] += at_least[1: d + 1]

    def discount(self, keep: float) -> None:
        """Keep ``keep`` of the evidence's weight (a new drafter version): the estimate stays where it was and only
        its confidence drops, so new chain steps move it faster (the prior is re-anchored so that the kept counts
        shrunk towards it give today's rates; a discount that did not re-anchor would pull a measured rate back to
        the configured prior, e.g. a stale drafter's 0.3 towards an optimistic 0.8, and re-explore deep chains after
        every version). ``keep = 0`` erases it: back to the configured prior."""
        if keep <= 0:
            self.prior = list(self.configured)
        elif self.weight > 0:                    # the prior p' with (keep a + w p') / (keep r + w) = today's rate
            rates, w = self.rates(), self.weight
            n = min(len(rates), self.reached.size)
            self.prior = [float((rates[i] * (keep * self.reached[i] + w) - keep * self.accepted[i]) / w)
                          for i in range(n)]
        self.reached *= keep
        self.accepted *= keep

    def rates(self, depth: int | None = None, prior: Sequence[float] | None = None) -> list[float]:
        """Rates for depths 1..``depth`` (default: every depth measured, at least the prior's); ``prior``: rates to
        shrink towards instead of the configured ones (e.g. the family's over all batch sizes)."""
        prior = self.prior if prior is None else list(prior)
        n = depth or max(len(prior), int((self.reached > 0).sum()))
        prior = (prior + [prior[-1]] * n)[:n]
        return [float((self.accepted[i] + self.weight * prior[i]) / (self.reached[i] + self.weight))
                for i in range(n)]

    def state_dict(self) -> dict:
        return {"reached": self.reached.tolist(), "accepted": self.accepted.tolist(), "prior": list(self.prior)}

    def load_state_dict(self, d: dict) -> None:
        self.reached[:], self.accepted[:] = d["reached"], d["accepted"]
        self.prior = [float(a) for a in d.get("prior", self.configured)]


# ------------------------------------------------------------------------------------------------ controller
@dataclass(frozen=True)
class AdaptiveConfig:
    """The adaptive engine: when SD may run, and how its strategy is tuned."""

    threshold: int = 32
    """SD may run while at most this many rows are generating (see :func:`default_threshold`)."""
    tuner: TunerConfig = field(default_factory=TunerConfig)
    """The tuner's arms (``off`` always among them), buckets and rule."""
    on_drafter_change: str = "discount"
    """When the drafter's version changes (the online drafter trained): ``"discount"`` keeps ``tuner.discount`` of
    the weight of the evidence of the arms that use it (rewards and measured acceptance), so the tuner re-checks
    them without starting over; ``"reset"`` erases it (the arms are re-explored); ``"keep"`` keeps it whole."""
    accept_prior: tuple[float, ...] = (0.8,)
    """Acceptance per draft depth assumed by the cost-model prior for learned-drafter arms until chain steps
    measure it (last value repeats)."""
    ngram_accept_prior: float = 0.3
    """Acceptance per depth assumed by the prior for n-gram arms."""
    switch_horizon: float = 16.0
    """SD steps a switch from plain decoding to a drafter arm is expected to last. The first such step pays the
    drafter's catch-up over its backlog (every row's tokens since the last SD step): the tuner charges a drafter
    arm ``log(1 + catch-up / (switch_horizon x the arm's step time))`` when it chooses (needs a cost model), so a
    doubtful arm is not explored at the price of a long catch-up. 0 = switching is free."""

    def accept_for(self, arm: SpecStrategy) -> tuple[float, ...] | float:
        """The acceptance the cost-model prior assumes for ``arm`` before any is measured."""
        return self.ngram_accept_prior if arm.kind == "ngram" else self.accept_prior

    def __post_init__(self):
        if self.threshold < 0:
            raise BadInput(f"threshold must be >= 0 running rows (0 = SD never on), got {self.threshold}")
        if not self.accept_prior or not all(0.0 <= a <= 1.0 for a in self.accept_prior):
            raise BadInput(f"accept_prior must hold rates in [0, 1], got {self.accept_prior}")
        if not self.switch_horizon >= 0:
            raise BadInput(f"switch_horizon must be >= 0 SD steps (0 = switching to SD is charged nothing), got "
                           f"{self.switch_horizon}")
        if not 0.0 <= self.ngram_accept_prior <= 1.0:
            raise BadInput(f"ngram_accept_prior must be in [0, 1], got {self.ngram_accept_prior}")
        if self.on_drafter_change not in ("discount", "reset", "keep"):
            raise BadInput(f"on_drafter_change must be 'discount', 'reset' or 'keep', got "
                           f"{self.on_drafter_change!r}")


def iteration_speedup(costs, active: int, tokens: int, seconds: float, rows: int | None = None,
                      context: float | None = None) -> float | None:
    """The tuner's reward of a decode iteration that ran ``active`` rows for ``seconds``, the ``rows`` of them that
    keep running (default: all) emitting ``tokens``: the batch's tokens per second had every row yielded as many as
    they did on average, over plain decoding's at ``active`` rows and ``context`` under ``costs`` (None: the rate
    itself); None when the iteration is no evidence (no time, or every row ended in it)."""
    rows = active if rows is None else rows
    if seconds <= 0 or rows < 1:
        return None
    rate = tokens / rows * active / seconds
    return rate / plain_rate(costs, active, context) if costs is not None else rate


def _family(arm: SpecStrategy) -> str:
    return "ngram" if arm.kind in ("ngram", "suffix") else "learned"


class AdaptiveController(StrategySource):
    """The engine's strategy source (``RolloutEngine.generate(..., strategy=controller)``): the batch-size switch
    plus the tuner. Keep one controller across rollouts so the tuner keeps learning.

    Args:
        config: :class:`AdaptiveConfig`.
        costs: the cost model (:class:`tltlib.sim.costs.MeasuredCosts`, or a :class:`~tltlib.sim.costs.Roofline`):
            the prior and the rewards' scale; None = raw tokens/s rewards, no prior.
        drafter: the learned drafter whose ``version`` is watched (see ``on_drafter_change``).
    """

    wants_context = True                          # rewards are normalised by the plain rate at the mean context
    wants_backlog = True                          # a drafter arm is charged the catch-up over the pending backlog

    def __init__(self, config: AdaptiveConfig | None = None, costs: MeasuredCosts | None = None, drafter=None):
        self.config = config or AdaptiveConfig()
        learned = sorted({a.name for arms in self.config.tuner.arms_per_bucket() for a in arms if a.uses_drafter})
        if learned and costs is not None and not getattr(costs, "draft_s", True):
            raise BadInput(f"the tuner's arms {learned} draft with the learned drafter but the cost model has no "
                           "drafter timings: measure it with the drafter (measure_costs(model, drafter)), or keep "
                           "only off and model-free arms (ngram-D, suffix-D-N)")
        self.costs = costs
        self.drafter = drafter
        self.tuner = Bandit(self.config.tuner, prior=self._prior if costs is not None else None)
        self._version = getattr(drafter, "version", None)
        self._tuned = False                       # whether the last choice came from the tuner
        self._context: float | None = None       # mean context of the running rows at the last observation
        self._step_s: dict = {}                   # batch -> (choice computed at, drafter arms' step seconds)
        self._choices = 0
        self.accept = {"learned": DepthAcceptance(self.config.accept_prior),
                       "ngram": DepthAcceptance((self.config.ngram_accept_prior,))}
        # (family, bucket) -> acceptance measured at that bucket's batch sizes, shrunk towards the family's: where
        # rows are few the responses are late in their text, where a drafter may be worse (one trained on short
        # answers), so one acceptance for all buckets would keep the prior of the tail optimistic
        self.bucket_accept: dict[tuple[str, int], DepthAcceptance] = {}
        self.log: dict[str, list] = {"active": [], "arm": [], "reward": [], "tokens_per_s": []}
        self.resets = 0

    @property
    def alpha(self) -> dict[str, list[float]]:
        """The acceptance per depth the prior uses now, by drafter family."""
        return {f: a.rates() for f, a in self.accept.items()}

    def state_dict(self) -> dict:
        """The tuner, the measured acceptance, the drafter version seen and the log (JSON-able)."""
        return {"tuner": self.tuner.state_dict(), "accept": {f: a.state_dict() for f, a in self.accept.items()},
                "bucket_accept": {f"{f}:{b}": a.state_dict() for (f, b), a in self.bucket_accept.items()},
                "version": self._version, "resets": self.resets, "log": {k: list(v) for k, v in self.log.items()}}

    def load_state_dict(self, d: dict) -> None:
        self.tuner.load_state_dict(d["tuner"])
        for f, a in self.accept.items():
            a.load_state_dict(d["accept"][f])
        self.bucket_accept = {}
        for key, state in d.get("bucket_accept", {}).items():
            f, b = key.rsplit(":", 1)
            self._bucket_acceptance(f, int(b)).load_state_dict(state)
        self._version, self.resets = d["version"], d["resets"]
        self.log = {k: list(v) for k, v in d["log"].items()}

    def _bucket_acceptance(self, family: str, bucket: int) -> DepthAcceptance:
        key = (family, bucket)
        if key not in self.bucket_accept:
            self.bucket_accept[key] = DepthAcceptance(self.accept[family].prior)
        return self.bucket_accept[key]

    def acceptance(self, arm: SpecStrategy, batch: int) -> list[float]:
        """The acceptance per depth the prior assumes for ``arm`` at ``batch`` rows: what chain steps measured in
        that batch-size bucket, shrunk towards the family's over all buckets (worth 4 rows per depth)."""
        family, depth = _family(arm), max(arm.depth, 1)
        overall = self.accept[family].rates(depth)
        local = self.bucket_accept.get((family, self.tuner.bucket(batch)))
        return overall if local is None else local.rates(depth, prior=overall)

    def _prior(self, arm: SpecStrategy, batch: int) -> float:
        return predicted_speedup(self.costs, arm, batch, self.acceptance(arm, batch), self._context)

    def switch_charge(self, active: int, backlog: int, uniform_left: int = 0) -> dict:
        """Per SD arm, the log-reward charged for switching to it now, amortised over ``switch_horizon`` steps: a
        drafter arm's first step catches up on ``backlog`` entries per row; and while the rows are at one length
        (``uniform_left``: the plain steps the longest of them may still take; 0 once they are not), any SD step
        leaves them at unequal lengths for the rest of the rollout, each later plain step paying the masked
        attention (:meth:`tltlib.sim.costs.MeasuredCosts.ragged_extra`). Empty without a cost model, a horizon, or
        anything to charge."""
        h = self.config.switch_horizon
        if self.costs is None or not h or (backlog <= 1 and uniform_left <= 0):
            return {}
        hit = self._step_s.get(active)
        if hit is None or self._choices - hit[0] >= PRIOR_REFRESH:  # the context moves slowly: cache like the prior
            steps = {a: iteration_time(self.costs, active, self._context, a)
                     for a in self.tuner.bucket_arms[self.tuner.bucket(active)] if a.enabled}
            hit = self._step_s[active] = (self._choices, steps)
        catch_up = switch_cost(self.costs, active, self._context, backlog)
        ragged = self.costs.ragged_extra(active) * uniform_left if uniform_left > 0 else 0.0
        charge = {}
        for arm, t in hit[1].items():
            extra = ragged + (catch_up if arm.uses_drafter else 0.0)
            if extra > 0:
                charge[arm] = math.log1p(extra / (h * t))
        return charge

    def choose(self, iteration: int, active: int, backlog: int = 0, uniform_left: int = 0) -> SpecStrategy:
        """The strategy of the next decode iteration at ``active`` running rows; ``backlog``: the entries per row
        the drafter must catch up on before an SD step; ``uniform_left``: while the running rows are at one length,
        the plain steps the longest may still take, else 0 (the engine's; see :meth:`switch_charge`)."""
        self._tuned = active <= self.config.threshold
        if not self._tuned:
            return OFF
        self._choices += 1
        version = getattr(self.drafter, "version", None)
        if version != self._version:
            mode = self.config.on_drafter_change
            if mode != "keep":
                keep = self.config.tuner.discount if mode == "discount" else 0.0
                self.tuner.discount(lambda a: a.uses_drafter, keep)
                self.accept["learned"].discount(keep)
                for (family, _), acc in self.bucket_accept.items():
                    if family == "learned":
                        acc.discount(keep)
                self.resets += 1
            self._version = version
        return self.tuner.select(active, lambda: self.switch_charge(active, backlog, uniform_left))

    def exploits(self, strategy: SpecStrategy, active: int) -> bool:
        """Whether ``strategy``, just played at ``active`` rows, is the arm the tuner believed best when it chose it
        (not an exploration: the tuner's belief at that choice, no new one computed); True outside the tuner (above
        the threshold, where the switch alone decides)."""
        return not self._tuned or strategy == self.tuner.believed

    def observe(self, strategy: SpecStrategy, active: int, tokens: int, seconds: float,
                rows: int | None = None, context: float | None = None, accepted: np.ndarray | None = None) -> None:
        """Reward of the decode iteration just finished: it ran ``active`` rows for ``seconds`` at a mean cached
        ``context``, and the ``rows`` of them that keep running (default: all) emitted ``tokens``; ``accepted``:
        its histogram of rows by accepted drafts (chain steps' feed the measured acceptance). Rows that ended in it
        are left out of the reward (their last iteration emits only what was left of the response, whatever the
        arm); an iteration that ended every row is no evidence."""
        rows = active if rows is None else rows
        if not self._tuned or seconds <= 0 or rows < 1:
            return
        if context is not None:
            self._context = float(context)
        if strategy.kind in ("chain", "ngram") and accepted is not None:      # chains measure depth by depth
            self.accept[_family(strategy)].update(accepted)
            self._bucket_acceptance(_family(strategy), self.tuner.bucket(active)).update(accepted)
        reward = iteration_speedup(self.costs, active, tokens, seconds, rows, context)
        rate = iteration_speedup(None, active, tokens, seconds, rows)
        self.tuner.update(active, strategy, reward)
        for k, v in (("active", active), ("arm", strategy.name), ("reward", reward), ("tokens_per_s", rate)):
            self.log[k].append(v)


def timed_rollout(engine, prompts, strategy=None, seed: int = 0, progress: bool = False):
    """(result, wall seconds) of one rollout of ``prompts`` with ``strategy`` and a generator seeded ``seed``
    (CUDA synchronised at both ends)."""
    dev = engine.model.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda _: None)
    sync(dev)
    t = time.perf_counter()
    res = engine.generate(prompts, torch.Generator(device=dev).manual_seed(seed), progress=progress, strategy=strategy)
    sync(dev)
    return res, time.perf_counter() - t
