"""The curriculum: each RL step draws its prompts from the levels opened so far, a missing level is refused with the
levels that exist named, and the trainer follows it (and resumes it) exactly."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from tltlib.model.loading import load
from tltlib.rl.curriculum import CurriculumConfig, level_pools, problem_level, stage, stage_pool
from tltlib.rl.grpo import GRPOConfig
from tltlib.rl.trainer import GRPOTrainer
from tltlib.tasks.chain import ChainTaskConfig, generate_problems
from tltlib.tasks.datasets import load_problems, save_problems
from tltlib.tasks.problem import Problem

PROBLEMS = [p for k in (3, 4, 5) for p in generate_problems(ChainTaskConfig(min_steps=3, max_steps=6), 6, seed=k,
                                                               steps=k)]
ARGS = GRPOConfig(num_generations=2, generation_batch_size=8, max_completion_length=40, temperature=1.5,
                  learning_rate=1e-3, max_steps=4, seed=5, micro_batch_tokens=200)


def test_stages_open_levels_in_order_and_the_last_stays_open():
    cfg = CurriculumConfig(levels=(1, 2, 4), steps_per_level=5)
    assert [stage(s, cfg) for s in (0, 4, 5, 9, 10, 99)] == [0, 0, 1, 1, 2, 2]
    pools = [np.array([0, 3]), np.array([1, 4]), np.array([2])]
    assert stage_pool(pools, 0, cfg).tolist() == [0, 3]
    assert stage_pool(pools, 7, cfg).tolist() == [0, 1, 3, 4]
    assert stage_pool(pools, 12, cfg).tolist() == [0, 1, 2, 3, 4]
    only = CurriculumConfig(levels=(1, 2, 4), steps_per_level=5, cumulative=False)
    assert stage_pool(pools, 7, only).tolist() == [1, 4]


def test_levels_come_from_meta_or_verl_extra_info(tmp_path):
    probs = [Problem("a", "1", {"steps": 2}), Problem("b", "1", {"extra_info": {"steps": 3}}), Problem("c", "1")]
    assert [problem_level(p) for p in probs] == [2, 3, None]
    save_problems(PROBLEMS, tmp_path / "d.parquet")
    back = load_problems(tmp_path / "d.parquet")
    assert [problem_level(p) for p in back] == [p.meta["steps"] for p in PROBLEMS]


def test_a_level_without_problems_is_refused_with_the_levels_there(tmp_path):
    with pytest.raises(ValueError, match="d.jsonl: no problem of curriculum level steps = 9; the levels there are "
                                         "3, 4, 5. Remove 9"):
        level_pools(PROBLEMS, CurriculumConfig(levels=(3, 9)), source="d.jsonl")
    with pytest.raises(ValueError, match="no problem of curriculum level level = 1; the levels there are none "
                                         "\\(no problem has a 'level' field\\)"):
        level_pools(PROBLEMS, CurriculumConfig(levels=(1,), key="level"))
    with pytest.raises(ValueError, match="stage 0 \\(level 3\\) draws from 6 problems but an RL step needs 8"):
        level_pools(PROBLEMS, CurriculumConfig(levels=(3, 4)), need=8)
    with pytest.raises(ValueError, match="must be distinct"):
        CurriculumConfig(levels=(1, 1))
    with pytest.raises(ValueError, match="steps_per_level must be >= 1"):
        CurriculumConfig(steps_per_level=0)


@pytest.fixture(scope="module")
def shipped():
    return load("data/tiny-reasoner", None)


def test_the_trainer_draws_each_step_from_the_open_levels_and_resumes_the_draw(shipped, tmp_path):
    model, tok, _ = shipped
    cfg = CurriculumConfig(levels=(5, 3), steps_per_level=2, cumulative=False)
    tr = GRPOTrainer(copy.deepcopy(model), tok, PROBLEMS, ARGS, curriculum=cfg)
    seen = []
    for _ in range(4):
        seen.append({p.meta["steps"] for p in tr.next_problems()})
        tr.step_count += 1                                 # the draw alone, as step() advances it
    assert seen == [{5}, {5}, {3}, {3}]
    tr = GRPOTrainer(copy.deepcopy(model), tok, PROBLEMS, ARGS, curriculum=CurriculumConfig(levels=(4, 5),
                                                                                            steps_per_level=1))
    m = tr.step()
    assert m["rl/curriculum_level"] == 4.0
    tr.save(tmp_path / "ckpt")
    other = GRPOTrainer(copy.deepcopy(model), tok, PROBLEMS, ARGS, curriculum=CurriculumConfig(levels=(4, 3)))
    with pytest.raises(ValueError, match="differs in curriculum"):
        other.load(tmp_path / "ckpt")
