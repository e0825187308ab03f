"""Admission by memory (tltlib.rollout.admission): a rollout whose rows outgrow the KV budget preempts rows and
re-admits them by recomputing their tokens, and finishes with the tokens an unconstrained rollout gives (greedy),
log-probs the training forward reproduces (sampled, plain and SD), the SD switch shown only running rows, and the KV
pool never above its budget; budgets that cannot hold one row or the prefill are refused before the rollout."""
from __future__ import annotations

import pytest
import torch

from tltlib.kv.paged import KVConfig
from tltlib.kv.pages import kv_bytes_per_token
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.drafter import Drafter, DrafterConfig
from tltlib.model.logprobs import SequenceBatch, response_logprobs
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.spec.strategy import OFF, SpecStrategy

CFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), pad_token_id=0, bos_token_id=1, max_position_embeddings=160)
PROMPTS = [[1, 5, 6], [1, 7], [1, 3, 4, 5, 6, 8, 9], [1, 10, 11, 12], [1, 13]]
PAGE = 4
TARGET_PAGE = PAGE * kv_bytes_per_token(CFG.num_layers, CFG.num_kv_heads, CFG.dim_head, 4)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    m = Transformer(CFG, init_std=0.4).eval()
    with torch.no_grad():
        m.embed.weight[2] *= 1.5                  # EOS likely enough that lengths vary, rare enough for long rows
    return m


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    return Drafter(DrafterConfig.from_target(target.config), init_std=0.3).eval().attach(target)


def _engine(target, kv, drafter=None, temperature=0.0, max_new=48):
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new)
    return RolloutEngine(target, RolloutConfig(sampling, num_generations=3, compact_fraction=0.3, kv=kv),
                         drafter=drafter)


def _tight(pages: int, drafter=None) -> KVConfig:
    """A budget of ``pages`` target pages (and as many drafter tokens, split as the workspace splits it)."""
    total = pages * TARGET_PAGE
    if drafter is not None:                  # the drafter's cache: one layer, so 1 / layers more bytes
        total += total // CFG.num_layers
    return KVConfig(kind="paged", memory=total, page_size=PAGE)


def test_a_rollout_larger_than_its_budget_preempts_and_gives_the_unconstrained_tokens(target):
    """Greedy: the 15 rows need ~3x the pages the budget holds at their longest; rows are preempted and recomputed,
    the tokens equal the roomy rollout's, and the pool never held more than its budget."""
    roomy = _engine(target, KVConfig(memory=1 << 26, page_size=PAGE)).generate(PROMPTS)
    assert roomy.stats["rollout/preempted"] == 0
    full_pages = sum(-(-(len(PROMPTS[i // 3]) + int(n)) // PAGE) for i, n in enumerate(roomy.lengths))
    tight = _engine(target, _tight(full_pages // 3)).generate(PROMPTS)
    assert tight.stats["rollout/preempted"] > 0 and tight.stats["rollout/recomputed_tokens"] > 0
    assert torch.equal(tight.lengths, roomy.lengths) and torch.equal(tight.tokens, roomy.tokens)
    torch.testing.assert_close(tight.logprobs, roomy.logprobs, atol=1e-4, rtol=0)
    assert tight.stats["rollout/kv_peak_bytes"] <= tight.stats["rollout/kv_pool_bytes"] == (full_pages // 3) * \
        TARGET_PAGE


@pytest.mark.parametrize("strategy", [None, SpecStrategy("chain", 3), SpecStrategy("tree", 3, 2, 5),
                                      SpecStrategy("tree", 4, 3, 4)],
                         ids=["plain", "chain-3", "tree", "tree-drafts-more-than-it-verifies"])
def test_preempted_rows_sample_from_the_policy_their_log_probs_match_the_training_forward(target, drafter, strategy):
    """Sampled (T=0.9), with the drafter's cache paged too: under a tight budget the rollout finishes, rows were
    preempted, and every response's recorded log-probs equal the training forward's over its tokens."""
    s = SamplingConfig(temperature=0.9, max_new_tokens=48)
    eng = RolloutEngine(target, RolloutConfig(s, num_generations=3, compact_fraction=0.3, kv=_tight(40, drafter)),
                        drafter=drafter)
    res = eng.generate(PROMPTS, torch.Generator().manual_seed(3), strategy=strategy)
    assert res.stats["rollout/preempted"] > 0
    prompts = [PROMPTS[i // 3] for i in range(res.num_sequences)]
    batch = SequenceBatch.build(prompts, [res.response_ids(i) for i in range(res.num_sequences)],
                                range(res.num_sequences), 0, "cpu")
    with torch.no_grad():
        got = response_logprobs(target, batch, s, chunk=16)
    mask = batch.response_mask()
    torch.testing.assert_close(got[mask], res.logprobs[:, : batch.width][mask], atol=1e-4, rtol=1e-5)


def test_the_sd_switch_sees_running_rows_not_waiting_ones(target, drafter):
    """The strategy source is asked with the rows in the batch: while rows wait, fewer than the unfinished ones."""
    seen = []

    def source(iteration, active):
        seen.append((active, len(rollout.waiting), int(rollout.alive.sum())))
        return SpecStrategy("chain", 3) if active <= 4 else OFF
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0.9, max_new_tokens=48), num_generations=3,
                                              kv=_tight(40, drafter)), drafter=drafter)
    rollout = eng.start(PROMPTS, torch.Generator().manual_seed(4), strategy=source)
    rollout.finish()
    assert any(waiting for _, waiting, _ in seen), "no row ever waited: tighten the budget"
    assert all(active == alive for active, _, alive in seen)          # running rows only


def test_a_budget_that_cannot_hold_the_longest_row_or_the_prefill_is_refused_before_the_rollout(target):
    with pytest.raises(ValueError, match=r"a row of 56 tokens \(its prompt, max_new_tokens and one more\) needs 14 "
                                         r"pages of KV cache but its budget holds 13: give RolloutConfig.kv = "
                                         r"KVConfig\(memory=...\) at least 14,336 bytes"):
        _engine(target, _tight(13)).generate(PROMPTS)                   # the 7-token prompt + 48 new + 1
    many = [[1, 3, 4, 5, 6, 8, 9, 10, 11]] * 4                           # 3 pages each, shared by the samples
    with pytest.raises(ValueError, match=r"the prefill of 4 prompts needs 13 pages of KV cache but its budget holds "
                                         r"12: .*fewer prompts per rollout"):
        _engine(target, _tight(12), max_new=8).generate(many)
    out = _engine(target, _tight(13), max_new=8).generate(many)        # 12 prompt pages + 1: the samples take turns
    assert out.stats["rollout/preempted"] > 0 and (out.lengths >= 1).all()
    # one prefill chunk (padding within PREFILL_WASTE), each row padded from 5 pages to 6
    padded = [[1, 3, 4, 5] * 5] * 3 + [[1, 3, 4, 5] * 5 + [6]]
    with pytest.raises(ValueError, match=r"the prefill of 4 prompts needs 25 pages"):
        _engine(target, _tight(24), max_new=4).generate(padded)
    assert _engine(target, _tight(25), max_new=4).generate(padded).num_sequences == 12


def test_with_a_drafter_the_refusal_names_the_whole_budget_it_is_a_share_of(target, drafter):
    """The budget is split between the target's cache and the drafter's: the bytes named are the whole budget's."""
    with pytest.raises(ValueError, match=r"needs 14 pages of KV cache .* at least (\d[\d,]*) bytes \(this cache gets "
                                         r"67% of it") as err:
        _engine(target, _tight(13, drafter), drafter).generate(PROMPTS)
    named = int(err.value.args[0].split("at least ")[1].split(" bytes")[0].replace(",", ""))
    per_token = kv_bytes_per_token(CFG.num_layers, CFG.num_kv_heads, CFG.dim_head, 4)
    assert named >= 14 * TARGET_PAGE * (CFG.num_layers + 1) // CFG.num_layers >= 14 * PAGE * per_token
