"""The adaptive rollout engine's control: SD on/off by the running batch size, and BEG-MAB, a bucketed epsilon-greedy
bandit that picks the SD strategy (draft depth, top-k, tokens to verify, or the n-gram drafter) per batch size.

* **The switch.** SD runs only while at most ``threshold`` rows are still generating (the tail); above it every decode
  iteration is plain. Switching on costs no re-prefill: the drafter catches up on its backlog of the target's hidden
  states (:mod:`tltlib.specdecode`). It is re-evaluated every iteration, so SD switches back off if rows grow again.
* **BEG-MAB.** Batch sizes fall into buckets (``buckets`` = their lower bounds); each bucket has several arms. In a
  bucket an arm with fewer than ``min_samples`` rewards is played first (fewest first, the cost-model prior breaks
  ties), then with probability ``epsilon`` a random arm, otherwise the arm with the best median reward over its last
  ``window`` plays. Reward = tokens per second of the decode iteration, divided by plain decoding's tokens per
  second at that batch size (from the cost model), i.e. the iteration's speedup; this makes samples from different
  batch sizes of one bucket comparable. Tokens are counted per row over the rows that keep running: a response's last
  iteration emits only what was left of it, whatever the arm (at one or two rows nearly every iteration is some
  response's last, which made every arm look equally slow there).
* **Drafter changes.** When the learned drafter's weights change (``drafter.version`` moves) the windows of the arms
  that use it are cleared, so the tuner re-explores.
* **Cost model.** :func:`measure_costs` times target forwards of B rows x T tokens and drafter forwards on the real
  models; with a per-token acceptance it predicts each arm's speedup (:meth:`CostModel.predict`), the prior. The
  acceptance starts from ``accept_prior`` and then follows what chain SD steps measure (per drafter family).

Timing adds no device synchronisation: rewards use host timestamps taken at the per-iteration sync the engine
already needs to retire finished rows, and iteration k's reward is used from iteration k+1 on.

Paper: TLT §5.2 (Algorithm 1, BEG-MAB; thresholds [1, 2, 5, 21], epsilon 0.1, window 300, SD at <= 32 requests on
H100). Reference: SGLang fork ``eagle_mab.py`` / ``scheduler.py``.

Departures:
1. Every bucket holds several arms (the reference maps one arm per bucket, so it never explores), and an arm's
   median is trusted only from ``min_samples`` rewards on (one reward is too noisy: an unlucky first iteration kept
   good arms unplayed for whole rollouts).
2. The reward is normalised by the plain rate at the iteration's batch size (the reference uses raw tokens per second,
   which favours whichever arm happened to run at the larger batch inside a bucket).
3. The switch is two-way and needs no re-prefill (the reference latches SD on after 10 small batches and
   re-prefills every running request).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .profiling import call_times
from .speculative import OFF, SpecStrategy, StrategySource, alpha_from_accept_length

# SD on/off threshold (running rows) by device type. CPU: bench/speculative.py measured that SD with the shipped warm
# drafter pays at every batch size it tried (up to 512, the GRPO batch of notebook 04), so the tail switch is set at
# 512. CUDA: the paper's 32 (H100, 7B-70B models); not measured here.
DEFAULT_THRESHOLD = {"cpu": 512, "cuda": 32}
DEFAULT_ARMS = ("chain-4", "chain-8", "chain-16", "tree-6x4-24", "ngram-4")


def default_threshold(device: str | torch.device) -> int:
    """The SD switch threshold for a device type (see :data:`DEFAULT_THRESHOLD`)."""
    return DEFAULT_THRESHOLD.get(torch.device(device).type, 32)


def _arm(a) -> SpecStrategy:
    return a if isinstance(a, SpecStrategy) else SpecStrategy.parse(a)


@dataclass(frozen=True)
class TunerConfig:
    """BEG-MAB: arms, batch-size buckets and the epsilon-greedy rule."""

    arms: tuple = DEFAULT_ARMS
    """Strategies (names like ``chain-4``, ``tree-8x4-32``, ``ngram-4``, ``off``, or SpecStrategy) in every
    bucket, unless ``bucket_arms`` says otherwise."""
    buckets: tuple[int, ...] = (1, 2, 5, 17, 65, 257)
    """Lower batch-size bound of each bucket, strictly increasing from 1 (the paper's [1, 2, 5, 21], widened to 512
    rows: rewards are normalised per batch size, and fewer buckets x arms means each window fills faster)."""
    bucket_arms: tuple | None = None
    """Per bucket, the arms it may play (a tuple of arm tuples, one per bucket); None = ``arms`` everywhere."""
    max_verify_rows: int = 0
    """Drop an arm from a bucket when rows x verify tokens at the bucket's lower bound exceed this (0 = keep all)."""
    epsilon: float = 0.1
    """Probability of playing a random arm instead of the best one."""
    window: int = 50
    """Rewards per arm and bucket the median is taken over (the paper's code uses 300 over many rollouts)."""
    min_samples: int = 3
    """Rewards an arm needs in a bucket before its median is trusted; arms with fewer are played first (fewest
    first, then in the prior's order). 1 = the paper's "untried arms first"."""
    prune: float = 0.5
    """With a prior: arms predicted below this fraction of the best predicted arm at the batch size are neither tried
    nor explored (re-evaluated at every choice, so measured acceptance can bring them back); 0 = explore all."""
    seed: int = 0
    """Seed of the exploration draws."""

    def __post_init__(self):
        arms = tuple(_arm(a) for a in self.arms)
        object.__setattr__(self, "arms", arms)
        if not arms:
            raise ValueError("TunerConfig.arms is empty: give at least one strategy, e.g. arms=('chain-4',)")
        if not self.buckets or self.buckets[0] != 1:
            raise ValueError(f"buckets must start at batch size 1, got {self.buckets}; e.g. buckets=(1, 2, 5, 21)")
        if any(b >= c for b, c in zip(self.buckets, self.buckets[1:])):
            raise ValueError(f"buckets (lower bounds) must be strictly increasing, got {self.buckets}")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {self.epsilon}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 1 <= self.min_samples <= self.window:
            raise ValueError(f"min_samples must be in [1, window={self.window}], got {self.min_samples}")
        if not 0.0 <= self.prune <= 1.0:
            raise ValueError(f"prune must be in [0, 1], got {self.prune}")
        if self.bucket_arms is not None:
            if len(self.bucket_arms) != len(self.buckets):
                raise ValueError(f"bucket_arms has {len(self.bucket_arms)} entries for {len(self.buckets)} buckets; "
                                 "give one tuple of arms per bucket")
            object.__setattr__(self, "bucket_arms", tuple(tuple(_arm(a) for a in b) for b in self.bucket_arms))
        for i, arms_i in enumerate(self.arms_per_bucket()):
            if not arms_i:
                hi = self.buckets[i + 1] - 1 if i + 1 < len(self.buckets) else "inf"
                raise ValueError(f"bucket {i} (batch {self.buckets[i]}..{hi}) has no arm; give it at least one "
                                 "(raise max_verify_rows, or list arms for it in bucket_arms)")

    def arms_per_bucket(self) -> list[tuple[SpecStrategy, ...]]:
        per = self.bucket_arms or (self.arms,) * len(self.buckets)
        if not self.max_verify_rows:
            return [tuple(a) for a in per]
        return [tuple(a for a in arms if a.verify_tokens * lo <= self.max_verify_rows)
                for lo, arms in zip(self.buckets, per)]


class BEGMAB:
    """Bucketed epsilon-greedy multi-armed bandit over SD strategies (pure logic; no timing, no models).

    Args:
        config: :class:`TunerConfig`.
        prior: optional ``prior(arm, batch) -> predicted reward``; orders untried arms (best first).
    """

    def __init__(self, config: TunerConfig | None = None, prior=None):
        self.config = config or TunerConfig()
        self.bucket_arms = self.config.arms_per_bucket()
        self.prior = prior
        self.rng = np.random.default_rng(self.config.seed)
        self.windows = [{a: deque(maxlen=self.config.window) for a in arms} for arms in self.bucket_arms]
        self.plays = [{a: 0 for a in arms} for arms in self.bucket_arms]

    def bucket(self, batch: int) -> int:
        """Index of the bucket holding ``batch`` rows."""
        if batch < 1:
            raise ValueError(f"batch size must be >= 1, got {batch}")
        return int(np.searchsorted(self.config.buckets, batch, side="right")) - 1

    def score(self, bucket: int, arm: SpecStrategy) -> float:
        """Median reward of ``arm`` over its window in ``bucket`` (-inf when empty)."""
        w = self.windows[bucket][arm]
        return float(np.median(w)) if w else -math.inf

    def best(self, batch: int) -> SpecStrategy:
        """The arm the tuner currently believes best at ``batch`` (no exploration)."""
        b = self.bucket(batch)
        return max(self.bucket_arms[b], key=lambda a: self.score(b, a))

    def candidates(self, batch: int) -> tuple[SpecStrategy, ...]:
        """The arms worth trying at ``batch`` rows: all of the bucket's, minus those the prior rules out (``prune``)
        that have no measurement of their own."""
        arms = self.bucket_arms[self.bucket(batch)]
        if not self.prior or not self.config.prune or len(arms) == 1:
            return arms
        pred = {a: self.prior(a, batch) for a in arms}
        cut = self.config.prune * max(pred.values())
        b = self.bucket(batch)
        return tuple(a for a in arms if pred[a] >= cut or self.windows[b][a])

    def select(self, batch: int) -> SpecStrategy:
        """The arm to play at ``batch`` rows: under-tried first (fewest rewards, then prior order), else
        epsilon-greedy on the median."""
        b = self.bucket(batch)
        arms = self.candidates(batch)
        seen = {a: len(self.windows[b][a]) for a in arms}
        fewest = min(seen.values())
        if fewest < self.config.min_samples:
            under = [a for a in arms if seen[a] == fewest]
            arm = max(under, key=lambda a: self.prior(a, batch)) if self.prior else under[0]
        elif len(arms) > 1 and self.rng.random() < self.config.epsilon:
            arm = arms[int(self.rng.integers(len(arms)))]
        else:
            arm = max(arms, key=lambda a: self.score(b, a))
        self.plays[b][arm] += 1
        return arm

    def update(self, batch: int, arm: SpecStrategy, reward: float) -> None:
        """Record the reward ``arm`` earned at ``batch`` rows (ignored if the arm is not in that bucket)."""
        b = self.bucket(batch)
        w = self.windows[b].get(arm)
        if w is not None and math.isfinite(reward):
            w.append(float(reward))

    def reset(self, which=None) -> None:
        """Clear the windows of the arms for which ``which(arm)`` is true (default: all), so they are re-explored."""
        for wins in self.windows:
            for a, w in wins.items():
                if which is None or which(a):
                    w.clear()

    def state_dict(self) -> dict:
        """Windows, play counts and the exploration RNG (JSON-able), to resume tuning where it stopped."""
        return {"windows": [{a.name: list(w) for a, w in wins.items()} for wins in self.windows],
                "plays": [{a.name: n for a, n in p.items()} for p in self.plays],
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, d: dict) -> None:
        names = [[a.name for a in arms] for arms in self.bucket_arms]
        if [sorted(w) for w in d["windows"]] != [sorted(n) for n in names]:
            raise ValueError("the saved tuner has other buckets or arms than this one; use the same TunerConfig")
        for wins, saved in zip(self.windows, d["windows"]):
            for a, w in wins.items():
                w.clear()
                w.extend(saved[a.name])
        for plays, saved in zip(self.plays, d["plays"]):
            for a in plays:
                plays[a] = saved[a.name]
        self.rng.bit_generator.state = d["rng"]

    def best_by_bucket(self) -> list[dict]:
        """Per bucket with measurements: its batch range, the arm with the best median reward, and that reward."""
        best: dict[int, dict] = {}
        for row in self.summary():
            if row["samples"] and (row["bucket"] not in best or row["median_reward"] > best[row["bucket"]]["median_reward"]):
                best[row["bucket"]] = row
        return [best[b] for b in sorted(best)]

    def summary(self) -> list[dict]:
        """Per bucket and arm: batch range, plays, samples in the window, median reward."""
        out = []
        for b, arms in enumerate(self.bucket_arms):
            lo = self.config.buckets[b]
            hi = self.config.buckets[b + 1] - 1 if b + 1 < len(self.config.buckets) else None
            for a in arms:
                out.append({"bucket": b, "batch_lo": lo, "batch_hi": hi, "arm": a.name, "plays": self.plays[b][a],
                            "samples": len(self.windows[b][a]), "median_reward": self.score(b, a)})
        return out


# ------------------------------------------------------------------------------------------------ cost model
@dataclass
class CostModel:
    """Measured forward costs. ``target_s[i, j]``: seconds of a target forward of ``batches[i]`` rows x
    ``tokens[j]`` tokens (1 = a plain decode iteration); ``draft_s[i, k]``: a drafter forward of ``batches[i]`` rows x
    ``draft_tokens[k]`` tokens. Between measured sizes it interpolates log-log in rows, linearly in tokens."""

    batches: np.ndarray
    tokens: np.ndarray
    target_s: np.ndarray
    draft_tokens: np.ndarray = field(default_factory=lambda: np.array([1]))
    draft_s: np.ndarray | None = None
    ngram_s_per_row: float = 2e-5

    def _interp(self, table, cols, batch, n) -> float:
        lb = np.log(np.clip(batch, self.batches[0], self.batches[-1]))
        per_col = [math.exp(np.interp(lb, np.log(self.batches), np.log(table[:, j]))) for j in range(len(cols))]
        if n > cols[-1]:                               # extrapolate linearly in tokens beyond the last column
            slope = (per_col[-1] - per_col[-2]) / (cols[-1] - cols[-2]) if len(cols) > 1 else per_col[-1] / cols[-1]
            return per_col[-1] + slope * (n - cols[-1])
        return float(np.interp(n, cols, per_col))

    def target_time(self, batch: int, tokens: int) -> float:
        """Seconds of one target forward over ``batch`` rows x ``tokens`` tokens."""
        return self._interp(self.target_s, self.tokens, batch, tokens)

    def draft_time(self, batch: int, tokens: int = 1) -> float:
        """Seconds of one drafter forward over ``batch`` rows x ``tokens`` tokens (0 without drafter timings)."""
        if self.draft_s is None:
            return 0.0
        return self._interp(self.draft_s, self.draft_tokens, batch, tokens)

    def plain_rate(self, batch: int) -> float:
        """Tokens per second of plain decoding at ``batch`` rows."""
        return batch / self.target_time(batch, 1)

    def iteration_time(self, arm: SpecStrategy, batch: int) -> float:
        """Predicted seconds of one decode iteration with ``arm`` at ``batch`` rows."""
        if not arm.enabled:
            return self.target_time(batch, 1)
        verify = self.target_time(batch, arm.verify_tokens + 1)
        if arm.kind == "ngram":
            return verify + self.ngram_s_per_row * batch
        levels = arm.depth + 1                          # one catch-up over the backlog + one forward per level
        width = 1 if arm.kind == "chain" else arm.top_k
        return verify + levels * self.draft_time(batch, width)

    def predict(self, arm: SpecStrategy, batch: int, accept: Sequence[float] | float) -> float:
        """Predicted speedup of ``arm`` over plain decoding at ``batch`` rows, given the acceptance ``accept``
        (one rate, or the chance of accepting depth d given depth d-1 was, for d = 1, 2, ...)."""
        if not arm.enabled:
            return 1.0
        tokens = expected_tokens(arm, accept)
        return tokens * batch / self.iteration_time(arm, batch) / self.plain_rate(batch)

    def to_dict(self) -> dict:
        return {"batches": self.batches.tolist(), "tokens": self.tokens.tolist(), "target_s": self.target_s.tolist(),
                "draft_tokens": self.draft_tokens.tolist(),
                "draft_s": None if self.draft_s is None else self.draft_s.tolist()}


def expected_tokens(arm: SpecStrategy, accept: Sequence[float] | float) -> float:
    """Expected tokens emitted per row per step (bonus included): 1 + sum_j prod_{i<=j} a_i, where a tree level
    with w candidates (w = top_k, at most budget / depth) is accepted with 1 - (1 - a)^w."""
    if not arm.enabled:
        return 1.0
    rates = [float(accept)] * arm.depth if np.isscalar(accept) else [float(a) for a in accept]
    rates = (rates + [rates[-1]] * arm.depth)[: arm.depth]
    if arm.kind == "tree":
        w = max(1, min(arm.top_k, arm.verify_tokens // arm.depth))
        rates = [1 - (1 - a) ** w for a in rates]
    total, run = 1.0, 1.0
    for a in rates:
        run *= a
        total += run
    return total


@torch.no_grad()
def measure_costs(target, drafter=None, batches: Sequence[int] | None = None, max_batch: int = 64,
                  tokens: Sequence[int] = (1, 9, 25), context: int = 64, repeats: int = 2) -> CostModel:
    """Time target forwards of B rows x T tokens (and drafter forwards of B x 1 and B x 4) at ``context`` cached
    positions, the fastest of ``repeats`` after one warm-up (the least disturbed run). ``batches`` default: powers of
    four up to ``max_batch``, and ``max_batch`` itself (make it the SD threshold: rewards are normalised by the plain
    rate up to there).
    Nothing is committed to any cache."""
    if batches is None:
        batches = [4 ** i for i in range(int(math.log(max(1, max_batch), 4) + 1e-9) + 1)]
        if batches[-1] < max_batch:
            batches.append(max_batch)
    dev = target.embed.weight.device
    vocab = target.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    t_tab = np.zeros((len(batches), len(tokens)))
    draft_tokens = np.array([1, 4])
    d_tab = np.zeros((len(batches), len(draft_tokens))) if drafter is not None else None

    def timed(fn) -> float:                                  # the least disturbed of the repeats
        return float(min(call_times(fn, repeats, dev)))

    for i, b in enumerate(batches):
        cache = target.new_cache(b, context + max(tokens) + 1)
        prompt = torch.randint(0, vocab, (b, context), generator=g).to(dev)
        last = torch.full((b,), context - 1, device=dev)
        _, h = target.forward_cached(prompt, cache, logits_at=last)
        cache.advance(context)
        for j, n in enumerate(tokens):
            x = torch.randint(0, vocab, (b, n), generator=g).to(dev)
            t_tab[i, j] = timed(lambda x=x: target.forward_cached(x, cache))
        if drafter is not None:
            dcache = drafter.new_cache(b, context + 8)
            drafter.forward_cached(h[:, :-1], prompt[:, 1:], dcache, logits_at=last - 1)
            dcache.advance(context - 1)
            for k, n in enumerate(draft_tokens):
                f = h[:, -1:].expand(b, int(n), h.shape[-1]).contiguous()
                x = torch.randint(0, vocab, (b, int(n)), generator=g).to(dev)
                d_tab[i, k] = timed(lambda f=f, x=x: drafter.forward_cached(f, x, dcache))
    return CostModel(np.asarray(batches, dtype=np.float64), np.asarray(tokens, dtype=np.float64), t_tab,
                     draft_tokens.astype(np.float64), d_tab)


# ------------------------------------------------------------------------------------------------ controller
@dataclass(frozen=True)
class AdaptiveConfig:
    """The adaptive engine: when SD runs, and how its strategy is tuned."""

    threshold: int = 32
    """SD runs while at most this many rows are generating (see :func:`default_threshold` for measured values)."""
    tuner: TunerConfig = field(default_factory=TunerConfig)
    """The BEG-MAB arms, buckets and exploration."""
    on_drafter_change: str = "reset"
    """When the drafter's version changes (the online drafter trained): ``"reset"`` clears the reward windows of the
    arms that use it, which are then re-explored (``min_samples`` in every bucket); ``"keep"`` keeps them, and the
    sliding window and epsilon-exploration follow the new drafter (no forced exploration)."""
    accept_prior: tuple[float, ...] = (0.8,)
    """Acceptance per draft depth assumed by the cost-model prior for learned-drafter arms (last value repeats)."""
    ngram_accept_prior: float = 0.3
    """Acceptance per depth assumed by the prior for n-gram arms."""

    def accept_for(self, arm: SpecStrategy) -> tuple[float, ...] | float:
        """The acceptance the cost-model prior assumes for ``arm`` (n-gram arms have their own)."""
        return self.ngram_accept_prior if arm.kind == "ngram" else self.accept_prior

    def __post_init__(self):
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0 running rows (0 = SD never on), got {self.threshold}")
        if not self.accept_prior or not all(0.0 <= a <= 1.0 for a in self.accept_prior):
            raise ValueError(f"accept_prior must hold rates in [0, 1], got {self.accept_prior}")
        if not 0.0 <= self.ngram_accept_prior <= 1.0:
            raise ValueError(f"ngram_accept_prior must be in [0, 1], got {self.ngram_accept_prior}")
        if self.on_drafter_change not in ("reset", "keep"):
            raise ValueError(f"on_drafter_change must be 'reset' or 'keep', got {self.on_drafter_change!r}")


class AdaptiveController(StrategySource):
    """The engine's strategy source (``RolloutEngine.generate(..., strategy=controller)``): the batch-size switch
    plus BEG-MAB. Keep one controller across rollouts so the tuner keeps learning.

    Args:
        config: :class:`AdaptiveConfig`.
        costs: a :class:`CostModel` (prior and reward normalisation); None = raw tokens/s rewards, no prior.
        drafter: the learned drafter whose ``version`` is watched (windows of its arms reset when it changes).
    """

    def __init__(self, config: AdaptiveConfig | None = None, costs: CostModel | None = None, drafter=None):
        self.config = config or AdaptiveConfig()
        self.costs = costs
        self.drafter = drafter
        self.tuner = BEGMAB(self.config.tuner, prior=self._prior if costs is not None else None)
        self._version = getattr(drafter, "version", None)
        self._tuned = False                       # whether the last choice came from the tuner ("off" may be an arm)
        self.alpha: dict[str, float] = {}         # measured per-token acceptance by family ("learned", "ngram")
        self.log: dict[str, list] = {"active": [], "arm": [], "reward": [], "tokens_per_s": []}
        self.resets = 0

    def state_dict(self) -> dict:
        """The tuner, the measured acceptance, the drafter version seen and the log (JSON-able)."""
        return {"tuner": self.tuner.state_dict(), "alpha": dict(self.alpha), "version": self._version,
                "resets": self.resets, "log": {k: list(v) for k, v in self.log.items()}}

    def load_state_dict(self, d: dict) -> None:
        self.tuner.load_state_dict(d["tuner"])
        self.alpha, self._version, self.resets = dict(d["alpha"]), d["version"], d["resets"]
        self.log = {k: list(v) for k, v in d["log"].items()}

    def _prior(self, arm: SpecStrategy, batch: int) -> float:
        family = "ngram" if arm.kind == "ngram" else "learned"
        return self.costs.predict(arm, batch, self.alpha.get(family, self.config.accept_for(arm)))

    def choose(self, iteration: int, active: int) -> SpecStrategy:
        """The strategy of the next decode iteration at ``active`` running rows."""
        self._tuned = active <= self.config.threshold
        if not self._tuned:
            return OFF
        version = getattr(self.drafter, "version", None)
        if version != self._version:
            if self.config.on_drafter_change == "reset":
                self.tuner.reset(lambda a: a.uses_drafter)
                self.resets += 1
            self._version = version
        return self.tuner.select(active)

    def observe(self, strategy: SpecStrategy, active: int, tokens: int, seconds: float,
                rows: int | None = None) -> None:
        """Reward of the decode iteration just finished: it ran ``active`` rows for ``seconds``, and the ``rows`` of
        them that keep running (default: all) emitted ``tokens``. Rows that ended in it are left out (their last
        iteration emits only what was left of the response, whatever the arm); an iteration that ended every row is
        no evidence."""
        rows = active if rows is None else rows
        if not self._tuned or seconds <= 0 or rows < 1:
            return
        per_row = tokens / rows
        if strategy.kind in ("chain", "ngram"):          # acceptance measured on chains feeds the prior
            family = "ngram" if strategy.kind == "ngram" else "learned"
            a = alpha_from_accept_length(per_row, strategy.depth, tol=1e-4)
            self.alpha[family] = a if family not in self.alpha else 0.9 * self.alpha[family] + 0.1 * a
        rate = per_row * active / seconds                 # tokens/s of the batch if every row yielded per_row
        reward = rate / self.costs.plain_rate(active) if self.costs is not None else rate
        self.tuner.update(active, strategy, reward)
        for k, v in (("active", active), ("arm", strategy.name), ("reward", reward), ("tokens_per_s", rate)):
            self.log[k].append(v)


def timed_rollout(engine, prompts, strategy=None, seed: int = 0, progress: bool = False):
    """(result, wall seconds) of one rollout of ``prompts`` with ``strategy`` and a generator seeded ``seed``
    (CUDA synchronised at both ends)."""
    dev = engine.model.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    res = engine.generate(prompts, torch.Generator(device=dev).manual_seed(seed), progress=progress,
                          strategy=strategy)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return res, time.perf_counter() - t
