"""Teaching helpers: a traced step agrees with what the engine emits; sample comparison pools and tests."""
from __future__ import annotations

from collections import Counter

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
