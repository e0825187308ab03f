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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import BadInput, NotFound
from ..fileio import atomic_folder, read_json
from ..model.weights import check_finite, check_floating, read_safetensors

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


def fingerprint(model_config, args, tlt, drafter: bool, reward_names: list[str], curriculum=None, world_size: int = 1,
                sched=None) -> dict:
    """What a checkpoint must match to be resumed (the model's shape, the RL and TLT settings; with several workers
    also their number, as each one's state is saved, and the scheduler settings that change what is trained —
    budgets and timeouts may change on resume)."""
    grpo = {k: v for k, v in _config_dict(args).items() if k not in ("max_steps", "save_steps")}
    out = {"model": model_config.to_hf(), "grpo": grpo, "tlt": _config_dict(tlt), "drafter": drafter,
           "rewards": list(reward_names)}
    if curriculum is not None:
        out["curriculum"] = _config_dict(curriculum)
    if world_size > 1:
        out.update(world=world_size, scheduler={"spot_trainer": sched.spot_trainer, "train_on": sched.train_on})
    return out


@dataclass
class TrainerState:
    """Everything a checkpoint holds of a trainer (:meth:`tltlib.rl.trainer.GRPOTrainer.checkpoint_state`): the
    JSON part (``meta``: step, fingerprint, history, the prompt draw's RNG, the controller, the drafter's version and
    micro-steps), the policy's weights and the other tensors (``tensors``: the optimizers, the sampling generator,
    the reference policy, the drafter and its pair buffer, where the run has them)."""

    meta: dict
    policy: dict
    tensors: dict


def save(path: str | os.PathLike, state: TrainerState, world, worker: dict | None = None) -> Path:
    """Write a checkpoint folder atomically (a temporary folder renamed over ``path``; other files there, such
    as the run's metrics.jsonl, are carried over). With several workers each one's own state ``worker`` (sampling
    generator, pair buffer, tuner) is staged beside it first and moved in by rank 0."""
    path = Path(path).resolve()
    staged = _stage_worker_state(path, state.meta["step"], world, worker)
    if world.rank == 0:
        with atomic_folder(path, keep_existing=True) as tmp:
            _write_checkpoint(state, tmp, path)
            for k, f in enumerate(staged):
                f.replace(tmp / f"rank{k}.pt")
    world.barrier()
    return path


def _stage_worker_state(path: Path, step: int, world, worker: dict | None) -> list[Path]:
    """Several workers: every worker writes its own state beside ``path``; returns all their files."""
    if world.size == 1:
        return []
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = [path.parent / f".{path.name}-rank{k}-step{step}.pt" for k in range(world.size)]
    mine = staged[world.rank]
    tmp = mine.with_name(mine.name + ".part")
    torch.save(worker, tmp)
    tmp.replace(mine)
    world.barrier()
    return staged


def _write_checkpoint(state: TrainerState, tmp: Path, path: Path) -> None:
    meta = {"format": CHECKPOINT_FORMAT, **state.meta}
    (tmp / "trainer_state.json").write_text(json.dumps(meta, default=float) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in state.policy.items()}, str(tmp / "policy.safetensors"))
    torch.save(state.tensors, tmp / "state.pt")
    digest = hashlib.sha256(json.dumps(meta["fingerprint"], sort_keys=True).encode()).hexdigest()[:16]
    (tmp / "README.md").write_text(f"# tltlib GRPO checkpoint\n\nStep {meta['step']}; configuration "
                                   f"{digest}. Resume with `python -m tltlib train-grpo --params <the file that "
                                   f"started it> --resume {path}`.\n")


def load(path: str | os.PathLike, expected: dict, device, world) -> tuple[TrainerState, dict | None]:
    """(the :class:`TrainerState` of a checkpoint written by :func:`save`, this worker's own state or None with one
    worker), refused, with the differences named, when its fingerprint is not ``expected``
    (:func:`fingerprint` of the trainer that resumes it)."""
    path = Path(path)
    state_file = path / "trainer_state.json"
    if not state_file.is_file():
        raise NotFound(f"{str(path)!r} is not a tltlib GRPO checkpoint (no trainer_state.json); pass "
                       "the folder written by a run (--output-dir)")
    meta = read_json(state_file, "the checkpoint is damaged: resume from an earlier one")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise BadInput(f"{state_file}: format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    mine, theirs = _flatten(expected), _flatten(meta["fingerprint"])
    if "scheduler.pairs" in theirs:                   # written before the key was renamed
        theirs["scheduler.train_on"] = theirs.pop("scheduler.pairs")
    diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if diff:
        raise BadInput(f"{path} was written by a run with another model or configuration (differs in "
                       f"{', '.join(diff[:6])}); resume with the same model and settings, or start anew "
                       "with another output folder")
    state = TrainerState(meta, read_policy(path, device), _read_state(path / "state.pt"))
    worker = _read_state(path / f"rank{world.rank}.pt") if world.size > 1 else None
    return state, worker


def read_policy(path: Path, device) -> dict[str, torch.Tensor]:
    """The policy of a checkpoint folder, checked: a truncated file, integer or non-finite weights are refused with
    the file named (before any rollout runs on them)."""
    f = path / "policy.safetensors"
    if not f.is_file():
        raise NotFound(f"{f} is missing: the checkpoint is incomplete; resume from another one or start anew")
    tensors = read_safetensors([f], device)
    check_floating(tensors, str(f))
    check_finite(tensors, str(f))
    return tensors


def _read_state(f: Path) -> dict:
    """A torch.save'd state file of a checkpoint (the optimizers, RNG states, buffer), its damage named."""
    try:
        return torch.load(f, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise NotFound(f"{f} is missing: the checkpoint is incomplete; resume from another one or start "
                       "anew") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise BadInput(f"{f} is not readable ({' '.join(str(e).split())[:160]}): the checkpoint is damaged; "
                       "resume from another one or start anew") from None


def load_weights(path: str | os.PathLike, model, drafter=None) -> dict:
    """Load the policy (and the drafter) of a checkpoint written by :func:`save` into ``model`` (and
    ``drafter``) without a trainer, e.g. to probe a finished run; returns its ``trainer_state.json``."""
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        raise NotFound(f"{str(path)!r} is not a tltlib GRPO checkpoint (no trainer_state.json)")
    meta = read_json(path / "trainer_state.json", "the checkpoint is damaged")
    model.load_state_dict(read_policy(path, model.embed.weight.device))
    if drafter is not None:
        tensors = _read_state(path / "state.pt")
        if "drafter" not in tensors:
            raise BadInput(f"{path} holds no drafter (the run had none): load the policy only")
        drafter.load_state_dict(tensors["drafter"])
        drafter.version = meta.get("drafter_version") or 0
    return meta
