"""The memory estimate of a GRPO run: its parts scale with what sets them, and a run that cannot fit is refused
before the first rollout with the largest parts and their fixes named."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from tltlib.grpo import GRPOConfig
from tltlib.loading import load
from tltlib.memory import activation_bytes_per_token, available_bytes, check_fits, grpo_memory, trainer_memory
from tltlib.tasks import ChainTaskConfig, generate_problems
from tltlib.trainer import GRPOTrainer

ARGS = GRPOConfig(num_generations=2, generation_batch_size=8, max_completion_length=64, micro_batch_tokens=256,
                  logprob_chunk=128)


@pytest.fixture(scope="module")
def tiny():
    return load("data/tiny-reasoner", None)


def test_each_part_scales_with_what_sets_it(tiny):
    cfg = tiny[0].config
    base = grpo_memory(cfg, ARGS, prompt_tokens=30, rows=8, elem_bytes=4, params=1000)
    assert base["gradients"] == 4000 and base["optimizer"] == 8000 and base["reference"] == 0
    more = grpo_memory(cfg, replace(ARGS, micro_batch_tokens=2048), 30, 64, 4, 1000)
    assert more["update activations"] == activation_bytes_per_token(cfg, 4) * 2048
    assert base["update activations"] == activation_bytes_per_token(cfg, 4) * 256
    long = grpo_memory(cfg, replace(ARGS, micro_batch_tokens=16), 30, 8, 4, 1000)
    assert long["update activations"] == activation_bytes_per_token(cfg, 4) * (30 + 64)   # one whole sequence
    whole = grpo_memory(cfg, replace(ARGS, micro_batch_tokens=10 ** 6), 30, 8, 4, 1000)
    assert whole["update activations"] == activation_bytes_per_token(cfg, 4) * 8 * (30 + 64)   # the batch at most
    rows = grpo_memory(cfg, ARGS, 30, 16, 4, 1000)
    assert rows["rollout KV cache"] == 2 * base["rollout KV cache"]
    assert grpo_memory(cfg, replace(ARGS, logprob_chunk=256), 30, 8, 4, 1000)["LM-head chunk"] == \
        2 * base["LM-head chunk"]
    assert grpo_memory(cfg, replace(ARGS, beta=0.1), 30, 8, 2, 1000)["reference"] == 2000


def test_a_run_that_cannot_fit_is_refused_before_the_rollout(tiny, monkeypatch):
    import tltlib.memory
    model, tok, _ = tiny
    probs = generate_problems(ChainTaskConfig(), 16, seed=0)
    parts = trainer_memory(GRPOTrainer(copy.deepcopy(model), tok, probs, ARGS))
    assert parts["rollout KV cache"] > 0 and parts["update activations"] > 0
    assert available_bytes("cpu") > 0
    monkeypatch.setattr(tltlib.memory, "available_bytes", lambda device: sum(parts.values()))   # short by 10%
    with pytest.raises(MemoryError, match="GRPO with 8 completions of up to 64 tokens on cpu needs about .* GiB "
                                          "beyond the loaded weights .*may use 90%.*update activations .*lower "
                                          "grpo.micro_batch_tokens"):
        GRPOTrainer(copy.deepcopy(model), tok, probs, ARGS)
    monkeypatch.setattr(tltlib.memory, "available_bytes", lambda device: 2 * sum(parts.values()))
    GRPOTrainer(copy.deepcopy(model), tok, probs, ARGS)
    with pytest.raises(MemoryError, match="rollout KV cache 2.0 GiB \\(lower grpo.generation_batch_size"):
        check_fits({"rollout KV cache": 2 << 30, "gradients": 1 << 20}, 1 << 30)
