"""Running experiments: the notebooks' runner and parameter files, their figures (``plots``), the ``train-grpo``
job, baseline-vs-TLT comparisons, the teaching helpers of notebook 02, the simulator's validation on this machine,
and the recipes that built the tiny reasoner and warm-start a real model."""
from . import plots
from .e2e import compare, schedule_summary, summarize, trl_peer, trl_phases
from .explain import compare_samplers, sample_categories, trace_step
from .notebook import read_metrics, resolve, run_notebooks, save_figure, write_metrics
from .params import dataclass_from_mapping, task_configs
from .rljob import launch, read_metrics_log, run_job, write_job_params

__all__ = ["compare", "compare_samplers", "dataclass_from_mapping", "launch", "plots", "read_metrics",
           "read_metrics_log", "resolve", "run_job", "run_notebooks", "sample_categories", "save_figure",
           "schedule_summary", "summarize", "task_configs", "trace_step", "trl_peer", "trl_phases", "write_job_params",
           "write_metrics"]
