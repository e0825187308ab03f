"""Long-tail statistics on hand-computed cases."""
from __future__ import annotations

import numpy as np
import pytest

from tltlib.metrics import METRICS
from tltlib.stats import (
    active_over_time,
    empty_slot_fraction,
    length_stats,
    long_tail_report,
    paired_ratio,
    per_bucket_oracle,
    rollout_stats,
    split_idle_fraction,
    tail_time_share,
    time_by_bucket,
)


def test_length_stats():
    s = length_stats([10] * 98 + [100, 200])
    assert s["rollout/len_p50"] == 10 and s["rollout/len_max"] == 200
    assert s["rollout/max_over_p50"] == 20
    assert s["rollout/p99_over_p50"] == pytest.approx(np.percentile([10] * 98 + [100, 200], 99) / 10)
    assert set(s) <= set(METRICS)
    with pytest.raises(ValueError):
        length_stats([])


def test_tail_time_share():
    # 4 steps of 1 s with 10, 5, 2, 1 of 10 rows running: <=10% -> last step, <=25% -> last two
    assert tail_time_share([1, 1, 1, 1], [10, 5, 2, 1], 10, 0.10) == 0.25
    assert tail_time_share([1, 1, 1, 1], [10, 5, 2, 1], 10, 0.25) == 0.5
    assert tail_time_share([], [], 10, 0.1) == 0.0


def test_split_idle_fraction():
    # 2 workers: lengths [1, 1 | 1, 9] -> busy 1 and 9 -> idle = 1 - 5/9
    assert split_idle_fraction([1, 1, 1, 9], 2) == pytest.approx(1 - 5 / 9)
    assert split_idle_fraction([4, 4, 4, 4], 4) == 0.0
    with pytest.raises(ValueError, match="cannot split"):
        split_idle_fraction([1, 2], 3)


def test_active_over_time_and_rollout_stats_keys():
    t, a = active_over_time([1.0, 2.0, 3.0], 3.0, points=4)
    assert a.tolist() == [3, 2, 1, 0]
    s = rollout_stats(np.array([3, 5]), [0.1] * 5, [2, 2, 2, 1, 1], 2, np.array([False, True]), 0.6, 0.1)
    assert set(s) <= set(METRICS) and s["rollout/truncated_frac"] == 0.5


def test_empty_slots_and_report():
    assert empty_slot_fraction([1, 1, 1, 9]) == pytest.approx(1 - 3 / 9)
    rep = long_tail_report({"rollout/len_p50": 1.0}, [1, 1, 1, 9], 2, rewards=[1.0, 0.0, 0.5, 1.0])
    assert rep["sched/idle_frac"] == pytest.approx(1 - 5 / 9) and rep["rl/accuracy"] == 0.5
    assert rep["rl/reward_mean"] == 0.625 and set(rep) <= set(METRICS)


def test_time_by_bucket():
    # buckets [1, 2), [2, 5), [5, inf): steps at 8, 5, 4, 2, 1 running rows
    out = time_by_bucket([1.0, 2.0, 3.0, 4.0, 5.0], [8, 5, 4, 2, 1], (1, 2, 5))
    np.testing.assert_allclose(out, [5.0, 7.0, 3.0])
    assert time_by_bucket([], [], (1, 9)).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="strictly increasing"):
        time_by_bucket([1.0], [1], (1, 1))


def test_per_bucket_oracle_takes_the_fastest_policy_per_bucket():
    total, pick = per_bucket_oracle({"a": [1.0, 5.0, 2.0, 0.0], "b": [3.0, 1.0, 2.5, 0.0]})
    assert total == pytest.approx(1.0 + 1.0 + 2.0)
    assert pick == ["a", "b", "a", None]                 # the last bucket was never visited
    with pytest.raises(ValueError):
        per_bucket_oracle({})


def test_paired_ratio_is_the_median_within_rounds_with_an_interval_that_narrows_with_rounds():
    # round 3 was a slow spell for both: pairing cancels it, while the ratio of medians would not
    med, lo, hi = paired_ratio([1.0, 2.0, 9.0], [0.5, 1.0, 4.5])
    assert (med, lo, hi) == (2.0, 2.0, 2.0)
    assert paired_ratio([3.0], [2.0]) == (1.5, 1.5, 1.5)
    rng = np.random.default_rng(1)
    noisy = lambda n: (1.0 + 0.1 * rng.standard_normal(n), 1.0 + 0.1 * rng.standard_normal(n))
    few, many = paired_ratio(*noisy(5)), paired_ratio(*noisy(200))
    assert few[1] <= few[0] <= few[2] and many[1] <= many[0] <= many[2]
    assert many[2] - many[1] < 0.5 * (few[2] - few[1]) and many[1] < 1.0 < many[2]
    assert paired_ratio([2.0, 1.0, 1.5], [1.0, 2.0, 1.0], seed=3) == paired_ratio([2.0, 1.0, 1.5], [1.0, 2.0, 1.0],
                                                                                   seed=3)
    for bad in (([], []), ([1.0], [1.0, 2.0]), ([1.0, -1.0], [1.0, 1.0])):
        with pytest.raises(ValueError):
            paired_ratio(*bad)
    with pytest.raises(ValueError, match="level"):
        paired_ratio([1.0, 2.0], [1.0, 2.0], level=1.0)


def test_call_times_warm_up_once_then_time_each_repeat():
    from tltlib.machine import call_times
    calls = []
    times = call_times(lambda: calls.append(1), 4, "cpu")
    assert len(calls) == 5 and len(times) == 4 and all(t >= 0 for t in times)
