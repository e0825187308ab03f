"""Notebook smoke tier: every notebook runs headless with params/smoke.yaml and writes metrics.json (one at a time,
in the slow tier; the default run executes all of them at the same sizes through the README's GPU sequence,
tests/test_gpu_sequence.py, with the same checks)."""
from __future__ import annotations

import json

import pytest

from tltlib.lab.notebook import notebook_paths, read_metrics, run_notebooks

EXPECTED = {
    "01_profile_long_tail": ["rollout/len_p50", "rollout/len_p99", "rollout/tail_time_frac_10",
                             "rollout/tail_time_frac_25", "sched/idle_frac", "rl/accuracy"],
    "02_speculative_decoding_explained": ["spec/accept_len_mean", "spec/chi2_pvalue", "spec/accept_ge_1"],
    "03_train_drafter": ["drafter/loss", "drafter/acc_1", "drafter/acc_5", "spec/accept_len_mean"],
    "04_adaptive_rollout": ["adaptive/speedup_vs_no_sd", "adaptive/speedup_vs_fixed", "adaptive/explored_arms",
                            "adaptive/whatif_speedup", "spec/accept_len_mean"],
    "05_grpo_with_tlt": ["e2e/step_speedup", "e2e/amdahl_bound", "e2e/rollout_share", "eval/accuracy_tlt",
                         "spec/accept_len_online_last", "spec/accept_len_frozen_last"],
    "06_idle_time_drafter_training": ["sched/idle_frac", "sched/harvested", "sched/preempt_micro_steps",
                                      "sched/overhead_share", "spec/accept_len_spot_last",
                                      "spec/accept_len_frozen_last"],
    "07_reproduce_speedup_plots": ["sim/speedup_qwen2.5-7b_nodes8", "sim/speedup_qwen2.5-32b_nodes8",
                                   "sim/case_study_speedup", "measured/case_study_speedup", "measured/e2e_speedup_w1",
                                   "measured/accept_online_last", "measured/harvested_w2"],
}


def test_every_notebook_has_expectations_and_a_parameters_cell():
    for nb in notebook_paths():
        assert nb.stem in EXPECTED, f"add {nb.stem} to EXPECTED"
        cells = json.loads(nb.read_text())["cells"]
        tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{nb.name} needs exactly one cell tagged 'parameters'"
        source = "".join(tagged[0]["source"])
        assigned = [line.split("=")[0].strip() for line in source.splitlines() if line and not line.startswith("#")]
        from papermill.translators import PythonTranslator
        parsed = [p.name for p in PythonTranslator.inspect({"source": source})]
        assert parsed == assigned, f"{nb.name}: papermill cannot parse every parameter line (no '=' in comments)"
        assert all(not c.get("outputs") and not c.get("execution_count") for c in cells if c["cell_type"] == "code"),\
            f"{nb.name} is committed with outputs: strip them"


@pytest.mark.notebooks
@pytest.mark.slow                                        # the default run executes them in test_gpu_sequence.py
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_smoke(name, tmp_path):
    (executed,) = run_notebooks("params/smoke.yaml", out_root=tmp_path, only=[name[:2]], progress=False)
    assert executed.is_file()
    metrics = read_metrics(executed.parent)
    for key in EXPECTED[name]:
        assert key in metrics, key
    assert list(executed.parent.glob("*.png")), "the notebook wrote no figure"
