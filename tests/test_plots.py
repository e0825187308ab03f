"""The notebooks' figures draw what their data says (checked on the artists, not on pixels)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tltlib.lab import plots  # noqa: E402
from tltlib.sim.costs import MeasuredCosts, predicted_speedup  # noqa: E402
from tltlib.spec.strategy import SpecStrategy  # noqa: E402


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def test_arm_rewards_bars_are_medians_per_arm_and_bucket():
    log = {"active": [1, 1, 1, 3, 3, 40], "arm": ["a", "a", "b", "a", "b", "b"],
           "reward": [1.0, 3.0, 2.0, 5.0, 4.0, 7.0]}
    fig = plots.arm_rewards(log, (1, 2, 17))
    ax = fig.axes[0]
    bars = ax.patches                      # arm "a" over the three used buckets, then arm "b"
    heights = [b.get_height() for b in bars]
    np.testing.assert_allclose(heights[:2], [2.0, 5.0])                 # a: median(1, 3), 5
    assert np.isnan(heights[2])                                           # a never ran at 17+
    np.testing.assert_allclose(heights[3:], [2.0, 4.0, 7.0])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1-1", "2-16", "17+"]


def test_policy_times_labels_speedups_over_the_first_policy():
    fig = plots.policy_times({"no SD": 10.0, "always chain-8": 5.0, "adaptive": 4.0})
    texts = [t.get_text().strip() for t in fig.axes[0].texts]
    assert texts == ["1.00x", "2.00x", "2.50x"]


def test_length_plots_mark_percentiles_and_end_the_cdf_at_one():
    lengths = [10] * 98 + [100, 400]
    ax = plots.length_histogram(lengths).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["p50 = 10",
                                                                   f"p99 = {np.percentile(lengths, 99):.0f}"]
    line = plots.length_cdf(lengths).axes[0].lines[0]
    assert line.get_ydata()[-1] == 1.0 and line.get_xdata()[-1] == 400


def test_the_length_histogram_counts_every_response():
    lengths = [15] * 34 + [40] * 50 + [700] * 16       # a first edge of 10**log10(15) = 15.000000000000004 lost the 15s
    bars = plots.length_histogram(lengths).axes[0].patches
    assert sum(b.get_height() for b in bars) == len(lengths)


def test_worker_timeline_title_reports_idle_share():
    fig = plots.worker_timeline([1, 1, 1, 9], 2)          # busy 1 and 9 steps of 9 -> 44% idle
    assert fig.axes[0].get_title().startswith("2 workers: 44% of worker-time idle")


def test_adaptive_timeline_colours_each_strategy_and_draws_the_threshold():
    tl = {"time": [0.1, 0.2, 0.3, 0.4], "active": [64, 40, 8, 2], "iter_time": [0.1] * 4,
          "strategy": ["off", "off", "chain-4", "chain-8"]}
    ax = plots.adaptive_timeline(tl, 32).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"off", "chain-4", "chain-8", "threshold = 32", "SD on"} <= set(labels)


def test_predicted_speedups_plots_one_curve_per_arm():
    cm = MeasuredCosts((1, 64), (64,), (1, 9), (((1.0, 1.1),), ((2.0, 16.0),)), (1,), (((0.1,),), ((0.2,),)))
    arms = [SpecStrategy("chain", 2), SpecStrategy("chain", 8)]
    ax = plots.predicted_speedups(cm, arms, 0.9, batches=[1, 8, 64]).axes[0]
    curves = [line for line in ax.lines if len(line.get_xdata()) == 3]
    assert len(curves) == 2
    np.testing.assert_allclose(curves[1].get_ydata(), [predicted_speedup(cm, arms[1], b, 0.9) for b in (1, 8, 64)])


def test_step_time_bars_stack_the_phases_and_label_the_rollout_share():
    phases = {"baseline": {"rollout": 6.0, "update": 3.0, "logprob": 0.0, "drafter": 0.0, "reward": 1.0},
              "TLT": {"rollout": 3.0, "update": 3.0, "logprob": 0.0, "drafter": 0.5, "reward": 0.5}}
    ax = plots.step_time_bars(phases).axes[0]
    tops = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0), bar.get_y() + bar.get_height())
    assert tops == {0: pytest.approx(10.0), 1: pytest.approx(7.0)}
    assert [t.get_text() for t in ax.texts] == ["60%", "43%"]
    # a peer 50x slower gets its own linear panel instead of squashing the others
    fig = plots.step_time_bars({**phases, "TRL": {"rollout": 100.0, "update": 400.0}})
    assert len(fig.axes) == 2 and [t.get_text() for t in fig.axes[1].texts] == ["20%"]
    assert fig.axes[0].get_yscale() == fig.axes[1].get_yscale() == "linear"


def test_reward_curves_draw_the_seed_mean():
    ax = plots.reward_curves({"baseline": [[0.5, 0.7], [0.6, 0.8]], "TLT": [[0.4, 0.6], [1.0, 1.0]]}).axes[0]
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [0.6, 0.7])
    np.testing.assert_allclose(ax.lines[1].get_ydata(), [0.5, 1.0])


def test_acceptance_curves_one_line_per_drafter():
    acc = [{"step": 1, "online": 3.0, "frozen": 2.0, "ngram": 1.1}, {"step": 2, "online": 4.0, "frozen": 2.0,
                                                                       "ngram": 1.2}]
    ax = plots.acceptance_curves(acc).axes[0]
    assert [list(line.get_ydata()) for line in ax.lines] == [[3.0, 4.0], [2.0, 2.0], [1.1, 1.2]]


def test_step_time_bars_draw_the_median_step_and_its_spread():
    phases = {"baseline": {"rollout": 6.0, "update": 4.0, "step": 10.0, "spread": {"step": [9.0, 12.0]}},
              "TLT": {"rollout": 3.0, "update": 4.0, "step": 7.0, "spread": {"step": [6.5, 8.0]}}}
    ax = plots.step_time_bars(phases).axes[0]
    bars = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(bars) == 2
    segs = bars[0].lines[2][0].get_segments()               # the whisker of the first bar: (x, 9) to (x, 12)
    assert segs[0][0][1] == pytest.approx(9.0) and segs[0][1][1] == pytest.approx(12.0)


# ----------------------------------------------------------------------------------- notebook 02's figures
def test_pq_bars_stack_kept_and_resampled_mass_to_p():
    from tltlib.lab import sdplots
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.3, 0.5])
    fig = sdplots.pq_bars(p, q)
    right = fig.axes[1]
    kept = [b.get_height() for b in right.patches[:3]]
    rest = [b.get_height() for b in right.patches[3:6]]
    np.testing.assert_allclose(kept, np.minimum(p, q))
    np.testing.assert_allclose(np.add(kept, rest), p)
    assert "alpha = sum min(p, q) = 0.70" in fig.axes[0].get_title()


def test_speedup_curves_mark_the_best_depth_and_say_when_sd_does_not_pay():
    from tltlib.lab import sdplots
    from tltlib.spec.acceptance import chain_speedup
    fig = sdplots.speedup_curves(0.8, 0.05, 1.0, max_depth=10)
    best = max(range(1, 11), key=lambda k: chain_speedup(0.8, k, 0.05))
    assert f"best k = {best}" in fig.axes[1].get_title()
    assert "does not pay" in sdplots.speedup_curves(0.3, 0.2, 2.0).axes[1].get_title()


def test_the_draft_tree_marks_only_the_turned_down_drafts_red():
    """A tree step that accepted one draft then rejected: red = the children of the accepted node (turned down,
    the residual drawn after them), grey = nodes the walk never reached, green = the accepted path."""
    import torch

    from tltlib.lab import sdplots
    from tltlib.spec.strategy import SpecStrategy
    from tltlib.spec.trees import DraftTree

    class Trace:                                    # root 0; depth 1: nodes 1, 2; depth 2: 3, 4 under 1, 5 under 2
        strategy = SpecStrategy("tree", 2, 2, 5)
        tree = DraftTree(torch.tensor([[7, 1, 2, 3, 4, 5]]), torch.tensor([[-1, 0, 0, 1, 1, 2]]),
                         torch.tensor([[0, 1, 1, 2, 2, 2]]))
        q = p = torch.full((1, 6), 0.5)
        path, accepted, next = torch.tensor([[1, 0]]), torch.tensor([1]), torch.tensor([9])
        bonus = torch.tensor([False])
    fig = sdplots.draft_tree(Trace())
    colours = [c.get_facecolor()[0][:3] for c in fig.axes[0].collections[:6]]
    green, red, grey = (matplotlib.colors.to_rgb(x) for x in (sdplots.GREEN, sdplots.RED, sdplots.GREY))
    assert [tuple(np.round(c, 3)) for c in colours] == [tuple(np.round(x, 3)) for x in
                                                         (green, green, grey, red, red, grey)]
    assert "1 drafts accepted + 1 resampled" in fig.axes[0].get_title()
