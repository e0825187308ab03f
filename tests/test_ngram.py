"""The model-free n-gram drafter: what it proposes, and that SD with it stays exact in the engine."""
from __future__ import annotations

import pytest
import torch

from conftest import first_tokens_pvalue
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.spec import verify
from tltlib.spec.ngram import NgramConfig, NgramDrafter
from tltlib.spec.strategy import SpecStrategy


def _drafter(prompt, responses, **kw):
    d = NgramDrafter([prompt], len(responses), NgramConfig(**kw))
    width = max(map(len, responses))
    toks = torch.zeros(len(responses), width, dtype=torch.long)
    for i, r in enumerate(responses):
        toks[i, : len(r)] = torch.tensor(r)
    d.update(range(len(responses)), toks, torch.tensor([len(r) for r in responses]))
    return d


def test_proposes_the_continuation_of_an_earlier_occurrence_in_the_row():
    d = _drafter([1, 2], [[7, 8, 9, 4, 5, 7, 8]])
    assert d.propose_one(0, 3) == [9, 4, 5]
    assert d.propose(torch.tensor([0]), 5).tolist() == [[9, 4, 5, 7, 8]]


def test_prefers_the_longest_suffix_and_pads_short_or_missing_proposals():
    d = _drafter([1], [[3, 4, 9, 5, 4, 6, 3, 4]], max_n=2, min_n=1)
    assert d.propose_one(0, 2) == [9, 5]                  # "3 4" -> 9 5, not "4" -> 6 3
    d = _drafter([1], [[3, 4, 5, 6]], min_n=2)
    assert d.propose_one(0, 3) == [] and d.propose([0], 3).tolist() == [[6, 6, 6]]   # no match: repeat last token
    d = _drafter([1], [[3, 4, 5, 3, 4]], min_n=2)
    assert d.propose([0], 4).tolist() == [[5, 3, 4, 4]]   # continuation shorter than depth: padded


def test_siblings_supply_text_they_wrote_ahead():
    responses = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7]]       # sibling 0 is ahead of sibling 1
    assert _drafter([1, 2], responses).propose_one(1, 3) == [8, 9, 10]
    assert _drafter([1, 2], responses, siblings=False).propose_one(1, 3) == []


def test_incremental_updates_index_new_text_only_once():
    d = NgramDrafter([[1]], 2, NgramConfig(min_n=1, max_n=2))
    toks = torch.tensor([[4, 5, 6, 4, 0], [4, 5, 0, 0, 0]])
    d.update([0], toks, torch.tensor([3, 2]))
    d.update([0], toks, torch.tensor([4, 2]))
    assert d.text[0] == [1, 4, 5, 6, 4] and d.text[1] == [1, 4, 5]
    assert d.propose_one(0, 2) == [5, 6]
    occ = d.index[0][(4, 5)]
    assert len(occ) == len(set(occ))                      # no duplicate occurrences after repeated updates


def test_config_errors():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramConfig(max_n=1, min_n=2)
    with pytest.raises(ValueError, match="occurrences"):
        NgramConfig(occurrences=0)


# ------------------------------------------------------------------------------------------- in the engine
CFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), pad_token_id=0, bos_token_id=1, max_position_embeddings=160)
SMALL = ModelConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    eos_token_ids=(5,), pad_token_id=0, max_position_embeddings=32)


def _model(cfg, seed=0, std=0.4):
    torch.manual_seed(seed)
    return Transformer(cfg, init_std=std).eval()


def test_greedy_ngram_sd_is_token_identical_to_plain_without_a_drafter():
    target = _model(CFG)
    prompts = [[1, 5, 6, 5, 6], [1, 7], [1, 3, 4, 3, 4, 3], [1, 9, 9, 9]]
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=40), num_generations=3,
                                              compact_fraction=0.3), ngram=NgramConfig(min_n=1))
    plain = eng.generate(prompts)
    for st in ("ngram-1", "ngram-5"):
        spec = eng.generate(prompts, strategy=SpecStrategy.parse(st))
        assert torch.equal(plain.tokens, spec.tokens) and torch.equal(plain.lengths, spec.lengths)
        torch.testing.assert_close(plain.logprobs, spec.logprobs, atol=1e-4, rtol=0)
        assert spec.stats["spec/ngram_match_rate"] > 0.3 and spec.stats["spec/accept_len_mean"] > 1.0
    with pytest.raises(ValueError, match="needs a learned drafter"):
        eng.generate(prompts, strategy=SpecStrategy("chain", 2))


def _ngram_joint_pvalue(temperature, top_k, top_p, rows=12000):
    target = _model(SMALL, seed=5)
    with torch.no_grad():
        target.embed.weight[5] *= 0.0
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=3)
    eng = RolloutEngine(target, RolloutConfig(sampling, num_generations=rows, compact_fraction=0.0),
                        ngram=NgramConfig(min_n=1, max_n=2))
    prompt = [1, 3, 4, 1, 3]
    res = eng.generate([prompt], torch.Generator().manual_seed(0), strategy=SpecStrategy("ngram", 2))
    assert 1.0 < res.stats["spec/accept_len_mean"] < 3.0                # proposals are accepted and rejected
    return first_tokens_pvalue(target, prompt, res, temperature, top_k, top_p)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_ngram_sd_sampling_distribution_equals_plain(temperature, top_k, top_p):
    assert _ngram_joint_pvalue(temperature, top_k, top_p) > 1e-3


def test_ngram_chi_square_detects_a_missing_residual(monkeypatch):
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    assert _ngram_joint_pvalue(1.0, 0, 1.0) < 1e-6
