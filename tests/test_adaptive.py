"""The adaptive engine's control: BEG-MAB on synthetic rewards (converges, re-explores), the batch-size switch,
the cost model, config errors, and exactness of adaptive rollouts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tltlib.adaptive import (BEGMAB, AdaptiveConfig, AdaptiveController, CostModel, TunerConfig, default_threshold,
                             expected_tokens, measure_costs, timed_rollout)
from tltlib.drafter import Drafter, DrafterConfig
from tltlib.model import ModelConfig, Transformer
from tltlib.rollout import RolloutConfig, RolloutEngine
from tltlib.sampling import SamplingConfig
from tltlib.speculative import OFF, SpecStrategy

ARMS = ("chain-2", "chain-6", "tree-4x2-8", "ngram-4")


def _play(bandit, reward_of, batch, steps, rng):
    for _ in range(steps):
        arm = bandit.select(batch)
        bandit.update(batch, arm, reward_of[arm.name] + rng.normal(0, 0.3))


def test_bandit_converges_to_the_best_arm_per_bucket():
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1, 8), epsilon=0.1, window=30, seed=1))
    rng = np.random.default_rng(0)
    small = {"chain-2": 1.0, "chain-6": 2.0, "tree-4x2-8": 1.5, "ngram-4": 0.8}
    large = {"chain-2": 1.6, "chain-6": 1.1, "tree-4x2-8": 0.9, "ngram-4": 1.2}
    _play(bandit, small, 3, 400, rng)
    _play(bandit, large, 20, 400, rng)
    assert bandit.best(1).name == "chain-6" and bandit.best(20).name == "chain-2"
    plays = {r["arm"]: r["plays"] for r in bandit.summary() if r["bucket"] == 0}
    assert plays["chain-6"] > 0.8 * 400 and min(plays.values()) >= 1          # exploited, and every arm tried


def test_untried_arms_first_in_prior_order():
    prior = {"chain-2": 0.5, "chain-6": 3.0, "tree-4x2-8": 2.0, "ngram-4": 1.0}
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), prune=0.0), prior=lambda a, b: prior[a.name])
    order = []
    for _ in range(4):
        arm = bandit.select(1)
        order.append(arm.name)
        bandit.update(1, arm, 1.0)
    assert order == ["chain-6", "tree-4x2-8", "ngram-4", "chain-2"]


def test_under_tried_arms_are_played_round_robin_until_min_samples():
    prior = {"chain-2": 0.5, "chain-6": 3.0, "tree-4x2-8": 2.0, "ngram-4": 1.0}
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), prune=0.0, epsilon=0.0, min_samples=3),
                    prior=lambda a, b: prior[a.name])
    order = []
    for _ in range(12):
        arm = bandit.select(1)
        order.append(arm.name)
        bandit.update(1, arm, 5.0 if arm.name == "chain-2" else 1.0)   # the arm the prior ranks last is best
    assert order == ["chain-6", "tree-4x2-8", "ngram-4", "chain-2"] * 3
    assert bandit.select(1).name == "chain-2"
    with pytest.raises(ValueError, match="min_samples"):
        TunerConfig(min_samples=0)


def test_bandit_re_explores_after_a_reset_and_tracks_a_change():
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), epsilon=0.1, window=20, seed=2))
    rng = np.random.default_rng(1)
    before = {"chain-2": 1.0, "chain-6": 2.0, "tree-4x2-8": 1.5, "ngram-4": 0.8}
    after = {"chain-2": 2.5, "chain-6": 0.7, "tree-4x2-8": 1.2, "ngram-4": 0.9}
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
    # without a reset, epsilon exploration and the sliding window also follow a change
    _play(bandit, before, 1, 400, rng)
    assert bandit.best(1).name == "chain-6"


def test_prior_prunes_hopeless_arms_until_measurements_say_otherwise():
    prior = {"chain-2": 0.5, "chain-6": 3.0, "tree-4x2-8": 2.0, "ngram-4": 1.0}
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), prune=0.5, epsilon=1.0), prior=lambda a, b: prior[a.name])
    assert {a.name for a in bandit.candidates(1)} == {"chain-6", "tree-4x2-8"}
    played = set()
    for _ in range(200):
        arm = bandit.select(1)
        played.add(arm.name)
        bandit.update(1, arm, 1.0)
    assert played == {"chain-6", "tree-4x2-8"}               # explored, but never the ruled-out arms
    prior["ngram-4"] = 2.9                                    # e.g. measured acceptance raised its prediction
    assert "ngram-4" in {a.name for a in bandit.candidates(1)}
    with pytest.raises(ValueError, match=r"prune must be in \[0, 1\]"):
        TunerConfig(prune=1.5)


def test_epsilon_zero_never_explores_and_one_always_does():
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), epsilon=0.0, min_samples=1))
    for a in bandit.bucket_arms[0]:
        bandit.update(1, a, 2.0 if a.name == "ngram-4" else 1.0)
    assert {bandit.select(1).name for _ in range(50)} == {"ngram-4"}
    bandit = BEGMAB(TunerConfig(arms=ARMS, buckets=(1,), epsilon=1.0, seed=3, min_samples=1))
    for a in bandit.bucket_arms[0]:
        bandit.update(1, a, 2.0 if a.name == "ngram-4" else 1.0)
    assert len({bandit.select(1).name for _ in range(200)}) == 4


def test_tuner_config_errors():
    with pytest.raises(ValueError, match="arms is empty"):
        TunerConfig(arms=())
    with pytest.raises(ValueError, match="strictly increasing"):
        TunerConfig(buckets=(1, 8, 4))
    with pytest.raises(ValueError, match="start at batch size 1"):
        TunerConfig(buckets=(2, 8))
    for eps in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"epsilon must be in \[0, 1\]"):
            TunerConfig(epsilon=eps)
    with pytest.raises(ValueError, match="bucket 1 .* has no arm"):
        TunerConfig(arms=ARMS, buckets=(1, 4), bucket_arms=(("chain-2",), ()))
    with pytest.raises(ValueError, match="bucket 1 .* has no arm"):
        TunerConfig(arms=("chain-8",), buckets=(1, 64), max_verify_rows=256)
    with pytest.raises(ValueError, match="one tuple of arms per bucket"):
        TunerConfig(arms=ARMS, buckets=(1, 4), bucket_arms=(("chain-2",),))
    with pytest.raises(ValueError, match="cannot read speculative strategy"):
        TunerConfig(arms=("chain4",))
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        AdaptiveConfig(threshold=-1)
    with pytest.raises(ValueError, match="accept_prior"):
        AdaptiveConfig(accept_prior=(1.2,))


def test_max_verify_rows_drops_big_arms_from_big_buckets():
    cfg = TunerConfig(arms=("chain-2", "chain-8"), buckets=(1, 64), max_verify_rows=256)
    assert [[a.name for a in arms] for arms in cfg.arms_per_bucket()] == [["chain-2", "chain-8"], ["chain-2"]]


# --------------------------------------------------------------------------------------------- controller
class _Versioned:
    version = 0


def test_controller_switches_on_at_the_threshold_and_back_off_when_rows_grow():
    d = _Versioned()
    ctl = AdaptiveController(AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=ARMS, buckets=(1, 4))), drafter=d)
    assert ctl.choose(0, 64) == OFF and ctl.choose(1, 9) == OFF
    on = ctl.choose(2, 8)
    assert on.enabled
    assert ctl.choose(3, 40) == OFF and ctl.choose(4, 3).enabled
    ctl.observe(on, 3, 30, 0.01)
    ctl.choose(4, 40)
    ctl.observe(OFF, 40, 40, 0.01)                          # plain steps above the threshold are not rewards
    assert ctl.log["arm"] == [on.name] and ctl.log["reward"] == [3000.0]
    ctl.choose(5, 8)
    assert len(ctl.tuner.windows[ctl.tuner.bucket(3)][on]) == 1
    d.version += 1                                         # a drafter training step happened
    ctl.choose(6, 8)
    assert ctl.resets == 1 and (not ctl.tuner.windows[ctl.tuner.bucket(3)][on]) == on.uses_drafter
    assert AdaptiveController(AdaptiveConfig(threshold=0)).choose(0, 1) == OFF


def test_controller_can_keep_its_windows_when_the_drafter_changes():
    d = _Versioned()
    ctl = AdaptiveController(AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=("chain-4",), buckets=(1,)),
                                            on_drafter_change="keep"), drafter=d)
    arm = ctl.choose(0, 4)
    ctl.observe(arm, 4, 20, 0.01)
    d.version += 1
    ctl.choose(1, 4)
    assert ctl.resets == 0 and len(ctl.tuner.windows[0][arm]) == 1
    with pytest.raises(ValueError, match="on_drafter_change must be 'reset' or 'keep', got 'clear'"):
        AdaptiveConfig(on_drafter_change="clear")


def test_default_thresholds():
    assert default_threshold("cpu") == 512 and default_threshold("cuda:0") == 32


# ---------------------------------------------------------------------------------------------- cost model
def test_expected_tokens_and_predictions():
    assert expected_tokens(SpecStrategy("chain", 4), 1.0) == 5 and expected_tokens(SpecStrategy("chain", 4), 0.0) == 1
    assert expected_tokens(SpecStrategy("chain", 2), [0.5, 0.5]) == pytest.approx(1.75)
    assert expected_tokens(SpecStrategy("tree", 4, 2, 8), 0.6) > expected_tokens(SpecStrategy("chain", 4), 0.6)
    # verify cost grows with tokens, more with rows; draft levels cost 10% of a plain step
    batches, tokens = np.array([1.0, 64.0]), np.array([1.0, 9.0])
    cm = CostModel(batches, tokens, np.array([[1.0, 1.1], [2.0, 16.0]]), np.array([1.0]), np.array([[0.1], [0.2]]))
    assert cm.predict(OFF, 4, 0.9) == 1.0
    small, large = cm.predict(SpecStrategy("chain", 8), 1, 0.9), cm.predict(SpecStrategy("chain", 8), 64, 0.9)
    assert small > 2.5 and large < 1.0                     # SD pays at batch 1 and loses at 64 in this model
    # log-log in rows at each measured token count (sqrt at the geometric midpoint), then linear in tokens
    assert cm.target_time(8, 5) == pytest.approx((np.sqrt(1.0 * 2.0) + np.sqrt(1.1 * 16.0)) / 2)
    assert cm.target_time(1000, 1) == pytest.approx(2.0)       # clamped to the measured range


def test_measure_costs_on_a_small_model():
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      eos_token_ids=(2,), max_position_embeddings=160)
    torch.manual_seed(0)
    target = Transformer(cfg).eval()
    drafter = Drafter(DrafterConfig.from_target(cfg)).eval().attach(target)
    cm = measure_costs(target, drafter, batches=(1, 4), tokens=(1, 5), context=16, repeats=1)
    assert cm.target_s.shape == (2, 2) and cm.draft_s.shape == (2, 2)
    assert np.isfinite(cm.target_s).all() and (cm.target_s > 0).all() and (cm.draft_s > 0).all()
    assert cm.plain_rate(2) > 0 and np.isfinite(cm.predict(SpecStrategy("tree", 3, 2, 4), 2, 0.7))


# ------------------------------------------------------------------------------------------ in the engine
@pytest.fixture(scope="module")
def small_pair():
    """A small random target and a random (poor) drafter attached to it."""
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      eos_token_ids=(2,), pad_token_id=0, max_position_embeddings=160)
    torch.manual_seed(0)
    target = Transformer(cfg, init_std=0.4).eval()
    return target, Drafter(DrafterConfig.from_target(cfg), init_std=0.3).eval().attach(target)


def test_adaptive_rollout_is_token_identical_to_plain_at_temperature_zero(small_pair):
    target, drafter = small_pair
    prompts = [[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9], [1, 10, 11, 12], [1, 13], [1, 4, 4]]
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=48), group_size=3),
                        drafter=drafter)
    plain = eng.generate(prompts)
    ctl = AdaptiveController(AdaptiveConfig(threshold=12, tuner=TunerConfig(arms=ARMS, buckets=(1, 3, 6),
                                                                            epsilon=0.3)))
    for _ in range(2):                                      # the tuner keeps learning across rollouts
        res = eng.generate(prompts, strategy=ctl)
        assert torch.equal(plain.tokens, res.tokens) and torch.equal(plain.lengths, res.lengths)
    strategies = set(res.timeline["strategy"])
    assert "off" in strategies and len(strategies - {"off"}) >= 3    # plain above the threshold, arms explored
    on = res.timeline["strategy"] != "off"
    assert (res.timeline["active"][on] <= 12).all() and (res.timeline["active"][~on] > 12).all()
    assert len(ctl.log["reward"]) > 0


def test_reward_counts_only_rows_that_keep_running():
    ctl = AdaptiveController(AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=("chain-4",), buckets=(1,))))
    arm = ctl.choose(0, 4)
    ctl.observe(arm, 4, 15, 0.01, rows=3)       # 3 rows kept running with 5 tokens each; 1 ended
    assert ctl.log["reward"] == [pytest.approx(5 * 4 / 0.01)]
    ctl.choose(1, 1)
    ctl.observe(arm, 1, 0, 0.01, rows=0)        # the last row ended: no evidence about the arm
    assert len(ctl.log["reward"]) == 1


def test_engine_reports_only_continuing_rows(small_pair):
    target, drafter = small_pair

    class Recorder:
        def __init__(self):
            self.calls = []

        def choose(self, step, active):
            return SpecStrategy("chain", 3)

        def observe(self, strategy, active, tokens, seconds, rows):
            self.calls.append((active, tokens, rows))

    rec = Recorder()
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=30), group_size=2),
                        drafter=drafter)
    res = eng.generate([[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9], [1, 10, 11, 12]], strategy=rec)
    assert all(rows <= active and tokens <= 4 * rows for active, tokens, rows in rec.calls)
    assert rec.calls[-1][2] == 0                         # the step that ended the last response
    assert any(rows < active for active, _, rows in rec.calls[:-1])      # responses end at different steps
    assert len(rec.calls) == len(res.timeline["iter_time"])


def test_off_can_be_an_arm_and_is_rewarded():
    ctl = AdaptiveController(AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=("off", "ngram-4"), buckets=(1,),
                                                                           epsilon=0.0)))
    for _ in range(6):                                         # min_samples (3) rewards for each arm
        arm = ctl.choose(0, 4)
        ctl.observe(arm, 4, 8 if arm.enabled else 4, 0.01)     # n-gram emits 2 tokens per row here, plain 1
    assert set(ctl.log["arm"]) == {"off", "ngram-4"}
    assert ctl.choose(1, 4).name == "ngram-4"


def test_prior_follows_measured_acceptance():
    batches, tokens = np.array([1.0, 64.0]), np.array([1.0, 9.0])
    cm = CostModel(batches, tokens, np.array([[1.0, 1.2], [2.0, 6.0]]), np.array([1.0]), np.array([[0.05], [0.1]]))
    ctl = AdaptiveController(AdaptiveConfig(threshold=64, tuner=TunerConfig(arms=("chain-2", "chain-8"),
                                                                            buckets=(1,))), cm)
    deep, shallow = SpecStrategy("chain", 8), SpecStrategy("chain", 2)
    assert ctl._prior(deep, 1) > ctl._prior(shallow, 1)        # the 0.8 prior favours depth at batch 1
    for _ in range(30):                                        # chain-2 steps that accept nothing: alpha -> 0
        ctl.choose(0, 4)
        ctl.observe(shallow, 4, 4, 0.01)
    assert ctl.alpha["learned"] < 0.1
    assert ctl._prior(deep, 1) < ctl._prior(shallow, 1) < 1.0


def test_best_by_bucket_names_the_best_measured_arm_of_each_bucket():
    bandit = BEGMAB(TunerConfig(arms=("chain-2", "chain-6"), buckets=(1, 4, 16), min_samples=1))
    for arm, batch, reward in (("chain-2", 2, 1.5), ("chain-6", 2, 2.5), ("chain-2", 8, 1.2), ("chain-6", 8, 0.9)):
        bandit.update(batch, SpecStrategy.parse(arm), reward)
    rows = bandit.best_by_bucket()
    assert [(r["batch_lo"], r["batch_hi"], r["arm"], r["median_reward"]) for r in rows] == [
        (1, 3, "chain-6", 2.5), (4, 15, "chain-2", 1.2)]                  # bucket 16+ has no measurement


def test_accept_prior_per_arm_family():
    cfg = AdaptiveConfig(accept_prior=(0.9, 0.7), ngram_accept_prior=0.2)
    assert cfg.accept_for(SpecStrategy.parse("chain-4")) == (0.9, 0.7)
    assert cfg.accept_for(SpecStrategy.parse("ngram-4")) == 0.2


def test_timed_rollout_runs_the_named_strategy_seeded(small_pair):
    target, drafter = small_pair
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0.9, max_new_tokens=12)), drafter=drafter)
    a, sa = timed_rollout(eng, [[1, 5, 6]], "chain-3", seed=4)
    b, _ = timed_rollout(eng, [[1, 5, 6]], SpecStrategy.parse("chain-3"), seed=4)
    assert sa > 0 and torch.equal(a.tokens, b.tokens) and set(a.timeline["strategy"]) == {"chain-3"}
