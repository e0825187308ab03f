"""The simulator against this machine: the policy a measured rollout played, a small validation run end to end, and
the command's verdict."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tltlib.lab.calibrate import Check, Drift, check_harvest, policy_from, validate
from tltlib.sim.measure import fit_overheads, measure_costs
from tltlib.sim.simulate import OFF, harvested_share
from tltlib.spec.strategy import SpecStrategy


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
    assert Check("idle", 0.07, 0.03, share=True).ok and not Check("idle", 0.10, 0.03, share=True).ok   # in points
    assert Check("idle", 0.07, 0.03, share=True).error == pytest.approx(0.04)


def _workers_file(tmp_path, workers=2, spot_max=200, **schedule):
    path = tmp_path / "w2.json"
    path.write_text(json.dumps({"workers": workers, "settings": {"spot_max": spot_max},
                                "summary": {"schedule": schedule}}))
    return path


def test_the_harvested_share_of_a_bench_file_is_checked_against_the_preemption_model(tmp_path):
    """Every idle window is trained in but for half a micro-step, and at most spot_max micro-steps: the first
    window here (10 s) is capped at 100 x 0.05 s."""
    f = _workers_file(tmp_path, spot_max=100, idle_s_by_step=[10.0, 1.0, 0.02], train_s_by_step=[5.0, 0.97, 0.0],
                      micro_step_s_by_step=[0.05, 0.06, 0.05])
    (c,) = check_harvest(f)
    assert c.share and c.predicted == pytest.approx((5.0 + 0.97 + 0.0) / 11.02)
    assert c.measured == pytest.approx(5.97 / 11.02) and c.ok
    assert harvested_share([1.0, 0.0], 0.2) == pytest.approx(0.9) and np.isnan(harvested_share([0.0], 0.1))


def test_a_missing_or_foreign_workers_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench e2e_grpo --workers 2"):
        check_harvest(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="no spot-trainer schedule"):
        check_harvest(_workers_file(tmp_path))
    with pytest.raises(ValueError, match="reads runs of 2 workers"):
        check_harvest(_workers_file(tmp_path, workers=4, idle_s_by_step=[1.0], train_s_by_step=[1.0],
                                    micro_step_s_by_step=[0.1]))


@pytest.mark.long
def test_measured_costs_grow_with_rows_and_tokens(monkeypatch):
    """What the simulator reads back; two repeats of forwards this small disagree by tens of percent between
    passes on any machine, so the noise limit is off here (its refusal is tested in test_physical)."""
    import math

    import tltlib.sim.physical as physical
    from tltlib.model.loading import load
    monkeypatch.setattr(physical, "NOISE_LIMIT", math.inf)
    monkeypatch.setattr(physical, "MIN_TOLERANCE", math.inf)       # a fall within any noise lifted, not refused
    model, _, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter", device="cpu")
    c = measure_costs(model, drafter, rows=(1, 64), contexts=(16, 256), tokens=(1, 33), widths=(1, 4), repeats=2,
                      passes=2)
    t = np.asarray(c.target_s)
    assert (t > 0).all() and t[1, 0, 1] > t[0, 0, 0] and c.forward(8, 100, 9) > 0 and c.draft_level(8, 100, 2) > 0


@pytest.mark.long
def test_a_small_validation_measures_simulates_and_names_every_check(monkeypatch):
    """Small inputs, end to end: the costs, update rate and micro-step are measured, every run is measured and
    simulated, every check is there with positive finite numbers. (How close the simulation comes is a measurement,
    the command's verdict on a quiet machine, not something a test can assert; nor is the machine's quiet: a busy
    moment's refusal is tested in test_physical, so here any noise is accepted.)"""
    import math

    import tltlib.sim.physical as physical
    from tltlib.model.loading import load
    monkeypatch.setattr(physical, "NOISE_LIMIT", math.inf)
    # nor a crossing of a physical bound by noise: 2-row bands of these tiny rollouts hold a handful of SD steps, whose
    # median came out 0.85x its forwards once under an 11% noise (the bounds' refusal is tested in test_physical)
    monkeypatch.setattr(physical, "MIN_TOLERANCE", math.inf)
    model, tok, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter", device="cpu")
    checks, inputs = validate(model, tok, drafter, prompts=4, num_generations=4, max_new=96, steps=2, cost_rows=(1, 4,
                                                                                                                 16),
                              log=lambda s: None)
    assert [c.what for c in checks] == [
        "rollout 4 x 4, no SD: median seconds", "rollout 4 x 4, chain-8 at <= 32 rows: median seconds",
        "rollout 4 x 4, adaptive: median seconds", "rollout speedup, chain-8 at <= 32 rows over no SD",
        "rollout speedup, adaptive over no SD", "2 workers x 2 prompts, slowest worker's rollout: median seconds",
        "2 workers, idle share of the rollout",
        *(f"GRPO step, {n}: median {p} seconds" for n in ("baseline", "tlt") for p in ("rollout", "update", "step")),
        "GRPO step speedup, TLT over baseline"]
    assert all(np.isfinite([c.predicted, c.measured]).all() and c.predicted >= 0 and c.measured >= 0 for c in checks)
    assert [c.share for c in checks].count(True) == 1
    assert inputs["update_tokens_per_s"] > 0 and inputs["micro_step_s"] > 0 and inputs["costs"].draft_s
    # every measured run is recorded with its prediction and the machine's speed: 3 arms x 3 rounds, 2 workers x 3,
    # 2 policies x 2 steps
    assert len(inputs["runs"]) == 9 + 6 + 4
    assert all(r["simulated_s"] > 0 and r["measured_s"] > 0 and r["slowdown"] > 0 and len(r["slowdowns"]) == 2
               for r in inputs["runs"])
    assert set(inputs["speed_reference_s"]) == {1, 16}
    assert inputs["costs"].setup_s_per_row > 0                      # zeroing the KV cache is never free on a CPU


def test_the_command_exits_non_zero_when_a_prediction_is_off(monkeypatch, tmp_path, capsys):
    import tltlib.lab.calibrate as cal
    from tltlib.cli import main
    from tltlib.sim.costs import MeasuredCosts
    costs = MeasuredCosts((1,), (1,), (1,), (((1.0,),),))
    monkeypatch.setattr(cal, "validate", lambda *a, **k: ([Check("rollout", 1.0, 1.05), Check("step", 1.3, 1.0),
                                                          Check("idle", 0.06, 0.03, share=True)],
                                                         {"costs": costs, "update_tokens_per_s": 1.0,
                                                          "micro_step_s": 0.1, "step_notes": [
                                                              "GRPO steps, tlt: an overhead set to 0 ms"]}))
    assert main(["simulate", "--validate", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "| step | 1.300 | 1.000 | +30.0% | OFF |" in out.out
    assert "| idle | 0.060 | 0.030 | +3.0 points | ok |" in out.out
    assert "moved onto a physical bound within that noise: GRPO steps, tlt: an overhead set to 0 ms" in out.out
    assert "1 prediction(s) off by more than 15% (shares: 5 points): step" in out.err
    assert (tmp_path / "simulate-validate-cpu.json").is_file()


def test_the_engines_overhead_is_fitted_from_what_a_rollout_took_beyond_its_forwards():
    """Plain iterations that took their forward plus 1 ms + 0.1 ms per row, SD steps 1.2x their forwards at 1-2
    rows and 1.5x at 8: the fit gives those back per band of rows (interpolated between), and the simulator's
    iteration time then matches the measured one."""
    from tltlib.sim.costs import MeasuredCosts, iteration_time
    costs = MeasuredCosts((1, 64), (16, 512), (1, 9), (((0.002, 0.003), (0.003, 0.004)), ((0.01, 0.03), (0.012,
                                                                                                         0.035))),
                          (1,), (((0.0005,), (0.0006,)), ((0.001,), (0.0012,))))
    scale = {1: 1.2, 2: 1.2, 4: 1.3, 8: 1.5}

    def rollout(rows, strategies, setup_per_row=None):
        active, times, names, accepted, gen = [], [], [], [], 0.0
        for r, st in zip(rows, strategies):
            t = iteration_time(costs, r, 10 + gen, st)
            t = t * scale[r] if st.enabled else t + 0.001 + 1e-4 * r
            acc = 4 * r if st.enabled else 0
            active.append(r), times.append(t), names.append(st.name), accepted.append(acc)
            gen += 1 + (acc / r if st.enabled else 0)
        clock = np.cumsum(times) + 0.01                                 # after a 10 ms prefill
        seconds = None if setup_per_row is None else clock[-1] + setup_per_row * max(rows)
        return {"active": active, "iter_time": times, "strategy": names, "accepted": accepted, "time": clock,
                "rows": [max(rows)] * len(rows)}, 10.0, seconds, max(rows)

    plain, c4, c8 = SpecStrategy(), SpecStrategy.parse("chain-4"), SpecStrategy.parse("chain-8")
    fitted = fit_overheads(costs, [rollout([64, 32, 16, 8, 4, 2, 1], [plain] * 7, setup_per_row=0.002),
                                   rollout([8, 8, 4, 4, 2, 2, 1, 1], [c8, c4] * 4, setup_per_row=0.002)])
    at, seconds = zip(*fitted.overhead)
    assert at == (1, 2, 4, 8, 16, 32, 64) and seconds == pytest.approx([0.001 + 1e-4 * r for r in at], abs=1e-12)
    assert fitted.plain_overhead(6) == pytest.approx(np.interp(np.log(6), np.log([4, 8]), [0.0014, 0.0018]))
    assert dict(fitted.sd_scale) == pytest.approx(scale)
    assert iteration_time(fitted, 8, 100, c8) == pytest.approx(1.5 * iteration_time(costs, 8, 100, c8))
    assert fitted.sd_factor(3) == pytest.approx(np.interp(np.log(3), np.log([2, 4]), [1.2, 1.3]))
    assert fitted.setup_s_per_row == pytest.approx(0.002)
    refit = fit_overheads(fitted, [rollout([4, 2], [c8, c8])])  # SD only, no wall time: the plain fit, set-up kept
    assert refit.overhead == fitted.overhead and dict(refit.sd_scale) == pytest.approx({4: 1.3, 2: 1.2})
    assert refit.setup_s_per_row == fitted.setup_s_per_row
    with pytest.raises(ValueError, match="no decode iterations"):
        fit_overheads(costs, [])


def test_the_drift_factors_are_each_probe_now_over_that_probe_at_calibration(monkeypatch):
    from tltlib.lab.calibrate import _moved
    from tltlib.model.loading import load
    model, _, _ = load("data/tiny-reasoner", device="cpu")
    d = Drift(model, rows=(1, 2), context=8, calls=3)
    assert d.factors().tolist() == [1.0, 1.0]                   # no reference yet: no slowdown
    assert d.probe().shape == (2,) and (d.probe() > 0).all()
    d.reference = [np.array([0.004, 0.010]), np.array([0.005, 0.012]), np.array([0.006, 0.011])]
    monkeypatch.setattr(d, "probe", lambda: np.array([0.004, 0.0132]))
    assert d.factors() == pytest.approx([0.8, 1.2])            # one row 20% faster, two rows 20% slower
    assert _moved([np.array([0.9, 1.05]), np.array([1.1, 0.7])]) == pytest.approx(0.3) and _moved([]) == 0.0


def test_leave_one_out_drops_exactly_the_step_it_predicts():
    from tltlib.lab.calibrate import _without
    assert [_without(["a", "b", "c"], i) for i in range(3)] == [["b", "c"], ["a", "c"], ["a", "b"]]
