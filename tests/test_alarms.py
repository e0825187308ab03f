"""The alarms of SD's and the online drafter's silent failures, each caused on purpose (a random drafter, a drafter
trained for another policy, SD forced where plain decoding is faster, a drafter training skipped, an engine holding
another copy of the drafter) and seen to fire within 5 SD steps, once; none on the shipped tiny drafter. And
``drafter_train: on_drift``: the drafter trains when its acceptance falls from its best, and not otherwise."""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from tltlib.metrics import is_metric
from tltlib.model.decoder import Transformer
from tltlib.model.drafter import Drafter, DrafterConfig
from tltlib.model.loading import load
from tltlib.model.sampling import SamplingConfig
from tltlib.rl import online
from tltlib.rl.config import TLTConfig
from tltlib.rl.drift import DriftGate, accept_by_strategy, accept_vs_best, plateaued
from tltlib.rl.grpo import GRPOConfig
from tltlib.rl.trainer import GRPOTrainer
from tltlib.rollout.alarms import (
    AlarmConfig,
    Alarms,
    AlarmWarning,
    WatchedSource,
    accept_moments,
    card_acceptance,
    card_floor,
    floor_breached,
    slower_than,
)
from tltlib.rollout.config import RolloutConfig
from tltlib.rollout.engine import RolloutEngine
from tltlib.spec.strategy import SpecStrategy
from tltlib.tasks.chain import ChainTaskConfig, generate_problems
from tltlib.tasks.prompts import encode_prompts

CHAIN = SpecStrategy.parse("chain-4")
PROBLEMS = generate_problems(ChainTaskConfig(min_steps=3, max_steps=6), 40, seed=3)
ARGS = GRPOConfig(num_generations=4, generation_batch_size=16, max_completion_length=72, temperature=0.9,
                  learning_rate=1e-3, max_steps=3, seed=5, micro_batch_tokens=400)
TLT = TLTConfig(speculative="chain-4", drafter_steps=2, drafter_batch=2, drafter_lr=1e-3)


@pytest.fixture(scope="module")
def shipped():
    return load("data/tiny-reasoner", "data/tiny-reasoner-drafter")


def _hist(accepted_per_row: list[int], depth: int = 4) -> np.ndarray:
    return np.bincount(accepted_per_row, minlength=depth + 1)


def _fired(alarms: Alarms) -> dict:
    return {k: v for k, v in alarms.fired_at.items() if v}


# ------------------------------------------------------------------------------------------- pure alarms
def test_the_floor_fires_once_at_the_patience_th_low_step_and_rearms_after_recovering():
    alarms = Alarms(AlarmConfig(accept_floor=2.0, patience=5, min_rows=16), floor_source="test")
    for _ in range(10):                                    # a good drafter: 4 drafts of 4 accepted
        alarms.sd_step(CHAIN, _hist([4] * 8))
    assert not _fired(alarms)
    with pytest.warns(AlarmWarning, match="accept_floor.*under the floor 2.00"):
        for _ in range(10):                                # it breaks: nothing accepted
            alarms.sd_step(CHAIN, _hist([0] * 8))
    # at the 4th bad step the last 5 steps' mean is under 2, (1 x 5 + 4 x 1) / 5 = 1.8, but within 3 standard errors
    # of their spread (1.8 + 3 x 0.26 = 2.57); at the 5th every row-step accepted nothing: 1 + 3 x 0.08 < 2
    assert alarms.fired_at["accept_floor"] == [15]
    assert alarms.metrics()["alarm/accept_floor"] == 1.0 and alarms.metrics()["alarm/accept_floor"] == 0.0
    for _ in range(10):
        alarms.sd_step(CHAIN, _hist([4] * 8))
    with pytest.warns(AlarmWarning):
        for _ in range(5):
            alarms.sd_step(CHAIN, _hist([0] * 8))
    assert len(alarms.fired_at["accept_floor"]) == 2


def test_the_floor_judges_only_the_learned_drafter_and_waits_for_enough_rows():
    alarms = Alarms(AlarmConfig(accept_floor=2.0, patience=5, min_rows=16))
    ngram = SpecStrategy.parse("ngram-4")
    for _ in range(20):
        alarms.sd_step(ngram, _hist([0, 0]))              # a model-free drafter accepting nothing: its nature
    assert not _fired(alarms)
    with pytest.warns(AlarmWarning):
        for k in range(8):                                 # two rows per step: 8 steps make 16 row-steps
            alarms.sd_step(CHAIN, _hist([0, 0]))
            assert bool(alarms.fired_at["accept_floor"]) == (k == 7)


def test_floor_breached_needs_the_mean_under_the_floor_by_z_standard_errors():
    # 16 row-steps accepting nothing: 1 + 3 x sqrt(1/4 / 16) = 1.375 (the spread floored at a quarter token squared)
    assert floor_breached(*accept_moments(_hist([0] * 16)), 1.4, 3.0) == (True, 1.0, 16)
    assert not floor_breached(*accept_moments(_hist([0] * 16)), 1.37, 3.0)[0]
    # mean 1.5 with a spread: 1.5 + 3 x 0.27 = 2.30 clears a floor of 2.15, the mean alone (z = 0) does not
    uneven = accept_moments(_hist([0, 0, 0, 3, 0, 0, 1, 0] * 2))
    assert floor_breached(*uneven, 2.15, 3.0)[:2] == (False, 1.5) and floor_breached(*uneven, 2.15, 0.0)[0]
    assert floor_breached(*accept_moments(np.zeros(5)), 2.0, 3.0) == (False, 0.0, 0)
    with pytest.raises(ValueError, match="confidence_z"):
        AlarmConfig(confidence_z=-1.0)


def test_a_tails_hard_stretch_stays_quiet_but_a_drafter_accepting_nothing_does_not():
    """A tail's last rows meet a stretch their drafter predicts poorly (text sampled at high entropy): under the
    floor on average but unevenly, or at one row (one response: not judged); a drafter that fits no policy accepts
    nothing at every row-step."""
    alarms = _card_alarms()
    for k in range(48):
        alarms.sd_step(CHAIN, _hist([[0, 0, 0, 3, 0, 0, 1, 0][k % 8]] * 2))
        alarms.sd_step(CHAIN, _hist([0]), speedup=0.3, active=1)        # the last row: not judged
    assert not _fired(alarms)
    with pytest.warns(AlarmWarning, match="accept_floor.*by more than 3 standard errors"):
        for _ in range(8):
            alarms.sd_step(CHAIN, _hist([0, 0]))
    with pytest.raises(ValueError, match="min_active"):
        AlarmConfig(min_active=0)


def test_the_floor_comes_from_the_card():
    acc = card_acceptance("data/tiny-reasoner-drafter")
    assert acc["chain-4"] == pytest.approx(4.85, abs=0.01) and card_floor(acc, 0.3) == pytest.approx(2.15, abs=0.01)
    assert card_acceptance("data") == {} and card_acceptance(None) == {} and card_floor({}, 0.3) is None
    alarms = online.alarms_for(TLTConfig(), None, type("D", (), {"source": "data/tiny-reasoner-drafter"})())
    assert alarms.floor == pytest.approx(2.15, abs=0.01) and "chain-4 4.85" in alarms.floor_source
    assert online.alarms_for(TLTConfig(accept_floor=3.0), None, None).floor == 3.0
    assert online.alarms_for(TLTConfig(alarms=False), None, None) is None
    with pytest.raises(ValueError, match="accept_floor.*>= 1"):
        TLTConfig(accept_floor=0.5)


def test_sd_slower_needs_patience_consecutive_slow_sd_steps():
    alarms = Alarms(AlarmConfig(patience=5, slower_ratio=0.75))
    for _ in range(4):
        alarms.sd_step(CHAIN, speedup=0.5)
    alarms.plain_step()                                   # the tuner turned SD off: the run of SD steps ends
    for _ in range(4):
        alarms.sd_step(CHAIN, speedup=0.5)
    with pytest.warns(AlarmWarning, match=r"sd_slower: the last 5 SD steps \(chain-4 the latest\) ran at 0.53x plain"):
        alarms.sd_step(CHAIN, speedup=0.7)                # 0.53x, 3 x 0.1 / sqrt(5) = 0.13 under log(0.75)
    assert alarms.fired_at["sd_slower"] == [9]
    for speedups in ([0.6, 1.3, 0.7, 1.2, 0.9],          # around 1
                     [0.3, 1.2, 0.5, 1.0, 0.6]):          # 0.64x on average, unevenly: a hard stretch, no proof
        quiet = Alarms(AlarmConfig(patience=5))
        for s in speedups * 4:
            quiet.sd_step(CHAIN, speedup=s)
        assert not _fired(quiet)


def test_slower_than_needs_the_mean_under_the_ratio_by_z_standard_errors():
    assert slower_than(np.log([0.5] * 5), 0.75, 3.0) == (True, pytest.approx(0.5))
    assert not slower_than(np.log([0.7] * 5), 0.75, 3.0)[0]             # within the 10% timing noise
    assert slower_than(np.log([0.7] * 5), 0.75, 0.0)[0]
    assert not slower_than(np.log([0.3, 1.2, 0.5, 1.0, 0.6]), 0.75, 3.0)[0]


def test_sd_slower_judges_the_arm_the_tuner_exploits_not_its_exploration():
    from tltlib.rollout.adaptive import AdaptiveConfig, AdaptiveController, TunerConfig
    from tltlib.spec.strategy import OFF
    chain8 = SpecStrategy.parse("chain-8")
    ctl = AdaptiveController(AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=("chain-4", "chain-8"), buckets=(1,))))
    for _ in range(20):                      # chain-4 1.5x, chain-8 0.5x, plain 1x: chain-4 is the tuner's best
        for arm, rate in ((CHAIN, 1.5), (chain8, 0.5), (OFF, 1.0)):
            ctl.choose(0, 2)
            ctl.observe(arm, 2, tokens=int(rate * 200), seconds=1.0)
    assert ctl.exploits(CHAIN, 2) and not ctl.exploits(chain8, 2)
    ctl.choose(0, 100)                       # above the threshold: the switch, not the tuner, decides
    assert ctl.exploits(chain8, 100)
    ctl.choose(0, 2)
    alarms = Alarms(AlarmConfig(patience=5))
    source = WatchedSource(ctl, alarms)
    for _ in range(3):
        source.observe(OFF, 2, tokens=200, seconds=1.0)
    for _ in range(10):                      # exploring chain-8, at half plain's speed: not judged
        source.observe(chain8, 2, tokens=100, seconds=1.0)
    assert alarms.sd_steps == 10 and not _fired(alarms)
    with pytest.warns(AlarmWarning, match="sd_slower"):
        for _ in range(5):                   # the exploited chain-4 itself turns slow: judged
            source.observe(CHAIN, 2, tokens=100, seconds=1.0)
    assert alarms.fired_at["sd_slower"] == [15]


def test_stale_and_mismatch_fire_on_their_faults_only():
    alarms = Alarms()
    alarms.after_update(policy_moved=True, drafter_moved=True, due=True)
    alarms.after_update(policy_moved=True, drafter_moved=False, due=False)     # on_drift skipped on purpose
    assert not _fired(alarms)
    with pytest.warns(AlarmWarning, match="drafter_stale"):
        alarms.after_update(policy_moved=True, drafter_moved=False, due=True, version=3)
    alarms.after_update(policy_moved=True, drafter_moved=False, due=True)       # once, not at every step
    assert len(alarms.fired_at["drafter_stale"]) == 1
    a = Drafter(DrafterConfig.from_target(load_cfg()), init_std=0.02)
    alarms.check_drafter(a, a)
    alarms.check_drafter(copy.deepcopy(a), a)
    assert not alarms.fired_at["drafter_mismatch"]
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.fc.weight.add_(1e-3)
    with pytest.warns(AlarmWarning, match="drafter_mismatch.*not the one just trained"):
        alarms.check_drafter(b, a)
    with pytest.warns(AlarmWarning, match="workers' merged drafters differ"):
        fresh = Alarms()
        fresh.check_drafter(a, a, workers=["x", "y"])


def load_cfg():
    from tltlib.model.decoder import preset
    return preset("tiny-cpu")


# -------------------------------------------------------------------------------------- caused in rollouts
def _rollout(model, drafter, alarms, strategy=CHAIN, costs=None, n=4, G=4):
    eng = RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=0.9, max_new_tokens=96), num_generations=G),
                        drafter=drafter)
    tok = load_tokenizer_of(model)
    source = WatchedSource(strategy, alarms, costs=costs)
    res = eng.generate(encode_prompts(PROBLEMS[:n], tok), torch.Generator().manual_seed(0), strategy=source)
    return res


_TOK = {}


def load_tokenizer_of(model):
    from tltlib.tasks.tokenizer import load_tokenizer
    return _TOK.setdefault("tok", load_tokenizer("data/tiny-reasoner"))


def _card_alarms():
    acc = card_acceptance("data/tiny-reasoner-drafter")
    return Alarms(AlarmConfig(), card_floor(acc, AlarmConfig().floor_share), "card")


def test_a_random_drafter_fires_the_floor_within_5_sd_steps(shipped):
    model, _, drafter = shipped
    rnd = Drafter(drafter.config, init_std=0.02).attach(model)
    alarms = _card_alarms()
    with pytest.warns(AlarmWarning, match="accept_floor"):
        _rollout(model, rnd, alarms)
    assert alarms.fired_at["accept_floor"][0] <= 5


def test_a_drafter_trained_for_another_policy_fires_the_floor_within_5_sd_steps(shipped):
    model, _, drafter = shipped
    torch.manual_seed(0)
    # another policy of the same shape (random weights, std 0.3: peaked, unlike a near-uniform fresh model, whose
    # every proposal a drafter on its head would pass)
    other = Transformer(model.config, init_std=0.3).eval()
    d = copy.deepcopy(drafter).attach(other)
    alarms = _card_alarms()
    with pytest.warns(AlarmWarning, match="accept_floor"):
        _rollout(other, d, alarms)
    assert alarms.fired_at["accept_floor"][0] <= 5


def test_sd_forced_where_plain_is_faster_fires_sd_slower_within_5_sd_steps(shipped):
    from tltlib.sim.costs import ModelShape, Roofline, hardware
    model, _, drafter = shipped
    h100 = Roofline(ModelShape(model.config, 4), hardware("h100"))   # plain decoding as fast as on an H100
    alarms = Alarms(AlarmConfig())
    with pytest.warns(AlarmWarning, match="sd_slower"):
        _rollout(model, drafter, alarms, costs=h100)
    assert alarms.fired_at["sd_slower"] == [5]


def test_the_shipped_drafter_raises_no_alarm(shipped):
    model, _, drafter = shipped
    alarms = _card_alarms()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AlarmWarning)
        for strategy in ("chain-4", "tree-6x4-24", "chain-8"):
            _rollout(model, drafter, alarms, strategy=strategy, n=8)
    assert alarms.sd_steps > 20 and not _fired(alarms)


# ---------------------------------------------------------------------------------------- caused in GRPO
def _trainer(shipped, tlt=TLT):
    model, tok, d = shipped
    model, d = copy.deepcopy(model), copy.deepcopy(d)
    d.attach(model)
    return GRPOTrainer(model, tok, PROBLEMS, ARGS, drafter=d, tlt=tlt)


def test_grpo_steps_with_the_shipped_drafter_raise_no_alarm(shipped):
    tr = _trainer(shipped)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AlarmWarning)
        ms = [tr.step() for _ in range(2)]
    for m in ms:
        assert all(is_metric(k) for k in m), [k for k in m if not is_metric(k)]
        assert m["alarm/accept_floor"] == m["alarm/drafter_stale"] == m["alarm/drafter_mismatch"] == 0.0
        assert m["drafter/micro_steps"] == 2 and m["drafter/trained"] == 1.0
    assert ms[0]["alarm/floor"] == pytest.approx(2.15, abs=0.01) and tr.alarms.sd_steps > 0


def test_a_skipped_drafter_training_fires_stale_at_that_step(shipped, monkeypatch):
    tr = _trainer(shipped)
    tr.step()
    monkeypatch.setattr(online, "train_drafter", lambda *a, **k: {})    # the sync skipped on purpose
    with pytest.warns(AlarmWarning, match="drafter_stale"):
        m = tr.step()
    assert m["alarm/drafter_stale"] == 1.0 and m["drafter/trained"] == 0.0


def test_an_engine_holding_another_copy_of_the_drafter_fires_mismatch_at_the_first_sync(shipped):
    tr = _trainer(shipped)
    tr.engine.drafter = copy.deepcopy(tr.drafter).attach(tr.model)   # the trained weights never reach it
    with pytest.warns(AlarmWarning, match="drafter_mismatch"):
        m = tr.step()
    assert m["alarm/drafter_mismatch"] == 1.0


# ------------------------------------------------------------------------------------------------ on_drift
def _timeline(steps: list[tuple[str, int, int]]) -> dict:
    """(strategy, active rows, accepted drafts) per decode iteration."""
    return {"strategy": np.array([s for s, _, _ in steps]), "active": np.array([a for _, a, _ in steps]),
            "accepted": np.array([x for _, _, x in steps])}


def test_accept_by_strategy_counts_learned_sd_steps_per_strategy():
    tl = _timeline([("off", 16, 0), ("chain-4", 8, 24), ("chain-4", 8, 8), ("ngram-4", 8, 0), ("tree-6x4-24", 4, 16)])
    got = accept_by_strategy(tl, min_rows=1)
    assert got == {"chain-4": (3.0, 16), "tree-6x4-24": (5.0, 4)}
    assert accept_by_strategy(tl, min_rows=8) == {"chain-4": (3.0, 16)}
    assert accept_vs_best(got, {"chain-4": 4.0}) == pytest.approx(0.75)
    assert math.isnan(accept_vs_best(got, {}))


def test_plateaued_needs_a_flat_fit_whose_upper_bound_is_under_the_gain():
    flat = [1.0, 1.01, 0.99, 1.0, 1.01, 0.99]
    assert plateaued(flat, 0.01, 0.02, 4) and not plateaued(flat[:3], 0.01, 0.02, 4)
    rising = [1.0 + 0.03 * k for k in range(6)]                      # 3% a step: still learning
    assert not plateaued(rising, 0.01, 0.02, 4)
    noisy = [1.0, 1.15, 0.9, 1.1]                                      # 4 noisy points: cannot tell, keep learning
    assert not plateaued(noisy, 0.01, 0.02, 4)


def _accept(a: float) -> dict:
    return _timeline([("chain-4", 16, round(16 * (a - 1)))])           # 16 rows at accept length a


def test_on_drift_learns_until_the_acceptance_plateaus_then_rests_until_it_falls():
    gate = DriftGate("on_drift", margin=0.1)
    assert gate.learning and gate.decide(_accept(3.0)) and gate.ratio == 1.0      # the anchor: train
    # flat: the slope's upper bound, 0 + 2 x 0.02 / sqrt(17.5) = 0.0096, falls under 1% a step at the 6th point
    flat = [gate.decide(_accept(3.0)) for _ in range(6)]
    assert flat == [True] * 5 + [False] and not gate.learning                     # plateaued: rests
    rested = len(gate.curve)
    assert not gate.decide(_accept(2.9375)) and gate.ratio == pytest.approx(2.9375 / 3.0)
    assert gate.decide(_accept(2.5)) and gate.learning and gate.curve == []       # fell 10%+: learns from here
    assert gate.anchor == {"chain-4": 2.5} and rested >= 4
    gate.trained()
    assert gate.anchor == {"chain-4": 2.5}                                        # learning goes on
    assert gate.decide(_timeline([("off", 16, 0)]))    # nothing measured: train (it cannot tell)
    with pytest.raises(ValueError, match="drafter_train must be one of"):
        TLTConfig(drafter_train="sometimes")


def test_on_drift_keeps_training_a_drafter_still_learning_through_noise():
    """SmolLM2's warm drafter: its acceptance rises a few percent a step, under one step's noise; resting it on a
    noisy dip left it 28% behind always's."""
    gate, rng = DriftGate("on_drift", margin=0.1), np.random.default_rng(0)
    trains = [gate.decide(_accept(2.5 * (1 + 0.03 * k) * (1 + 0.08 * rng.standard_normal()))) for k in range(20)]
    assert sum(trains) >= 18, trains
    assert DriftGate("always").decide(_accept(3.0))


def test_the_gates_state_resumes_and_an_older_state_rests_from_its_bests():
    gate = DriftGate("on_drift")
    for a in (3.0, 3.1, 3.2):
        gate.decide(_accept(a))
    again = DriftGate("on_drift")
    again.load_state_dict(gate.state_dict())
    assert again.state_dict() == gate.state_dict() and again.learning
    old = DriftGate("on_drift")
    old.load_state_dict({"best": {"chain-4": 3.0}})
    assert not old.learning and not old.decide(_accept(2.9)) and old.decide(_accept(2.5))


def test_on_drift_in_grpo_learns_first_then_skips_the_drafter_until_its_acceptance_falls(shipped):
    tr = _trainer(shipped, replace(TLT, drafter_train="on_drift"))
    m0 = tr.step()                                         # learning: the anchor's step trains
    assert m0["drafter/trained"] == 1.0 and m0["drafter/learning"] == 1.0 and tr.drafter.version == 1
    tr.drift.learning, tr.drift.best = False, {}           # as if its acceptance had plateaued
    with warnings.catch_warnings():
        warnings.simplefilter("error", AlarmWarning)       # a skip on purpose is not a stale drafter
        m1 = tr.step()
    assert m1["drafter/trained"] == 0.0 and m1["drafter/micro_steps"] == 0 and tr.drafter.version == 1
    assert m1["drafter/learning"] == 0.0
    tr.drift.best = {k: 2 * v for k, v in tr.drift.best.items()}    # as if it had accepted twice as much before
    m2 = tr.step()
    assert m2["drafter/trained"] == 1.0 and m2["drafter/micro_steps"] == 2 and m2["drafter/accept_vs_best"] < 0.9
    assert tr.drafter.version == 2 and tr.drift.learning
    state = tr.checkpoint_state().meta["drafter_drift"]
    assert state["learning"] and state["curve"] == [] and state["anchor"]


def test_a_drafter_the_spot_trainer_trained_in_the_idle_window_counts_as_trained(shipped, monkeypatch):
    """With the spot trainer, the idle window's sync moves the drafter's version before the step's drafter phase:
    that phase measures against the version before the window (``SpotWindow.version``), so a worker that trained
    there raises no stale alarm and says ``drafter/trained`` 1 (reading the moved version, it fired after a few such
    steps in a row on 2 workers)."""
    from tltlib.rl.scheduler import SpotWindow
    tr = _trainer(shipped)
    monkeypatch.setattr(type(tr.spot), "active", property(lambda self: True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", AlarmWarning)
        for _ in range(TLT.alarm_patience + 1):
            window = SpotWindow(0.0, 1.0, steps=2, version=tr.drafter.version)
            tr.drafter.version += 1                                    # what the window's sync did
            m = tr.train_drafter(window)
            assert m["drafter/trained"] == 1.0 and not tr.alarms.fired_at["drafter_stale"]
