"""The memory estimate of a GRPO run: its parts scale with what sets them, the KV cache is estimated from measured
response lengths (the maximum only without them) and predicts a real rollout's peak, the page pool gets what the
run leaves, and a run that cannot fit is refused before the first rollout with the largest parts and their fixes
named."""
from __future__ import annotations

import copy
import math
import re
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tltlib.kv.pages import kv_bytes_per_token
from tltlib.model.loading import load
from tltlib.model.sampling import SamplingConfig
from tltlib.rl.grpo import GRPOConfig
from tltlib.rl.memory import (
    HEADROOM,
    KV_PART,
    POOL_SLACK,
    KVEstimate,
    MeasuredLengths,
    activation_bytes_per_token,
    available_bytes,
    check_fits,
    grpo_memory,
    grpo_plan,
    kv_estimate,
    kv_pool_bytes,
    peak_held_tokens,
    worker_kv,
    worker_memory,
)
from tltlib.rl.trainer import GRPOTrainer
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.tasks.chain import ChainTaskConfig, generate_problems
from tltlib.tasks.prompts import encode_prompts

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


def test_the_peak_is_the_largest_running_rows_times_their_pages_plus_the_shared_prompt_pages():
    # 4 rows in 2 groups, prompt of 10 tokens with pages of 4: 2 whole pages shared per group, 2 tokens copied per row
    lengths = [1, 5, 6, 14]
    by_hand = max(n * -(-(2 + t) // 4) * 4 for n, t in ((4, 1), (3, 5), (2, 6), (1, 14))) + 2 * 2 * 4
    assert peak_held_tokens(lengths, 14, rows=4, num_generations=2, prompt_tokens=10, page_size=4) == by_hand == 24 + 16
    # (the peak: 3 rows at 5 tokens, 2 pages each, beside the 2 groups' shared pages)
    # twice the rows in the same proportions hold twice as much; none measured: every row at the maximum
    assert peak_held_tokens(lengths, 14, 8, 2, 10, 4) == 2 * by_hand
    assert peak_held_tokens(None, 14, 4, 2, 10, 4) == 4 * 4 * 4 + 16


def test_the_estimate_says_what_it_assumed_and_runs_cut_responses_on_to_the_longer_maximum():
    none = kv_estimate(100, 8, 4, 10, 64)
    assert none.bytes == none.tokens * 100 == peak_held_tokens(None, 64, 8, 4, 10, 16) * 100
    assert "every row runs to max_completion_length (64 tokens)" in none.assumed and "no measured" in none.assumed
    short = MeasuredLengths((4, 8, 16, 16), max_new_tokens=16, source="profile.json")
    same = kv_estimate(100, 8, 4, 10, 16, short)
    assert same.tokens == peak_held_tokens([4, 8, 16, 16], 16, 8, 4, 10, 16)
    assert "4 measured in profile.json (median 12, p99 16, max 16 tokens)" in same.assumed
    longer = kv_estimate(100, 8, 4, 10, 64, short)     # the two cut at 16 may run on to 64
    assert longer.tokens == peak_held_tokens([4, 8, 64, 64], 64, 8, 4, 10, 16)
    assert "2 cut at 16 assumed to run to 64" in longer.assumed
    shorter = kv_estimate(100, 8, 4, 10, 8, short)     # a smaller maximum cuts the measured lengths
    assert shorter.tokens == peak_held_tokens([4, 8, 8, 8], 8, 8, 4, 10, 16) and "cut" not in shorter.assumed


def test_measured_lengths_round_trip_and_a_wrong_file_is_refused(tmp_path):
    m = MeasuredLengths((3, 9, 720), 720)
    m.save(tmp_path / "lengths.json")
    back = MeasuredLengths.load(tmp_path / "lengths.json")
    assert back.lengths == m.lengths and back.max_new_tokens == 720 and back.source.endswith("lengths.json")
    (tmp_path / "bad.json").write_text('{"lengths": [1, 2]}')
    with pytest.raises(ValueError, match="bad.json: a measured-lengths file holds .*notebook 01"):
        MeasuredLengths.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, max_new_tokens=8\].*got 1..9"):
        MeasuredLengths((1, 9), 8)
    with pytest.raises(ValueError, match="at least one length"):
        MeasuredLengths((), 8)
    # a file whose numbers are wrong is named with the fix, not only the dataclass
    for name, text, message in (
            ("long.json", '{"lengths": [1, 9], "max_new_tokens": 8}', "got 1..9; measure"),
            ("empty.json", '{"lengths": [], "max_new_tokens": 8}', "at least one length; measure"),
            ("zero.json", '{"lengths": [0], "max_new_tokens": 0}', "max_new_tokens >= 1"),
            ("zeros.json", '{"lengths": [0, 0, 0], "max_new_tokens": 8}', "at least its EOS token.*got 0..0"),
            ("text.json", '{"lengths": ["7"], "max_new_tokens": 8}', "holds .*'lengths': \\[ints\\]")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"{name}: .*{message}"):
            MeasuredLengths.load(tmp_path / name)


def test_the_estimate_from_a_rollouts_lengths_predicts_its_paged_kv_peak(tiny):
    model, tok, _ = tiny
    prompts = encode_prompts(generate_problems(ChainTaskConfig(), 4, seed=0), tok)
    engine = RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=0.9, max_new_tokens=720), num_generations=4))
    res = engine.generate(prompts, torch.Generator().manual_seed(0))
    c = model.config
    per = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.dim_head, 4)
    peak = res.stats["rollout/kv_peak_bytes"]
    est = kv_estimate(per, 16, 4, max(map(len, prompts)), 720, MeasuredLengths(tuple(res.lengths.tolist()), 720))
    assert abs(est.bytes / peak - 1) < 0.10, (est, peak)                 # measured within 3% on an AMD EPYC
    assert kv_estimate(per, 16, 4, max(map(len, prompts)), 720).bytes > 3 * peak     # the maximum: a long tail


def test_the_pool_gets_the_estimate_with_slack_what_the_run_leaves_at_most_and_the_longest_row_at_least():
    gib = 1 << 30
    parts = {"gradients": 2 * gib, "optimizer": 4 * gib, KV_PART: 123}
    kv = KVEstimate(tokens=1000, bytes=1 * gib, assumed="response lengths as the 8 measured")
    avail = 10 * gib                                    # the run may use 9 GiB: 3 left beside the 6 of the others
    assert kv_pool_bytes(parts, kv, 1 << 20, avail) == int(POOL_SLACK * gib)      # the estimate + slack
    assert kv_pool_bytes(parts, kv, 2 * gib, avail) == 2 * gib                    # at least the longest row
    big = KVEstimate(tokens=1000, bytes=5 * gib, assumed="every row runs to max_completion_length")
    with pytest.warns(UserWarning, match="pool gets 3.00 GiB .* expected to hold 5.00 GiB at its peak, assuming "
                                         "every row runs to max_completion_length: rows will wait for pages .*give "
                                         "measured response lengths \\(train-grpo's lengths:"):
        assert kv_pool_bytes(parts, big, 1 << 20, avail) == int(HEADROOM * avail) - 6 * gib   # what is left
    with pytest.raises(MemoryError, match="needs about 10.0 GiB .*rollout KV cache \\(the longest row\\) 4.0 GiB "
                                          "\\(lower max_completion_length or the prompts' length\\)"):
        kv_pool_bytes(parts, big, 4 * gib, avail)       # the longest row alone does not fit


def test_a_run_that_cannot_fit_is_refused_before_the_rollout_and_the_engine_gets_the_pool(tiny, monkeypatch):
    import tltlib.rl.memory
    model, tok, _ = tiny
    probs = generate_problems(ChainTaskConfig(), 16, seed=0)
    trainer = GRPOTrainer(copy.deepcopy(model), tok, probs, ARGS)
    kv, longest = worker_kv(model.config, ARGS, trainer.worker_shape())
    parts = worker_memory(model.config, ARGS, trainer.worker_shape(), kv)
    assert parts[KV_PART] == kv.bytes > longest > 0 and parts["update activations"] > 0
    assert available_bytes("cpu") > 0
    pool = max(longest, math.ceil(POOL_SLACK * kv.bytes))            # the estimate + slack: the machine has room
    assert trainer.engine.config.kv.memory == trainer.kv_plan.pool_bytes == pool
    assert "no measured response lengths" in trainer.kv_plan.describe()
    others = sum(parts.values()) - kv.bytes
    monkeypatch.setattr(tltlib.rl.memory, "available_bytes", lambda device: int((others + longest // 2) / HEADROOM))
    with pytest.raises(MemoryError, match="GRPO with 8 completions of up to 64 tokens on cpu needs about .* GiB "
                                          "beyond the loaded weights .*may use 90%.*update activations .*lower "
                                          "grpo.micro_batch_tokens"):
        GRPOTrainer(copy.deepcopy(model), tok, probs, ARGS)
    monkeypatch.setattr(tltlib.rl.memory, "available_bytes", lambda device: int((others + 2 * longest) / HEADROOM))
    with pytest.warns(UserWarning, match="rows will wait for pages"):
        short = GRPOTrainer(copy.deepcopy(model), tok, probs, ARGS)      # smaller than the estimate: it runs
    assert longest <= short.kv_plan.pool_bytes < kv.bytes
    measured = MeasuredLengths((4,) * 8, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # short responses measured: the same memory is enough
        fits = GRPOTrainer(copy.deepcopy(model), tok, probs, ARGS, lengths=measured)
    assert worker_kv(model.config, ARGS, fits.worker_shape(),
                     measured)[0].bytes < kv.bytes and "the 8 measured" in fits.kv_plan.describe()
    with pytest.raises(MemoryError, match="rollout KV cache 2.0 GiB \\(lower grpo.generation_batch_size"):
        check_fits({"rollout KV cache": 2 << 30, "gradients": 1 << 20}, 1 << 30)


# Published config.json values of Qwen2.5-1.5B-Instruct (qwen2, tied embeddings, q/k/v biases), the GPU examples' model
QWEN15 = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
              num_kv_heads=2, architecture="qwen2", tie_word_embeddings=True, attention_bias=True)
QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
              num_kv_heads=2, architecture="qwen2", tie_word_embeddings=True, attention_bias=True)
CONFIGS = {"Qwen2.5-1.5B-Instruct": QWEN15, "Qwen2.5-0.5B-Instruct": QWEN05}
H100 = 78 * 2 ** 30                                     # what the device tool reports of an H100 80 GB


def render_plan(path, lines: list[str]) -> tuple[str, str]:
    """(the file's text, the text with its ``#@memory-plan`` .. ``#@end`` block replaced by ``lines``)."""
    text = Path(path).read_text()
    head, rest = text.split("#@memory-plan\n")
    _, tail = rest.split("#@end\n")
    return text, head + "#@memory-plan\n" + "".join(f"#   {line}\n" for line in lines) + "#@end\n" + tail


@pytest.mark.parametrize("path", ["params/gpu-example.yaml", "params/train/gpu-example.yaml"])
def test_the_gpu_examples_fit_one_80gb_gpu_as_their_memory_comment_says(path):
    """The comment is rendered from memory.py (TLTLIB_RENDER=1 rewrites it); the run it describes, with TLT's online
    drafter, fits (train-grpo's with its page pool holding every row at the maximum length; notebook 05's two
    trainers side by side with rows waiting for pages if every row ran to the maximum)."""
    import os

    import yaml

    from tltlib.model.decoder import ModelConfig
    data = yaml.safe_load(Path(path).read_text())
    if "notebooks" in data:                             # notebook 05's GRPO
        nb = data["notebooks"]["05"]
        args = GRPOConfig(num_generations=nb["NUM_GENERATIONS"],
                          generation_batch_size=nb["N_PROMPTS"] * nb["NUM_GENERATIONS"],
                          max_completion_length=nb["MAX_NEW_TOKENS"], micro_batch_tokens=nb["MICRO_BATCH_TOKENS"])
        model = nb.get("MODEL_PATH", data["MODEL_PATH"])
    else:
        g = data["grpo"]
        args = GRPOConfig(num_generations=g["num_generations"], generation_batch_size=g["generation_batch_size"],
                          max_completion_length=g["max_completion_length"], micro_batch_tokens=g["micro_batch_tokens"])
        model = data["model"]
    assert Path(model).name in CONFIGS
    from tltlib.rl.config import TLTConfig
    trainers = 2 if "notebooks" in data else 1        # notebook 05 alternates a baseline's steps with TLT's
    lines = grpo_plan(ModelConfig(**CONFIGS[Path(model).name]), args, 256, args.generation_batch_size, 2, H100,
                      Path(model).name, buffer_tokens=TLTConfig().buffer_tokens, trainers=trainers)
    if trainers == 1:          # most rows at the maximum length (with a lengths file, as the README's sequence: all)
        held = re.fullmatch(r"the pool holds (\d+) of the (\d+) rows at that length: .*", lines[-1])
        assert lines[-1] == "the pool holds every row at that length." or int(held[1]) >= 0.7 * int(held[2]), lines
    text, rendered = render_plan(path, lines)
    if os.environ.get("TLTLIB_RENDER") == "1":
        Path(path).write_text(rendered)
    assert text == rendered, f"{path}'s memory comment is stale: rerun with TLTLIB_RENDER=1 (it becomes:\n{rendered})"
