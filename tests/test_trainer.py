"""The RL loop: the optimizer updates the module the engine decodes with, the online drafter trains on the rollout's
pairs (and never touches the target), micro-batched updates equal one full batch, a resumed run is bit-identical,
and bad input is one clear error."""
from __future__ import annotations

import copy

import pytest
import torch

from tltlib.model.loading import load
from tltlib.rl.config import TLTConfig
from tltlib.rl.grpo import GRPOConfig
from tltlib.rl.trainer import GRPOTrainer
from tltlib.tasks.chain import ChainTaskConfig, generate_problems

PROBLEMS = generate_problems(ChainTaskConfig(min_steps=3, max_steps=6), 40, seed=3)
ARGS = GRPOConfig(num_generations=2, generation_batch_size=8, max_completion_length=72, temperature=1.5,
                  learning_rate=1e-3, max_steps=3, seed=5, micro_batch_tokens=200)
TLT = TLTConfig(speculative="chain-3", drafter_steps=2, drafter_batch=2, drafter_lr=1e-3)


@pytest.fixture(scope="module")
def shipped():
    return load("data/tiny-reasoner", "data/tiny-reasoner-drafter")


def _fresh(shipped, args=ARGS, tlt=TLT, drafter=True):
    model, tok, d = shipped
    model, d = copy.deepcopy(model), copy.deepcopy(d)
    d.attach(model)
    return GRPOTrainer(model, tok, PROBLEMS, args, drafter=d if drafter else None, tlt=tlt if drafter else None)


def _state(trainer):
    return {**{f"policy.{k}": v.clone() for k, v in trainer.model.state_dict().items()},
            **{f"drafter.{k}": v.clone() for k, v in trainer.drafter.state_dict().items()}}


def test_a_step_updates_the_decoding_module_and_the_drafter_trains_on_the_stream(shipped):
    tr = _fresh(shipped)
    assert tr.engine.model is tr.model and tr.drafter.is_attached_to(tr.model)
    before = _state(tr)
    m = tr.step()
    after = _state(tr)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any(k.startswith("policy.") for k in changed) and any(k.startswith("drafter.") for k in changed)
    # its micro-steps made one new drafter for the next rollout (drafter/version: one per RL step that trained it)
    assert tr.buffer.num_pairs > 0 and m["drafter/version"] == 1 and tr.drafter_trainer.steps_done == 2
    from tltlib.metrics import is_metric
    ev = tr.evaluate(PROBLEMS[:4])
    assert all(is_metric(k) for k in [*m, *ev]), [k for k in [*m, *ev] if not is_metric(k)]
    assert 0 <= ev["eval/accuracy"] <= 1
    for key in ("rl/reward_mean", "rl/loss", "rl/grad_norm", "rollout/time_s", "spec/accept_len_mean",
                "drafter/loss", "time/rollout_s", "time/update_s", "time/drafter_s", "time/step_s"):
        assert key in m, key


def test_a_steps_clock_synchronises_the_trainers_device(shipped, monkeypatch):
    """The step's phase times are of the device's work: its clock is given the trainer's device (a GPU is
    synchronised at each phase boundary, tests/test_clock.py)."""
    from dataclasses import replace

    import tltlib.rl.trainer as trainer_module
    from tltlib.rl.clock import StepClock
    made = []
    monkeypatch.setattr(trainer_module, "StepClock", lambda *a, **k: made.append((a, k)) or StepClock(*a, **k))
    tr = _fresh(shipped, args=replace(ARGS, max_completion_length=16), drafter=False)
    tr.step()
    assert made == [((tr.device,), {})]


def test_drafter_training_never_changes_the_target(shipped):
    tr = _fresh(shipped)
    tr.step()
    policy = {k: v.clone() for k, v in tr.model.state_dict().items()}
    for _ in range(3):
        tr.drafter_trainer.micro_step(tr.buffer.sample(2))
    assert all(torch.equal(policy[k], v) for k, v in tr.model.state_dict().items())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batched_update_equals_one_full_batch(shipped, loss_type):
    from dataclasses import replace
    small = replace(ARGS, loss_type=loss_type, micro_batch_tokens=40, max_steps=1)
    big = replace(small, micro_batch_tokens=10 ** 6)
    a, b = _fresh(shipped, small, drafter=False), _fresh(shipped, big, drafter=False)
    a.step(), b.step()
    # the gradient each took, summed over its micro-batches: AdamW's first moment after one step is (1 - beta1) g
    grads = [{k: t.optimizer.state[p]["exp_avg"] for k, p in t.model.named_parameters() if p in t.optimizer.state}
             for t in (a, b)]
    assert grads[0].keys() == grads[1].keys() and any(bool(g.abs().max() > 0) for g in grads[1].values())
    for k, x in grads[0].items():
        torch.testing.assert_close(x, grads[1][k], atol=1e-9, rtol=1e-4, msg=k)
    # and the weights where the gradient determines the step. AdamW's first step moves an element by
    # lr * g / (|g| + eps) (and the same weight decay): about lr * sign(g) whatever |g| is, so an element whose
    # gradient is at summation-noise level (the gradients above agree to 1e-9) may move either way in the two runs,
    # by up to 2 lr apart on some CPU; that is the optimizer amplifying float noise, not micro-batching. Where |g| is
    # 1,000 times that tolerance or more, the sign is fixed and the two steps agree to float rounding (two float32
    # ulps of the weight, 2.4e-7 relative, plus 1e-5 lr for the gradient's own noise).
    beta1 = a.optimizer.param_groups[0]["betas"][0]
    determined = elements = 0
    for (k, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        if k not in grads[1]:
            assert torch.equal(p, q), k                     # no gradient: not stepped in either run
            continue
        sure = (grads[1][k] / (1 - beta1)).abs() >= 1e-6
        torch.testing.assert_close(p[sure], q[sure], atol=1e-5 * ARGS.learning_rate, rtol=2.4e-7, msg=k)
        determined, elements = determined + int(sure.sum()), elements + sure.numel()
    assert determined > 0.5 * elements, f"only {determined} of {elements} elements have a gradient above the noise"


def test_resumed_run_is_bit_identical(shipped, tmp_path):
    straight = _fresh(shipped)
    straight.train(3)
    first = _fresh(shipped)
    first.train(2, save_to=tmp_path / "ckpt")
    resumed = _fresh(shipped).load(tmp_path / "ckpt")            # fresh objects, as after a killed process
    assert resumed.step_count == 2
    resumed.train(1)
    a, b = _state(straight), _state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    assert [h["rl/reward_mean"] for h in straight.history] == [h["rl/reward_mean"] for h in resumed.history]


def test_resume_from_another_configuration_or_model_is_refused(shipped, tmp_path):
    from dataclasses import replace
    tr = _fresh(shipped)
    tr.save(tmp_path / "ckpt")
    other = _fresh(shipped, replace(ARGS, learning_rate=5e-4))
    with pytest.raises(ValueError, match="another model or configuration \\(differs in grpo.learning_rate\\)"):
        other.load(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="not a tltlib GRPO checkpoint"):
        other.load(tmp_path)
    _fresh(shipped, replace(ARGS, max_steps=9)).load(tmp_path / "ckpt")   # more steps: allowed


def test_bad_input_is_one_clear_error(shipped):
    model, tok, drafter = shipped
    with pytest.raises(ValueError, match="drafter_steps is the drafter-training budget per RL step and must be >= 0"):
        TLTConfig(drafter_steps=-1)
    with pytest.raises(ValueError, match="on_drafter_change must be 'discount', 'reset' or 'keep', got 'never'"):
        TLTConfig(on_drafter_change="never")
    with pytest.raises(ValueError, match="3 training problems but a step needs 4"):
        GRPOTrainer(model, tok, PROBLEMS[:3], ARGS)
    with pytest.raises(ValueError, match="speculative='chain-3' needs a learned drafter"):
        GRPOTrainer(model, tok, PROBLEMS, ARGS, tlt=TLT)
    with pytest.raises(ValueError, match="cannot read speculative strategy 'fast'"):
        TLTConfig(speculative="fast")

    def bad_reward(prompts, completions, **kw):
        return [1.0]

    tr = GRPOTrainer(copy.deepcopy(model), tok, PROBLEMS, ARGS, reward_funcs=[bad_reward])
    with pytest.raises(ValueError, match="reward function bad_reward returned 1 values for 8 completions"):
        tr.step()


def test_a_diverged_update_stops_the_run_without_touching_the_policy(shipped):
    trainer = _fresh(shipped)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    for p in trainer.model.parameters():
        p.register_hook(lambda g: g * float("nan"))
    with pytest.raises(FloatingPointError, match="gradient norm is nan .* lower learning_rate \\(now 0.001\\)"):
        trainer.step()
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_an_update_raises_the_likelihood_of_completions_with_positive_advantage(shipped):
    """The direction of the policy gradient: after one update, the completions the group rated above its mean are
    more likely than before and those below less (summed response log-probabilities, same sampling settings)."""
    import numpy as np

    from tltlib.model.logprobs import response_logprobs
    model, tok, _ = shipped
    probs = generate_problems(ChainTaskConfig(min_steps=4, max_steps=8), 32, seed=3)
    tr = GRPOTrainer(copy.deepcopy(model), tok, probs, GRPOConfig(
        num_generations=4, generation_batch_size=32, max_completion_length=120, temperature=1.5, learning_rate=1e-4,
        seed=1))
    problems = tr.next_problems()
    batch = tr.score(problems, tr.rollout(problems))

    @torch.no_grad()
    def logp():
        out = {}
        for g in batch.micro_batches:
            mb = batch.sequence_batch(g, tr.engine.pad_id, tr.device)
            lp = response_logprobs(tr.model, mb, tr.sampling, 2048)
            out.update({i: float((lp[j] * mb.response_mask()[j]).sum()) for j, i in enumerate(g)})
        return out

    before = logp()
    tr.update(batch)
    after = logp()
    adv = batch.advantages.numpy()
    change = np.array([after[i] - before[i] for i in range(len(adv))])
    assert (adv > 0).sum() >= 4 and (adv < 0).sum() >= 4              # the draw has signal both ways
    assert change[adv > 0].mean() > 0 > change[adv < 0].mean()
    assert np.corrcoef(adv, change)[0, 1] > 0.3
