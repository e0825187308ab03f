"""Notebook 07's data and figures: the measured points read from the committed bench results, the simulated ones at
the paper's settings, and figures whose legends say where each point comes from."""
from __future__ import annotations

import matplotlib
import pytest

from tltlib.paper import plots as paper_plots
from tltlib.paper.numbers import PAPER
from tltlib.paper.projection import ProjectionConfig, project
from tltlib.paper.reproduce import (
    measured_drift,
    measured_e2e,
    measured_idle,
    measured_rewards,
    measured_sd,
    results,
    simulated_case_study,
    simulated_idle,
    simulated_sd,
    timeline_rows,
)

matplotlib.use("Agg")
RESULTS = "bench/results"


def test_a_missing_results_file_names_the_bench_that_writes_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="run `python -m tltlib bench e2e_grpo --workers 2`"):
        results(tmp_path, "e2e_grpo-cpu-float32-w2.json")


def test_the_measured_points_come_from_the_committed_results():
    e2e = measured_e2e(RESULTS)
    assert set(e2e["tlt"]) == {1, 2} and all(v > 1.0 for v in e2e["tlt"].values())
    assert set(e2e["trl"]) == {"TRL tuned", "TRL defaults"} and 0 < e2e["trl"]["TRL defaults"] < e2e["trl"][
        "TRL tuned"] < 1.0
    sd = measured_sd(RESULTS, "speculative-cpu-float32.json")
    assert "chain-4" in sd and sd["chain-4"][1] > 1.0
    with pytest.raises(ValueError, match="no results at temperature 0.5; it has \\[0.0, 0.9\\]"):
        measured_sd(RESULTS, "speculative-cpu-float32.json", temperature=0.5)
    drift = measured_drift(RESULTS)
    assert len(drift["step"]) == len(drift["online"]) == len(drift["frozen"]) >= 8
    assert drift["online"][-1] > drift["frozen"][-1] and drift["paper"] == PAPER["table6"]
    rewards = measured_rewards(RESULTS)
    assert len(rewards["baseline"]) == len(rewards["TLT"]) == 8 and len(rewards["TLT"][0]) == 3
    idle = measured_idle(RESULTS)
    assert idle["workers"] == [2] and 0 < idle["idle"][0] < 1 and 0.9 < idle["harvested"][0] <= 1


def test_the_simulated_sd_curves_have_table_4s_shape():
    """Verification is almost free at batch 1 and costly at batch 32: there the fewest verified tokens win."""
    sd = simulated_sd(batches=(1, 32))
    assert sorted(sd) == [16, 32, 48, 64]
    assert all(sd[v][1] > sd[v][32] for v in sd)
    assert sd[16][32] > sd[32][32] > sd[48][32] > sd[64][32]
    assert max(sd[v][1] for v in sd) / min(sd[v][1] for v in sd) < 1.05


def test_the_simulated_case_study_switches_sd_on_below_the_threshold():
    case = simulated_case_study(ProjectionConfig().lengths, seed=0)
    assert case["speedup"] > 1.5
    assert case["plain"].timeline[0][1] == 128
    assert all(rows <= 32 for _, rows, name in case["tlt"].timeline if name != "off")
    assert all(rows > 32 for _, rows, name in case["tlt"].timeline if name == "off")
    t, rows, on = timeline_rows({"time": [0.1, 0.2, 0.3], "active": [40, 30, 2], "strategy": ["off", "chain-8",
                                                                                            "chain-8"]})
    assert t.tolist() == [0.1, 0.2, 0.3] and rows.tolist() == [40, 30, 2] and on.tolist() == [False, True, True]


def test_the_simulated_idle_shares_skip_configurations_that_do_not_fit():
    rows = project(ProjectionConfig(model="qwen2.5-32b", tp=8, seeds=1))
    idle = simulated_idle(rows)
    assert idle["workers"] == [4, 8] and idle["idle"] == sorted(idle["idle"]) and idle["source"] == "simulated"


def _labels(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def test_every_figure_says_where_each_point_comes_from():
    rows = {"qwen2.5-7b": project(ProjectionConfig(seeds=1)),
            "qwen2.5-32b": project(ProjectionConfig(model="qwen2.5-32b", tp=8, seeds=1))}
    fig = paper_plots.e2e_speedup(rows, measured_e2e(RESULTS))
    labels = _labels(fig)
    assert "qwen2.5-7b: paper (Table 3)" in labels and "qwen2.5-32b: simulated" in labels
    assert "TLT: measured here" in labels and "TRL tuned (its speed): measured here" in labels
    fig = paper_plots.sd_by_batch(simulated_sd(), {"CPU": measured_sd(RESULTS, "speculative-cpu-float32.json")})
    assert {"verify 64: paper", "verify 64: simulated", "chain-4, CPU"} <= set(_labels(fig))
    timeline = {"time": [0.1, 0.2, 0.3], "active": [40, 30, 2], "strategy": ["off", "chain-8", "chain-8"],
                "iter_time": [0.1, 0.1, 0.1]}
    case = simulated_case_study(ProjectionConfig().lengths, seed=0)
    fig = paper_plots.case_study(case, {"plain": timeline, "tlt": timeline, "speedup": 1.0})
    assert {"no SD: simulated", "TLT: simulated", "no SD: measured here"} <= set(_labels(fig))
    assert "paper 2.44x" in fig.axes[0].get_title()
    fig = paper_plots.drift(measured_drift(RESULTS))
    assert "trained online: measured here" in _labels(fig) and "Table 6" in fig.axes[1].get_title()
    fig = paper_plots.idle_vs_workers(simulated_idle(rows["qwen2.5-7b"]), measured_idle(RESULTS))
    assert {"idle share: simulated", "harvested: measured here"} <= set(_labels(fig))
    import matplotlib.pyplot as plt
    plt.close("all")


def test_lengths_and_projection_read_the_committed_bench_file(tmp_path):
    from tltlib.paper.projection import lengths_from_bench
    d = lengths_from_bench(f"{RESULTS}/e2e_grpo-cpu-float32.json")
    assert 1000 < d.median < d.p99 < d.cap == 32768
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        lengths_from_bench(broken)
