"""The TRL rollout's state in TRL's checkpoints: a callback that writes it into ``checkpoint-N/tlt_rollout/`` when
TRL saves, and the reader that restores it when TRL resumes.

What is saved, per process (``rank-R/``, each written atomically): the online drafter as a drafter folder
(:func:`tltlib.model.drafter.save_drafter`: ``load_drafter`` reads it back, e.g. to ship it), and ``state.pt`` with
its AdamW state, version and micro-steps, the adaptive controller's evidence, ``drafter_train``'s gate
(:class:`tltlib.rl.drift.DriftGate`: its phase and references), the sampling generator and the step.

Departures: the pair buffer is not saved (for SmolLM2 it can hold GBs): after a resume the drafter trains on the
pairs of the rollouts that follow, not on those of the steps before the checkpoint.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import BadInput, NotFound
from ..fileio import atomic_file, atomic_folder
from ..model.drafter import load_drafter, save_drafter
from ..model.weights import read_weights
from .trl_weights import hf_tensors

FOLDER = "tlt_rollout"
"""The TRL rollout's folder inside a TRL checkpoint (``checkpoint-N/``)."""


def checkpoint_folder(output_dir: str | os.PathLike, global_step: int) -> Path:
    """TRL's (transformers') checkpoint folder of ``global_step`` in ``output_dir``."""
    return Path(output_dir) / f"checkpoint-{global_step}"


def resumed_from(trainer, resume_from) -> Path | None:
    """The TRL checkpoint folder this run resumed from (None: a fresh run): ``resume_from`` when given, else TRL's
    ``output_dir/checkpoint-<global_step>``; refused unless TRL's model holds that folder's weights (a checkpoint
    of the same step from another run, or one TRL did not resume from, would restore another run's drafter), and
    ``resume_from`` on a run TRL did not resume."""
    step = trainer.state.global_step
    if step == 0:
        if resume_from is not None:
            raise BadInput(f"tlt_rollout_func(resume_from={str(resume_from)!r}) was given but TRL did not resume "
                           "(global_step 0): pass the same folder to trainer.train(resume_from_checkpoint=...)")
        return None
    folder = Path(resume_from) if resume_from is not None else checkpoint_folder(trainer.args.output_dir, step)
    fix = ("pass tlt_rollout_func(resume_from=<the folder given to trainer.train(resume_from_checkpoint=...)>)")
    try:
        saved = read_weights(folder)
    except (FileNotFoundError, ValueError) as e:
        raise NotFound(f"TRL resumed at step {step}, but {str(folder)!r} is not a checkpoint with the "
                       f"policy's weights ({e}); {fix}") from None
    ours = hf_tensors(trainer.model)
    for name, t in saved.items():
        if name in ours and not torch.equal(t.to(ours[name].device, ours[name].dtype), ours[name]):
            raise BadInput(f"TRL did not resume from {str(folder)!r} (its {name} is not TRL's model's): the TLT "
                           f"rollout would restore another run's drafter; {fix}")
    return folder


def save(rollout, folder: str | os.PathLike) -> Path:
    """Write this process's TRL rollout state into ``folder/tlt_rollout/rank-R/`` (atomically)."""
    dest = Path(folder) / FOLDER / f"rank-{rollout.world.rank}"
    with atomic_folder(dest) as tmp:
        if rollout.drafter is not None:
            save_drafter(rollout.drafter, tmp / "drafter")
        trains = rollout.drafter_trainer
        state = {"world_size": rollout.world.size, "global_step": rollout.synced_step,
                 "drafter_version": getattr(rollout.drafter, "version", None),
                 "drafter_optimizer": trains.opt.state_dict() if trains else None,
                 "drafter_steps_done": trains.steps_done if trains else None,
                 "controller": rollout.controller.state_dict() if rollout.controller is not None else None,
                 "drafter_drift": rollout.drift.state_dict(), "generator": rollout.generator.get_state()}
        with atomic_file(tmp / "state.pt") as f:
            torch.save(state, f)
    return dest


def load(rollout, folder: str | os.PathLike) -> None:
    """Restore this process's TRL rollout state from a TRL checkpoint ``folder``; refused, naming what is missing,
    when the folder holds none or was written by another number of processes."""
    src = Path(folder) / FOLDER / f"rank-{rollout.world.rank}"
    if not (src / "state.pt").is_file():
        raise NotFound(f"TRL resumed from {str(folder)!r}, which holds no TLT rollout state ({src} is "
                       "missing): the drafter would silently restart from its initial weights; resume from a "
                       "checkpoint written with the TLT rollout_func, or pass tlt_rollout_func(resume_from="
                       "the folder that holds tlt_rollout/)")
    state = torch.load(src / "state.pt", map_location="cpu", weights_only=False)
    if state["world_size"] != rollout.world.size:
        raise BadInput(f"{src} was written by {state['world_size']} processes, this run has {rollout.world.size}: "
                       "resume with the same number of processes (accelerate launch --num_processes)")
    if rollout.drafter is not None:
        saved = load_drafter(src / "drafter", rollout.model)
        rollout.drafter.load_state_dict(saved.state_dict())
        rollout.drafter.version = state["drafter_version"]
    if rollout.drafter_trainer is not None and state["drafter_optimizer"] is not None:
        rollout.drafter_trainer.opt.load_state_dict(state["drafter_optimizer"])
        rollout.drafter_trainer.steps_done = state["drafter_steps_done"]
    if rollout.controller is not None and state["controller"] is not None:
        rollout.controller.load_state_dict(state["controller"])
    if "drafter_drift" in state:                     # a checkpoint from before the gate was saved: a fresh gate
        rollout.drift.load_state_dict(state["drafter_drift"])
    rollout.generator.set_state(state["generator"])


def callback(rollout):
    """A ``transformers.TrainerCallback`` that saves the rollout's state with every TRL checkpoint and adds the
    ``sched/*`` metrics of several processes after each optimizer step."""
    from transformers import TrainerCallback

    class TLTRolloutCallback(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            save(rollout, checkpoint_folder(args.output_dir, state.global_step))
            return control

        def on_step_end(self, args, state, control, **kwargs):
            rollout.log_schedule()
            return control

    return TLTRolloutCallback()
