"""The simulator at the paper's settings: the adaptive policy it plays, the lengths it draws, the projection against
Table 3 (the trend and the memory limits), and bad input as one clear error."""
from __future__ import annotations

import json

import pytest

from tltlib.paper.numbers import PAPER, SETTINGS
from tltlib.paper.projection import (
    ProjectionConfig,
    fit_acceptance,
    lengths_from_bench,
    ngram_policy,
    paper_policy,
    project,
    sd_time_share,
    table3,
)
from tltlib.sim.simulate import LengthDistribution, RolloutSim
from tltlib.spec.acceptance import expected_tokens
from tltlib.spec.strategy import SpecStrategy


def test_the_fitted_acceptance_gives_the_accept_length_back():
    a = fit_acceptance(6.53, 10)
    assert 0.85 < a < 0.92
    assert expected_tokens(SpecStrategy.parse("chain-10"), a) == pytest.approx(6.53, abs=1e-9)
    assert fit_acceptance(1.5, 1) == pytest.approx(0.5)
    for bad in (1.0, 11.0, 0.5):
        with pytest.raises(ValueError, match=r"accept length must lie in \(1, depth \+ 1\)"):
            fit_acceptance(bad, 10)


def test_the_papers_policy_verifies_fewer_tokens_in_larger_buckets():
    p = paper_policy()
    assert p.threshold == 32
    assert [(lo, name) for lo, name in p.buckets] == [(1, "tree-10x8-48"), (2, "tree-10x8-32"), (5, "tree-10x8-16"),
                                                      (21, "tree-8x8-8")]
    accept = dict(p.accept)
    assert accept["tree-10x8-48"] == pytest.approx(6.53) and accept["tree-8x8-8"] < accept["tree-10x8-16"]
    assert [p.choose(rows)[0].verify_tokens for rows in (1, 3, 10, 32, 33)] == [48, 32, 16, 8, 0]
    assert dict(ngram_policy(1.3).accept) == {"ngram-4": 1.3}
    with pytest.raises(ValueError, match="one verify budget per bucket"):
        paper_policy(buckets=(1, 2), verify=(48,))


def _bench_file(tmp_path, steps):
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"settings": {"max_new": 720}, "runs": {"baseline": [{"steps": steps}]}}))
    return path


def test_lengths_come_from_a_bench_file_scaled_to_the_cap(tmp_path):
    steps = [{"rollout/len_p50": 40, "rollout/len_p99": 500}, {"rollout/len_p50": 50, "rollout/len_p99": 540},
             {"rollout/len_p50": 45, "rollout/len_p99": 520}]
    d = lengths_from_bench(_bench_file(tmp_path, steps), cap=7200)
    assert (d.median, d.p99, d.cap) == (pytest.approx(450), pytest.approx(5200), 7200)


def test_a_missing_or_foreign_bench_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such results file; run `python -m tltlib bench e2e_grpo`"):
        lengths_from_bench(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="no baseline rollout lengths"):
        lengths_from_bench(_bench_file(tmp_path, [{"time/step_s": 1.0}]))
    with pytest.raises(ValueError, match="median > 0"):
        LengthDistribution(median=0, p99=10)


def test_the_sd_share_of_a_rollout_counts_only_its_sd_intervals():
    sim = RolloutSim(10.0, timeline=[(4.0, 64, "off"), (7.0, 20, "chain-4"), (10.0, 3, "tree-8x4-32")])
    assert sd_time_share(sim) == pytest.approx(0.6)


def test_the_projection_grows_with_scale_and_meets_table_3():
    """The paper's trend from the paper's settings: more nodes -> fewer rows per worker -> a larger share of the
    rollout under SD, a larger rollout share of the step, more idle worker-time; the 32B model does not fit on 1-2
    nodes (the paper's OOM) and fits on 4 and 8. Every simulated speedup is within 15% of Table 3."""
    seven = project(ProjectionConfig(model="qwen2.5-7b", tp=4, seeds=2))
    keys = ("speedup", "rollout_share", "sd_time_share", "idle_frac")
    for key in keys:
        values = [r[key] for r in seven]
        assert values == sorted(values), (key, values)
    assert [r["rows_per_worker"] for r in seven] == [256, 128, 64, 32]
    big = project(ProjectionConfig(model="qwen2.5-32b", tp=8, seeds=2))
    assert ["oom" in r for r in big] == [True, True, False, False]
    assert "need" in big[0]["oom"] and "GB per device" in big[0]["oom"]
    for r in seven + big:
        if "oom" not in r:
            assert r["speedup"] == pytest.approx(r["paper"], rel=0.15), r
            assert r["speedup"] > r["tlt_base_speedup"] > 1.0 and r["harvested"] > 0.9
    text = table3({"qwen2.5-7b": seven, "qwen2.5-32b": big})
    assert "| qwen2.5-32b | 1 | — | — | — | — | OOM (needs" in text and "| 1.76x |" in text
    assert set(SETTINGS) == set(PAPER["table3"])


def test_bad_projection_settings_are_refused():
    with pytest.raises(ValueError, match="tensor parallelism 3 does not divide the model's 28 attention heads"):
        project(ProjectionConfig(model="qwen2.5-7b", tp=3, nodes=(1,), seeds=1))
    with pytest.raises(ValueError, match="unknown hardware preset 'tpu'"):
        project(ProjectionConfig(hardware="tpu", nodes=(1,), seeds=1))
    with pytest.raises(ValueError, match="seeds >= 1"):
        ProjectionConfig(seeds=0)


@pytest.mark.parametrize("settings,match", [(None, "settings.max_new .* must be a number > 0, got none"),
                                            ({"max_new": 0}, "settings.max_new .* must be a number > 0, got 0"),
                                            ({"max_new": "720"}, "settings.max_new .* got '720'")])
def test_a_bench_file_without_a_usable_max_new_is_named(tmp_path, settings, match):
    """Was KeyError: 'settings' and ZeroDivisionError: the lengths are scaled from the bench's max_new."""
    path = _bench_file(tmp_path, [{"rollout/len_p50": 40, "rollout/len_p99": 500}])
    d = json.loads(path.read_text())
    d.pop("settings") if settings is None else d.update(settings=settings)
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"{path.name}: {match}"):
        lengths_from_bench(path)
