"""The adaptive engine's control: the batch-size switch, the controller's rewards and measured acceptance, the
cost model (with context), the tuner's prior file, config errors, and exactness of adaptive rollouts (the tuner
itself: tests/test_bandit.py)."""
from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.drafter import Drafter, DrafterConfig
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.adaptive import (
    AdaptiveConfig,
    AdaptiveController,
    DepthAcceptance,
    TunerConfig,
    default_threshold,
    timed_rollout,
)
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.rollout.prior import load_prior, save_prior
from tltlib.sim.costs import MeasuredCosts, iteration_time, plain_rate, predicted_speedup, switch_cost
from tltlib.sim.measure import measure_costs
from tltlib.spec.acceptance import expected_tokens
from tltlib.spec.strategy import OFF, SpecStrategy

ARMS = ("chain-2", "chain-6", "tree-4x2-8", "ngram-4")


def _costs(rows, tokens, target, widths=(1,), draft=(), contexts=(64.0,), **kw) -> MeasuredCosts:
    """A hand-made cost model: ``target[r][t]`` (and ``draft[r][w]``) seconds at each of ``contexts`` (one table per
    context when ``target[r]`` holds one row per context)."""
    def cube(table):
        return tuple(tuple(tuple(map(float, c)) for c in (r if np.ndim(r) == 2 else [r] * len(contexts)))
                     for r in table)
    return MeasuredCosts(tuple(rows), tuple(contexts), tuple(tokens), cube(target), tuple(widths),
                         cube(draft) if len(draft) else (), **kw)


# --------------------------------------------------------------------------------------------- controller
class _Versioned:
    version = 0


def test_controller_switches_on_at_the_threshold_and_back_off_when_rows_grow():
    d = _Versioned()
    ctl = AdaptiveController(AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=ARMS, buckets=(1, 4))), drafter=d)
    assert ctl.choose(0, 64) == OFF and ctl.choose(1, 9) == OFF
    assert ctl.choose(2, 8) == OFF                         # no prior: untried arms in order, off first
    ctl.tuner.update(8, OFF, 1.0)
    on = ctl.choose(2, 8)
    assert on.enabled
    ctl.tuner.update(3, OFF, 1.0)
    assert ctl.choose(3, 40) == OFF and ctl.choose(4, 3).enabled
    ctl.observe(on, 3, 30, 0.01)
    ctl.choose(4, 40)
    ctl.observe(OFF, 40, 40, 0.01)                          # plain steps above the threshold are not rewards
    assert ctl.log["arm"] == [on.name] and ctl.log["reward"] == [3000.0]
    ctl.choose(5, 8)
    b = ctl.tuner.bucket(3)
    assert list(ctl.tuner.weights[b][on]) == [1.0]
    d.version += 1                                         # a drafter training step happened: evidence discounted
    ctl.choose(6, 8)
    assert ctl.resets == 1 and list(ctl.tuner.weights[b][on]) == ([0.25] if on.uses_drafter else [1.0])
    assert AdaptiveController(AdaptiveConfig(threshold=0)).choose(0, 1) == OFF


def test_controller_can_keep_its_windows_when_the_drafter_changes():
    d = _Versioned()
    ctl = AdaptiveController(AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=("chain-4",), buckets=(1,)),
                                            on_drafter_change="keep"), drafter=d)
    arm = ctl.choose(0, 4)
    ctl.observe(arm, 4, 20, 0.01)
    d.version += 1
    ctl.choose(1, 4)
    assert ctl.resets == 0 and list(ctl.tuner.weights[0][arm]) == [1.0]
    ctl = AdaptiveController(AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=("chain-4",), buckets=(1,)),
                                            on_drafter_change="reset"), drafter=d)
    ctl.tuner.update(4, OFF, 1.0)
    arm = ctl.choose(0, 4)
    ctl.observe(arm, 4, 20, 0.01)
    d.version += 1
    ctl.choose(1, 4)
    assert ctl.resets == 1 and not ctl.tuner.rewards[0][arm]
    with pytest.raises(ValueError, match="on_drafter_change must be 'discount', 'reset' or 'keep', got 'clear'"):
        AdaptiveConfig(on_drafter_change="clear")


def test_default_thresholds():
    assert default_threshold("cpu") == 512 and default_threshold("cuda:0") == 32


# ---------------------------------------------------------------------------------------------- cost model
def test_expected_tokens_and_predictions():
    assert expected_tokens(SpecStrategy("chain", 4), 1.0) == 5 and expected_tokens(SpecStrategy("chain", 4), 0.0) == 1
    assert expected_tokens(SpecStrategy("chain", 2), [0.5, 0.5]) == pytest.approx(1.75)
    assert expected_tokens(SpecStrategy("tree", 4, 2, 8), 0.6) > expected_tokens(SpecStrategy("chain", 4), 0.6)
    # verify cost grows with tokens, more with rows; draft levels cost 10% of a plain step
    cm = _costs((1, 64), (1, 9), [[1.0, 1.1], [2.0, 16.0]], (1,), [[0.1], [0.2]])
    assert predicted_speedup(cm, OFF, 4, 0.9) == 1.0
    chain = SpecStrategy("chain", 8)
    small, large = predicted_speedup(cm, chain, 1, 0.9), predicted_speedup(cm, chain, 64, 0.9)
    assert small > 2.5 and large < 1.0                     # SD pays at batch 1 and loses at 64 in this model
    # one catch-up (which proposes the first draft) and depth - 1 draft levels, then the verify
    assert iteration_time(cm, 1, None, chain) == pytest.approx(1.1 + 8 * 0.1)
    # log-log in rows at each measured token count (sqrt at the geometric midpoint), then linear in tokens
    assert cm.forward(8, None, 5) == pytest.approx((np.sqrt(1.0 * 2.0) + np.sqrt(1.1 * 16.0)) / 2)
    assert cm.forward(1000, None, 1) == pytest.approx(2.0)       # clamped to the measured range


def test_measure_costs_on_a_small_model():
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      eos_token_ids=(2,), max_position_embeddings=160)
    torch.manual_seed(0)
    target = Transformer(cfg).eval()
    drafter = Drafter(DrafterConfig.from_target(cfg)).eval().attach(target)
    cm = measure_costs(target, drafter, rows=(1, 4), tokens=(1, 5), contexts=(16, 512), repeats=1)
    t, d = np.asarray(cm.target_s), np.asarray(cm.draft_s)
    assert t.shape == (2, 2, 2) and d.shape == (2, 2, 2) and len(cm.ragged_s) == 2
    assert cm.widths == (1, 4) and cm.catch_up_width == 64 and len(cm.catch_up_s) == 2
    # a catch-up's extra cost is a timing (on a model this small, 64 tokens per row can time as fast as 1): never
    # negative, and kept by the prior file
    assert switch_cost(cm, 4, None, 64) >= 0
    assert switch_cost(MeasuredCosts.from_dict(cm.to_dict()), 4, None, 64) == switch_cost(cm, 4, None, 64)
    assert cm.contexts == (16, 153)                             # 512 capped by the model's 160 positions
    assert np.isfinite(t).all() and (t > 0).all() and (d > 0).all()
    assert plain_rate(cm, 2) > 0 and np.isfinite(predicted_speedup(cm, SpecStrategy("tree", 3, 2, 4), 2, 0.7))


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
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=48), num_generations=3),
                        drafter=drafter)
    plain = eng.generate(prompts)
    ctl = AdaptiveController(AdaptiveConfig(threshold=12, tuner=TunerConfig(arms=ARMS, buckets=(1, 3, 6),
                                                                            rule="epsilon-greedy", epsilon=0.3)))
    for _ in range(2):                                      # the tuner keeps learning across rollouts
        res = eng.generate(prompts, strategy=ctl)
        assert torch.equal(plain.tokens, res.tokens) and torch.equal(plain.lengths, res.lengths)
    strategies = set(res.timeline["strategy"])
    assert "off" in strategies and len(strategies - {"off"}) >= 3    # plain above the threshold, arms explored
    on = res.timeline["strategy"] != "off"
    assert (res.timeline["active"][on] <= 12).all() and not on[res.timeline["active"] > 12].any()
    assert len(ctl.log["reward"]) > 0


def test_the_tuner_may_choose_block_verification_as_an_arm_of_its_own(small_pair):
    """``chain-3:block`` beside ``chain-3``: two arms, each rewarded for what it measured, and at T=0 the rollout
    stays the plain one whichever verifies."""
    target, drafter = small_pair
    prompts = [[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9], [1, 10, 11, 12]]
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=40), num_generations=2),
                        drafter=drafter)
    plain = eng.generate(prompts)
    arms = ("off", "chain-3", "chain-3:block")
    ctl = AdaptiveController(AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=arms, buckets=(1, 4, 8),
                                                                           rule="epsilon-greedy", epsilon=0.5)))
    res = eng.generate(prompts, strategy=ctl)
    assert torch.equal(plain.tokens, res.tokens)
    assert {"chain-3", "chain-3:block"} <= set(res.timeline["strategy"]) and set(ctl.log["arm"]) <= set(arms)


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
        wants_context = True

        def __init__(self):
            self.calls, self.hists = [], []

        def choose(self, step, active):
            return SpecStrategy("chain", 3)

        def observe(self, strategy, active, tokens, seconds, rows, context=None, accepted=None):
            self.calls.append((active, tokens, rows))
            self.hists.append((context, accepted))

    rec = Recorder()
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=30), num_generations=2),
                        drafter=drafter)
    res = eng.generate([[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9], [1, 10, 11, 12]], strategy=rec)
    assert all(rows <= active and tokens <= 4 * rows for active, tokens, rows in rec.calls)
    assert rec.calls[-1][2] == 0                         # the step that ended the last response
    assert any(rows < active for active, _, rows in rec.calls[:-1])      # responses end at different steps
    assert len(rec.calls) == len(res.timeline["iter_time"])
    # each SD step's histogram of rows by accepted drafts (0..3) is the timeline's, the context grows
    for (context, hist), tl_hist in zip(rec.hists, res.timeline["accept_hist"]):
        assert hist.shape == (4,) and (hist == tl_hist).all()
    contexts = [c for c, _ in rec.hists[:5]]
    assert contexts == sorted(contexts) and contexts[0] >= 2


def test_off_is_an_arm_and_is_rewarded():
    ctl = AdaptiveController(AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=("ngram-4",), buckets=(1,),
                                                                           rule="epsilon-greedy", epsilon=0.0)))
    for _ in range(6):                                         # min_samples (3) rewards for each arm
        arm = ctl.choose(0, 4)
        ctl.observe(arm, 4, 8 if arm.enabled else 4, 0.01)     # n-gram emits 2 tokens per row here, plain 1
    assert set(ctl.log["arm"]) == {"off", "ngram-4"}
    assert ctl.choose(1, 4).name == "ngram-4"


def test_prior_follows_measured_acceptance():
    cm = _costs((1, 64), (1, 9), [[1.0, 1.2], [2.0, 6.0]], (1,), [[0.05], [0.1]])
    ctl = AdaptiveController(AdaptiveConfig(threshold=64, tuner=TunerConfig(arms=("chain-2", "chain-8"),
                                                                            buckets=(1,))), cm)
    deep, shallow = SpecStrategy("chain", 8), SpecStrategy("chain", 2)
    assert ctl._prior(deep, 1) > ctl._prior(shallow, 1)        # the 0.8 prior favours depth at batch 1
    for _ in range(30):                                        # chain-2 steps that accept nothing: alpha -> 0
        ctl.choose(0, 4)
        ctl.observe(shallow, 4, 4, 0.01, accepted=np.array([4, 0, 0]))
    assert max(ctl.alpha["learned"]) < 0.05
    assert ctl._prior(deep, 1) < ctl._prior(shallow, 1) < 1.0


def test_depth_acceptance_recovers_the_rate_of_each_depth():
    acc = DepthAcceptance((0.5,), weight=4.0)
    rng = np.random.default_rng(0)
    truth = [0.9, 0.6, 0.3]
    for _ in range(400):                                       # chain-3 steps of 8 rows
        k = np.zeros(8, dtype=int)
        for r in range(8):
            while k[r] < 3 and rng.random() < truth[k[r]]:
                k[r] += 1
        acc.update(np.bincount(k, minlength=4))
    assert acc.rates(3) == pytest.approx(truth, abs=0.03)
    assert acc.rates(5)[3:] == [0.5, 0.5]                     # never reached: the prior
    deep = DepthAcceptance((0.5,), weight=0.0, depth=2)
    deep.update(np.array([0, 0, 0, 4]))                       # a chain-3 step: every row accepted all 3
    assert deep.rates(2) == [1.0, 1.0]                        # rows beyond the table still reached depth 2
    reached, before = acc.reached.copy(), acc.rates(3)
    acc.discount(0.25)
    assert acc.reached[:3] == pytest.approx(reached[:3] * 0.25) and acc.rates(3) == pytest.approx(before)


def test_a_discount_keeps_the_measured_rates_and_a_reset_returns_to_the_configured_prior():
    """A new drafter version weakens the evidence without moving the estimate (a stale drafter's 0.3 must not drift
    back to the optimistic configured 0.8), so the next steps move it faster; keep = 0 erases it; the state dict
    keeps the re-anchored prior."""
    acc = DepthAcceptance((0.8,), weight=4.0)
    for _ in range(5):
        acc.update(np.array([7, 3]))                               # chain-1 steps of 10 rows: 30% accepted
    measured = acc.rates(1)[0]
    assert measured == pytest.approx((15 + 3.2) / 54)
    acc.discount(0.1)
    assert acc.rates(1)[0] == pytest.approx(measured) and measured < acc.prior[0] < 0.8
    twin = DepthAcceptance((0.8,), weight=4.0)
    twin.load_state_dict(acc.state_dict())
    assert twin.rates(1) == pytest.approx(acc.rates(1))
    undiscounted = DepthAcceptance((0.8,), weight=4.0)
    for _ in range(5):
        undiscounted.update(np.array([7, 3]))
    for a in (acc, undiscounted):
        a.update(np.array([1, 9]))                                 # the new version: 90% accepted
    assert acc.rates(1)[0] - measured > 2 * (undiscounted.rates(1)[0] - measured)
    acc.discount(0.0)
    assert acc.rates(1) == [0.8] and acc.prior == [0.8]


def test_cost_model_scales_with_context_and_the_reward_is_normalised_by_it():
    cm = _costs((1, 16), (1, 9), [[[1.0, 1.2], [1.448, 1.648]], [[2.0, 4.0], [4.24, 6.24]]], contexts=(64.0, 512.0))
    assert cm.forward(1, 512, 1) == pytest.approx(1.448) and cm.forward(1, None, 1) == pytest.approx(1.0)
    assert cm.forward(16, 288, 1) == pytest.approx(3.12) and cm.forward(16, 288, 9) == pytest.approx(5.12)
    assert MeasuredCosts.from_dict(cm.to_dict()).to_dict() == cm.to_dict()
    with pytest.raises(ValueError, match="the tuner's arms \\['chain-2'\\] draft with the learned drafter but the cost "
                                         "model "
                                         "has no drafter timings"):
        AdaptiveController(AdaptiveConfig(threshold=16, tuner=TunerConfig(arms=("chain-2",), buckets=(1,))), cm)
    ctl = AdaptiveController(AdaptiveConfig(threshold=16, tuner=TunerConfig(arms=("ngram-4",), buckets=(1,))), cm)
    ctl.choose(0, 16)
    ctl.observe(OFF, 16, 16, 3.12, context=288)                 # plain decoding, as fast as the model says
    assert ctl.log["reward"] == [pytest.approx(1.0)]


def test_prior_file_round_trip_and_refusals(tmp_path, small_pair):
    target, drafter = small_pair
    cm = measure_costs(target, drafter, rows=(1, 2), tokens=(1, 5), contexts=(8, 32), repeats=1)
    ctl = AdaptiveController(AdaptiveConfig(threshold=4), cm, drafter)
    ctl.accept["learned"].update(np.array([1, 2, 5]))
    save_prior(tmp_path / "prior.json", ctl, target, drafter, recommended={"threshold": 4, "arms": ["off", "chain-4"]})
    costs, accept, threshold, arms, floor = load_prior(tmp_path / "prior.json", target, drafter)
    assert costs.to_dict() == cm.to_dict() and accept["learned"]["reached"][:2] == [8.0, 7.0]
    assert (threshold, arms, floor) == (4, ("off", "chain-4"), None)
    retrained = copy.deepcopy(drafter)                       # the same shape, other weights: another drafter
    with torch.no_grad():
        retrained.fc.weight[0, 0] += 1e-3
    with pytest.raises(ValueError, match="measured for another drafter"):
        load_prior(tmp_path / "prior.json", target, retrained)
    other = Transformer(ModelConfig(vocab_size=24, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2, eos_token_ids=(2,), max_position_embeddings=160))
    with pytest.raises(ValueError, match="measured for another model"):
        load_prior(tmp_path / "prior.json", other)
    import json
    d = json.loads((tmp_path / "prior.json").read_text())
    d["fingerprint"]["machine"]["cpu"] = "some other CPU"
    (tmp_path / "other.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="measured for another machine"):
        load_prior(tmp_path / "other.json", target, drafter)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tuner prior file"):
        load_prior(tmp_path / "bad.json", target, drafter)
    with pytest.raises(ValueError, match="no cost model"):
        save_prior(tmp_path / "x.json", AdaptiveController(), target)


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


# --------------------------------------------------------------------------------------------- switching charge
def _costs_with_a_slow_catch_up():
    """1 and 16 rows; a plain step 10/20 ms, a 3-token verify 11/24 ms; a drafter forward 1 ms at 1-4 tokens, a
    catch-up over a 64-entry backlog 200 ms."""
    return _costs((1, 16), (1, 3), [[0.010, 0.011], [0.020, 0.024]], (1, 4), [[0.001, 0.001], [0.001, 0.001]],
                  catch_up_width=64, catch_up_s=(0.2, 0.2))


def test_cost_model_catch_up_time_grows_with_the_backlog():
    cm = _costs_with_a_slow_catch_up()
    assert switch_cost(cm, 1, None, 1) == 0.0 and switch_cost(cm, 1, None, 4) == pytest.approx(3 / 63 * 0.199)
    assert switch_cost(cm, 1, None, 64) == pytest.approx(0.199)
    assert switch_cost(cm, 1, None, 124) == pytest.approx(0.199 * 123 / 63)  # extrapolated linearly past the widest
    none = _costs((1,), (1,), [[0.01]])
    assert switch_cost(none, 1, None, 100) == 0.0                 # no drafter timings: nothing to charge
    no_catch_up = _costs((1,), (1,), [[0.01]], (1, 4), [[0.001, 0.004]])   # drafter forwards, no catch-up timed
    assert switch_cost(no_catch_up, 1, None, 64) == pytest.approx(0.063)      # extrapolated from the draft widths


def test_switching_to_a_drafter_arm_is_charged_its_catch_up():
    """A drafter arm predicted 1.25x is played right after SD steps (backlog of a few entries) but not after a long
    stretch of plain decoding, whose catch-up it would pay; n-gram arms are never charged; horizon 0 = free."""
    chain = SpecStrategy("chain", 2)

    def controller(horizon):
        cfg = AdaptiveConfig(threshold=16, tuner=TunerConfig(arms=("chain-2", "ngram-4"), buckets=(1,), seed=0),
                             accept_prior=(0.5,), ngram_accept_prior=0.0, switch_horizon=horizon)
        return AdaptiveController(cfg, _costs_with_a_slow_catch_up())

    ctl = controller(16.0)
    # 1 + 0.5 + 0.25 tokens in a verify, a catch-up and one draft level
    assert ctl._prior(chain, 1) == pytest.approx(1.75 * 0.010 / (0.011 + 2 * 0.001))
    charge = ctl.switch_charge(1, 64)
    assert set(charge) == {chain} and charge[chain] == pytest.approx(np.log1p(0.199 / (16 * 0.013)))
    assert ctl.switch_charge(1, 1) == {} and controller(0.0).switch_charge(1, 64) == {}
    near = [ctl.choose(0, 1, backlog=2).name for _ in range(100)]
    far = [ctl.choose(0, 1, backlog=64).name for _ in range(100)]
    assert near.count("chain-2") > 80 and far.count("chain-2") < 5
    free = controller(0.0)
    assert [free.choose(0, 1, backlog=64).name for _ in range(100)].count("chain-2") > 80
    with pytest.raises(ValueError, match="switch_horizon"):
        AdaptiveConfig(switch_horizon=-1)


class _Recorder:
    wants_backlog = True

    def __init__(self, plan):
        self.plan, self.seen, self.uniform_left = plan, [], []

    def choose(self, iteration, active, backlog=0, uniform_left=0):
        self.seen.append(backlog)
        self.uniform_left.append(uniform_left)
        return self.plan(iteration)

    def observe(self, *a, **k):
        pass


def test_the_engine_tells_the_source_the_drafter_backlog(small_pair):
    """Each plain iteration adds one backlog entry per row; an SD step's catch-up empties it (then the step's
    emitted tokens are its new backlog, at most depth + 1)."""
    target, drafter = small_pair
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=24)), drafter=drafter)
    src = _Recorder(lambda i: SpecStrategy("chain", 3) if i in (6, 7) else OFF)
    res = eng.generate([[1, 7]], strategy=src)
    assert res.lengths[0] > 12, "the test needs a response longer than the probed iterations"
    seen = src.seen
    assert seen[1:6] == [seen[1] + k for k in range(5)]                # grows by one per plain iteration
    assert 1 <= seen[7] <= 4 and 1 <= seen[8] <= 4                     # after SD steps: that step's emitted tokens


def test_the_engine_tells_the_source_how_long_the_rows_stay_at_one_length(small_pair):
    """Equal prompts: the rows stay at one length while every step is plain, so the source is told the plain steps
    the longest row may still take (budget - iteration) until the first SD step, then 0; prompts of unequal
    lengths are ragged from the start (0)."""
    target, drafter = small_pair
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=24), num_generations=2),
                        drafter=drafter)
    src = _Recorder(lambda i: SpecStrategy("chain", 3) if i == 6 else OFF)
    res = eng.generate([[1, 7, 9], [1, 5, 6]], strategy=src)
    assert int(res.timeline["strategy"].size) > 8, "the test needs more than 8 decode iterations"
    assert src.uniform_left[:6] == [24 - i for i in range(1, 7)] and set(src.uniform_left[6:]) == {0}
    ragged = _Recorder(lambda i: OFF)
    eng.generate([[1, 7], [1, 5, 6]], strategy=ragged)
    assert set(ragged.uniform_left) == {0}


def test_an_sd_step_that_would_leave_the_rows_ragged_is_charged_for_the_masked_steps_after_it():
    """While rows are at one length, any SD arm (n-gram too) is charged the extra seconds of every plain step left
    (``MeasuredCosts.ragged_extra`` x ``uniform_left``), amortised over the horizon; once ragged (0), nothing; a cost
    model without the measurement charges nothing for it."""
    ngram, chain = SpecStrategy("ngram", 4), SpecStrategy("chain", 2)
    base = _costs_with_a_slow_catch_up()
    costs = replace(base, ragged_s=(0.0105, 0.0210))
    assert costs.ragged_extra(1) == pytest.approx(0.0005) and costs.ragged_extra(16) == pytest.approx(0.001)
    assert base.ragged_extra(16) == 0.0
    assert MeasuredCosts.from_dict(costs.to_dict()).ragged_extra(16) == pytest.approx(0.001)
    cfg = AdaptiveConfig(threshold=16, tuner=TunerConfig(arms=("chain-2", "ngram-4"), buckets=(1,), seed=0),
                         accept_prior=(0.5,), ngram_accept_prior=0.5, switch_horizon=16.0)
    ctl = AdaptiveController(cfg, costs)
    charge = ctl.switch_charge(1, 1, uniform_left=400)
    t_ngram, t_chain = iteration_time(costs, 1, None, ngram), iteration_time(costs, 1, None, chain)
    assert charge[ngram] == pytest.approx(np.log1p(0.0005 * 400 / (16 * t_ngram)))
    assert charge[chain] == pytest.approx(np.log1p(0.0005 * 400 / (16 * t_chain)))
    both = ctl.switch_charge(1, 64, uniform_left=400)[chain]
    assert both == pytest.approx(np.log1p((0.199 + 0.0005 * 400) / (16 * t_chain)))
    assert ctl.switch_charge(1, 1, uniform_left=0) == {}
    assert AdaptiveController(cfg, base).switch_charge(1, 1, uniform_left=400) == {}
    uniform = [ctl.choose(0, 1, uniform_left=400).name for _ in range(100)]
    ragged = [ctl.choose(0, 1, uniform_left=0).name for _ in range(100)]
    assert uniform.count("off") > ragged.count("off") + 30


def test_acceptance_is_measured_per_batch_size_bucket_and_shrunk_towards_the_familys():
    """A drafter right early in responses (many rows) and wrong late (few rows): each bucket's prior follows what
    chain steps measured there, a bucket without steps the family's overall rate; kept in the state dict; a new
    drafter version discounts the buckets' evidence too."""
    cfg = AdaptiveConfig(threshold=64, tuner=TunerConfig(arms=("chain-2",), buckets=(1, 8, 32), seed=0),
                         accept_prior=(0.5,))
    ctl = AdaptiveController(cfg, _costs_with_a_slow_catch_up())
    chain = SpecStrategy("chain", 2)
    ctl._tuned = True
    for _ in range(5):
        ctl.observe(chain, 40, 120, 0.1, accepted=np.array([0, 4, 36]))      # 40 rows: 90% accept both depths
        ctl.observe(chain, 4, 5, 0.1, accepted=np.array([3, 1, 0]))          # 4 rows: 25% at depth 1
    many, few, none = ctl.acceptance(chain, 40), ctl.acceptance(chain, 4), ctl.acceptance(chain, 16)
    assert many[0] > 0.9 and few[0] < 0.4 and none == ctl.accept["learned"].rates(2)
    assert few[0] < none[0] < many[0]
    twin = AdaptiveController(cfg, _costs_with_a_slow_catch_up())
    twin.load_state_dict(ctl.state_dict())
    assert twin.acceptance(chain, 4) == few and twin.acceptance(chain, 40) == many
    reached = ctl.bucket_accept[("learned", ctl.tuner.bucket(4))].reached.sum()
    ctl.drafter = type("D", (), {"version": 7})()
    ctl.choose(0, 4)
    assert ctl.bucket_accept[("learned", ctl.tuner.bucket(4))].reached.sum() == pytest.approx(
        reached * cfg.tuner.discount)


def test_measured_costs_hold_the_ragged_forward_and_leave_the_cache_uniform(small_pair):
    target, _ = small_pair
    costs = measure_costs(target, None, rows=[1, 4], tokens=(1, 3), contexts=(8, 16), repeats=1)
    assert len(costs.ragged_s) == 2 and np.all(np.asarray(costs.ragged_s) > 0)
    assert costs.ragged_s[0] == costs.target_s[0][0][0]                # one row cannot be ragged
    assert costs.ragged_extra(4) >= 0.0


def _spy_on_graph_pools(monkeypatch) -> list:
    """Every ``GraphPool.run`` call: (name, running rows, new slots, the cache's length, the pool's GraphConfig)."""
    from tltlib.model.cudagraph import GraphPool
    calls, run = [], GraphPool.run

    def spy(self, name, fn, cache, new_slots, inputs):
        calls.append((name, int(inputs[0].shape[0]), new_slots, cache.max_len, self.config))
        return run(self, name, fn, cache, new_slots, inputs)
    monkeypatch.setattr(GraphPool, "run", spy)
    return calls


def test_on_cuda_the_costs_are_measured_through_the_rollouts_graphs(small_pair, monkeypatch):
    """Where the rollout replays CUDA graphs (faked here: ``GraphConfig.active``; on a CPU the pool runs its padded
    fixed-span call eagerly), each measured target forward and drafter level goes through a GraphPool of the
    rollout's GraphConfig at the row and span bucket the rollout uses; the catch-up stays eager."""
    from tltlib.model.cudagraph import GraphConfig
    target, drafter = small_pair
    calls = _spy_on_graph_pools(monkeypatch)
    monkeypatch.setattr(GraphConfig, "active", lambda self, device: self.enabled)
    graphs = GraphConfig(max_rows=2, min_span=16)
    costs = measure_costs(target, drafter, rows=(1, 2, 4), tokens=(1, 5), contexts=(8, 32), widths=(1, 3),
                          catch_up_width=6, repeats=1, graphs=graphs)
    assert {c[4] for c in calls} == {graphs}
    seen = {(name, rows, n, length) for name, rows, n, length, _ in calls}
    # 32 + 5 + 1 slots -> the span bucket 64 (16 doubled); rows above graphs.max_rows are eager in the pool too
    assert {(r, n, length) for name, r, n, length in seen if name == "target"} == {
        (r, n, length) for r in (1, 2, 4) for n in (1, 5) for length in (16, 64)}
    assert {(r, n) for name, r, n, _ in seen if name == "draft"} == {(r, w) for r in (1, 2, 4) for w in (1, 3)}
    assert all(n != 6 for name, _, n, _ in seen if name == "draft")          # the catch-up: eager
    assert np.all(np.asarray(costs.target_s) > 0) and np.all(np.asarray(costs.draft_s) > 0)
    del calls[:]
    measure_costs(target, drafter, rows=(1, 2), tokens=(1,), contexts=(8,), repeats=1,
                  graphs=GraphConfig(enabled=False))                         # the rollout without graphs: eager
    assert calls == []


def test_on_a_cpu_the_costs_are_measured_without_graphs(small_pair, monkeypatch):
    target, drafter = small_pair
    calls = _spy_on_graph_pools(monkeypatch)
    costs = measure_costs(target, drafter, rows=(1, 2), tokens=(1, 3), contexts=(8, 16), repeats=1)
    assert calls == [] and np.all(np.asarray(costs.target_s) > 0)


def test_only_a_switch_catch_up_is_left_out_of_the_reward(small_pair, monkeypatch):
    """The catch-up after plain iterations is a switching cost (charged at the choice, left out of the arm's reward);
    the catch-up of an SD step right after another feeds that step's tokens, a cost of every SD step, so it stays
    in the reward (leaving it out made SD look cheaper than it is in steady state)."""
    from tltlib.spec.step import SpecDecoder
    seen = []
    orig = SpecDecoder.draft_and_verify

    def spy(self, *a, **k):
        out = orig(self, *a, **k)
        seen.append(out.catchup_s)
        return out
    monkeypatch.setattr(SpecDecoder, "draft_and_verify", spy)
    target, drafter = small_pair
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=24)), drafter=drafter)
    res = eng.generate([[1, 7]], strategy=_Recorder(lambda i: SpecStrategy("chain", 3) if i in (6, 7) else OFF))
    assert res.lengths[0] > 12 and len(seen) == 2
    assert seen[0] > 0 and seen[1] == 0.0
