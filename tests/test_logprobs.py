"""The RL training forward: log-probabilities equal the rollout's (plain and speculative), gradients equal a full
logits computation, micro-batches cover every sequence within their token budget."""
from __future__ import annotations

import pytest
import torch

from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.drafter import Drafter, DrafterConfig
from tltlib.model.logprobs import SequenceBatch, micro_batches, padded_tokens, response_logprobs, sampling_logprobs
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), pad_token_id=0, max_position_embeddings=128)
PROMPTS = [[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9]]


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    target = Transformer(CFG, init_std=0.3).eval()
    drafter = Drafter(DrafterConfig.from_target(CFG), init_std=0.3).eval().attach(target)
    return target, drafter


@pytest.mark.parametrize("strategy", [None, "chain-3", "chain-3:block", "tree-3x2-5"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.8, top_k=10, top_p=0.9), dict(temperature=1.0),
                                      dict(temperature=0.0)], ids=["topk-topp", "t1", "greedy"])
def test_training_logprobs_equal_the_rollouts(pair, strategy, sampling):
    target, drafter = pair
    s = SamplingConfig(max_new_tokens=30, **sampling)
    res = RolloutEngine(target, RolloutConfig(s, num_generations=2), drafter=drafter).generate(
        PROMPTS, torch.Generator().manual_seed(1), strategy=strategy)
    prompts = [PROMPTS[i // 2] for i in range(res.num_sequences)]
    responses = [res.response_ids(i) for i in range(res.num_sequences)]
    batch = SequenceBatch.build(prompts, responses, range(res.num_sequences), 0, "cpu")
    with torch.no_grad():
        got = response_logprobs(target, batch, s, chunk=7)                  # chunks that cut across rows
    want = res.logprobs[:, : batch.width]
    mask = batch.response_mask()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-4, rtol=1e-5)   # summation order differs by CPU
    assert (got[~mask] == 0).all()


def test_chunked_checkpointed_gradients_equal_the_full_logits_computation(pair):
    target, _ = pair
    s = SamplingConfig(temperature=0.7, top_k=12)
    prompts, responses = PROMPTS, [[4, 9, 9, 3, 2], [7], [11, 12, 13, 14, 15, 16, 2]]
    batch = SequenceBatch.build(prompts, responses, [0, 1, 2], 0, "cpu")
    weights = torch.randn(batch.response_mask().shape, generator=torch.Generator().manual_seed(0))

    def grads(fn):
        target.zero_grad(set_to_none=True)
        (fn() * weights * batch.response_mask()).sum().backward()
        return {n: p.grad.clone() for n, p in target.named_parameters()}

    def full():
        logits = target(batch.tokens)
        out = torch.zeros(batch.response_mask().shape)
        for b, (p, r) in enumerate(zip(prompts, responses)):
            lp = sampling_logprobs(logits[b, len(p) - 1: len(p) + len(r) - 1], torch.tensor(r), s)
            out = out.index_put((torch.full((len(r),), b), torch.arange(len(r))), lp)
        return out

    a, b = grads(lambda: response_logprobs(target, batch, s, chunk=4)), grads(full)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4, msg=name)


def test_micro_batches_cover_everything_within_budget_and_cut_padding():
    lengths = [40, 37, 512, 35, 60, 38, 300, 41, 36, 44, 39, 45, 576, 42, 37, 50]
    groups = micro_batches(lengths, max_tokens=1024)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 1024
    one_batch = len(lengths) * max(lengths)
    assert padded_tokens(lengths, groups) < 1.3 * sum(lengths) < 0.3 * one_batch   # long tail: padding mostly avoided
    assert padded_tokens(lengths, groups) >= sum(lengths)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        micro_batches(lengths, 0)
