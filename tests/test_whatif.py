"""Notebook 04's what-if explorer (tltlib.lab.whatif): the simulated rollout checked by hand, the real controller's
threshold and arm set obeyed, a threshold of 0 is plain decoding, and bad input as one clear error."""
from __future__ import annotations

import numpy as np
import pytest

from tltlib.errors import BadInput
from tltlib.lab.whatif import accepted_histogram, simulate_adaptive, simulate_plain, what_if
from tltlib.model.decoder import preset
from tltlib.rollout.adaptive import AdaptiveConfig, AdaptiveController, TunerConfig
from tltlib.sim.costs import ModelShape, Roofline, forward_time, hardware
from tltlib.spec.acceptance import expected_tokens
from tltlib.spec.strategy import SpecStrategy

SHAPE = ModelShape(preset("qwen2.5-7b", tie_word_embeddings=False))
H100 = Roofline(SHAPE, hardware("h100"))        # verification nearly free at small batch: SD pays in the tail
ACCEPT = {"learned": [0.9, 0.85, 0.8], "ngram": [0.3]}
LENGTHS = [40] * 24 + [120, 200, 400, 900]     # a long tail: four rows outlive the rest
ARMS = ["chain-2", "chain-4", "ngram-2"]


def test_the_accepted_histogram_holds_every_row_and_the_chains_expected_tokens():
    rates = [0.9, 0.5, 0.25]
    h = accepted_histogram(rates, 4, rows=10)                 # the last rate repeats for depth 4
    assert h.shape == (5,) and h.sum() == pytest.approx(10)
    mean_accepted = (np.arange(5) * h).sum() / 10
    assert mean_accepted + 1 == pytest.approx(expected_tokens(SpecStrategy.parse("chain-4"), rates + [0.25]))
    assert h[0] == pytest.approx(10 * 0.1) and h[4] == pytest.approx(10 * 0.9 * 0.5 * 0.25 * 0.25)


def test_a_plain_rollout_of_equal_lengths_is_that_many_forwards_at_the_mean_context():
    got = simulate_plain(H100, [50] * 6, prompt_len=10)
    assert got == pytest.approx(50 * forward_time(SHAPE, hardware("h100"), 1, 6, 10 + 25, 1), rel=1e-9)


def test_threshold_zero_is_plain_decoding_and_the_speedup_is_one():
    r = what_if(H100, LENGTHS, 64, threshold=0, arms=ARMS, rule="thompson", acceptance=ACCEPT)
    assert r["speedup"] == pytest.approx(1.0) and r["sd_share"] == 0 and not any(r["played"].values())
    assert {arm for _, _, arm in r["timeline"]} == {"off"}


def test_sd_runs_only_at_or_below_the_threshold_and_only_the_given_arms():
    r = simulate_adaptive(H100, LENGTHS, 64, AdaptiveConfig(threshold=4, tuner=TunerConfig(arms=("chain-4",))),
                          ACCEPT, seed=3)
    assert all(rows <= 4 for _, rows, arm in r["timeline"] if arm != "off")
    assert {arm for _, _, arm in r["timeline"]} <= {"off", "chain-4"} and r["played"]["chain-4"] > 0
    assert isinstance(r["controller"], AdaptiveController) and r["controller"].log["arm"]   # it learned rewards


def test_the_tail_pays_on_an_h100_and_a_tuned_controller_carries_over():
    r = what_if(H100, LENGTHS, 64, threshold=8, arms=ARMS, rule="thompson", acceptance=ACCEPT, tuning=2)
    assert r["speedup"] > 1.3 and 0 < r["sd_share"] < 1
    assert set(k for k, v in r["played"].items() if v) <= set(ARMS)
    assert r["adaptive_s"] == pytest.approx(r["plain_s"] / r["speedup"])
    first = simulate_adaptive(H100, LENGTHS, 64, AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=tuple(ARMS))),
                              ACCEPT, seed=1)
    again = simulate_adaptive(H100, LENGTHS, 64, AdaptiveConfig(threshold=8, tuner=TunerConfig(arms=tuple(ARMS))),
                              ACCEPT, seed=2, controller=first["controller"])
    assert again["controller"] is first["controller"]
    assert len(again["controller"].log["arm"]) > len(first["played"]) and sum(again["played"].values()) > 0


def test_a_useless_drafter_makes_sd_lose_and_the_rule_can_be_epsilon_greedy():
    bad = {"learned": [0.0], "ngram": [0.0]}
    r = what_if(H100, LENGTHS, 64, threshold=28, arms=["chain-4"], rule="epsilon-greedy", acceptance=bad)
    assert r["speedup"] < 1.0


@pytest.mark.parametrize("kw, words", [
    (dict(threshold=-1), "threshold >= 0"),
    (dict(seeds=0), "seeds >= 1"),
    (dict(arms=[]), "at least one arm"),
])
def test_bad_what_if_input_is_one_clear_error(kw, words):
    args = dict(threshold=8, arms=ARMS, rule="thompson", acceptance=ACCEPT) | kw
    with pytest.raises(BadInput, match=words):
        what_if(H100, LENGTHS, 64, **args)
    with pytest.raises(BadInput, match="at least one response length"):
        simulate_plain(H100, [], 64)


def test_the_what_if_panels_draw_the_timeline_and_the_measured_bars():
    import matplotlib
    matplotlib.use("Agg")
    from tltlib.lab.plots import what_if_panels
    r = what_if(H100, LENGTHS, 64, threshold=8, arms=ARMS, rule="thompson", acceptance=ACCEPT)
    fig = what_if_panels(r, 8, {"no SD": 2.0, "adaptive": 1.0}, total_rows=len(LENGTHS))
    left, right = fig.axes
    assert len(right.patches) == 4 and [t.get_text() for t in right.get_yticklabels()][-1] == "adaptive (measured)"
    assert left.get_yscale() == "log" and any(line.get_linestyle() == "--" for line in left.get_lines())
