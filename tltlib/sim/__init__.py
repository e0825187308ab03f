"""The cost model and the simulator: what a forward and a decode iteration cost (measured on this machine, or from a
device's roofline), read alike by the adaptive engine's tuner and by the simulator of synchronous GRPO steps at
scales this machine cannot run; what a calibration must satisfy to be physical."""
from .costs import (
                    Hardware,
                    MeasuredCosts,
                    ModelShape,
                    Roofline,
                    hardware,
                    iteration_time,
                    plain_rate,
                    predicted_speedup,
)
from .measure import fit_overheads, measure_costs
from .simulate import LengthDistribution, SDPolicy, StepConfig, compare_policies, simulate_rollout, simulate_step

__all__ = ["Hardware", "LengthDistribution", "MeasuredCosts", "ModelShape", "Roofline", "SDPolicy", "StepConfig",
           "compare_policies", "fit_overheads", "hardware", "iteration_time", "measure_costs", "plain_rate",
           "predicted_speedup", "simulate_rollout", "simulate_step"]
