"""The suffix drafter: the trees it proposes (from the row, its siblings and earlier rollouts of its prompt), and
that SD with them stays exact in the engine (greedy identity, chi-square of sampled sequences)."""
from __future__ import annotations

import pytest
import torch

from conftest import first_tokens_pvalue
from test_ngram import CFG, SMALL, _model  # the same small models as the n-gram drafter's tests
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.spec import verify
from tltlib.spec.strategy import SpecStrategy
from tltlib.spec.suffix import SuffixConfig, SuffixDrafter, SuffixHistory, trie_nodes


def _drafter(prompt, responses, history=None, **kw):
    d = SuffixDrafter([prompt], len(responses), SuffixConfig(**kw), history)
    width = max(map(len, responses))
    toks = torch.zeros(len(responses), width, dtype=torch.long)
    for i, r in enumerate(responses):
        toks[i, : len(r)] = torch.tensor(r)
    d.update(range(len(responses)), toks, torch.tensor([len(r) for r in responses]))
    return d


def test_trie_nodes_are_the_most_probable_paths_parents_first():
    nodes = trie_nodes([[1, 2, 3], [1, 2, 4], [1, 5], [6]], budget=4)
    # 1 (3/4), then 2 (2/4), then the 1/4 nodes: the shallower 5 and 6 before 3 and 4
    assert nodes == [(1, -1, 0.75), (6, -1, 0.25), (2, 0, 0.5), (5, 0, 0.25)]
    assert [t for t, _, _ in trie_nodes([[1, 2, 3], [1, 2, 4]], budget=10)] == [1, 2, 3, 4]
    assert trie_nodes([], 4) == [] and trie_nodes([[1]], 0) == []


def test_siblings_and_the_row_merge_into_one_tree():
    d = _drafter([1, 2], [[7, 8, 9, 4, 7, 8], [3, 7, 8, 5, 6], [6, 7, 8]], min_match=2)
    conts = d.continuations(2, depth=3)                    # row 2 ends with "7 8": what followed it elsewhere
    assert sorted(conts) == [[5, 6], [9, 4, 7]]
    tree = d.propose([2], torch.tensor([8]), depth=3, budget=4)
    assert tree.tokens[0].tolist() == [8, 9, 5, 4, 6] and tree.parents[0].tolist() == [-1, 0, 0, 1, 2]
    assert tree.depth[0].tolist() == [0, 1, 1, 2, 2]
    padded = d.propose([2], torch.tensor([8]), depth=3, budget=8)       # 5 nodes; 3 padding nodes hang off nothing
    assert padded.parents[0, 6:].tolist() == [-1, -1, -1] and d.proposed == 2 and d.asked == 2
    trimmed = d.propose([2], torch.tensor([8]), depth=3, budget=8, trim=True)  # only as wide as its 5 nodes
    assert trimmed.tokens.shape == (1, 6) and torch.equal(trimmed.tokens, padded.tokens[:, :6])
    lone = _drafter([1, 2], [[3, 4, 5]]).propose([0], torch.tensor([5]), 3, 8, trim=True)
    assert lone.tokens.shape == (1, 2) and lone.parents[0, 1] == -1       # nothing recurs: one padding node


def test_earlier_rollouts_of_the_prompt_supply_drafts_and_no_match_gives_the_root_alone():
    hist = SuffixHistory(keep=2)
    for resp in ([4, 4, 5, 6, 7], [9, 9, 9], [4, 5, 6, 8]):
        hist.add([1, 2], resp)
    assert len(hist) == 2 and hist.of([1, 2]) == [[9, 9, 9], [4, 5, 6, 8]]   # the newest 2
    d = _drafter([1, 2], [[3, 4, 5]], history=hist)
    assert d.continuations(0, 2) == [[6, 8]]
    assert _drafter([1, 2], [[3, 4, 5]]).continuations(0, 2) == []
    tree = _drafter([1, 2], [[3, 4, 5]]).propose([0], torch.tensor([5]), 2, 3)
    assert (tree.parents[0, 1:] == -1).all()              # nothing recurs: no draft can be accepted


def test_history_is_bounded_in_tokens_and_kept_only_when_asked_for():
    hist = SuffixHistory(keep=4, max_tokens=10)
    hist.add([1], [5] * 4)
    hist.add([2], [6] * 4)
    hist.add([1], [7] * 3)                                 # prompt 1 visited again: prompt 2 is now the oldest
    hist.add([3], [8] * 2)                                 # 13 tokens > 10: prompt 2's 4 go
    assert sorted(hist.by_prompt) == [(1,), (3,)] and hist.tokens == 9 and hist.of([1]) == [[5] * 4, [7] * 3]
    target = _model(CFG)
    cfg = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=6), num_generations=2)
    plain = RolloutEngine(target, cfg)
    plain.generate([[1, 5, 6]])
    assert len(plain.suffix_history) == 0                  # no suffix config given: nothing copied or kept
    with pytest.raises(ValueError, match="history and history_tokens >= 0"):
        SuffixConfig(history_tokens=-1)


def test_config_errors():
    for kw, msg in ((dict(min_match=0), "min_match"), (dict(min_match=5, max_match=4), "min_match"),
                    (dict(occurrences=0), "occurrences"), (dict(history=-1), "history")):
        with pytest.raises(ValueError, match=msg):
            SuffixConfig(**kw)
    for name in ("suffix-8-0", "suffix-8--1", "suffix-8-4"):
        with pytest.raises(ValueError, match="budget of at least its depth"):
            SpecStrategy.parse(name)
    assert SpecStrategy.parse("suffix-8-16").name == "suffix-8-16" and not SpecStrategy.parse("suffix-4-8").uses_drafter


def test_greedy_suffix_sd_is_token_identical_to_plain_and_learns_from_earlier_rollouts():
    target = _model(CFG)
    prompts = [[1, 5, 6, 5, 6], [1, 7], [1, 3, 4, 3, 4, 3], [1, 9, 9, 9]]
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=40), num_generations=3,
                                              compact_fraction=0.3), suffix=SuffixConfig(min_match=1))
    plain = eng.generate(prompts)
    assert len(eng.suffix_history) == 12                   # every rollout's responses are kept per prompt
    first = None
    for st in ("suffix-1-1", "suffix-6-12", "suffix-6-12"):
        spec = eng.generate(prompts, strategy=SpecStrategy.parse(st))
        assert torch.equal(plain.tokens, spec.tokens) and torch.equal(plain.lengths, spec.lengths)
        torch.testing.assert_close(plain.logprobs, spec.logprobs, atol=1e-4, rtol=0)
        first = first or spec.stats["spec/accept_len_mean"]
    # greedy responses repeat the earlier rollouts' word for word: nearly every draft of 6 is accepted
    assert spec.stats["spec/suffix_match_rate"] > 0.9 and spec.stats["spec/accept_len_mean"] > 4.0


def _suffix_joint_pvalue(temperature, top_k, top_p, rows=6000):
    target = _model(SMALL, seed=5)
    with torch.no_grad():
        target.embed.weight[5] *= 0.0
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=3)
    eng = RolloutEngine(target, RolloutConfig(sampling, num_generations=rows, compact_fraction=0.0),
                        suffix=SuffixConfig(min_match=1, max_match=2, occurrences=8, history=4))
    prompt = [1, 3, 4, 1, 3]
    eng.suffix_history.add(prompt, [4, 1, 2])
    eng.suffix_history.add(prompt, [3, 2, 4])
    res = eng.generate([prompt], torch.Generator().manual_seed(0), strategy=SpecStrategy("suffix", 2, 1, 4))
    assert 1.0 < res.stats["spec/accept_len_mean"] < 3.0                # branches are accepted and rejected
    return first_tokens_pvalue(target, prompt, res, temperature, top_k, top_p)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_suffix_sd_sampling_distribution_equals_plain(temperature, top_k, top_p):
    assert _suffix_joint_pvalue(temperature, top_k, top_p) > 1e-3


def test_suffix_chi_square_detects_siblings_left_in_the_residual(monkeypatch):
    monkeypatch.setattr(verify, "drop_children", lambda p, tree, is_child: p)
    assert _suffix_joint_pvalue(1.0, 0, 1.0) < 1e-6


def test_hybrid_picks_per_row_the_tree_expecting_more_and_stays_token_identical():
    from tltlib.model.drafter import Drafter, DrafterConfig
    from tltlib.spec.step import _pick_trees
    from tltlib.spec.trees import DraftTree
    two = (lambda row: torch.tensor([row] * 2))
    eagle = DraftTree(two([9, 1, 2]), two([-1, 0, 1]), two([0, 1, 2]))           # a chain 1 -> 2
    suffix = DraftTree(two([9, 3, 4]), two([-1, 0, 0]), two([0, 1, 1]))          # two branches
    scores = torch.log(torch.tensor([[1.0, 0.5, 0.25], [1.0, 0.9, 0.8]]))      # expects 0.75 and 1.7 tokens
    tree = _pick_trees(eagle, scores, suffix, torch.tensor([1.0, 1.0]))
    assert tree.tokens.tolist() == [[9, 3, 4], [9, 1, 2]] and tree.parents.tolist() == [[-1, 0, 0], [-1, 0, 1]]
    with pytest.raises(ValueError, match="hybrid trees differ in size"):
        _pick_trees(eagle, scores, DraftTree(suffix.tokens[:, :2], suffix.parents[:, :2], suffix.depth[:, :2]),
                    torch.ones(2))
    target = _model(CFG)
    torch.manual_seed(1)
    drafter = Drafter(DrafterConfig.from_target(CFG), init_std=0.3).eval().attach(target)
    prompts = [[1, 5, 6, 5, 6], [1, 7], [1, 3, 4, 3, 4, 3]]
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=30), num_generations=2),
                        drafter=drafter, suffix=SuffixConfig(min_match=1))
    plain = eng.generate(prompts)
    for _ in range(2):
        res = eng.generate(prompts, strategy=SpecStrategy.parse("hybrid-3x2-6"))
        assert torch.equal(plain.tokens, res.tokens) and torch.equal(plain.lengths, res.lengths)
    # the random drafter's trees accept little; the repeated greedy text makes the suffix trees win
    assert res.stats["spec/suffix_match_rate"] > 0.5 and res.stats["spec/accept_len_mean"] > 2.0


def test_the_combined_drafter_refuses_a_drafter_of_another_target_and_trees_the_cache_cannot_hold():
    from dataclasses import replace

    from tltlib.model.drafter import Drafter, DrafterConfig
    target = _model(CFG)
    for other in (replace(CFG, hidden_size=48), replace(CFG, vocab_size=30)):
        with pytest.raises(ValueError, match="does not match the target"):
            RolloutEngine(target, RolloutConfig(), drafter=Drafter(DrafterConfig.from_target(other)))
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(max_new_tokens=4), draft_margin=8),
                        drafter=Drafter(DrafterConfig.from_target(CFG)))
    for name in ("suffix-8-16", "hybrid-4x4-16"):
        with pytest.raises(ValueError, match="verifies 16 tokens but the cache leaves room for 7"):
            eng.generate([[1, 4, 5]], strategy=name)
    from tltlib.lab.explain import trace_step
    for name in ("ngram-2", "suffix-2-4", "hybrid-2x2-4"):              # traces need the drafter's q at every node
        with pytest.raises(ValueError, match="trace a chain-D or tree-DxK-N step"):
            trace_step(target, eng.drafter, [1, 4, 5], SpecStrategy.parse(name), SamplingConfig(), context_steps=1)
