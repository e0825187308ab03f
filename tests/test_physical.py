"""A calibration that refuses what is not physical (tltlib.sim.physical, tltlib.sim.measure): costs that fall as the
work grows, a negative engine overhead, an SD step cheaper than its own forwards, a set-up below zero and a machine
too busy to measure are each refused with a message that names the value and says to rerun on a quiet machine;
what crosses a bound by less than the measurement's noise is moved onto it and said."""
from __future__ import annotations

import numpy as np
import pytest

from tltlib.sim.costs import MeasuredCosts, iteration_time
from tltlib.sim.measure import fit_overheads
from tltlib.sim.physical import (
    CalibrationError,
    at_least,
    check_quiet,
    monotone,
    nondecreasing_fit,
    pass_noise,
    tolerance,
)
from tltlib.spec.strategy import SpecStrategy

QUIET = "rerun on a quiet machine"
COSTS = MeasuredCosts((1, 64), (16, 512), (1, 9), (((0.002, 0.003), (0.003, 0.004)), ((0.01, 0.03), (0.012, 0.035))),
                      (1,), (((0.0005,), (0.0006,)), ((0.001,), (0.0012,))), noise=0.01)
PLAIN, CHAIN = SpecStrategy(), SpecStrategy.parse("chain-4")


def test_costs_must_grow_with_the_work_or_be_lifted_within_the_noise():
    axes = [("rows", (1, 2, 4)), ("tokens", (1, 9))]
    t = np.array([[1.0, 2.0], [0.98, 2.1], [1.5, 1.9]]) * 1e-3     # 2 rows 2% below 1 row; 9 tokens at 4 rows below 2
    with pytest.raises(CalibrationError, match="a forward is not monotone in rows: 2.1 ms at rows 2 but 1.9 ms at "
                                               f"rows 4 \\(tokens 9\\): 10% less time for more work.*{QUIET}"):
        monotone(t, axes, "a forward", tol=0.05)
    fixed, notes = monotone(t, axes, "a forward", tol=0.12)
    assert (np.diff(fixed, axis=0) >= 0).all() and (np.diff(fixed, axis=1) >= 0).all()
    assert fixed[1, 0] == t[0, 0] and fixed[2, 1] == t[1, 1] and fixed[0, 1] == t[0, 1]   # lifted, the rest kept
    assert len(notes) == 2 and "raised to the one at 1" in notes[0]
    assert monotone(np.sort(t, axis=None).reshape(3, 2), axes, "x", 0)[1] == []           # already monotone: no note


def test_two_passes_that_disagree_are_a_busy_machine():
    a = np.linspace(1, 2, 50)
    assert pass_noise(a, a * 1.02) == pytest.approx(0.02 / 1.02, rel=1e-6)
    check_quiet(pass_noise(a, a * 1.02), "costs")
    busy = a.copy()
    busy[:20] *= 2.0                                   # a minute of another process over 40% of the cells
    with pytest.raises(CalibrationError, match=f"costs: two passes over the same cells disagree by 100% .*within 50%"
                                               f".*{QUIET}"):
        check_quiet(pass_noise(busy, a), "costs")
    assert tolerance(0.0) == 0.03 and tolerance(0.12) == pytest.approx(0.12)


def test_the_nondecreasing_fit_pools_what_falls():
    assert nondecreasing_fit([1, 2, 4], [1.0, 2.0, 3.0], [1, 1, 1]).tolist() == [1.0, 2.0, 3.0]
    assert nondecreasing_fit([1, 2, 4, 8], [2.0, 1.0, 3.0, 2.0], [3, 1, 1, 1]).tolist() == [1.75, 1.75, 2.5, 2.5]


def test_a_value_below_its_bound_is_moved_within_the_noise_and_refused_beyond():
    v, notes = at_least([0.5e-3, -0.1e-3], 0.0, [5e-3, 5e-3], 0.03, "an overhead", "s", ["1 rows", "2 rows"])
    assert v.tolist() == [0.5e-3, 0.0] and notes == ["an overhead -0.1 ms at 2 rows set to 0 ms (within the noise)"]
    with pytest.raises(CalibrationError, match=f"an overhead came out -1.4 ms at 1 rows, below 0 ms \\(by 28% of 5 ms, "
                                               f"beyond the measurement's noise 3%\\).*{QUIET}"):
        at_least([-1.4e-3], 0.0, [5e-3], 0.03, "an overhead", "s", ["1 rows"])


def _rollout(rows, strategies, took):
    """A timeline whose iterations took ``took(rows, strategy, predicted)`` seconds."""
    active, times, names, accepted, gen = [], [], [], [], 0.0
    for r, st in zip(rows, strategies):
        t = took(r, st, iteration_time(COSTS, r, 10 + gen, st))
        acc = 2 * r if st.enabled else 0
        active.append(r), times.append(t), names.append(st.name), accepted.append(acc)
        gen += 1 + (acc / r if st.enabled else 0)
    return {"active": active, "iter_time": times, "strategy": names, "accepted": accepted,
            "time": np.cumsum(times) + 0.01, "rows": [max(rows)] * len(rows)}, 10.0, None, max(rows)


def test_a_negative_engine_overhead_is_refused_and_a_small_one_set_to_zero():
    """Plain iterations faster than the isolated forwards say (by 30% at 1-2 rows): impossible, refused; by 1%:
    the noise of a quiet machine, the overhead there is 0 (and said)."""
    rows = [64, 32, 16, 8, 4, 2, 1]
    with pytest.raises(CalibrationError, match="the engine's cost per plain iteration beyond its forward came out "
                                               f"-0.\\d+ ms at 1 rows, below 0 ms.*{QUIET}"):
        fit_overheads(COSTS, [_rollout(rows, [PLAIN] * 7, lambda r, st, t: t * (0.7 if r <= 2 else 1.1))])
    fitted = fit_overheads(COSTS, [_rollout(rows, [PLAIN] * 7, lambda r, st, t: t * (0.99 if r <= 2 else 1.1))])
    at, seconds = zip(*fitted.overhead)
    assert seconds[0] == 0.0 and all(np.diff(seconds) >= 0) and seconds[-1] > 0
    assert any("set to 0 ms (within the noise)" in n for n in fitted.fit_notes)


def test_the_machines_drift_between_the_forwards_and_the_rollouts_widens_the_tolerance_up_to_a_limit():
    """Iterations 15% faster than the forwards timed minutes before: beyond the passes' noise (3%), refused; with the
    Drift probe saying the machine ran 20% faster during those rollouts, within it (set to 0 and said); a drift past
    the noise limit is refused as a machine that was not quiet."""
    rows = [64, 32, 16, 8, 4, 2, 1]
    rollout = _rollout(rows, [PLAIN] * 7, lambda r, st, t: t * (0.85 if r <= 2 else 1.1))
    with pytest.raises(CalibrationError, match=f"at 1 rows, below 0 ms.*beyond the measurement's noise 3%.*{QUIET}"):
        fit_overheads(COSTS, [rollout])
    fitted = fit_overheads(COSTS, [rollout], drift=0.2)
    assert dict(fitted.overhead)[1.0] == 0.0
    assert fitted.fit_notes[0].startswith("within the machine's drift of 20% between timing the forwards")
    with pytest.raises(CalibrationError, match=f"the rollouts the engine's costs are fitted on: the machine ran 60% "
                                               f"faster or slower .*within 50%.*{QUIET}"):
        fit_overheads(COSTS, [rollout], drift=0.6)
    assert fit_overheads(COSTS, [_rollout(rows, [PLAIN] * 7, lambda r, st, t: t * 1.1)], drift=0.2).fit_notes == ()


def test_an_sd_step_cheaper_than_its_forwards_is_refused():
    with pytest.raises(CalibrationError,
                       match=f"an SD step's time over its forwards' came out 0.56x at 4 rows.*{QUIET}"):
        fit_overheads(COSTS, [_rollout([4, 4, 2], [CHAIN] * 3, lambda r, st, t: t * (0.56 if r == 4 else 1.2))])
    fitted = fit_overheads(COSTS, [_rollout([4, 4, 2], [CHAIN] * 3, lambda r, st, t: t * (0.99 if r == 4 else 1.2))])
    assert dict(fitted.sd_scale) == pytest.approx({4: 1.0, 2: 1.2})


def test_measured_costs_that_cannot_be_physical_are_refused():
    with pytest.raises(CalibrationError, match="a target forward is not monotone in context: 10 ms at context 16 but 9 "
                                               "ms"):
        MeasuredCosts((1, 64), (16, 512), (1,), (((0.002,), (0.003,)), ((0.010,), (0.009,))))
    with pytest.raises(CalibrationError, match="a draft level is not monotone in width"):
        MeasuredCosts((1,), (16,), (1,), (((0.002,),),), (1, 4), (((0.002, 0.001),),))
    for bad, what in ((dict(overhead=((1, -0.001),)), "overhead -1 ms at 1 rows"),
                      (dict(sd_scale=((4, 0.56),)), "an SD step 0.56x its forwards at 4 rows"),
                      (dict(setup_s_per_row=-0.001), "set-up -1 ms per response")):
        with pytest.raises(CalibrationError, match=f"MeasuredCosts cannot be physical: {what}"):
            MeasuredCosts((1,), (16,), (1,), (((0.002,),),), **bad)


def test_a_busy_machine_during_the_cost_measurement_is_refused(monkeypatch):
    """The second pass over the forwards ran while another process held the CPU: nothing is fitted."""
    import tltlib.sim.measure as mc
    from tltlib.model.loading import load
    model, _, _ = load("data/tiny-reasoner", device="cpu")
    calls = []

    def fake_pass(model, drafter, rows, contexts, tokens, widths, catch_up_width, repeats, order, g, graphs=None,
                  bar=None, native_layers=False):
        calls.append(order)
        base = np.add.outer(np.add.outer(np.log2(rows), np.log(contexts)), np.asarray(tokens) / 10.0) + 10.0
        return {"target": base * 1e-4 * (1.0 if order == 1 else 2.5),
                "draft": np.zeros((len(rows), len(contexts), len(widths))), "catch_up": np.zeros(len(rows)),
                "ragged": np.zeros(len(rows))}
    monkeypatch.setattr(mc, "_cost_pass", fake_pass)
    with pytest.raises(CalibrationError, match=f"the forward costs: two passes .* disagree by 60%.*{QUIET}"):
        mc.measure_costs(model, rows=(1, 4), contexts=(16, 64), tokens=(1, 5), passes=2)
    assert calls == [1, -1]                                 # the second pass in the opposite order of rows


def test_the_measurements_cache_is_filled_in_chunks_as_one_forward_would_fill_it():
    """measure_costs fills its caches 64 tokens per row at a time (memory: 2.0 -> 1.2 GB at 128 rows x 512): the
    cache and the hidden states equal one forward over the whole context's."""
    import torch

    from tltlib.model import load
    from tltlib.sim.measure import prefill
    target, _, _ = load("data/tiny-reasoner", device="cpu")
    prompt = torch.randint(0, target.config.vocab_size, (3, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = target.new_cache(3, 160)
        _, h_whole = target.forward_cached(prompt, whole)
        whole.advance(150)
        chunked = target.new_cache(3, 160)
        calls = []
        h = prefill(lambda x, at: calls.append(x.shape[1]) or target.forward_cached(x, chunked, logits_at=at)[1],
                    prompt, chunked.advance, chunk=64)
        assert calls == [64, 64, 22] and h.shape == h_whole.shape
        torch.testing.assert_close(h, h_whole, atol=1e-4, rtol=1e-4)
        x = prompt[:, :1]
        torch.testing.assert_close(target.forward_cached(x, chunked)[0], target.forward_cached(x, whole)[0],
                                   atol=1e-4, rtol=1e-4)
