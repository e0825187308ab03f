"""The SD tuner: a bucketed bandit that picks the decode strategy (no SD, a chain, a tree, n-gram drafts) per batch
size from measured rewards (pure logic: no timing, no models; :mod:`tltlib.rollout.adaptive` feeds it).

Batch sizes fall into buckets (``buckets`` = their lower bounds); each bucket has several arms, and **no SD
(``off``) is always one of them**, so the tuner can always fall back to plain decoding where SD loses. A reward is
the speedup an iteration achieved over plain decoding (its tokens per second over the predicted plain rate at its
batch size and context), so every arm's rewards, ``off``'s included, are on one scale.

Two rules (``TunerConfig.rule``):

* ``"thompson"`` (default): every (bucket, arm) has a Gaussian belief about its mean log-reward. The prior is the
  cost model's predicted speedup (measured forward costs and measured acceptance; ``prior(arm, batch)``) worth
  ``prior_weight`` rewards; each reward updates it. Each choice draws one sample from every arm's belief and plays
  the largest (Thompson sampling): arms that are clearly worse are almost never played, arms whose belief is still
  wide are tried in proportion to their chance of being best. The reward noise is estimated from the bucket's
  rewards (``noise`` until there are enough). When the drafter changes, the rewards of the arms that use it keep
  ``discount`` of their weight (:meth:`Bandit.discount`): the evidence is softened, not erased, so a good arm is not
  re-explored from scratch and a losing one is not retried many times.
* ``"epsilon-greedy"``: the paper's BEG-MAB (TLT §5.2, Algorithm 1): an arm with fewer than ``min_samples`` rewards
  is played first (fewest first, the prior breaks ties); then with probability ``epsilon`` a random arm, otherwise
  the best median over the last ``window`` rewards.

Departures from the paper's BEG-MAB (reference: SGLang fork ``eagle_mab.py``): several arms per bucket (the
reference maps one arm per bucket, so it never explores); rewards normalised per batch size and context (raw tokens
per second favour whichever arm ran at the larger batch inside a bucket); ``off`` as an arm; Thompson sampling with
the cost model's prior as the default rule.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import BadInput
from ..spec.strategy import OFF, SpecStrategy

DEFAULT_ARMS = ("chain-4", "chain-8", "chain-16", "tree-6x4-24", "ngram-4")
PRIOR_REFRESH = 16
"""Choices a cached prior value is used for before the prior (measured acceptance, context) is asked again."""
SETTLED_Z = 3.5
"""thompson: a bucket is *settled* on its best arm when every other arm's mean log-reward lies this many standard
deviations (of the difference of the two draws) below; it then plays that arm for :data:`PRIOR_REFRESH` choices
without drawing (another arm would have won a draw with probability < 2.4e-4 each time)."""
RULES = ("thompson", "epsilon-greedy")


@dataclass(frozen=True)
class TunerConfig:
    """The tuner: arms, batch-size buckets and the rule that chooses among them."""

    arms: tuple = DEFAULT_ARMS
    """Strategies (names like ``chain-4``, ``tree-8x4-32``, ``ngram-4``, or SpecStrategy) in every bucket, unless
    ``bucket_arms`` says otherwise. ``off`` (no SD) is added to every bucket when not listed."""
    buckets: tuple[int, ...] = (1, 2, 5, 17, 65, 257)
    """Lower batch-size bound of each bucket, strictly increasing from 1 (the paper's [1, 2, 5, 21], widened to 512
    rows: rewards are normalised per batch size, and fewer buckets x arms means each bucket learns faster)."""
    bucket_arms: tuple | None = None
    """Per bucket, the arms it may play (a tuple of arm tuples, one per bucket); None = ``arms`` everywhere."""
    max_verify_rows: int = 0
    """Drop an SD arm from a bucket when rows x verify tokens at the bucket's lower bound exceed this (0 = keep
    all)."""
    rule: str = "thompson"
    """``"thompson"`` (Thompson sampling from the cost model's prior) or ``"epsilon-greedy"`` (the paper's)."""
    prior_weight: float = 2.0
    """thompson: how many rewards the cost model's prediction is worth."""
    noise: float = 0.15
    """thompson: the standard deviation of one log-reward assumed until the bucket has measured its own."""
    discount: float = 0.25
    """thompson: the weight the rewards of drafter arms keep when the drafter changes (1 = all, 0 = none)."""
    calibrate: bool = True
    """thompson with a prior: move every SD arm's prior by what ``off`` measured in the bucket against its own
    prediction (its mean log-reward, shrunk towards 0 with ``prior_weight``). Rewards are speedups over the cost
    model's plain rate, timed once; when plain decoding runs slower or faster now (another process's memory state,
    e.g. a trainer's between updates, or other load), every arm's rewards move alike, but an arm with few rewards
    would be judged against its stale prediction: off measured at 0.65 beside a chain predicted at 1.3 looks like
    a 2x win worth exploring. False = the raw prediction."""
    epsilon: float | None = None
    """epsilon-greedy only (default 0.1): probability of playing a random arm instead of the best one."""
    window: int = 50
    """Rewards per arm and bucket kept (the newest); epsilon-greedy takes their median (the paper's code: 300)."""
    min_samples: int | None = None
    """epsilon-greedy only (default 3): rewards an arm needs in a bucket before its median is trusted; arms with
    fewer are played first (fewest first, then in the prior's order). 1 = the paper's "untried arms first"."""
    prune: float = 0.5
    """With a prior: SD arms predicted below this fraction of the best predicted arm at the batch size are not
    tried until measured (re-evaluated at every choice, so measured acceptance can bring them back); 0 = none."""
    seed: int = 0
    """Seed of the exploration draws."""

    def __post_init__(self):
        arms = tuple(SpecStrategy.parse(a) for a in self.arms)
        object.__setattr__(self, "arms", arms)
        if not arms:
            raise BadInput("TunerConfig.arms is empty: give at least one strategy, e.g. arms=('chain-4',)")
        if self.rule not in RULES:
            raise BadInput(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.rule == "epsilon-greedy":
            object.__setattr__(self, "epsilon", 0.1 if self.epsilon is None else self.epsilon)
            object.__setattr__(self, "min_samples", 3 if self.min_samples is None else self.min_samples)
        elif self.epsilon is not None or self.min_samples is not None:
            raise BadInput("epsilon and min_samples are settings of rule='epsilon-greedy' (the paper's BEG-MAB); "
                           "the 'thompson' rule explores by its beliefs: drop them, or set rule='epsilon-greedy'")
        eps, mins = (self.epsilon, self.min_samples) if self.rule == "epsilon-greedy" else (0.0, 1)
        if not self.buckets or self.buckets[0] != 1:
            raise BadInput(f"buckets must start at batch size 1, got {self.buckets}; e.g. buckets=(1, 2, 5, 21)")
        if any(b >= c for b, c in zip(self.buckets, self.buckets[1:])):
            raise BadInput(f"buckets (lower bounds) must be strictly increasing, got {self.buckets}")
        checks = ((0.0 <= eps <= 1.0, f"epsilon must be in [0, 1], got {eps}"),
                  (self.window >= 1, f"window must be >= 1, got {self.window}"),
                  (1 <= mins <= self.window, f"min_samples must be in [1, window={self.window}], got {mins}"),
                  (0.0 <= self.prune <= 1.0, f"prune must be in [0, 1], got {self.prune}"),
                  (self.prior_weight > 0, f"prior_weight must be > 0 rewards, got {self.prior_weight}"),
                  (self.noise > 0, f"noise must be > 0, got {self.noise}"),
                  (0.0 <= self.discount <= 1.0, f"discount must be in [0, 1], got {self.discount}"))
        for ok, msg in checks:
            if not ok:
                raise BadInput(msg)
        if self.bucket_arms is not None:
            if len(self.bucket_arms) != len(self.buckets):
                raise BadInput(f"bucket_arms has {len(self.bucket_arms)} entries for {len(self.buckets)} buckets; "
                               "give one tuple of arms per bucket")
            object.__setattr__(self, "bucket_arms",
                               tuple(tuple(SpecStrategy.parse(a) for a in b) for b in self.bucket_arms))

    def arms_per_bucket(self) -> list[tuple[SpecStrategy, ...]]:
        """Each bucket's arms: ``off`` first, then its SD arms (those within ``max_verify_rows``)."""
        per = self.bucket_arms or (self.arms,) * len(self.buckets)
        out = []
        for lo, arms in zip(self.buckets, per):
            sd = [a for a in dict.fromkeys(arms) if a.enabled and
                  (not self.max_verify_rows or a.verify_tokens * lo <= self.max_verify_rows)]
            out.append((OFF, *sd))
        return out


class Bandit:
    """The bucketed bandit over SD strategies (:class:`TunerConfig`'s rule).

    Args:
        config: :class:`TunerConfig`.
        prior: optional ``prior(arm, batch) -> predicted reward`` (a speedup over plain decoding; ``off``: about 1).
    """

    def __init__(self, config: TunerConfig | None = None, prior=None):
        self.config = config or TunerConfig()
        self.bucket_arms = self.config.arms_per_bucket()
        self.prior = prior
        self.rng = np.random.default_rng(self.config.seed)
        w = self.config.window
        self.rewards = [{a: deque(maxlen=w) for a in arms} for arms in self.bucket_arms]
        self.weights = [{a: deque(maxlen=w) for a in arms} for arms in self.bucket_arms]
        self.plays = [{a: 0 for a in arms} for arms in self.bucket_arms]
        self._prior_cache: dict = {}
        self._stat_cache: dict = {}
        self._bucket_of: dict = {}
        self._settled: dict = {}                 # bucket -> (arm, choice count when it was found settled)
        self._choices = 0
        self.believed: SpecStrategy | None = None
        """The arm the tuner believed best (no exploration) when it last chose, computed by that choice; None when
        it had no belief yet (an arm still untried: epsilon-greedy's first samples)."""

    def bucket(self, batch: int) -> int:
        """Index of the bucket holding ``batch`` rows."""
        b = self._bucket_of.get(batch)
        if b is None:
            if batch < 1:
                raise BadInput(f"batch size must be >= 1, got {batch}")
            b = self._bucket_of[batch] = int(np.searchsorted(self.config.buckets, batch, side="right")) - 1
        return b

    def score(self, bucket: int, arm: SpecStrategy) -> float:
        """Median reward of ``arm`` over its window in ``bucket`` (-inf when empty)."""
        w = self.rewards[bucket][arm]
        return float(np.median(w)) if w else -math.inf

    def predicted(self, arm: SpecStrategy, batch: int) -> float:
        """The prior's reward of ``arm`` at ``batch`` rows, cached for :data:`PRIOR_REFRESH` choices (the tuner
        runs every decode iteration: its own cost must stay far below one)."""
        key = (arm, batch)
        hit = self._prior_cache.get(key)
        if hit is None or self._choices - hit[1] >= PRIOR_REFRESH:
            hit = self._prior_cache[key] = (float(self.prior(arm, batch)), self._choices)
        return hit[0]

    def _stats(self, b: int, arm: SpecStrategy) -> tuple[float, float, float, int]:
        """(sum of weights, weighted sum of log-rewards, squared deviations of the log-rewards around their mean,
        count) of ``arm`` in bucket ``b``: running sums, kept up to date by :meth:`update` (the tuner runs every
        decode iteration), recomputed from the window after a discount or a load."""
        sums = self._stat_cache.get((b, arm))
        if sums is None:
            sums = self._stat_cache[(b, arm)] = [0.0, 0.0, 0.0, 0.0, 0]
            for r, w in zip(self.rewards[b][arm], self.weights[b][arm]):
                _add(sums, _log_reward(r), w, 1)
        wsum, wx, sx, sxx, n = sums
        return wsum, wx, (max(sxx - sx * sx / n, 0.0) if n > 1 else 0.0), n

    def noise(self, bucket: int) -> float:
        """Standard deviation of one log-reward in ``bucket``: pooled over its arms' rewards around their own means,
        with ``config.noise`` worth 4 degrees of freedom (so a few rewards cannot make it tiny)."""
        ss, dof = 4 * self.config.noise ** 2, 4.0
        for arm in self.rewards[bucket]:
            _, _, s, n = self._stats(bucket, arm)
            if n > 1:
                ss, dof = ss + s, dof + n - 1
        return math.sqrt(ss / dof)

    def belief(self, batch: int, arm: SpecStrategy, noise: float | None = None,
               shift: float | None = None) -> tuple[float, float]:
        """(mean, standard deviation) of ``arm``'s mean log-reward at ``batch`` rows: the prior (weight
        ``prior_weight``; none without a prior) updated by the bucket's weighted rewards. An arm with neither has
        an infinite deviation (it is tried first). ``noise``, ``shift``: the bucket's :meth:`noise` and
        :meth:`calibration`, when already known (a choice asks for every arm's belief at once)."""
        b = self.bucket(batch)
        n0 = self.config.prior_weight if self.prior else 0.0
        wsum, wx, _, _ = self._stats(b, arm)
        n = n0 + wsum
        if n <= 0:
            return 0.0, math.inf
        prior = 0.0
        if self.prior:
            prior = math.log(max(self.predicted(arm, batch), 1e-3))
            if arm.enabled and self.config.calibrate:
                prior += self.calibration(batch) if shift is None else shift
        return (n0 * prior + wx) / n, (self.noise(b) if noise is None else noise) / math.sqrt(n)

    def calibration(self, batch: int) -> float:
        """thompson with a prior: the log of how much faster (> 0) or slower plain decoding runs at ``batch``'s
        bucket than the prior predicts: ``off``'s weighted log-rewards less its predicted log-reward, over its
        weight plus ``prior_weight`` (0 until measured). See :attr:`TunerConfig.calibrate`."""
        b = self.bucket(batch)
        if not self.prior or OFF not in self.rewards[b]:
            return 0.0
        wsum, wx, _, _ = self._stats(b, OFF)
        if wsum <= 0:
            return 0.0
        return (wx - wsum * math.log(max(self.predicted(OFF, batch), 1e-3))) / (self.config.prior_weight + wsum)

    def best(self, batch: int) -> SpecStrategy:
        """The arm the tuner currently believes best at ``batch`` (no exploration)."""
        b = self.bucket(batch)
        if self.config.rule == "epsilon-greedy":
            return max(self.bucket_arms[b], key=lambda a: self.score(b, a))
        return max(self.candidates(batch), key=lambda a: self.belief(batch, a)[0])

    def candidates(self, batch: int) -> tuple[SpecStrategy, ...]:
        """The arms worth trying at ``batch`` rows: all of the bucket's, minus the SD arms the prior rules out
        (``prune``) that have no measurement of their own; ``off`` always."""
        b = self.bucket(batch)
        arms = self.bucket_arms[b]
        if not self.prior or not self.config.prune or len(arms) == 1:
            return arms
        pred = {a: self.predicted(a, batch) for a in arms}
        cut = self.config.prune * max(pred.values())
        return tuple(a for a in arms if not a.enabled or pred[a] >= cut or self.rewards[b][a])

    def select(self, batch: int, charge: dict | Callable[[], dict] | None = None) -> SpecStrategy:
        """The arm to play at ``batch`` rows (``config.rule``). ``charge``: a one-off cost of playing an arm now,
        as a log-reward to subtract (e.g. the drafter's catch-up before its first SD step, amortised over the steps
        the switch is expected to last); it weighs the choice, not the arm's rewards. A callable is asked only when
        needed (not when the bucket is settled on ``off``, which no charge can make dearer)."""
        b = self.bucket(batch)
        arm = self.settled(batch)
        if callable(charge):
            charge = {} if arm is not None and not arm.enabled else charge()
        charge = charge or {}
        if arm is not None and not charge.get(arm):
            self._choices += 1
            self.plays[b][arm] += 1
            self.believed = arm
            return arm
        arms = self.candidates(batch)
        self._choices += 1
        arm = self._epsilon_greedy(b, batch, arms, charge) if self.config.rule == "epsilon-greedy" else \
            self._thompson(batch, arms, charge)
        self.plays[b][arm] += 1
        return arm

    def _thompson(self, batch: int, arms, charge: dict) -> SpecStrategy:
        if len(arms) == 1:
            self.believed = arms[0]
            return arms[0]
        noise, shift = self.noise(self.bucket(batch)), self.calibration(batch)
        beliefs = [self.belief(batch, a, noise, shift) for a in arms]
        top = max(range(len(arms)), key=lambda i: beliefs[i][0])
        self.believed = arms[top]
        untried = [a for a, (_, sd) in zip(arms, beliefs) if math.isinf(sd)]
        if untried:
            return untried[0]
        m0, s0 = beliefs[top]
        if all((m0 - m) >= SETTLED_Z * math.hypot(s0, sd) for i, (m, sd) in enumerate(beliefs) if i != top):
            self._settled[self.bucket(batch)] = (arms[top], self._choices)
        z = self.rng.standard_normal(len(arms))
        draws = [m + sd * zi - charge.get(a, 0.0) for a, (m, sd), zi in zip(arms, beliefs, z)]
        return arms[int(np.argmax(draws))]

    def settled(self, batch: int) -> SpecStrategy | None:
        """thompson: the arm the bucket of ``batch`` is settled on (see :data:`SETTLED_Z`), or None. The tuner runs
        every decode iteration; a settled bucket costs it a lookup instead of a belief per arm and a draw."""
        hit = self._settled.get(self.bucket(batch))
        if hit is None or self._choices - hit[1] >= PRIOR_REFRESH:
            return None
        return hit[0]

    def _epsilon_greedy(self, b: int, batch: int, arms, charge: dict) -> SpecStrategy:
        seen = {a: len(self.rewards[b][a]) for a in arms}
        fewest = min(seen.values())
        if fewest < self.config.min_samples:
            self.believed = None
            under = [a for a in arms if seen[a] == fewest]
            return max(under, key=lambda a: self.predicted(a, batch)) if self.prior else under[0]
        self.believed = max(arms, key=lambda a: self.score(b, a) * math.exp(-charge.get(a, 0.0)))
        if len(arms) > 1 and self.rng.random() < self.config.epsilon:
            return arms[int(self.rng.integers(len(arms)))]
        return self.believed

    def update(self, batch: int, arm: SpecStrategy, reward: float) -> None:
        """Record the reward ``arm`` earned at ``batch`` rows (ignored if the arm is not in that bucket)."""
        b = self.bucket(batch)
        r = self.rewards[b].get(arm)
        if r is not None and math.isfinite(reward) and reward > 0:
            w = self.weights[b][arm]
            sums = self._stat_cache.get((b, arm))
            if sums is not None:
                if len(r) == r.maxlen:                # the oldest reward leaves the window
                    _add(sums, _log_reward(r[0]), w[0], -1)
                _add(sums, _log_reward(reward), 1.0, 1)
            r.append(float(reward))
            w.append(1.0)

    def discount(self, which, keep: float) -> None:
        """Multiply the weights of the rewards of the arms for which ``which(arm)`` is true by ``keep`` (0 clears
        them, so those arms are re-explored)."""
        self._stat_cache.clear()
        self._settled.clear()
        for rewards, weights in zip(self.rewards, self.weights):
            for a in rewards:
                if which(a):
                    kept = [w * keep for w in weights[a]] if keep > 0 else []
                    weights[a].clear()
                    weights[a].extend(kept)
                    if not kept:
                        rewards[a].clear()

    def reset(self, which=None) -> None:
        """Clear the rewards of the arms for which ``which(arm)`` is true (default: all), so they are re-explored."""
        self.discount(which or (lambda a: True), 0.0)

    def state_dict(self) -> dict:
        """Rewards, their weights, play counts and the exploration RNG (JSON-able), to resume where it stopped."""
        return {"rewards": [{a.name: list(r) for a, r in rs.items()} for rs in self.rewards],
                "weights": [{a.name: list(w) for a, w in ws.items()} for ws in self.weights],
                "plays": [{a.name: n for a, n in p.items()} for p in self.plays],
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, d: dict) -> None:
        names = [[a.name for a in arms] for arms in self.bucket_arms]
        if "rewards" not in d or [sorted(w) for w in d["rewards"]] != [sorted(n) for n in names]:
            raise BadInput("the saved tuner has other buckets or arms than this one (or was saved by an older "
                           "tltlib); use the same TunerConfig, or start the tuner afresh")
        for store, key in ((self.rewards, "rewards"), (self.weights, "weights")):
            for per, saved in zip(store, d[key]):
                for a, q in per.items():
                    q.clear()
                    q.extend(saved[a.name])
        for plays, saved in zip(self.plays, d["plays"]):
            for a in plays:
                plays[a] = saved[a.name]
        self.rng.bit_generator.state = d["rng"]
        self._stat_cache.clear()
        self._settled.clear()

    def best_by_bucket(self) -> list[dict]:
        """Per bucket with measurements: its batch range, the arm with the best median reward, and that reward."""
        best: dict[int, dict] = {}
        for row in self.summary():
            b = row["bucket"]
            if row["samples"] and (b not in best or row["median_reward"] > best[b]["median_reward"]):
                best[b] = row
        return [best[b] for b in sorted(best)]

    def summary(self) -> list[dict]:
        """Per bucket and arm: batch range, plays, samples in the window, median reward."""
        out = []
        for b, arms in enumerate(self.bucket_arms):
            lo = self.config.buckets[b]
            hi = self.config.buckets[b + 1] - 1 if b + 1 < len(self.config.buckets) else None
            for a in arms:
                out.append({"bucket": b, "batch_lo": lo, "batch_hi": hi, "arm": a.name, "plays": self.plays[b][a],
                            "samples": len(self.rewards[b][a]), "median_reward": self.score(b, a)})
        return out


def _log_reward(r: float) -> float:
    return math.log(max(r, 1e-3))


def _add(sums: list, x: float, w: float, sign: int) -> None:
    """Add (sign 1) or remove (-1) one log-reward ``x`` of weight ``w`` to the running [sum w, sum w x, sum x,
    sum x^2, count]."""
    sums[0] += sign * w
    sums[1] += sign * w * x
    sums[2] += sign * x
    sums[3] += sign * x * x
    sums[4] += sign


BEGMAB = Bandit
"""The paper's name for the tuner (with ``rule="epsilon-greedy"`` it plays the paper's rule)."""
