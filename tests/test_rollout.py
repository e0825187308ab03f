"""RolloutEngine: greedy equals transformers generate, sampling follows the model, batches shrink, traces add up."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import chi2_pvalue
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.sampling import SamplingConfig, probs_from_logits
from tltlib.model.weights import save_model
from tltlib.rollout.engine import RolloutConfig, RolloutEngine

CFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), pad_token_id=0, bos_token_id=1, max_position_embeddings=96)
PROMPTS = [[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9], [1, 10, 11, 12]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Transformer(CFG, init_std=0.4).eval()
    with torch.no_grad():                      # make EOS likely enough that lengths vary
        m.embed.weight[2] *= 3
    return m


def _engine(model, **kw):
    sampling = {k: kw.pop(k) for k in ("temperature", "top_k", "top_p", "max_new_tokens") if k in kw}
    return RolloutEngine(model, RolloutConfig(SamplingConfig(**sampling), **kw))


def test_greedy_matches_transformers_generate(model, tmp_path):
    from transformers import AutoModelForCausalLM
    save_model(model, tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    res = _engine(model, temperature=0, max_new_tokens=30).generate(PROMPTS)
    for i, p in enumerate(PROMPTS):
        out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=30, eos_token_id=2, pad_token_id=0)
        assert res.response_ids(i) == out[0, len(p):].tolist()


def test_rows_leave_the_batch_and_traces_add_up(model):
    res = _engine(model, temperature=1.0, max_new_tokens=40, num_generations=4, compact_fraction=0.0).generate(PROMPTS)
    tl = res.timeline
    assert res.num_sequences == 16
    assert np.all(np.diff(tl["rows"]) <= 0) and tl["rows"][-1] < 16
    assert np.array_equal(tl["rows"], tl["active"])                  # compacted at every finish
    lengths = res.lengths.numpy()
    assert len(tl["iter_time"]) == lengths.max() - 1 and res.stats["rollout/tokens"] == lengths.sum()
    assert np.array_equal(res.finish_iter, lengths - 1)
    assert np.all(np.diff(tl["time"]) >= 0) and res.finish_time.max() <= res.stats["rollout/time_s"]
    # rows still generating at step s = responses longer than s
    assert np.array_equal(tl["active"], [(lengths > s).sum() for s in range(1, lengths.max())])
    ended = res.tokens[torch.arange(16), res.lengths - 1]
    assert torch.equal(ended == 2, torch.from_numpy(~res.truncated))
    assert np.all(lengths[res.truncated] == 40)


def test_logprobs_and_streamed_hidden_states_match_a_full_forward(model):
    from tltlib.drafting.pairs import PairBuffer
    buf = PairBuffer(CFG.hidden_size)
    res = _engine(model, temperature=0.8, top_k=10, max_new_tokens=25, num_generations=2).generate(
        PROMPTS, torch.Generator().manual_seed(5), pairs=buf)
    assert buf.sequences() == list(range(res.num_sequences))
    for i in range(res.num_sequences):
        p, r = PROMPTS[i // 2], res.response_ids(i)
        with torch.no_grad():
            logits, hidden = model(torch.tensor([p + r]), return_hidden=True)
        probs = probs_from_logits(logits[0, len(p) - 1:-1], 0.8, 10)
        torch.testing.assert_close(res.logprobs[i, : len(r)], probs.gather(-1, torch.tensor(r)[:, None])[:, 0].log(),
                                   atol=1e-5, rtol=1e-5)
        h, t, plen = buf.pairs_of(i)
        assert plen == len(p) and t.tolist() == (p + r)[1:]
        torch.testing.assert_close(h, hidden[0, :-1], atol=1e-4, rtol=1e-5)   # summation order differs by CPU


def test_first_two_tokens_follow_the_model_chi_square(model):
    g = torch.Generator().manual_seed(11)
    res = _engine(model, temperature=1.0, max_new_tokens=2, num_generations=3000).generate([[1, 5]], g)
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([[1, 5]]))[0, -1], -1)
    counts = np.bincount(res.tokens[:, 0].numpy(), minlength=CFG.vocab_size)
    assert chi2_pvalue(counts, p1.numpy()) > 1e-3


def test_seeded_reproducible_and_groups_differ(model):
    eng = _engine(model, temperature=1.0, max_new_tokens=20, num_generations=3)
    a = eng.generate(PROMPTS, torch.Generator().manual_seed(1))
    b = eng.generate(PROMPTS, torch.Generator().manual_seed(1))
    c = eng.generate(PROMPTS, torch.Generator().manual_seed(2))
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert len({tuple(a.response_ids(i)) for i in range(3)}) > 1        # samples of one prompt differ


def test_max_new_tokens_and_context_budget(model):
    res = _engine(model, temperature=0, max_new_tokens=5).generate(PROMPTS)
    assert res.lengths.max() <= 5
    long_prompt = [1] + [5] * 90                                         # context 96: room for 5 tokens only
    res = _engine(model, temperature=1.0, max_new_tokens=50).generate([long_prompt])
    assert res.lengths[0] <= 5


def test_bad_prompts_are_clear_errors(model):
    eng = _engine(model, temperature=0, max_new_tokens=5)
    with pytest.raises(ValueError, match="prompt 1 has 96 tokens but the model's context is 96"):
        eng.generate([[1, 2], [1] * 96])
    with pytest.raises(ValueError, match="no prompts"):
        eng.generate([])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        eng.generate([[]])
    with pytest.raises(ValueError, match="token ids outside"):
        eng.generate([[1, 99]])
    with pytest.raises(ValueError, match="num_generations must be >= 1"):
        RolloutConfig(num_generations=0)


@pytest.mark.gpu
def test_cuda_greedy_matches_cpu(model):
    cpu = _engine(model, temperature=0, max_new_tokens=30).generate(PROMPTS)
    gpu = _engine(model.to("cuda"), temperature=0, max_new_tokens=30).generate(PROMPTS)
    model.to("cpu")
    assert torch.equal(cpu.tokens, gpu.tokens.cpu())


def test_prefill_chunks_cover_every_row_within_the_row_and_padding_bounds():
    from tltlib.rollout.engine import PREFILL_WASTE, prefill_chunks
    g = torch.Generator().manual_seed(0)
    lengths = sorted(torch.randint(1, 200, (157,), generator=g).tolist())
    chunks = prefill_chunks(lengths, max_rows=16)
    assert [c[0] for c in chunks][1:] == [c[1] for c in chunks][:-1] and chunks[0][0] == 0
    assert chunks[-1][1] == len(lengths)
    for c0, c1 in chunks:
        rows = lengths[c0:c1]
        assert 1 <= c1 - c0 <= 16
        assert c1 - c0 == 1 or len(rows) * max(rows) <= (1 + PREFILL_WASTE) * sum(rows)
    assert prefill_chunks([5] * 40, max_rows=16) == [(0, 16), (16, 32), (32, 40)]
    assert prefill_chunks([1, 100], max_rows=16) == [(0, 1), (1, 2)]


def test_a_prompts_tokens_do_not_depend_on_the_other_prompts_or_their_order(model):
    """Prompts are prefilled shortest first in chunks; every response still belongs to its own prompt."""
    g = torch.Generator().manual_seed(5)
    prompts = [[1] + torch.randint(3, 24, (int(n),), generator=g).tolist() for n in (3, 40, 7, 25, 2, 40, 11)]
    cfg = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=12), num_generations=2, ignore_eos=True,
                        prefill_rows=3)
    eng = RolloutEngine(model, cfg)
    together = eng.generate(prompts)
    backwards = eng.generate(prompts[::-1])
    for i, p in enumerate(prompts):
        alone = eng.generate([p])
        for g_ in range(2):
            assert together.response_ids(2 * i + g_) == alone.response_ids(g_)
            assert backwards.response_ids(2 * (len(prompts) - 1 - i) + g_) == alone.response_ids(g_)


def test_a_cpu_rollout_reuses_a_kept_workspace_at_least_as_long_and_gives_the_same_tokens():
    """A CPU engine keeps its workspace; a later rollout of the same rows that needs fewer slots runs in it (fresh
    buffers cost their first touch, up to half a tiny-reasoner rollout) and draws exactly the tokens a fresh engine
    draws; a longer one or another row count gets new buffers."""
    from dataclasses import replace
    torch.manual_seed(0)
    m = Transformer(replace(CFG, max_position_embeddings=400), init_std=0.4).eval()
    eng = _engine(m, temperature=1.0, max_new_tokens=300, num_generations=3)
    short = [4, 9, 2] * len(PROMPTS)
    eng.generate(PROMPTS, torch.Generator().manual_seed(1), lengths=short)
    small = eng.kept._workspace[1]
    eng.generate(PROMPTS, torch.Generator().manual_seed(2), lengths=[300] * (3 * len(PROMPTS)))
    big = eng.kept._workspace[1]
    assert big is not small and big.cache.max_len > small.cache.max_len
    again = eng.generate(PROMPTS, torch.Generator().manual_seed(3), lengths=short)
    assert eng.kept._workspace[1] is big
    fresh = _engine(m, temperature=1.0, max_new_tokens=300, num_generations=3).generate(
        PROMPTS, torch.Generator().manual_seed(3), lengths=short)
    assert torch.equal(again.tokens, fresh.tokens) and torch.equal(again.logprobs, fresh.logprobs)
    eng.generate(PROMPTS[:2], torch.Generator().manual_seed(4), lengths=short[:6])
    assert eng.kept._workspace[1] is not big


def test_forced_lengths_replay_a_length_distribution(model):
    """``lengths=``: every response has exactly its given length, EOS ignored; a plain rollout given its own lengths
    and seed reproduces itself; lengths that do not fit are refused."""
    eng = _engine(model, temperature=1.0, max_new_tokens=20, num_generations=3, draft_margin=8)   # a tight cache
    free = eng.generate(PROMPTS, torch.Generator().manual_seed(4))
    assert free.lengths.min() < 20                                    # some end at EOS
    again = eng.generate(PROMPTS, torch.Generator().manual_seed(4), lengths=free.lengths)
    assert torch.equal(again.tokens, free.tokens) and torch.equal(again.lengths, free.lengths)
    want = torch.tensor([1, 20, 13] * len(PROMPTS))                   # the longest of a group is not its first
    for strategy in (None, "ngram-4"):                                # SD steps emit several tokens: cut too
        other = eng.generate(PROMPTS, torch.Generator().manual_seed(5), lengths=want.tolist(), strategy=strategy)
        assert torch.equal(other.lengths, want)
    with pytest.raises(ValueError, match="one length per response"):
        eng.generate(PROMPTS, lengths=[3])
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0 is outside 1..20"):
        eng.generate(PROMPTS, lengths=[3, 0] + [3] * (len(PROMPTS) * 3 - 2))
    with pytest.raises(ValueError, match="outside 1..20"):
        eng.generate(PROMPTS, lengths=[21] * (len(PROMPTS) * 3))
