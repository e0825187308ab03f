"""Training that trains in bf16: the policy's and the drafter's AdamW step float32 master weights when the module
computes in bf16/fp16 (:class:`tltlib.model.optimizer.MixedPrecisionAdamW`), so a bf16 GRPO run at RL's learning
rates moves the weights as the float32 run does; a float32 module is plain AdamW, bit for bit; the masters resume
exactly; float16 skips a step whose gradients overflow."""
from __future__ import annotations

import copy

import pytest
import torch

from tltlib.drafting.pairs import PairBuffer, PairBufferConfig
from tltlib.drafting.train import DrafterTrainConfig, DrafterTrainer
from tltlib.model.loading import load
from tltlib.model.optimizer import MixedPrecisionAdamW
from tltlib.rl.grpo import GRPOConfig
from tltlib.rl.memory import adamw_bytes
from tltlib.rl.trainer import GRPOTrainer
from tltlib.tasks.chain import ChainTaskConfig, generate_problems

PROBLEMS = generate_problems(ChainTaskConfig(min_steps=3, max_steps=6), 40, seed=3)
ARGS = GRPOConfig(num_generations=4, generation_batch_size=8, max_completion_length=48, temperature=1.5,
                  learning_rate=1e-6, seed=5, micro_batch_tokens=200)       # lr 1e-6: the GPU examples' value


def spread_reward(prompts, completions, **kw):
    """A reward that differs within every group (the chain task's own is often equal across a group of the tiny
    reasoner, and then no gradient flows)."""
    return [float(sum(map(ord, c)) % 97) for c in completions]


@pytest.fixture(scope="module")
def shipped():
    return load("data/tiny-reasoner", "data/tiny-reasoner-drafter")


def _flat_change(after, before) -> torch.Tensor:
    return torch.cat([(a.detach().float() - b.float()).flatten() for a, b in zip(after, before)])


@pytest.mark.long
def test_a_bf16_grpo_run_at_lr_1e6_moves_the_weights_as_the_float32_run_does(shipped):
    """Five updates on one batch: the bf16 run's (master) weights change in the same elements as the float32 run's
    (>= 99.9% agree), by an update within 25% of the float32 one (bf16 forwards round the gradients: cosine >= 0.95);
    the module decodes with the masters' rounding. The control, AdamW directly on the bf16 weights (what the trainer
    did before), changes a few % of them."""
    model, tok, _ = shipped
    f32 = GRPOTrainer(copy.deepcopy(model), tok, PROBLEMS, ARGS, reward_funcs=[spread_reward])
    b16 = GRPOTrainer(copy.deepcopy(model).to(torch.bfloat16), tok, PROBLEMS, ARGS, reward_funcs=[spread_reward])
    problems = f32.next_problems()
    batch = f32.score(problems, f32.rollout(problems))
    assert batch.advantages.abs().sum() > 0
    w0 = [p.detach().clone() for p in f32.model.parameters()]
    m0 = [m.clone() for m in b16.optimizer.master_weights()]
    for _ in range(5):
        f32.update(batch)
        stats = b16.update(batch)
    d32 = _flat_change(f32.model.parameters(), w0)
    d16 = _flat_change(b16.optimizer.master_weights(), m0)
    assert (d32 != 0).float().mean() > 0.99                                  # float32 moves (almost) every weight
    assert ((d16 != 0) == (d32 != 0)).float().mean() >= 0.999
    assert (d16 - d32).norm() / d32.norm() <= 0.25
    assert torch.nn.functional.cosine_similarity(d16, d32, 0) >= 0.95
    for p, m in zip(b16.model.parameters(), b16.optimizer.master_weights()):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32 and torch.equal(p, m.to(torch.bfloat16))
    assert 0 < stats.moved < 1                                             # update/weights_moved: some, not all

    plain = copy.deepcopy(model).to(torch.bfloat16)                        # the control
    c0 = [p.detach().clone() for p in plain.parameters()]
    trainer = GRPOTrainer(plain, tok, PROBLEMS, ARGS, reward_funcs=[spread_reward])
    trainer.optimizer = torch.optim.AdamW(plain.parameters(), lr=ARGS.learning_rate, weight_decay=ARGS.weight_decay)
    trainer.optimizer.backward = lambda loss: loss.backward()
    for _ in range(5):
        trainer.optimizer.zero_grad()
        for k, g in enumerate(batch.micro_batches):
            trainer._accumulate(batch, k, g, None, None, type(stats)())
        trainer.optimizer.step()
    assert (_flat_change(plain.parameters(), c0) != 0).float().mean() < 0.1


def test_a_float32_module_is_plain_adamw_bit_for_bit():
    torch.manual_seed(0)
    a = torch.nn.Linear(16, 8)
    b = copy.deepcopy(a)
    mine = MixedPrecisionAdamW(a.parameters(), lr=1e-3, weight_decay=0.1)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.1)
    assert not mine.mixed and mine.master_weights()[0] is a.weight
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 16, generator=g)
        for m, opt in ((a, mine), (b, ref)):
            opt.zero_grad()
            m(x).square().sum().backward()
        mine.accumulate()
        mine.step()
        ref.step()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


def test_bf16_gradients_accumulate_in_float32_over_micro_batches():
    """Gradients summed over micro-batches in bf16 lose what lies under the sum's rounding step; the masters' float32
    sum keeps it (a gradient of 1, then 64 of 2**-9 each: bf16's sum stays 1, 1 + 2**-9 rounding back to 1)."""
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MixedPrecisionAdamW([w], lr=1e-3)
    for c in [1.0] + [2.0 ** -9] * 64:
        (w * c).float().sum().backward()
        opt.accumulate()
        assert w.grad is None                     # freed: only the float32 sum is kept
    assert torch.equal(opt.master_weights()[0].grad, torch.full((4,), 1.125))
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))      # the control: bf16 accumulation
    for c in [1.0] + [2.0 ** -9] * 64:
        (plain * c).float().sum().backward()
    assert torch.equal(plain.grad, torch.ones(4, dtype=torch.bfloat16))


def _pairs(target, n=6, length=24):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, target.config.vocab_size, (length,), generator=g).tolist() for _ in range(n)]
    from tltlib.drafting.train import pairs_from_sequences
    return pairs_from_sequences(target, seqs, [4] * n, config=PairBufferConfig(max_tokens=n * length, seed=0))


def test_a_bf16_online_drafter_trains_as_the_float32_one(shipped):
    """The drafter's micro-steps on the same batches at a small learning rate: its bf16 copy's master weights move
    as the float32 drafter's do."""
    model, _, drafter = shipped
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        target = copy.deepcopy(model).to(dtype)
        d = copy.deepcopy(drafter).to(dtype).attach(target)
        buf = _pairs(target)
        assert isinstance(buf, PairBuffer)
        trainer = DrafterTrainer(d, DrafterTrainConfig(lr=1e-5, warmup_steps=1, schedule="constant", batch_sequences=6))
        before = [m.clone() for m in trainer.opt.master_weights()]
        for _ in range(3):
            trainer.micro_step(buf.batch(buf.sequences()))
        runs[dtype] = _flat_change(trainer.opt.master_weights(), before)
        assert all(torch.equal(p, m.to(dtype)) for p, m in zip(d.parameters(), trainer.opt.master_weights()))
    d32, d16 = runs[torch.float32], runs[torch.bfloat16]
    assert ((d16 != 0) == (d32 != 0)).float().mean() >= 0.999
    assert torch.nn.functional.cosine_similarity(d16, d32, 0) >= 0.95


def test_the_masters_resume_exactly_and_a_float32_state_loads_into_a_bf16_run():
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 8).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 8, generator=g).to(torch.bfloat16) for _ in range(4)]

    def steps(module, opt, batch):
        for x in batch:
            opt.zero_grad()
            opt.backward(module(x).float().square().sum())
            opt.clip_grad_norm(1.0)
            opt.step()

    straight = copy.deepcopy(base)
    opt = MixedPrecisionAdamW(straight.parameters(), lr=1e-4)
    steps(straight, opt, xs)
    first = copy.deepcopy(base)
    opt1 = MixedPrecisionAdamW(first.parameters(), lr=1e-4)
    steps(first, opt1, xs[:2])
    saved_module, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt1.state_dict())
    assert len(saved_opt["master_weights"]) == 2
    resumed = copy.deepcopy(base)                 # fresh objects: the module loaded first, then the optimizer
    opt2 = MixedPrecisionAdamW(resumed.parameters(), lr=1e-4)
    resumed.load_state_dict(saved_module)
    opt2.load_state_dict(saved_opt)
    steps(resumed, opt2, xs[2:])
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt2.master_weights()))
    assert torch.equal(straight.weight, resumed.weight)
    legacy = {k: v for k, v in saved_opt.items() if k != "master_weights"}     # a state saved without masters
    opt3 = MixedPrecisionAdamW(copy.deepcopy(first).parameters(), lr=1e-4)
    opt3.load_state_dict(legacy)
    assert torch.equal(opt3.master_weights()[0], first.weight.float())       # taken from the loaded module
    with pytest.raises(ValueError, match="holds 2 master weights for 1 parameters: it belongs to another model"):
        MixedPrecisionAdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], lr=1e-3).load_state_dict(
            saved_opt)


def test_float16_skips_a_step_whose_gradients_overflow():
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = MixedPrecisionAdamW([w], lr=1e-3)
    assert opt.overflow_skips and opt.scaler is not None
    scale = opt.scaler.get_scale()
    opt.zero_grad()
    opt.backward((w.float() * 1e30).sum())        # x the loss scale: inf in float16
    assert not torch.isfinite(torch.tensor(opt.clip_grad_norm(1.0)))
    assert opt.step() == 0.0 and torch.equal(w, torch.ones(4, dtype=torch.float16))
    assert opt.scaler.get_scale() < scale
    opt.zero_grad()
    opt.backward((w.float() * 1e-3).sum())
    assert opt.clip_grad_norm(1.0) == pytest.approx(2e-3, rel=1e-2)            # unscaled
    opt.step()
    assert (opt.master_weights()[0] < 1).all()


def test_the_memory_plan_counts_the_masters_of_a_bf16_policy():
    assert adamw_bytes(1000, 4) == {"gradients": 4000, "master weights": 0, "optimizer": 8000}
    assert adamw_bytes(1000, 2) == {"gradients": 6000, "master weights": 4000, "optimizer": 8000}
    with pytest.raises(ValueError, match="no parameters that require a gradient"):
        MixedPrecisionAdamW([torch.nn.Parameter(torch.ones(2), requires_grad=False)], lr=1e-3)
