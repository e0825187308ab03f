"""The paper's key results next to this project's: what was measured here (read from the committed bench results),
what the simulator projects at the paper's settings, and the paper's own number — the data behind notebook 07.

Every function returns plain data, each series saying where it comes from (``"source"``): ``measured here`` (a
bench results file, named), ``simulated`` (:mod:`tltlib.sim.simulate` / :mod:`tltlib.paper.projection`), ``paper`` (the
table).

Paper: TLT Table 3 / Fig. 11 (end to end), Table 4 (SD by batch size and tokens to verify), Fig. 14 (the rollout
case study), Table 6 (adaptive vs frozen drafter), Fig. 7 (reward curves), Fig. 1b (idle workers).
Departures: measured here means the tiny reasoner on a 2-core CPU (and one H100 for SD), not the paper's models.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from ..errors import BadInput, NotFound
from ..fileio import read_json
from ..model.decoder import preset
from ..sim.costs import ModelShape, Roofline, hardware, iteration_time
from ..sim.simulate import LengthDistribution, simulate_rollout
from ..spec.acceptance import expected_tokens
from ..spec.strategy import SpecStrategy
from .numbers import PAPER
from .projection import fit_acceptance, paper_policy

BENCH_COMMANDS = {
    "e2e_grpo-cpu-float32.json": "python -m tltlib bench e2e_grpo",
    "e2e_grpo-cpu-float32-w2.json": "python -m tltlib bench e2e_grpo --workers 2",
    "e2e_grpo-cpu-float32-drift.json": "python -m tltlib bench e2e_grpo --drafter data/tiny-reasoner-drafter-short "
                                       "--seeds 1 --steps 10 --trl-steps 0 --held-out 64 --tag=-drift",
    "speculative-cpu-float32.json": "python -m tltlib bench speculative",
    "speculative-cuda-bfloat16.json": "python -m tltlib bench speculative --device cuda --dtype bfloat16 (on a GPU)",
}


def results(folder: str | Path, name: str) -> dict:
    """A committed bench results file of ``folder``; a missing one is named with the command that writes it."""
    path = Path(folder) / name
    if not path.is_file():
        how = BENCH_COMMANDS.get(name, "the bench that writes it")
        raise NotFound(f"{path}: no such results file; run `{how}` (or point RESULTS_DIR at a folder "
                       "that has it)")
    return read_json(path, f"run `{BENCH_COMMANDS.get(name, 'the bench')}` again")


# ------------------------------------------------------------------------------------------- (a) end to end
def measured_e2e(folder: str | Path) -> dict:
    """TLT's step speedup over the baseline measured here, one process and 2 workers, and TRL's step relative to
    the tltlib baseline (its speed: baseline step / TRL step; the paper's Open-R1 baseline is TRL-based), for each
    TRL run the file holds."""
    one = results(folder, "e2e_grpo-cpu-float32.json")
    two = results(folder, "e2e_grpo-cpu-float32-w2.json")
    out = {"tlt": {1: one["summary"]["comparison"]["step_speedup"], 2: two["summary"]["comparison"]["step_speedup"]},
           "trl": {}, "source": "measured here: bench/results/e2e_grpo-cpu-float32{,-w2}.json (tiny reasoner, CPU)"}
    base = one["summary"]["baseline"]["step"]
    for key, label in (("trl_tuned", "TRL tuned"), ("trl", "TRL defaults")):
        if one.get(key) and one[key].get("step_s"):
            out["trl"][label] = base / statistics.median(one[key]["step_s"])
    return out


# ------------------------------------------------------------------------------------- (b) SD by batch size
def measured_sd(folder: str | Path, name: str, temperature: float = 0.9) -> dict[str, dict[int, float]]:
    """SD speedup over plain decoding per strategy and batch size from a ``bench speculative`` results file, at
    ``temperature``: ``{strategy: {batch: speedup}}``."""
    d = results(folder, name)
    out: dict[str, dict[int, float]] = {}
    for r in d["results"]:
        if abs(r["temperature"] - temperature) > 1e-9:
            continue
        for strategy, v in r["strategies"].items():
            out.setdefault(strategy, {})[int(r["batch"])] = float(v["speedup"])
    if not out:
        raise BadInput(f"{name}: no results at temperature {temperature}; it has "
                       f"{sorted({r['temperature'] for r in d['results']})}")
    return out


def simulated_sd(model: str = "qwen2.5-32b", tp: int = 4, hw: str = "h100", batches=(1, 2, 4, 8, 16, 32),
                 verify=(16, 32, 48, 64), depth: int = 10, branch: int = 8, context: int = 4000,
                 accept_at=(8.66, 12)) -> dict[int, dict[int, float]]:
    """Table 4's setting on the roofline: SD speedup ``{verify tokens: {batch: speedup}}`` of a tree of ``depth``
    x ``branch`` verifying ``verify`` tokens after ``context`` cached ones; the acceptance is fitted to
    ``accept_at`` = (accept length, depth) (Table 1: 8.66 at depth 12, top-k 8, for Qwen2.5-32B) and a tree
    accepts as a chain of its depth."""
    costs, accept = _setting(model, tp, hw, accept_at, depth)
    out = {}
    for v in verify:
        tree = SpecStrategy.parse(f"tree-{min(depth, v)}x{branch}-{v}")
        out[v] = {b: accept * iteration_time(costs, b, context, SpecStrategy()) / iteration_time(costs, b, context,
                                                                                                 tree)
                  for b in batches}
    return out


def _setting(model: str, tp: int, hw: str, accept_at: tuple, depth: int) -> tuple[Roofline, float]:
    """The roofline of ``model`` on ``tp`` ``hw`` devices, and the accept length of a chain of ``depth`` at the
    acceptance fitted to ``accept_at`` = (accept length, depth)."""
    costs = Roofline(ModelShape(preset(model, tie_word_embeddings=False)), hardware(hw), tp)
    return costs, expected_tokens(SpecStrategy.parse(f"chain-{depth}"), fit_acceptance(*accept_at))


# ----------------------------------------------------------------------------------- (c) the rollout case study
def simulated_case_study(lengths: LengthDistribution, model: str = "qwen2.5-32b", tp: int = 4, hw: str = "h100",
                         requests: int = 128, threshold: int = 32, accept_at=(8.66, 12), prompt_len: int = 512,
                         seed: int = 0) -> dict:
    """Fig. 14's rollout: ``requests`` responses on one worker without SD and with the paper's policy (SD at or
    below ``threshold`` running requests, acceptance fitted to ``accept_at`` as in :func:`simulated_sd`);
    ``{"plain": RolloutSim, "tlt": RolloutSim, "speedup"}``."""
    costs, accept = _setting(model, tp, hw, accept_at, 10)
    x = lengths.draw(requests, np.random.default_rng(seed))
    plain = simulate_rollout(costs, x, prompt_len)
    tlt = simulate_rollout(costs, x, prompt_len, paper_policy(accept, threshold=threshold))
    return {"plain": plain, "tlt": tlt, "speedup": plain.time_s / tlt.time_s, "source": "simulated"}


def timeline_rows(timeline: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds, running rows, SD on) per decode iteration of a measured rollout's timeline."""
    return (np.asarray(timeline["time"], dtype=float), np.asarray(timeline["active"], dtype=float),
            np.asarray(timeline["strategy"]).astype(str) != "off")


# ---------------------------------------------------------------------------- (d) drift, (e) rewards, (f) idle
def measured_drift(folder: str | Path, name: str = "e2e_grpo-cpu-float32-drift.json") -> dict:
    """Accept length per RL step of the drafter trained online and of the same drafter frozen (measured here, from
    the drifted warm-up), beside the paper's Table 6."""
    acc = results(folder, name)["acceptance"]
    return {"step": [a["step"] for a in acc], "online": [a["online"] for a in acc],
            "frozen": [a["frozen"] for a in acc], "paper": PAPER["table6"], "source": f"measured here: {name}"}


def measured_rewards(folder: str | Path, name: str = "e2e_grpo-cpu-float32.json") -> dict[str, list[list[float]]]:
    """Reward per RL step and seed of the baseline and of TLT (``{policy: [[seed rewards] per step]}``)."""
    s = results(folder, name)["summary"]
    return {"baseline": s["baseline"]["reward_by_step"], "TLT": s["tlt"]["reward_by_step"]}


def measured_idle(folder: str | Path) -> dict:
    """Idle share of the baseline's rollout and the share of it the spot trainer harvested, by workers: one
    process has none; 2 workers from ``bench e2e_grpo --workers 2``."""
    sched = results(folder, "e2e_grpo-cpu-float32-w2.json")["summary"]
    return {"workers": [2], "idle": [sched["schedule_baseline"]["idle_frac"]],
            "harvested": [sched["schedule"]["harvested_total"]],
            "source": "measured here: bench/results/e2e_grpo-cpu-float32-w2.json"}


def simulated_idle(rows: list[dict]) -> dict:
    """Idle and harvested shares by rollout workers from :func:`tltlib.paper.projection.project` rows (OOM rows
    skipped)."""
    kept = [r for r in rows if "oom" not in r]
    return {"workers": [r["workers"] for r in kept], "idle": [r["idle_frac"] for r in kept],
            "harvested": [r["harvested"] for r in kept], "source": "simulated"}
