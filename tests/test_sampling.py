"""Sampling distribution equals transformers' warpers; draws follow it (chi-square); bad settings are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import chi2_pvalue
from tltlib.model.sampling import SamplingConfig, probs_from_logits, sample, sample_from_logits


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (0.9, 0, 0.8), (1.3, 7, 0.6)])
def test_probs_match_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 2
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    ref = torch.softmax(procs(None, logits.clone()), -1)
    torch.testing.assert_close(probs_from_logits(logits, temperature, top_k, top_p), ref, atol=1e-6, rtol=0)


def test_top_p_keeps_the_most_likely_token_even_when_it_alone_exceeds_p():
    probs = probs_from_logits(torch.tensor([[5.0, 0.0, 0.0]]), 1.0, 0, 0.1)
    assert probs.tolist() == [[1.0, 0.0, 0.0]]


def test_samples_follow_the_distribution_chi_square():
    g = torch.Generator().manual_seed(1)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -3.0, 2.0])
    p = probs_from_logits(logits[None], 0.9, 4, 0.95)[0]
    draws = sample(p.expand(20000, -1), g)
    counts = np.bincount(draws.numpy(), minlength=6)
    assert counts[(p == 0).numpy()].sum() == 0, "sampled a token outside top-k/top-p"
    assert chi2_pvalue(counts, p.numpy()) > 1e-3


def test_greedy_is_argmax_with_softmax_logprob():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(2))
    tok, logp = sample_from_logits(logits, SamplingConfig(temperature=0), None)
    assert tok.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).max(-1).values)


def test_logprobs_are_under_the_sampling_distribution():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(3))
    cfg = SamplingConfig(temperature=0.5, top_k=3)
    tok, logp = sample_from_logits(logits, cfg, torch.Generator().manual_seed(0))
    p = probs_from_logits(logits, 0.5, 3)
    torch.testing.assert_close(logp, p.gather(-1, tok[:, None])[:, 0].log())


@pytest.mark.parametrize("kwargs,match", [(dict(temperature=-0.1), "temperature must be >= 0"),
                                          (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
                                          (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
                                          (dict(top_k=-1), "top_k must be >= 0"),
                                          (dict(max_new_tokens=0), "max_new_tokens must be > 0")])
def test_bad_sampling_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_inverse_cdf_never_draws_outside_the_support():
    from tltlib.model.sampling import inverse_cdf
    q = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.7], [0.5, 0.0, 0.0, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]])
    zero = torch.zeros(3, 1, dtype=torch.float64)
    assert inverse_cdf(q, zero)[:, 0].tolist() == [2, 0, 1]        # u = 0: the first token with mass, not token 0
    top = torch.full((3, 1), 1.0 - 2 ** -53, dtype=torch.float64)  # the largest float64 torch.rand can return
    assert inverse_cdf(q, top)[:, 0].tolist() == [4, 3, 1]         # never past the last token with mass
    unnormalised = q * 3.0
    assert inverse_cdf(unnormalised, zero)[:, 0].tolist() == [2, 0, 1]
    assert inverse_cdf(unnormalised, top)[:, 0].tolist() == [4, 3, 1]
    u = torch.rand(20000, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    counts = torch.bincount(inverse_cdf(q[:1].expand(20000, -1), u)[:, 0], minlength=5)
    assert counts[[0, 1, 3]].sum() == 0 and abs(counts[2].item() / 20000 - 0.3) < 0.02


def test_every_token_gets_exactly_its_share_of_the_unit_interval_at_qwens_vocabulary():
    """151,936 tokens, half of them far below float32's grid of 2^-24 (1e-9 each): a uniform anywhere inside a
    token's exact interval of [0, 1) (computed in 80-bit long double) draws that token — at its middle and a
    thousandth of its width inside either end. On a float32 CDF or with float32 uniforms most of the small tokens
    would be drawn never or 60x too often; float32 uniforms are refused."""
    from tltlib.model.sampling import inverse_cdf
    v = 151_936
    g = torch.Generator().manual_seed(0)
    p = torch.rand(v, generator=g, dtype=torch.float64) + 0.5
    p[::2] = 1e-9 * (1 + torch.rand(v // 2, generator=g, dtype=torch.float64))
    p[1::2] *= (1 - p[::2].sum()) / p[1::2].sum()
    probs = p.float()[None]                                         # the model's float32 probabilities
    exact = np.asarray(probs[0].double().numpy(), dtype=np.longdouble)
    hi = np.cumsum(exact) / exact.sum()
    lo = np.concatenate([[np.longdouble(0)], hi[:-1]])
    width = hi - lo
    for at in (lo + width / 2, lo + width * 1e-3, hi - width * 1e-3):
        u = torch.from_numpy(at.astype(np.float64))[None]
        assert torch.equal(inverse_cdf(probs, u)[0], torch.arange(v))
    with pytest.raises(ValueError, match="float64 uniforms"):
        inverse_cdf(probs, u.float())
