"""GRPO maths against hand-computed values (advantages, clipped loss, KL, aggregation by loss type), reward
function errors, config errors."""
from __future__ import annotations

import math

import pytest
import torch

from tltlib.rl.grpo import (
    GRPOConfig,
    accuracy_reward,
    aggregate_loss,
    clipped_token_loss,
    compute_rewards,
    format_reward,
    group_advantages,
    kl_k3,
    reward_funcs_named,
)


def test_group_advantages_by_scaling():
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])
    s3 = math.sqrt(1 / 3)                                              # unbiased std of (1, 0, 0, 1)
    torch.testing.assert_close(group_advantages(r, 4, "group"),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (s3 + 1e-4))
    sb = math.sqrt((2 * 0.75 ** 2 + 6 * 0.25 ** 2) / 7)                # unbiased std of the whole batch
    torch.testing.assert_close(group_advantages(r, 4, "batch"),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (sb + 1e-4))
    torch.testing.assert_close(group_advantages(r, 4, "none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="unknown scale_rewards 'std'"):
        group_advantages(r, 4, "std")


def test_clipped_loss_and_which_tokens_are_clipped():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.5]]))            # ratios
    adv = torch.tensor([1.0])
    loss, clipped = clipped_token_loss(logp, old, adv, 0.2, 0.28)
    torch.testing.assert_close(loss, -torch.tensor([[1.28, 0.5, 1.1, 0.5]]))
    assert clipped.tolist() == [[True, False, False, False]]         # only the ratio above 1 + 0.28 is cut
    loss, clipped = clipped_token_loss(logp, old, -adv, 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([[1.5, 0.8, 1.1, 0.8]]))
    assert clipped.tolist() == [[False, True, False, True]]          # ratios below 1 - 0.2 with A < 0


def test_kl_k3():
    got = kl_k3(torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.25, 0.3])))
    torch.testing.assert_close(got, torch.tensor([0.5 + math.log(2) - 1, 0.0]))


@pytest.mark.parametrize("loss_type,want", [("grpo", (2 + 4) / 2), ("dapo", 10 / 4), ("dr_grpo", 10 / (2 * 5))])
def test_aggregation_by_loss_type_and_micro_batches_sum_to_the_batch(loss_type, want):
    per = torch.tensor([[1.0, 2, 3], [4, 9, 9]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    full = aggregate_loss(per, mask, loss_type, 2, 4, 5)
    assert float(full) == pytest.approx(want)
    parts = sum(aggregate_loss(per[i:i + 1], mask[i:i + 1], loss_type, 2, 4, 5) for i in range(2))
    assert float(parts) == pytest.approx(want)                        # any micro-batching gives the batch loss


def test_reward_functions_are_called_with_trl_signature_and_errors_name_them():
    def length_penalty(prompts, completions, **kw):
        return [-len(c) / 10 for c in completions]

    def only_first(prompts, completions, **kw):
        return [1.0] + [None] * (len(completions) - 1)

    prompts, comps = ["p1", "p1"], ["a #7", "b #8"]
    table, total = compute_rewards([accuracy_reward, length_penalty, only_first], prompts, comps,
                                   {"answer": ["7", "7"]}, weights=(1.0, 0.5, 2.0))
    torch.testing.assert_close(total, torch.tensor([1 - 0.2 + 2.0, -0.2]))
    assert math.isnan(table[1, 2])

    def broken(prompts, completions, **kw):
        raise KeyError("answer")

    with pytest.raises(ValueError, match="reward function broken raised KeyError.*first prompt 'p1'"):
        compute_rewards([broken], prompts, comps, {})
    with pytest.raises(ValueError, match="reward function short returned 1 values for 2 completions"):
        def short(prompts, completions, **kw):
            return [1.0]
        compute_rewards([short], prompts, comps, {})
    with pytest.raises(ValueError, match="returned 'yes' for completion 0"):
        compute_rewards([lambda prompts, completions, **kw: ["yes", 1.0]], prompts, comps, {})
    with pytest.raises(ValueError, match="reward_weights has 1 values for 2"):
        compute_rewards([accuracy_reward, length_penalty], prompts, comps, {"answer": ["7", "7"]}, weights=(1.0,))


def test_format_reward_scores_the_answer_line_whatever_the_number_and_refuses_what_is_not_text():
    comps = ["Tom has 3 + 2 = 5 apples.\n#### 5", "#### 5", "x = 4\n#### 5\nSo the answer is 5.",
             "reasoning\n####  1,200.", "a\n#### <number>", [{"role": "assistant", "content": "2 + 2\n#### 4"}],
             "6 * 7 = 42\n#### -3"]
    assert format_reward(["p"] * 7, comps) == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    table, total = compute_rewards([accuracy_reward, format_reward], ["p", "p"], comps[:2], {"answer": ["5", "5"]},
                                   weights=(1.0, 0.2))
    torch.testing.assert_close(total, torch.tensor([1.2, 1.0]))       # the bare answer line is right, not well formed
    with pytest.raises(ValueError, match="reward function format_reward raised TypeError: completion 1 is int"):
        compute_rewards([format_reward], ["p", "p"], ["a\n#### 1", 3], {})
    with pytest.raises(ValueError, match="reward function format_reward returned nan for completion 0"):
        def format_reward_nan(prompts, completions, **kw):
            return [float("nan")] * len(completions)
        format_reward_nan.__name__ = "format_reward"
        compute_rewards([format_reward_nan], ["p"], ["a"], {})
    assert reward_funcs_named(["accuracy", "format"]) == [accuracy_reward, format_reward]
    with pytest.raises(ValueError, match="rewards: unknown reward function 'lenght'; choose from accuracy, format"):
        reward_funcs_named(["accuracy", "lenght"])
    with pytest.raises(ValueError, match="named twice"):
        reward_funcs_named(["format", "format"])


@pytest.mark.parametrize("kw,match", [
    (dict(num_generations=1), "num_generations must be >= 2"),
    (dict(num_generations=4, generation_batch_size=10), "must be a positive multiple of num_generations"),
    (dict(loss_type="bnpo"), "unknown loss_type 'bnpo'; choose one of grpo, dapo, dr_grpo"),
    (dict(scale_rewards="std"), "unknown scale_rewards 'std'"),
    (dict(learning_rate=0.0), "learning_rate must be > 0"),
    (dict(epsilon=0.0), "need 0 < epsilon < 1"),
    (dict(num_iterations=0), "num_iterations must be >= 1"),
    (dict(temperature=0.0), "temperature 0 samples every completion of a group greedily"),
    (dict(seed=-1), "seed must lie in \\[0, 2\\*\\*63 - 1\\]"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kw)


def test_trl_defaults():
    c = GRPOConfig()
    assert (c.loss_type, c.beta, c.epsilon, c.scale_rewards, c.num_iterations) == ("dapo", 0.0, 0.2, "group", 1)
    assert c.clip_high == 0.2 and GRPOConfig(epsilon_high=0.28).clip_high == 0.28
