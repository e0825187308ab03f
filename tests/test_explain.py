"""Teaching helpers: a traced step agrees with what the engine emits; sample comparison pools and tests."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tltlib.lab.explain import compare_samplers, sample_categories, trace_step
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.drafter import Drafter, DrafterConfig
from tltlib.model.sampling import SamplingConfig
from tltlib.spec.strategy import OFF, SpecStrategy

CFG = ModelConfig(vocab_size=12, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), max_position_embeddings=64)


def _pair():
    torch.manual_seed(0)
    target = Transformer(CFG, init_std=0.4).eval()
    return target, Drafter(DrafterConfig.from_target(CFG), init_std=0.3).eval().attach(target)


def test_trace_step_is_consistent():
    target, drafter = _pair()
    for st in (SpecStrategy("chain", 3), SpecStrategy("tree", 3, 2, 5)):
        tr, before = trace_step(target, drafter, [1, 4, 5], st, SamplingConfig(temperature=0.9), context_steps=4)
        assert len(before) == 5 and tr.strategy == st
        n = tr.tree.size
        assert tr.q.shape == (1, n) and tr.p.shape == (1, n) and 0 <= int(tr.accepted[0]) <= st.depth
        assert torch.all((tr.q > 0) & (tr.q <= 1 + 1e-6)) and torch.all((tr.p >= 0) & (tr.p <= 1 + 1e-6))
        torch.testing.assert_close(tr.final_dist.sum(-1), torch.ones(1))
        assert float(tr.final_dist[0, tr.next[0]]) > 0            # the next token came from that distribution
        if not bool(tr.bonus[0]):                                   # a rejection: rejected drafts have no mass left
            last = 0 if tr.accepted[0] == 0 else int(tr.path[0, tr.accepted[0] - 1])
            kids = tr.tree.tokens[0][tr.tree.parents[0] == last]
            if st.kind == "tree":
                assert float(tr.final_dist[0, kids].sum()) == 0.0


def test_sample_comparison_of_plain_and_speculative():
    target, drafter = _pair()
    s = SamplingConfig(temperature=1.5, max_new_tokens=4)
    key = lambda ids: tuple(ids[:2])
    plain = sample_categories(target, drafter, [[1, 3]], OFF, s, 1500, key, seed=1)
    spec = sample_categories(target, drafter, [[1, 3]], SpecStrategy("chain", 3), s, 1500, key, seed=2)
    labels, a, b, p = compare_samplers(plain, spec)
    assert sum(a) == sum(b) == 1500 and len(labels) == len(a) and p > 1e-3
    labels, a, b, p = compare_samplers(Counter({"x": 100, "y": 100}), Counter({"x": 190, "y": 10}))
    assert p < 1e-6


# ------------------------------------------------------------------------------- notebook 02: the rule on a toy
def test_the_kept_and_resampled_mass_stack_to_p_and_alpha_is_their_overlap():
    import numpy as np

    from tltlib.lab.explain import mass_split, toy_pair
    p, q = toy_pair(6, seed=3, closeness=0.4)
    split = mass_split(p, q)
    np.testing.assert_allclose(split["accepted"] + split["residual"], p, atol=1e-15)
    assert split["alpha"] == pytest.approx(np.minimum(p, q).sum()) and 0 < split["alpha"] < 1
    assert 1 - split["alpha"] == pytest.approx(np.maximum(q - p, 0).sum())     # the rejection probability
    assert mass_split(*toy_pair(6, seed=3, closeness=1.0))["alpha"] == pytest.approx(1.0)   # an exact drafter
    with pytest.raises(ValueError, match="closeness in \\[0, 1\\], got 6 and 1.5"):
        toy_pair(6, closeness=1.5)


def test_the_speculative_draws_follow_p_not_q():
    """Chi-square against p of draws by the rule (would fail for draws from q, the control), and the rule without
    its residual (a rejection just redrawing from q) fails."""
    import numpy as np
    from scipy.stats import chisquare

    from tltlib.lab.explain import toy_pair, toy_speculative_draws
    p, q = toy_pair(6, seed=5, closeness=0.3)
    n = 20000
    draws = toy_speculative_draws(p, q, n, seed=1)
    assert chisquare(np.bincount(draws, minlength=6), p * n).pvalue > 1e-3
    from_q = np.random.default_rng(2).choice(6, size=n, p=q)
    assert chisquare(np.bincount(from_q, minlength=6), p * n).pvalue < 1e-6


def test_chain_tokens_and_speedup_close_forms():
    from tltlib.spec.acceptance import chain_speedup, chain_tokens, leviathan_speedup
    assert chain_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert chain_tokens(1.0, 4) == 5.0 and chain_tokens(0.0, 4) == 1.0
    assert chain_speedup(0.8, 4, 0.1, 1.0) == pytest.approx(leviathan_speedup(0.8, 4, 0.1))
    assert chain_speedup(0.8, 4, 0.1, 3.0) < 1 < chain_speedup(0.8, 4, 0.1, 1.0)   # a dear verify: SD stops paying


def test_traced_steps_of_a_response_find_a_rejection_and_its_residual():
    """Every SD step of one response traced; a step with a rejection drew its token from the residual, which has
    no mass on the turned-down draft (a chain)."""
    target, drafter = _pair()
    from tltlib.lab.explain import first_rejection, trace_steps
    st = SpecStrategy("chain", 3)
    steps = trace_steps(target, drafter, [1, 4, 5], st, SamplingConfig(temperature=1.0), context_steps=2,
                        max_steps=12, seed=0)
    assert 1 <= len(steps) <= 12 and [s["step"] for s in steps] == list(range(len(steps)))
    assert all(len(b["before"]) < len(a["before"]) for a, b in zip(steps[1:], steps))
    i = first_rejection(steps)
    assert i is not None, "a random drafter is rejected somewhere in 12 steps"
    tr = steps[i]["trace"]
    acc = int(tr.accepted[0])
    rejected = int(tr.tree.tokens[0][acc + 1])                 # the chain's first draft not kept
    assert not bool(tr.bonus[0]) and float(tr.final_dist[0, rejected]) == 0.0   # p(d) < q(d): no residual mass
    torch.testing.assert_close(tr.final_dist.sum(-1), torch.ones(1))
    with pytest.raises(ValueError, match="needs a speculative strategy"):
        trace_steps(target, drafter, [1, 4], OFF, SamplingConfig())
    with pytest.raises(ValueError, match="trace_steps shows token-wise verification.*trace chain-3"):
        trace_steps(target, drafter, [1, 4], SpecStrategy.parse("chain-3:block"), SamplingConfig())


def test_sample_categories_in_chunks_counts_every_sample():
    target, drafter = _pair()
    s = SamplingConfig(temperature=1.2, max_new_tokens=3)
    counts = sample_categories(target, drafter, [[1, 3], [1, 5]], OFF, s, 50, lambda ids: ids[0], seed=0, chunk=16)
    assert sum(counts.values()) == 100
    with pytest.raises(ValueError, match="samples >= 1 and chunk >= 1"):
        sample_categories(target, drafter, [[1, 3]], OFF, s, 10, lambda ids: 0, chunk=0)
