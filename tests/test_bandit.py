"""The tuner (tltlib.rollout.bandit) on synthetic rewards: Thompson sampling from a prior (converges, keeps to plain
decoding where SD loses, softens evidence when the drafter changes) and the paper's epsilon-greedy BEG-MAB."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tltlib.rollout.bandit import BEGMAB, PRIOR_REFRESH, SETTLED_Z, Bandit, TunerConfig
from tltlib.spec.strategy import OFF, SpecStrategy

ARMS = ("chain-2", "chain-6", "tree-4x2-8", "ngram-4")
EG = dict(rule="epsilon-greedy")


def _play(bandit, reward_of, batch, steps, rng, sd=0.3):
    for _ in range(steps):
        arm = bandit.select(batch)
        bandit.update(batch, arm, max(reward_of[arm.name] + rng.normal(0, sd), 0.05))


def _plays(bandit, bucket=0):
    return {r["arm"]: r["plays"] for r in bandit.summary() if r["bucket"] == bucket}


# ------------------------------------------------------------------------------------------------ thompson
def test_off_is_an_arm_of_every_bucket_and_listed_once():
    cfg = TunerConfig(arms=("chain-2", "off", "chain-2", "ngram-4"), buckets=(1, 8))
    assert [[a.name for a in arms] for arms in cfg.arms_per_bucket()] == [["off", "chain-2", "ngram-4"]] * 2
    assert TunerConfig(arms=("off",)).arms_per_bucket()[0] == (OFF,)


def test_thompson_converges_to_the_best_arm_per_bucket_and_to_off_where_sd_loses():
    """Over four seeds (one path's share of plays is noisy where an arm is within 10% of off)."""
    small = {"off": 1.0, "chain-2": 1.3, "chain-6": 2.0, "tree-4x2-8": 1.5, "ngram-4": 0.8}
    large = {"off": 1.0, "chain-2": 0.8, "chain-6": 0.5, "tree-4x2-8": 0.6, "ngram-4": 0.9}
    best_plays = []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        bandit = Bandit(TunerConfig(arms=ARMS, buckets=(1, 8), seed=1 + seed))
        _play(bandit, small, 3, 300, rng, sd=0.2)
        _play(bandit, large, 20, 300, rng, sd=0.2)
        assert bandit.best(1).name == "chain-6" and bandit.best(20).name == "off"
        best_plays.append((_plays(bandit, 0)["chain-6"], _plays(bandit, 1)["off"]))
    assert np.min(best_plays, axis=0)[0] > 0.95 * 300 and np.mean(best_plays, axis=0)[1] > 0.85 * 300


def test_thompson_with_an_honest_prior_loses_almost_nothing_to_exploration():
    """The prior (the cost model) says SD loses at this batch: plain decoding is played from the start, and the SD
    arms, each worth 2 rewards of a 0.6x prior, are tried rarely."""
    truth = {"off": 1.0, "chain-2": 0.7, "chain-6": 0.5, "tree-4x2-8": 0.55, "ngram-4": 0.9}
    prior = {"off": 1.0, "chain-2": 0.75, "chain-6": 0.55, "tree-4x2-8": 0.6, "ngram-4": 0.85}
    bandit = Bandit(TunerConfig(arms=ARMS, buckets=(1,), prune=0.0, seed=3), prior=lambda a, b: prior[a.name])
    rng = np.random.default_rng(1)
    gained = []
    for _ in range(400):
        arm = bandit.select(4)
        gained.append(truth[arm.name])
        bandit.update(4, arm, truth[arm.name] * math.exp(rng.normal(0, 0.1)))
    assert np.mean(gained) >= 0.98 and _plays(bandit)["off"] > 380


def test_thompson_learns_against_a_wrong_prior():
    """The prior promises a 2x chain (a drafter that was good), the measurements say 0.6x (it is stale): within a
    few tries plain decoding takes over; the mean over 300 iterations stays >= 0.98 of plain."""
    truth = {"off": 1.0, "chain-2": 0.7, "chain-6": 0.6, "tree-4x2-8": 0.6, "ngram-4": 0.95}
    prior = {"off": 1.0, "chain-2": 1.6, "chain-6": 2.0, "tree-4x2-8": 1.8, "ngram-4": 0.9}
    bandit = Bandit(TunerConfig(arms=ARMS, buckets=(1,), seed=4), prior=lambda a, b: prior[a.name])
    rng = np.random.default_rng(2)
    gained = []
    for _ in range(300):
        arm = bandit.select(2)
        gained.append(truth[arm.name])
        bandit.update(2, arm, truth[arm.name] * math.exp(rng.normal(0, 0.1)))
    assert bandit.best(2) == OFF and np.mean(gained) >= 0.97
    assert sum(n for a, n in _plays(bandit).items() if a != "off") < 30


def test_untried_arms_without_a_prior_are_played_first():
    bandit = Bandit(TunerConfig(arms=("chain-2", "chain-6"), buckets=(1,)))
    first = []
    for _ in range(3):
        arm = bandit.select(1)
        first.append(arm.name)
        bandit.update(1, arm, 1.0)
    assert sorted(first) == ["chain-2", "chain-6", "off"]
    mean, sd = bandit.belief(1, SpecStrategy.parse("chain-2"))
    assert mean == pytest.approx(0.0) and math.isfinite(sd)


def test_belief_is_the_prior_updated_by_weighted_rewards_and_discount_widens_it():
    arm = SpecStrategy.parse("chain-6")
    bandit = Bandit(TunerConfig(arms=("chain-6",), buckets=(1,), prior_weight=2.0, noise=0.2),
                    prior=lambda a, b: 2.0 if a.enabled else 1.0)
    assert bandit.belief(1, arm) == (pytest.approx(math.log(2.0)), pytest.approx(0.2 / math.sqrt(2)))
    for _ in range(2):
        bandit.update(1, arm, 0.5)
    mean, sd = bandit.belief(1, arm)                      # (2 log 2 + 2 log 0.5) / 4 = 0, noise pooled from 2 equal
    assert mean == pytest.approx(0.0) and sd == pytest.approx(math.sqrt(4 * 0.04 / 5) / 2)
    bandit.discount(lambda a: a.uses_drafter, 0.25)       # the drafter changed: its evidence weighs 2 x 0.25
    mean2, sd2 = bandit.belief(1, arm)
    assert mean2 == pytest.approx((2 * math.log(2) + 0.5 * math.log(0.5)) / 2.5) and sd2 > sd
    assert len(bandit.rewards[0][arm]) == 2               # softened, not erased
    bandit.reset(lambda a: a.uses_drafter)
    assert not bandit.rewards[0][arm] and bandit.belief(1, OFF)[0] == pytest.approx(0.0)


def test_rewards_that_are_not_positive_and_finite_are_ignored():
    bandit = Bandit(TunerConfig(arms=("chain-2",), buckets=(1,)))
    for r in (0.0, -1.0, float("nan"), float("inf")):
        bandit.update(1, OFF, r)
    assert not bandit.rewards[0][OFF]


def test_state_dict_round_trip_and_refusals():
    bandit = Bandit(TunerConfig(arms=ARMS, buckets=(1, 8), seed=5))
    _play(bandit, {"off": 1, "chain-2": 1.2, "chain-6": 1.5, "tree-4x2-8": 1.1, "ngram-4": 0.9}, 3, 40,
          np.random.default_rng(0))
    bandit.discount(lambda a: a.uses_drafter, 0.5)
    other = Bandit(TunerConfig(arms=ARMS, buckets=(1, 8), seed=5))
    other.load_state_dict(bandit.state_dict())
    assert other.state_dict() == bandit.state_dict() and other.select(3) == bandit.select(3)
    with pytest.raises(ValueError, match="other buckets or arms"):
        Bandit(TunerConfig(arms=ARMS[:2], buckets=(1, 8))).load_state_dict(bandit.state_dict())
    with pytest.raises(ValueError, match="older"):
        other.load_state_dict({"windows": []})


# ------------------------------------------------------------------------------------------ epsilon-greedy
def test_epsilon_greedy_converges_to_the_best_arm_per_bucket():
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1, 8), epsilon=0.1, window=30, seed=1, **EG))
    rng = np.random.default_rng(0)
    small = {"off": 1.0, "chain-2": 1.0, "chain-6": 2.0, "tree-4x2-8": 1.5, "ngram-4": 0.8}
    large = {"off": 1.0, "chain-2": 1.6, "chain-6": 1.1, "tree-4x2-8": 0.9, "ngram-4": 1.2}
    _play(bandit, small, 3, 400, rng)
    _play(bandit, large, 20, 400, rng)
    assert bandit.best(1).name == "chain-6" and bandit.best(20).name == "chain-2"
    plays = _plays(bandit)
    assert plays["chain-6"] > 0.8 * 400 and min(plays.values()) >= 1          # exploited, and every arm tried


def test_epsilon_greedy_plays_under_tried_arms_round_robin_in_prior_order():
    prior = {"off": 0.9, "chain-2": 0.5, "chain-6": 3.0, "tree-4x2-8": 2.0, "ngram-4": 1.0}
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), prune=0.0, epsilon=0.0, min_samples=3, **EG),
                    prior=lambda a, b: prior[a.name])
    order = []
    for _ in range(15):
        arm = bandit.select(1)
        order.append(arm.name)
        bandit.update(1, arm, 5.0 if arm.name == "chain-2" else 1.0)   # the arm the prior ranks last is best
    assert order == ["chain-6", "tree-4x2-8", "ngram-4", "off", "chain-2"] * 3
    assert bandit.select(1).name == "chain-2"


def test_epsilon_greedy_re_explores_after_a_reset():
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), epsilon=0.1, window=20, seed=2, **EG))
    rng = np.random.default_rng(1)
    before = {"off": 1.0, "chain-2": 1.0, "chain-6": 2.0, "tree-4x2-8": 1.5, "ngram-4": 0.8}
    after = {"off": 1.0, "chain-2": 2.5, "chain-6": 0.7, "tree-4x2-8": 1.2, "ngram-4": 0.9}
    _play(bandit, before, 1, 200, rng)
    assert bandit.best(1).name == "chain-6"
    bandit.reset(lambda a: a.uses_drafter)                 # drafter changed: its arms are unknown again
    assert bandit.score(0, SpecStrategy.parse("ngram-4")) > -np.inf
    tried = set()
    for _ in range(3):                                     # the three drafter arms are replayed first
        arm = bandit.select(1)
        tried.add(arm.name)
        bandit.update(1, arm, after[arm.name])
    assert tried == {"chain-2", "chain-6", "tree-4x2-8"}
    _play(bandit, after, 1, 200, rng)
    assert bandit.best(1).name == "chain-2"


def test_prior_prunes_hopeless_sd_arms_until_measurements_say_otherwise():
    prior = {"off": 1.0, "chain-2": 0.5, "chain-6": 3.0, "tree-4x2-8": 2.0, "ngram-4": 1.0}
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), prune=0.5, epsilon=1.0, **EG),
                    prior=lambda a, b: prior[a.name])
    assert {a.name for a in bandit.candidates(1)} == {"off", "chain-6", "tree-4x2-8"}   # off is never pruned
    played = set()
    for _ in range(200):
        arm = bandit.select(1)
        played.add(arm.name)
        bandit.update(1, arm, 1.0)
    assert played == {"off", "chain-6", "tree-4x2-8"}
    prior["ngram-4"] = 2.9                                    # e.g. measured acceptance raised its prediction
    for _ in range(PRIOR_REFRESH):                            # seen once the cached prior is refreshed
        bandit.update(1, bandit.select(1), 1.0)
    assert "ngram-4" in {a.name for a in bandit.candidates(1)}


def test_epsilon_zero_never_explores_and_one_always_does():
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), epsilon=0.0, min_samples=1, **EG))
    for a in bandit.bucket_arms[0]:
        bandit.update(1, a, 2.0 if a.name == "ngram-4" else 1.0)
    assert {bandit.select(1).name for _ in range(50)} == {"ngram-4"}
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), epsilon=1.0, seed=3, min_samples=1, **EG))
    for a in bandit.bucket_arms[0]:
        bandit.update(1, a, 2.0 if a.name == "ngram-4" else 1.0)
    assert len({bandit.select(1).name for _ in range(200)}) == 5


def test_each_choice_records_the_arm_believed_best_whatever_it_played():
    """``believed`` is what the alarms judge SD's speed on: exploration plays other arms, the belief stays."""
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), epsilon=1.0, seed=3, min_samples=1, **EG))
    assert bandit.believed is None
    bandit.select(1)
    assert bandit.believed is None                         # an untried arm: no belief yet
    for a in bandit.bucket_arms[0]:
        bandit.update(1, a, 2.0 if a.name == "ngram-4" else 1.0)
    played = {bandit.select(1).name for _ in range(50)}
    assert len(played) > 1 and bandit.believed.name == "ngram-4"
    thompson = Bandit(TunerConfig(arms=ARMS, buckets=(1,), seed=0))
    for a in thompson.bucket_arms[0]:
        for _ in range(10):
            thompson.update(1, a, 2.0 if a.name == "chain-6" else 1.0)
    for _ in range(20):
        thompson.select(1)
        assert thompson.believed == thompson.best(1) and thompson.believed.name == "chain-6"


def test_best_by_bucket_names_the_best_measured_arm_of_each_bucket():
    bandit = BEGMAB(TunerConfig(arms=("chain-2", "chain-6"), buckets=(1, 4, 16), min_samples=1, **EG))
    for arm, batch, reward in (("chain-2", 2, 1.5), ("chain-6", 2, 2.5), ("chain-2", 8, 1.2), ("chain-6", 8, 0.9)):
        bandit.update(batch, SpecStrategy.parse(arm), reward)
    rows = bandit.best_by_bucket()
    assert [(r["batch_lo"], r["batch_hi"], r["arm"], r["median_reward"]) for r in rows] == [
        (1, 3, "chain-6", 2.5), (4, 15, "chain-2", 1.2)]                  # bucket 16+ has no measurement


# ----------------------------------------------------------------------------------------------- config
def test_tuner_config_errors():
    bad = [(dict(arms=()), "arms is empty"), (dict(buckets=(1, 8, 4)), "strictly increasing"),
           (dict(buckets=(2, 8)), "start at batch size 1"), (dict(rule="ucb"), "rule must be one of"),
           (dict(epsilon=0.2), "settings of rule='epsilon-greedy'"), (dict(min_samples=2), "settings of rule"),
           (dict(epsilon=1.5, **EG), r"epsilon must be in \[0, 1\]"), (dict(min_samples=0, **EG), "min_samples"),
           (dict(prune=1.5), r"prune must be in \[0, 1\]"), (dict(prior_weight=0), "prior_weight must be > 0"),
           (dict(noise=0), "noise must be > 0"), (dict(discount=1.5), r"discount must be in \[0, 1\]"),
           (dict(arms=ARMS, buckets=(1, 4), bucket_arms=(("chain-2",),)), "one tuple of arms per bucket"),
           (dict(arms=("chain4",)), "cannot read speculative strategy")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            TunerConfig(**kw)
    eg = TunerConfig(**EG)
    assert (eg.epsilon, eg.min_samples) == (0.1, 3)


def test_max_verify_rows_drops_big_arms_from_big_buckets_but_never_off():
    cfg = TunerConfig(arms=("chain-2", "chain-8"), buckets=(1, 64), max_verify_rows=256)
    assert [[a.name for a in arms] for arms in cfg.arms_per_bucket()] == [["off", "chain-2", "chain-8"],
                                                                          ["off", "chain-2"]]
    assert [a.name for a in TunerConfig(arms=("chain-8",), buckets=(1, 64), max_verify_rows=256)
            .arms_per_bucket()[1]] == ["off"]


def test_a_charge_weighs_the_choice_but_not_the_rewards():
    """An arm slightly ahead of `off` is played most of the time; charged more than its lead (the drafter's
    catch-up before a switch), it is almost never played, and its evidence is untouched."""
    prior = {"off": 1.0, "chain-2": 1.08}
    for rule in ({}, dict(EG, epsilon=0.0)):
        bandit = Bandit(TunerConfig(arms=("chain-2",), buckets=(1,), prune=0.0, seed=5, **rule),
                        prior=lambda a, b: prior[a.name])
        for arm, r in ((OFF, 1.0), (SpecStrategy("chain", 2), 1.08)) * 3:
            bandit.update(2, arm, r)
        chain = SpecStrategy("chain", 2)
        free = [bandit.select(2).name for _ in range(200)]
        charged = [bandit.select(2, {chain: math.log(1.5)}).name for _ in range(200)]
        assert free.count("chain-2") > 150 and charged.count("chain-2") < 10
        assert list(bandit.rewards[0][chain]) == [1.08] * 3


def test_running_statistics_equal_the_window_recomputed():
    """The tuner keeps running sums per arm (it runs every decode iteration): after the window has turned over and
    after a discount they equal the statistics recomputed from the window."""
    bandit = Bandit(TunerConfig(arms=("chain-2",), buckets=(1,), window=20))
    rng = np.random.default_rng(0)
    chain = SpecStrategy("chain", 2)

    def direct():
        x = np.log(np.asarray(bandit.rewards[0][chain]))
        w = np.asarray(bandit.weights[0][chain])
        return w.sum(), (w * x).sum(), ((x - x.mean()) ** 2).sum(), x.size

    for step in range(75):
        bandit.update(1, chain, float(rng.lognormal(0.2, 0.3)))
        if step in (5, 40):
            bandit.belief(1, chain)                              # the sums exist from here on
        if step == 60:
            bandit.discount(lambda a: True, 0.5)
    assert np.allclose(bandit._stats(0, chain), direct(), rtol=1e-9)
    assert bandit._stats(0, chain)[3] == 20


def test_a_settled_bucket_plays_its_arm_without_drawing_and_re_checks_after_a_while():
    """Once every other arm is SETTLED_Z deviations behind the best, the bucket plays the best for PRIOR_REFRESH
    choices without a draw (the tuner runs every iteration); then it draws again; close arms never settle; a
    discount (a new drafter) unsettles; another bucket is not affected."""
    bandit = Bandit(TunerConfig(arms=("chain-2",), buckets=(1, 8), prune=0.0, seed=2))
    chain = SpecStrategy("chain", 2)
    rng = np.random.default_rng(0)
    for _ in range(30):
        bandit.update(3, OFF, float(rng.lognormal(0.0, 0.1)))
        bandit.update(3, chain, float(rng.lognormal(-0.7, 0.1)))
        bandit.update(20, OFF, float(rng.lognormal(0.0, 0.1)))
        bandit.update(20, chain, float(rng.lognormal(-0.02, 0.1)))
    (m0, s0), (m1, s1) = bandit.belief(3, OFF), bandit.belief(3, chain)
    assert (m0 - m1) > SETTLED_Z * math.hypot(s0, s1)
    assert bandit.settled(3) is None and bandit.select(3) == OFF and bandit.settled(3) == OFF
    state = bandit.rng.bit_generator.state
    assert [bandit.select(3) for _ in range(PRIOR_REFRESH)] == [OFF] * PRIOR_REFRESH
    assert bandit.rng.bit_generator.state == state                  # no draws while settled
    assert bandit.settled(3) is None                                 # then a full choice again
    bandit.select(3)
    assert bandit.rng.bit_generator.state != state and bandit.settled(3) == OFF
    assert bandit.settled(20) is None and {bandit.select(20) for _ in range(60)} == {OFF, chain}
    bandit.discount(lambda a: a.uses_drafter, 0.25)
    assert bandit.settled(3) is None


def test_sd_priors_move_with_what_off_measured_against_its_own_prediction():
    """Plain decoding measured at 0.65 of the cost model's rate (every arm slowed alike), a chain predicted at 1.05
    measured at 0.60 (a loss): after the drafter's evidence is discounted, the calibrated prior (1.05 x off's
    shortfall) keeps the tuner on off; the raw prior would make the barely-measured chain look like a win."""
    chain = SpecStrategy.parse("chain-4")
    best = {}
    for calibrate in (True, False):
        bandit = Bandit(TunerConfig(arms=("chain-4",), buckets=(1,), calibrate=calibrate, noise=0.1),
                        prior=lambda a, b: 1.05 if a.enabled else 1.0)
        assert bandit.calibration(8) == 0.0                           # nothing measured: the raw prediction
        for _ in range(40):
            bandit.update(8, OFF, 0.65)
            bandit.update(8, chain, 0.60)
        bandit.discount(lambda a: a.uses_drafter, 0.05)               # a new drafter version: 2 rewards' weight
        best[calibrate] = bandit.best(8)
        off_mean = 40 * math.log(0.65) / 42
        assert bandit.belief(8, OFF)[0] == pytest.approx(off_mean)    # off's own belief is never shifted
        shift = bandit.calibration(8) if calibrate else 0.0
        assert shift == pytest.approx(off_mean if calibrate else 0.0)
        assert bandit.belief(8, chain)[0] == pytest.approx((2 * (math.log(1.05) + shift) + 2 * math.log(0.60)) / 4)
    assert best == {True: OFF, False: chain}
