"""The paper beside this project: its numbers, the simulator at its settings, each key result measured here (from
the committed results) and notebook 07's figures (``plots``)."""
from . import plots
from .numbers import PAPER, SETTINGS
from .projection import ProjectionConfig, lengths_from_bench, project, table3
from .reproduce import (
                        measured_drift,
                        measured_e2e,
                        measured_idle,
                        measured_rewards,
                        measured_sd,
                        simulated_case_study,
                        simulated_idle,
                        simulated_sd,
)

__all__ = ["PAPER", "SETTINGS", "ProjectionConfig", "lengths_from_bench", "measured_drift", "measured_e2e",
           "measured_idle", "measured_rewards", "measured_sd", "plots", "project", "simulated_case_study",
           "simulated_idle", "simulated_sd", "table3"]
