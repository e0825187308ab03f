"""A curriculum: which training problems an RL step draws its prompts from, by difficulty level, as training goes on.

A problem's level is ``meta[key]`` (``steps`` by default: the operations of a word problem or the links of a chain
problem; a dataset file's ``steps`` or ``level`` column, or verl's ``extra_info.steps``). Training moves through
``levels`` in order, ``steps_per_level`` RL steps each; the last level stays open to the end. A stage draws from its
own level only or, with ``cumulative`` (the default), from every level opened so far, each problem equally likely —
so the easy levels that make the reward non-zero stay in the mix while harder ones arrive::

    levels (1, 2, 4), steps_per_level 5, cumulative:   steps 0-4: level 1;  5-9: 1-2;  10-: 1, 2 and 4

GRPO learns only from groups whose completions differ in reward; a model that solves no multi-step problem gets
all-zero groups there, so the curriculum starts where some completions succeed.

Departures: none (the schedule is the simplest of curriculum RL's; TRL and verl leave sampling order to the data
loader, where this would be a sampler).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import BadInput


@dataclass(frozen=True)
class CurriculumConfig:
    """The levels a GRPO run trains on, in order, and how long each lasts."""

    levels: tuple[int, ...] = (1, 2, 3, 4)
    """Difficulty levels in training order (values of ``meta[key]``; distinct)."""
    steps_per_level: int = 5
    """RL steps before the next level opens (the last stays open)."""
    cumulative: bool = True
    """Draw from every level opened so far (False: from the current level only)."""
    key: str = "steps"
    """The problems' metadata field that holds the level."""

    def __post_init__(self):
        levels = tuple(self.levels)
        object.__setattr__(self, "levels", levels)
        if not levels or any(isinstance(v, bool) or not isinstance(v, int) for v in levels):
            raise BadInput(f"curriculum levels must be a non-empty list of integers, got {list(levels)}")
        if len(set(levels)) != len(levels):
            raise BadInput(f"curriculum levels must be distinct, got {list(levels)}")
        if self.steps_per_level < 1:
            raise BadInput(f"steps_per_level must be >= 1, got {self.steps_per_level}")
        if not self.key:
            raise BadInput("the curriculum's key (the metadata field holding the level) must not be empty")


def problem_level(problem, key: str = "steps"):
    """``problem.meta[key]``, else ``meta["extra_info"][key]`` (verl's parquet rows); None when absent."""
    meta = problem.meta or {}
    if key in meta:
        return meta[key]
    extra = meta.get("extra_info")
    return extra.get(key) if isinstance(extra, dict) else None


def level_pools(problems, cfg: CurriculumConfig, need: int = 1, source: str = "the training problems") \
        -> list[np.ndarray]:
    """Indices of ``problems`` at each of ``cfg.levels`` (one int64 array per level, in the levels' order).

    Refused with the levels that are there named: a level with no problems (or fewer than ``need``, the prompts
    of one RL step, when the stage draws from that level alone)."""
    levels = [problem_level(p, cfg.key) for p in problems]
    pools = [np.flatnonzero(np.array([lv == want for lv in levels], dtype=bool)) for want in cfg.levels]
    present = sorted({lv for lv in levels if lv is not None}, key=str)
    for want, pool in zip(cfg.levels, pools):
        if not len(pool):
            have = ", ".join(map(str, present)) if present else f"none (no problem has a {cfg.key!r} field)"
            raise BadInput(f"{source}: no problem of curriculum level {cfg.key} = {want}; the levels there are "
                           f"{have}. Remove {want} from curriculum.levels or add problems of that level")
    for k, (want, pool) in enumerate(zip(cfg.levels, pools)):
        drawn = sum(len(p) for p in pools[:k + 1]) if cfg.cumulative else len(pool)
        if drawn < need:
            raise BadInput(f"{source}: curriculum stage {k} (level {want}) draws from {drawn} problems but an RL "
                           f"step needs {need} prompts; add problems of that level or use fewer prompts per step")
    return pools


def stage(step: int, cfg: CurriculumConfig) -> int:
    """The curriculum stage (index into ``cfg.levels``) of RL step ``step`` (0-based)."""
    return min(step // cfg.steps_per_level, len(cfg.levels) - 1)


def stage_pool(pools: list[np.ndarray], step: int, cfg: CurriculumConfig) -> np.ndarray:
    """Indices the prompts of RL step ``step`` are drawn from (sorted)."""
    k = stage(step, cfg)
    return np.sort(np.concatenate(pools[:k + 1])) if cfg.cumulative else pools[k]
