"""The GRPO step simulator: its cost model against the paper's measured decode rates, rollouts checked by hand, the
step's phases and shares, and bad input as one clear error."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tltlib.model.decoder import preset
from tltlib.sim.costs import MeasuredCosts, ModelShape, Roofline, forward_time, hardware, iteration_time
from tltlib.sim.simulate import (
    OFF,
    LengthDistribution,
    SDPolicy,
    StepConfig,
    compare_policies,
    simulate_rollout,
    simulate_step,
)
from tltlib.spec.strategy import SpecStrategy

QWEN7 = preset("qwen2.5-7b", tie_word_embeddings=False)
H100 = hardware("h100")


def test_the_h100_preset_reproduces_the_papers_qwen_7b_decode_rates():
    """TLT Table 2 (TP 1, batch 1: 165 tok/s) and Table 7 (TP 2, batch 1: 242 tok/s plain, 542 with EAGLE at accept
    length 6.53): the preset's efficiencies and fixed costs were set from these three points."""
    shape = ModelShape(QWEN7)
    plain = {tp: 1 / iteration_time(Roofline(shape, H100, tp), 1, 1000, SpecStrategy()) for tp in (1, 2)}
    sd = 6.53 / iteration_time(Roofline(shape, H100, 2), 1, 1000, SpecStrategy.parse("tree-8x4-48"))
    assert plain[1] == pytest.approx(165, rel=0.05) and plain[2] == pytest.approx(242, rel=0.05)
    assert sd == pytest.approx(542, rel=0.05)


def test_forwards_turn_compute_bound_with_many_tokens():
    shape = ModelShape(QWEN7)
    one = forward_time(shape, H100, 4, 1, 1000, 1)
    assert forward_time(shape, H100, 4, 8, 1000, 1) < 1.2 * one            # memory-bound: 8 rows cost about one
    assert forward_time(shape, H100, 4, 64, 1000, 33) > 5 * one             # 2k new tokens: compute-bound


def test_a_rollout_of_equal_lengths_is_a_prefill_and_that_many_iterations():
    shape, cpu = ModelShape(preset("tiny-cpu"), 4), hardware("cpu")
    sim = simulate_rollout(Roofline(shape, cpu), [50] * 6, prompt_len=10)
    want = forward_time(shape, cpu, 1, 6, 0, 10) + 50 * forward_time(shape, cpu, 1, 6, 10 + 25, 1)
    assert sim.time_s == pytest.approx(want, rel=1e-9)
    assert sim.timeline == [(pytest.approx(want), 6, "off")] and sim.peak_kv_tokens == 6 * 60


def test_sd_runs_at_or_below_the_threshold_and_advances_rows_by_its_accept_length():
    costs = Roofline(ModelShape(preset("tiny-cpu"), 4), hardware("cpu"))
    policy = SDPolicy(threshold=1, buckets=((1, "chain-4"),), accept=(("chain-4", 4.0),))
    sim = simulate_rollout(costs, [100, 100, 100, 900], prompt_len=10, policy=policy)
    (t1, rows1, s1), (t2, rows2, s2) = sim.timeline
    assert (rows1, s1, rows2, s2) == (4, "off", 1, "chain-4")
    chain = iteration_time(costs, 1, 10 + 100 + 400, SpecStrategy.parse("chain-4"))
    assert t2 - t1 == pytest.approx(200 * chain, rel=1e-9)                # (900 - 100) / 4 SD steps
    assert policy.choose(2) == (SpecStrategy(), 1.0)


def _cfg(nodes, **kw):
    return StepConfig(QWEN7, H100, nodes=nodes, tp=4, prompts=64, num_generations=8,
                      lengths=LengthDistribution(median=3000, p99=30000, cap=32768), **kw)


TLT = SDPolicy(threshold=32, buckets=((1, "tree-8x4-48"), (2, "tree-8x4-32"), (5, "tree-8x4-16"), (21, "tree-8x4-8")),
               accept=(("tree-8x4-48", 6.5), ("tree-8x4-32", 6.0), ("tree-8x4-16", 5.0), ("tree-8x4-8", 4.0)))


def test_the_speedup_grows_with_scale_as_the_tail_gets_longer_relative_to_each_worker():
    """Fewer rows per worker: each worker's rollout is its own longest response, SD covers more of it, and the
    rollout's share of the step grows; the simulator must show the trend the paper's Table 3 shows."""
    speed, share, idle = [], [], []
    for nodes in (1, 2, 4, 8):
        r = compare_policies(_cfg(nodes), TLT)
        speed.append(r["baseline"].step_s / r["tlt"].step_s)
        share.append(r["baseline"].rollout_s / r["baseline"].step_s)
        idle.append(r["baseline"].idle_frac)
        assert r["tlt"].harvested(0.1) > 0.9 or r["baseline"].idle_frac < 0.05
    assert speed == sorted(speed) and share == sorted(share) and idle == sorted(idle)
    assert 1.0 < speed[0] < speed[-1]


def test_the_step_adds_the_update_and_syncs_and_tlt_pays_only_preemption_and_the_drafter_sync():
    cfg = _cfg(2)
    base, tlt = simulate_step(cfg), simulate_step(cfg, TLT, "tlt", spot_trainer=True)
    assert base.update_s == pytest.approx(tlt.update_s) and base.logprob_s == pytest.approx(tlt.logprob_s)
    assert base.drafter_s == 0 and 0.05 <= tlt.drafter_s < 0.2
    assert tlt.rollout_s < base.rollout_s
    assert base.step_s == pytest.approx(base.rollout_s + base.logprob_s + base.update_s + base.sync_s)
    more = simulate_step(_cfg(2, logprob_passes=2))
    assert more.logprob_s == pytest.approx(2 * base.logprob_s)


def test_idle_and_harvested_shares_by_hand():
    from tltlib.sim.simulate import RolloutSim, StepSim
    s = StepSim("x", 10.0, 0, 0, 0, 0, [RolloutSim(10.0), RolloutSim(6.0), RolloutSim(8.0)], 1.0)
    assert s.idle_frac == pytest.approx((0 + 4 + 2) / 30)
    assert s.harvested(1.0) == pytest.approx((3.5 + 1.5) / 6)


def test_lengths_resample_or_follow_a_fitted_log_normal_cut_at_the_cap():
    rng = np.random.default_rng(0)
    measured = LengthDistribution(samples=(10, 20, 30), cap=25)
    assert set(measured.draw(100, rng)) <= {10, 20, 25}
    fitted = LengthDistribution.fit(np.random.default_rng(1).lognormal(6, 1, 5000), cap=4000)
    x = fitted.draw(20000, rng)
    assert np.median(x) == pytest.approx(np.exp(6), rel=0.05) and x.max() == 4000


@pytest.mark.parametrize("make,error,match", [
    (lambda: hardware("tpu"), ValueError, "unknown hardware preset 'tpu'; choose one of h100, a100, b200, cpu"),
    (lambda: StepConfig(QWEN7, H100, tp=3), ValueError, "tensor parallelism 3 does not divide the model's 28 "
                                                         "attention heads; use one of \\[1, 2, 4, 7, 14, 28\\]"),
    (lambda: LengthDistribution(), ValueError, "needs measured samples, or a median > 0"),
    (lambda: LengthDistribution.fit([], 100), ValueError, "no samples: give measured response lengths"),
    (lambda: StepConfig(QWEN7, H100, nodes=1, tp=4, prompts=63), ValueError, "2 rollout workers cannot share 63"),
    (lambda: simulate_step(StepConfig(preset("qwen2.5-32b", tie_word_embeddings=False), H100, nodes=1, tp=8,
                                      lengths=LengthDistribution(median=3000, p99=30000))), ValueError,
     r"need \d+ GB per device \(training states 66 GB, update activations 22 GB, .* but 72 GB of a device.s 80 GB "
     r"are usable: add nodes"),
    (lambda: SDPolicy(threshold=4, buckets=((1, "chain-4"),)), ValueError, "strategy 'chain-4' has no accept length"),
])
def test_bad_input_is_one_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_off_is_plain_decoding_everywhere():
    assert OFF.choose(1) == (SpecStrategy(), 1.0)


def test_memory_matches_the_papers_32b_runs_out_on_one_and_two_nodes_and_fits_on_four():
    """TLT Table 3: Qwen2.5-32B (TP 8, 32K responses) is OOM on 1 and 2 nodes of 8 H100 and runs on 4 and 8."""
    qwen32 = preset("qwen2.5-32b", tie_word_embeddings=False)
    fits = []
    for nodes in (1, 2, 4, 8):
        cfg = StepConfig(qwen32, H100, nodes=nodes, tp=8, lengths=LengthDistribution(median=3000, p99=30000))
        try:
            simulate_step(cfg)
            fits.append(True)
        except ValueError:
            fits.append(False)
    assert fits == [False, False, True, True]


def test_measured_costs_interpolate_log_log_in_rows_and_linearly_in_tokens_and_context():
    # t = 1 ms x rows^0.5 x (1 + tokens / 10) x (1 + context / 1000), measured at a grid
    rows, ctx, tok = (1, 4, 16), (100, 500), (1, 9)
    f = lambda r, c, t: 1e-3 * r ** 0.5 * (1 + t / 10) * (1 + c / 1000)          # noqa: E731
    m = MeasuredCosts(rows, ctx, tok, tuple(tuple(tuple(f(r, c, t) for t in tok) for c in ctx) for r in rows),
                      (1, 4), tuple(tuple((0.1e-3, 0.2e-3) for _ in ctx) for _ in rows))
    assert m.forward(4, 100, 1) == pytest.approx(f(4, 100, 1))
    assert m.forward(8, 300, 5) == pytest.approx(f(8, 300, 5), rel=1e-6)         # between grid points: exact here
    assert m.forward(16, 900, 17) == pytest.approx(f(16, 900, 17), rel=1e-6)     # linear beyond the last ones
    assert m.draft_level(2, 300, 4) == pytest.approx(0.2e-3)
    plain_run = simulate_rollout(m, [20] * 4, prompt_len=100).time_s
    with_setup = simulate_rollout(replace(m, setup_s_per_row=0.01), [20] * 4, prompt_len=100).time_s
    assert with_setup == pytest.approx(plain_run + 4 * 0.01)                     # a rollout's set-up, per response
    with pytest.raises(ValueError, match="target_s must be positive seconds of shape rows x contexts x tokens"):
        MeasuredCosts((1,), (1,), (1,), ((( -1.0,),),))


def test_a_mixed_bucket_costs_and_emits_the_share_weighted_mean():
    costs = Roofline(ModelShape(preset("tiny-cpu"), 4), hardware("cpu"))
    mixed = SDPolicy(threshold=4, buckets=((1, (("off", 1), ("chain-4", 1))),), accept=(("chain-4", 5.0),))
    sim = simulate_rollout(costs, [300] * 4, prompt_len=10, policy=mixed)
    k = 100                                                      # 300 tokens at (1 + 5) / 2 per iteration
    each = [iteration_time(costs, 4, 10 + 150, SpecStrategy.parse(n)) for n in ("off", "chain-4")]
    prefill = costs.forward(4, 0, 10)
    assert sim.time_s == pytest.approx(prefill + k * sum(each) / 2, rel=1e-9)


def test_the_command_projects_the_workload_given_and_refuses_bad_flags_first(tmp_path, capsys):
    """``simulate --project`` simulates --prompts / --num-generations / --max-new when given (it ignored them), and
    a flag that cannot be simulated, or one of the other mode (which it would ignore), is refused before anything loads
    or is measured, naming the flag."""
    import json

    from tltlib.cli import main
    assert main(["simulate", "--project", "--prompts", "32", "--num-generations", "4", "--max-new", "100",
                 "--out", str(tmp_path)]) == 0
    assert "32 prompts x 4, at most 100 tokens (not the paper's settings" in capsys.readouterr().out
    d = json.loads((tmp_path / "simulate-project-h100.json").read_text())
    assert d["lengths"]["cap"] == 100 and d["settings"]["prompts"] == 32
    assert d["projection"]["qwen2.5-7b"][0]["rows_per_worker"] == 32 * 4 // 2     # 1 node of TP 4: 2 workers
    absent = str(tmp_path / "absent")                     # were anything loaded, it would fail on this model
    for argv, message in ((["--validate", "--prompts", "0", "--model", absent], "--prompts must be >= 1, got 0"),
                          (["--validate", "--max-new", "-1", "--model", absent], "--max-new must be >= 1"),
                          (["--project", "--num-generations", "1"], "--num-generations must be >= 2"),
                          (["--project", "--steps", "3"], "--steps goes with --validate, not --project"),
                          (["--project", "--model", absent], "--model goes with --validate"),
                          (["--project", "--workers-results", ""], "--workers-results goes with --validate"),
                          (["--validate", "--hardware", "a100", "--model", absent], "--hardware goes with --project"),
                          (["--validate", "--lengths-from", "x.json", "--model", absent],
                           "--lengths-from goes with --project")):
        assert main(["simulate", *argv, "--out", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and message in err, err
    blocker = tmp_path / "a-file"                          # --out naming a file: refused before anything runs
    blocker.write_text("x")
    for mode in (["--project"], ["--validate", "--model", absent]):
        assert main(["simulate", *mode, "--out", str(blocker)]) == 1
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and f"'{blocker}' is a file, not a folder" in err and "a bug" not in err, err
    assert blocker.read_text() == "x"
