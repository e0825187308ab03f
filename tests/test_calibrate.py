"""The simulator against this machine: the policy a measured rollout played, a small validation run end to end, and
the command's verdict."""
from __future__ import annotations

import numpy as np
import pytest

from tltlib.calibrate import Check, measure_costs, policy_from, validate
from tltlib.simulate import OFF
from tltlib.speculative import SpecStrategy


def test_the_policy_a_rollout_played_is_read_from_its_timeline():
    timeline = {"active": [64, 40, 12, 12, 12, 5, 5, 2], "accepted": [0, 0, 30, 34, 20, 12, 10, 6],
                "strategy": ["off", "off", "chain-4", "chain-4", "tree-4x2-8", "chain-8", "chain-8", "chain-8"]}
    p = policy_from(timeline)
    assert p.threshold == 12
    assert p.buckets == ((2, (("chain-8", 1),)), (5, (("chain-8", 2),)), (12, (("chain-4", 2), ("tree-4x2-8", 1))))
    accept = dict(p.accept)
    assert accept["chain-4"] == pytest.approx((30 + 34 + 24) / 24) and accept["chain-8"] == pytest.approx(40 / 12)
    assert p.choose(12)[0] == SpecStrategy.parse("chain-4") and p.choose(13)[0] == SpecStrategy()
    (c4, a4, w4), (tree, at, wt) = p.mix(12)                       # the shares of the iterations played at 12 rows
    assert (c4.name, w4, tree.name, wt) == ("chain-4", pytest.approx(2 / 3), "tree-4x2-8", pytest.approx(1 / 3))
    explored = policy_from({"active": [8, 8, 8, 8], "accepted": [0, 16, 0, 8], "strategy": ["off", "chain-4", "off",
                                                                                          "ngram-4"]})
    assert [(s.name, round(w, 2)) for s, _, w in explored.mix(8)] == [("chain-4", 0.25), ("ngram-4", 0.25),
                                                                      ("off", 0.5)]
    assert policy_from({"active": [4], "accepted": [0], "strategy": ["off"]}) is OFF


def test_checks_say_how_far_off_a_prediction_is():
    assert Check("x", 1.1, 1.0).ok and not Check("x", 1.2, 1.0).ok
    assert Check("x", 0.9, 1.0).error == pytest.approx(-0.1)


def test_measured_costs_grow_with_rows_and_tokens():
    from tltlib.loading import load
    model, _, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter", device="cpu")
    c = measure_costs(model, drafter, rows=(1, 64), contexts=(16, 256), tokens=(1, 33), widths=(1, 4), repeats=2)
    t = np.asarray(c.target_s)
    assert (t > 0).all() and t[1, 0, 1] > t[0, 0, 0] and c.forward(8, 100, 9) > 0 and c.draft_level(8, 100, 2) > 0


def test_a_small_validation_measures_simulates_and_names_every_check():
    """Small inputs, end to end: the costs, update rate and micro-step are measured, every run is measured and
    simulated, every check is there with positive finite numbers. (How close the simulation comes is a measurement,
    the command's verdict on a quiet machine, not something a test can assert.)"""
    from tltlib.loading import load
    model, tok, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter", device="cpu")
    checks, inputs = validate(model, tok, drafter, prompts=4, group=4, max_new=96, steps=2, cost_rows=(1, 4, 16),
                              log=lambda s: None)
    assert [c.what for c in checks] == [
        "rollout 4 x 4, no SD: seconds", "rollout 4 x 4, chain-8 at <= 32 rows: seconds",
        "rollout 4 x 4, adaptive: seconds", "rollout speedup, chain-8 at <= 32 rows over no SD",
        "rollout speedup, adaptive over no SD", "GRPO step, baseline: median seconds",
        "GRPO step, tlt: median seconds", "GRPO step speedup, TLT over baseline"]
    assert all(np.isfinite([c.predicted, c.measured]).all() and c.predicted > 0 and c.measured > 0 for c in checks)
    assert inputs["update_tokens_per_s"] > 0 and inputs["micro_step_s"] > 0 and inputs["costs"].draft_s


def test_the_command_exits_non_zero_when_a_prediction_is_off(monkeypatch, tmp_path, capsys):
    import tltlib.calibrate as cal
    from tltlib.cli import main
    from tltlib.costs import MeasuredCosts
    costs = MeasuredCosts((1,), (1,), (1,), (((1.0,),),))
    monkeypatch.setattr(cal, "validate", lambda *a, **k: ([Check("rollout", 1.0, 1.05), Check("step", 1.3, 1.0)],
                                                         {"costs": costs, "update_tokens_per_s": 1.0,
                                                          "micro_step_s": 0.1}))
    assert main(["simulate", "--validate", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "| step | 1.300 | 1.000 | +30.0% | OFF |" in out.out and "1 prediction(s) off by more than 15%: step" in out.err
    assert (tmp_path / "simulate-validate-cpu.json").is_file()
