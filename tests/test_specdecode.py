"""Speculative decoding in the rollout engine: lossless at T=0 (token-identical) and T>0 (chi-square on the joint
of the first tokens), over ragged batches, groups, EOS and budgets, with chains, trees and per-step switching."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from conftest import chi2_pvalue
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.drafter import Drafter, DrafterConfig
from tltlib.model.sampling import SamplingConfig, probs_from_logits
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.spec import strategy as S
from tltlib.spec import verify
from tltlib.spec.strategy import SpecStrategy

CFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), pad_token_id=0, bos_token_id=1, max_position_embeddings=160)
PROMPTS = [[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9], [1, 10, 11, 12], [1, 13]]
STRATEGIES = [SpecStrategy("chain", 1), SpecStrategy("chain", 4), SpecStrategy("tree", 3, 2),
              SpecStrategy("tree", 4, 3, 8), SpecStrategy("chain", 4, rule="block")]


def _model(seed=0, eos_boost=2.0, cfg=CFG):
    torch.manual_seed(seed)
    m = Transformer(cfg, init_std=0.4).eval()
    with torch.no_grad():
        m.embed.weight[2] *= eos_boost
    return m


@pytest.fixture(scope="module")
def target():
    return _model()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    return Drafter(DrafterConfig.from_target(target.config), init_std=0.3).eval().attach(target)


def _engine(target, drafter, **kw):
    sampling = {k: kw.pop(k) for k in ("temperature", "top_k", "top_p", "max_new_tokens") if k in kw}
    return RolloutEngine(target, RolloutConfig(SamplingConfig(**sampling), **kw), drafter=drafter)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_greedy_sd_is_token_identical_to_plain(target, drafter, strategy):
    eng = _engine(target, drafter, temperature=0, max_new_tokens=40, num_generations=2, compact_fraction=0.3)
    plain = eng.generate(PROMPTS)
    spec = eng.generate(PROMPTS, strategy=strategy)
    assert torch.equal(plain.lengths, spec.lengths)
    assert torch.equal(plain.tokens, spec.tokens)
    torch.testing.assert_close(plain.logprobs, spec.logprobs, atol=1e-4, rtol=0)
    assert spec.stats["spec/steps"] > 0 and spec.stats["spec/accept_len_mean"] >= 1


@pytest.fixture(scope="module")
def good(target):
    """A 'drafter' that copies the target (its layer = the target's last layer): usually right, long accepts."""
    torch.manual_seed(3)
    d = Drafter(DrafterConfig.from_target(target.config), init_std=0.0).attach(target)
    with torch.no_grad():
        d.fc.weight.zero_()
        d.fc.weight[:, CFG.hidden_size:] = torch.eye(CFG.hidden_size)     # pass the target feature through
        d.layer.load_state_dict(target.layers[-1].state_dict(), strict=False)
    return d


def test_greedy_identity_with_a_drafter_that_is_often_right(target, good):
    eng = _engine(target, good, temperature=0, max_new_tokens=60, num_generations=1)
    plain = eng.generate(PROMPTS)
    for st in (SpecStrategy("chain", 5), SpecStrategy("tree", 5, 3, 12)):
        spec = eng.generate(PROMPTS, strategy=st)
        assert torch.equal(plain.tokens, spec.tokens)


def test_strategy_may_change_every_step_and_budgets_hold(target, drafter):
    rng = random.Random(0)
    choices = [S.OFF] + STRATEGIES
    eng = _engine(target, drafter, temperature=0, max_new_tokens=23, num_generations=3)
    plain = eng.generate(PROMPTS)
    mixed = eng.generate(PROMPTS, strategy=lambda step, active: rng.choice(choices))
    assert torch.equal(plain.tokens, mixed.tokens)
    assert mixed.lengths.max() <= 23
    assert set(mixed.timeline["strategy"]) > {"off"}
    ended = mixed.tokens[torch.arange(15), mixed.lengths - 1]
    assert torch.equal(ended == 2, torch.from_numpy(~mixed.truncated))     # EOS ends exactly where it appears
    assert not (mixed.tokens[:, :].eq(2).cumsum(1).gt(1) & (mixed.tokens != 0)).any()  # nothing after the EOS


@pytest.fixture
def small_backlog(monkeypatch):
    """A backlog budget so small that plain iterations feed the drafter every 32 (the floor of ``flush_at``)."""
    import tltlib.spec.step as sd
    monkeypatch.setattr(sd, "BACKLOG_BYTES", 1)


@pytest.mark.parametrize("plain_steps", [30, 31, 32, 33])
def test_sd_switches_on_right_after_a_pending_flush(target, drafter, plain_steps, small_backlog):
    """With a small backlog budget SpecDecoder flushes it into the drafter every ``flush_at`` (32) plain iterations;
    an SD step right after a flush must still find each row's last entry in the backlog (it proposes the first
    draft)."""
    eng = _engine(target, drafter, temperature=0, max_new_tokens=60, num_generations=2, ignore_eos=True)
    assert eng.start(PROMPTS).spec.flush_at == 32
    plain = eng.generate(PROMPTS)
    late = eng.generate(PROMPTS, strategy=lambda step, active: S.OFF if step < plain_steps else SpecStrategy("chain",
                                                                                                             3))
    assert torch.equal(plain.tokens, late.tokens)


def test_plain_iterations_leave_the_drafter_alone_until_sd_needs_it(target, drafter, monkeypatch):
    """By default the backlog holds every plain iteration's pairs (rows that end while SD is off never cost a drafter
    forward); the first SD step feeds it in one catch-up, whose time the tuner's reward leaves out."""
    calls = []
    real = drafter.forward_cached
    monkeypatch.setattr(drafter, "forward_cached", lambda *a, **k: calls.append(a[0].shape[1]) or real(*a, **k))
    eng = _engine(target, drafter, temperature=0, max_new_tokens=50, ignore_eos=True)
    plain = eng.generate(PROMPTS)
    from tltlib.rollout.engine import prefill_chunks
    prefills = len(prefill_chunks(sorted(map(len, PROMPTS)), eng.config.prefill_rows))
    assert len(calls) == prefills                                # the prompts' prefill (in chunks) only
    seen = []

    class Source:
        wants_context = False

        def choose(self, step, active):
            return S.OFF if step < 40 else SpecStrategy("chain", 3)

        def observe(self, strategy, active, tokens, seconds, rows=None, context=None, accepted=None):
            seen.append((strategy.enabled, seconds))
    calls.clear()
    late = eng.generate(PROMPTS, strategy=Source())
    assert torch.equal(plain.tokens, late.tokens)
    assert calls[prefills] >= 39                                 # prefill, then one catch-up of the 39 plain steps
    first_sd = next(i for i, (on, _) in enumerate(seen) if on)
    assert seen[first_sd][1] < late.timeline["iter_time"][first_sd]          # the catch-up is not in the reward


def test_chain_deeper_than_the_flush_size_is_exact(target, good):
    """A fully accepted chain of depth >= flush_at pushes more pairs than the flush size in one step."""
    eng = _engine(target, good, temperature=0, max_new_tokens=120, ignore_eos=True)
    plain = eng.generate(PROMPTS)
    deep = SpecStrategy("chain", 40)
    rotation = (deep, S.OFF, SpecStrategy("chain", 2))               # deep, then plain, then shallow, ...
    for pick in (deep, lambda step, active: rotation[step % 3]):
        assert torch.equal(plain.tokens, eng.generate(PROMPTS, strategy=pick).tokens)


def test_streamed_pairs_of_sd_equal_plain(target, drafter):
    from tltlib.drafting.pairs import PairBuffer
    eng = _engine(target, drafter, temperature=0, max_new_tokens=20)
    bufs = [PairBuffer(CFG.hidden_size), PairBuffer(CFG.hidden_size)]
    plain = eng.generate(PROMPTS, pairs=bufs[0])
    spec = eng.generate(PROMPTS, strategy=SpecStrategy("tree", 3, 2), pairs=bufs[1])
    assert torch.equal(plain.tokens, spec.tokens)
    for i in range(plain.num_sequences):
        (hp, tp, _), (hs, ts, _) = bufs[0].pairs_of(i), bufs[1].pairs_of(i)
        assert torch.equal(tp, ts)
        torch.testing.assert_close(hs, hp, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------- T > 0: exact
SMALL = ModelConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    eos_token_ids=(5,), pad_token_id=0, max_position_embeddings=32)


def _exact_joint(model, prompt, sampling, n=3):
    """p(x1) p(x2|x1) p(x3|x1,x2) under the processed distribution, by brute force."""
    v = SMALL.vocab_size
    seqs = list(itertools.product(range(v), repeat=n))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + list(s) for s in seqs]))
    probs = probs_from_logits(logits[:, len(prompt) - 1: len(prompt) - 1 + n], sampling.temperature,
                              sampling.top_k, sampling.top_p).double()
    tok = torch.tensor(seqs)
    joint = probs.gather(-1, tok[..., None])[..., 0].prod(-1)
    return joint.numpy()


def _sd_joint_pvalue(strategy, temperature, top_k, top_p, rows=12000, seed=0, draft_vocab=None):
    target = _model(5, eos_boost=0.0, cfg=SMALL)               # eos embedding zeroed: EOS rarely wins
    torch.manual_seed(9)
    poor = Drafter(DrafterConfig.from_target(SMALL), init_std=0.5).eval().attach(target)
    if draft_vocab is not None:
        poor.set_draft_vocab(torch.tensor(draft_vocab))
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=3)
    eng = RolloutEngine(target, RolloutConfig(sampling, num_generations=rows, compact_fraction=0.0), drafter=poor)
    prompt = [1, 3]
    res = eng.generate([prompt], torch.Generator().manual_seed(seed), strategy=strategy)
    assert res.stats["spec/accept_len_mean"] < strategy.depth + 1       # the poor drafter is rejected sometimes
    toks = res.tokens[:, :3].numpy()
    full = res.lengths.numpy() == 3
    v = SMALL.vocab_size
    exact = _exact_joint(target, prompt, sampling)
    # responses that ended with EOS early are absent from the 3-token joint; compare the joint of the complete ones
    eos_paths = np.array([5 in s[:2] for s in itertools.product(range(v), repeat=3)])
    counts = np.bincount(np.ravel_multi_index(toks[full].T, [v] * 3), minlength=v ** 3)
    return chi2_pvalue(counts[~eos_paths], exact[~eos_paths])


@pytest.mark.parametrize("strategy,temperature,top_k,top_p", [
    (SpecStrategy("chain", 2), 1.0, 0, 1.0), (SpecStrategy("chain", 3), 0.8, 4, 1.0),
    (SpecStrategy("tree", 2, 2), 1.1, 0, 0.9), (SpecStrategy("tree", 3, 2, 4), 0.9, 5, 0.95),
    (SpecStrategy("chain", 3, rule="block"), 0.9, 0, 1.0), (SpecStrategy("chain", 2, rule="block"), 1.0, 4, 0.9)],
    ids=lambda x: getattr(x, "name", str(x)))
def test_sd_sampling_distribution_equals_plain(strategy, temperature, top_k, top_p):
    assert _sd_joint_pvalue(strategy, temperature, top_k, top_p) > 1e-3


@pytest.mark.parametrize("strategy", [SpecStrategy("chain", 3), SpecStrategy("tree", 3, 2, 5)], ids=lambda s: s.name)
def test_sd_with_a_draft_vocabulary_is_lossless(strategy):
    """Proposals from 3 of the 6 tokens only: the target still samples all of them, with the exact distribution."""
    assert _sd_joint_pvalue(strategy, 0.9, 0, 1.0, draft_vocab=[1, 3, 4]) > 1e-3


@pytest.mark.parametrize("strategy", [SpecStrategy("chain", 5), SpecStrategy("tree", 5, 3, 12)], ids=lambda s: s.name)
def test_greedy_sd_with_a_draft_vocabulary_is_token_identical(target, good, strategy):
    eng = _engine(target, good, temperature=0, max_new_tokens=60, num_generations=1)
    plain = eng.generate(PROMPTS)
    unused = [t for t in range(CFG.vocab_size) if t not in set(plain.tokens.flatten().tolist())]
    try:
        good.set_draft_vocab(plain.tokens[plain.tokens > 0].unique()[:6])    # some of the tokens it will need
        spec = eng.generate(PROMPTS, strategy=strategy)
        good.set_draft_vocab(torch.tensor(unused[:2]))                        # only tokens greedy never picks ...
        never = eng.generate(PROMPTS, strategy=strategy)
    finally:
        good.set_draft_vocab(None)
    assert torch.equal(plain.tokens, spec.tokens) and torch.equal(plain.tokens, never.tokens)
    assert spec.stats["spec/accept_len_mean"] > 1.0
    assert never.stats["spec/accept_len_mean"] == 1.0                         # ... so every draft is rejected


def test_sd_chi_square_detects_a_missing_residual(monkeypatch):
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    assert _sd_joint_pvalue(SpecStrategy("chain", 2), 1.0, 0, 1.0) < 1e-6


@pytest.mark.long
def test_sd_block_chi_square_detects_a_stop_probability_without_the_residuals_mass(monkeypatch):
    """The controls for block verification: judging each prefix by its weight alone (h_i = w_i, a subtle bias the
    exact enumeration of tests/test_block_verify.py also shows) and sampling p instead of the residual are both
    lossy, and the rollout's chi-square test catches each (the subtle one at 40,000 rows)."""
    block = SpecStrategy("chain", 3, rule="block")
    with monkeypatch.context() as m:
        m.setattr(verify, "block_stop_probs", lambda w, mass: w)
        assert _sd_joint_pvalue(block, 1.0, 0, 1.0, rows=40_000) < 1e-6
    monkeypatch.setattr(verify, "block_residuals", lambda w, p, q: p[:, :q.shape[1]].double())
    assert _sd_joint_pvalue(block, 1.0, 0, 1.0) < 1e-6


def test_sd_tree_chi_square_detects_a_missing_residual(monkeypatch):
    monkeypatch.setattr(verify, "drop_children", lambda p, tree, is_child: p)
    assert _sd_joint_pvalue(SpecStrategy("tree", 2, 2), 1.0, 0, 1.0) < 1e-6


# ------------------------------------------------------------------------------------------------ errors
def test_strategy_without_drafter_is_a_clear_error(target):
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=5)))
    with pytest.raises(ValueError, match="needs a learned drafter"):
        eng.generate(PROMPTS, strategy=SpecStrategy("chain", 2))


def test_too_many_verify_tokens_for_the_cache(target, drafter):
    eng = _engine(target, drafter, temperature=0, max_new_tokens=5, draft_margin=4)
    with pytest.raises(ValueError, match="raise RolloutConfig.draft_margin"):
        eng.generate(PROMPTS, strategy=SpecStrategy("chain", 6))


# ----------------------------------------------------------------------------------- the shipped models
def test_shipped_drafter_is_lossless_and_accepts_long_runs():
    from tltlib.lab.notebook import ROOT
    from tltlib.model.drafter import load_drafter
    from tltlib.model.weights import load_model
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems
    from tltlib.tasks.prompts import encode_prompts
    from tltlib.tasks.tokenizer import load_tokenizer
    if not (ROOT / "data" / "tiny-reasoner-drafter" / "drafter.safetensors").is_file():
        pytest.skip("data/tiny-reasoner-drafter not built")
    target = load_model(ROOT / "data" / "tiny-reasoner")
    tok = load_tokenizer(ROOT / "data" / "tiny-reasoner")
    drafter = load_drafter(ROOT / "data" / "tiny-reasoner-drafter", target)
    prompts = encode_prompts(generate_problems(ChainTaskConfig(zipf_exponent=0.8), 12, seed=5), tok)
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=200), num_generations=1),
                        drafter=drafter)
    plain = eng.generate(prompts)
    for st in (SpecStrategy("chain", 6), SpecStrategy("tree", 5, 3, 12)):
        spec = eng.generate(prompts, strategy=st)
        assert torch.equal(plain.tokens, spec.tokens), st.name
        assert spec.stats["spec/accept_len_mean"] > 4.0, st.name      # a trained drafter is usually right


def test_chain_drafts_stay_in_the_drafters_support_when_the_uniform_is_zero(target, drafter, monkeypatch):
    """A uniform of exactly 0.0 (2^-53 likely in float64): a draft must still be a token q allows (top-k here)."""
    from tltlib.spec.step import SpecDecoder
    seen = []
    real = SpecDecoder._draft_chain

    def spy(self, depth, q_logits, feat, generator):
        drafts, qs = real(self, depth, q_logits, feat, generator)
        seen.append(qs.gather(-1, drafts[..., None])[..., 0])
        return drafts, qs

    monkeypatch.setattr(SpecDecoder, "_draft_chain", spy)
    monkeypatch.setattr(torch, "rand", lambda *a, generator=None, device=None, dtype=None, **k:
                        torch.zeros(*a, device=device, dtype=dtype))
    eng = _engine(target, drafter, temperature=1.0, top_k=3, max_new_tokens=12)
    eng.generate(PROMPTS, torch.Generator().manual_seed(0), strategy=SpecStrategy("chain", 4))
    assert seen and all(bool((q > 0).all()) for q in seen)
