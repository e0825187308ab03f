"""What a GRPO trainer saves and restores: one checkpoint folder from which a run resumes bit for bit.

A checkpoint holds the policy (``policy.safetensors``), the optimizers, the drafter, its pair buffer, the adaptive
controller, every RNG state and the step (``state.pt``, ``trainer_state.json``), and with several workers each
worker's own sampling generator, buffer and tuner (``rank<k>.pt``). It is written atomically (a temporary folder
renamed over the old one; :func:`tltlib.fileio.atomic_folder`) and read with every file checked: a folder from
another model or configuration is refused with the differences named (:func:`fingerprint`), a truncated file or
weights that are integer or non-finite are named before anything runs on them.

Departures: none (tooling).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import check_finite, check_floating, read_safetensors
from .fileio import atomic_folder, read_json
from .grpo import reward_name

CHECKPOINT_FORMAT = "tltlib-grpo-checkpoint-1"


def _config_dict(cfg) -> dict:
    return json.loads(json.dumps(asdict(cfg), default=str))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fingerprint(trainer) -> dict:
    """What a checkpoint must match to be resumed here (the model's shape, the RL and TLT settings; with
    several workers also their number, as each one's state is saved, and the scheduler settings that change
    what is trained — budgets and timeouts may change on resume)."""
    args = {k: v for k, v in _config_dict(trainer.args).items() if k not in ("max_steps", "save_steps")}
    out = {"model": trainer.model.config.to_hf(), "grpo": args, "tlt": _config_dict(trainer.tlt),
           "drafter": trainer.drafter is not None, "rewards": [reward_name(f) for f in trainer.reward_funcs]}
    if trainer.curriculum is not None:
        out["curriculum"] = _config_dict(trainer.curriculum)
    if trainer.world.distributed:
        out.update(world=trainer.world.size, scheduler={"spot_trainer": trainer.sched.spot_trainer,
                                                     "train_on": trainer.sched.train_on})
    return out


def save(trainer, path: str | os.PathLike) -> Path:
    """Write a checkpoint folder atomically (a temporary folder renamed over ``path``; other files there, such
    as the run's metrics.jsonl, are carried over). With several workers each one's own state (sampling
    generator, pair buffer, tuner) is staged beside it first and moved in by rank 0."""
    path = Path(path).resolve()
    staged = _stage_worker_state(trainer, path)
    if trainer.world.rank == 0:
        with atomic_folder(path, keep_existing=True) as tmp:
            _write_checkpoint(trainer, tmp, path)
            for k, f in enumerate(staged):
                f.replace(tmp / f"rank{k}.pt")
    trainer.world.barrier()
    return path


def _stage_worker_state(trainer, path: Path) -> list[Path]:
    """Several workers: every worker writes its own state beside ``path``; returns all their files."""
    if trainer.world.size == 1:
        return []
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = [path.parent / f".{path.name}-rank{k}-step{trainer.step_count}.pt" for k in range(trainer.world.size)]
    mine = staged[trainer.world.rank]
    tmp = mine.with_name(mine.name + ".part")
    torch.save({"generator": trainer.generator.get_state(),
                "buffer": trainer.buffer.state_dict() if trainer.buffer is not None else None,
                "controller": trainer.controller.state_dict() if trainer.controller is not None else None}, tmp)
    tmp.replace(mine)
    trainer.world.barrier()
    return staged


def _write_checkpoint(trainer, tmp: Path, path: Path) -> None:
    meta = {"format": CHECKPOINT_FORMAT, "step": trainer.step_count, "fingerprint": fingerprint(trainer),
            "numpy_rng": trainer.rng.bit_generator.state, "history": trainer.history,
            "controller": trainer.controller.state_dict() if trainer.controller is not None else None,
            "drafter_version": getattr(trainer.drafter, "version", None),
            "drafter_steps_done": trainer.drafter_trainer.steps_done if trainer.drafter_trainer else None}
    (tmp / "trainer_state.json").write_text(json.dumps(meta, default=float) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in trainer.model.state_dict().items()},
              str(tmp / "policy.safetensors"))
    tensors = {"optimizer": trainer.optimizer.state_dict(), "generator": trainer.generator.get_state()}
    if trainer.reference is not None:
        tensors["reference"] = trainer.reference.state_dict()
    if trainer.drafter is not None:
        tensors["drafter"] = trainer.drafter.state_dict()
    if trainer.drafter_trainer is not None:
        tensors["drafter_optimizer"] = trainer.drafter_trainer.opt.state_dict()
    if trainer.buffer is not None:
        tensors["buffer"] = trainer.buffer.state_dict()
    torch.save(tensors, tmp / "state.pt")
    digest = hashlib.sha256(json.dumps(meta["fingerprint"], sort_keys=True).encode()).hexdigest()[:16]
    (tmp / "README.md").write_text(f"# tltlib GRPO checkpoint\n\nStep {trainer.step_count}; configuration "
                                   f"{digest}. Resume with `python -m tltlib train-grpo --params <the file that "
                                   f"started it> --resume {path}`.\n")


def load(trainer, path: str | os.PathLike) -> None:
    """Restore into ``trainer`` a checkpoint written by :func:`save` (refused, with the differences named, when it
    comes from another model or configuration)."""
    path = Path(path)
    state_file = path / "trainer_state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a tltlib GRPO checkpoint (no trainer_state.json); pass "
                                "the folder written by a run (--output-dir)")
    meta = read_json(state_file, "the checkpoint is damaged: resume from an earlier one")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{state_file}: format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    mine, theirs = _flatten(fingerprint(trainer)), _flatten(meta["fingerprint"])
    if "scheduler.pairs" in theirs:                   # written before the key was renamed
        theirs["scheduler.train_on"] = theirs.pop("scheduler.pairs")
    diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if diff:
        raise ValueError(f"{path} was written by a run with another model or configuration (differs in "
                         f"{', '.join(diff[:6])}); resume with the same model and settings, or start anew "
                         "with another output folder")
    trainer.model.load_state_dict(read_policy(path, trainer.device))
    tensors = _read_state(path / "state.pt")
    trainer.optimizer.load_state_dict(tensors["optimizer"])
    trainer.generator.set_state(tensors["generator"])
    if trainer.reference is not None:
        trainer.reference.load_state_dict(tensors["reference"])
    if trainer.drafter is not None:
        trainer.drafter.load_state_dict(tensors["drafter"])
        trainer.drafter.version = meta["drafter_version"]
    if trainer.drafter_trainer is not None:
        trainer.drafter_trainer.opt.load_state_dict(tensors["drafter_optimizer"])
        trainer.drafter_trainer.steps_done = meta["drafter_steps_done"]
    if trainer.buffer is not None:
        trainer.buffer.load_state_dict(tensors["buffer"])
    if trainer.controller is not None:
        trainer.controller.load_state_dict(meta["controller"])
    trainer.rng.bit_generator.state = meta["numpy_rng"]
    trainer.step_count, trainer.history = meta["step"], list(meta["history"])
    if trainer.world.size > 1:                       # this worker's own state
        st = _read_state(path / f"rank{trainer.world.rank}.pt")
        trainer.generator.set_state(st["generator"])
        if trainer.buffer is not None:
            trainer.buffer.load_state_dict(st["buffer"])
        if trainer.controller is not None:
            trainer.controller.load_state_dict(st["controller"])


def read_policy(path: Path, device) -> dict[str, torch.Tensor]:
    """The policy of a checkpoint folder, checked: a truncated file, integer or non-finite weights are refused with
    the file named (before any rollout runs on them)."""
    f = path / "policy.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing: the checkpoint is incomplete; resume from another one or start anew")
    tensors = read_safetensors([f], device)
    check_floating(tensors, str(f))
    check_finite(tensors, str(f))
    return tensors


def _read_state(f: Path) -> dict:
    """A torch.save'd state file of a checkpoint (the optimizers, RNG states, buffer), its damage named."""
    try:
        return torch.load(f, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"{f} is missing: the checkpoint is incomplete; resume from another one or start "
                                "anew") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ValueError(f"{f} is not readable ({' '.join(str(e).split())[:160]}): the checkpoint is damaged; "
                         "resume from another one or start anew") from None


def load_weights(path: str | os.PathLike, model, drafter=None) -> dict:
    """Load the policy (and the drafter) of a checkpoint written by :func:`save` into ``model`` (and
    ``drafter``) without a trainer, e.g. to probe a finished run; returns its ``trainer_state.json``."""
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a tltlib GRPO checkpoint (no trainer_state.json)")
    meta = read_json(path / "trainer_state.json", "the checkpoint is damaged")
    model.load_state_dict(read_policy(path, model.embed.weight.device))
    if drafter is not None:
        tensors = _read_state(path / "state.pt")
        if "drafter" not in tensors:
            raise ValueError(f"{path} holds no drafter (the run had none): load the policy only")
        drafter.load_state_dict(tensors["drafter"])
        drafter.version = meta.get("drafter_version") or 0
    return meta
