"""Drafter training: the pairs it trains on are exactly what the engine feeds the drafter; the loss trains."""
from __future__ import annotations

import pytest
import torch

from tltlib.drafting.pairs import PairBuffer, loss_mask
from tltlib.drafting.train import (
    DrafterTrainConfig,
    DrafterTrainer,
    depth_accuracy,
    drafter_loss,
    pairs_from_sequences,
    train_offline,
)
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.drafter import Drafter, DrafterConfig
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.spec.strategy import OFF, SpecStrategy

CFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), pad_token_id=0, max_position_embeddings=128)


def _pair(seed=0):
    torch.manual_seed(seed)
    target = Transformer(CFG, init_std=0.4).eval()
    with torch.no_grad():
        target.embed.weight[2] *= 0.0                 # no early EOS: long sequences
    drafter = Drafter(DrafterConfig.from_target(CFG), init_std=0.3).eval().attach(target)
    return target, drafter


def test_streamed_pairs_are_the_pairs_the_engine_feeds_the_drafter_and_a_full_forward_gives(monkeypatch):
    """The alignment DESIGN.md asks to pin: pair t = (f_t, x_{t+1}) at drafter position t, the same in the buffer
    the rollout streams, in what the engine feeds the drafter, and from a training forward of the sequence."""
    from tltlib.spec.step import SpecDecoder
    fed_pairs, feed = [], SpecDecoder._feed

    def recording_feed(self, cache, hidden, tokens, n):
        fed_pairs.append((hidden.clone(), tokens.clone(), n.clone(), cache.lengths[: cache.rows].clone()))
        return feed(self, cache, hidden, tokens, n)

    monkeypatch.setattr(SpecDecoder, "_feed", recording_feed)
    target, drafter = _pair()
    prompt = [1, 5, 6, 7]
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0.9, max_new_tokens=40)), drafter=drafter)
    strategies = [OFF, SpecStrategy("chain", 3), OFF, OFF, SpecStrategy("tree", 3, 2)]
    buf = PairBuffer(CFG.hidden_size)
    rollout = eng.start([prompt], torch.Generator().manual_seed(3), pairs=buf,
                        strategy=lambda step, active: strategies[step % len(strategies)])
    res = rollout.finish()
    seq = prompt + res.response_ids(0)
    fed_h, fed_t, fed_pos = [], [], []
    for hidden, tokens, n, start in fed_pairs:                     # row 0 only: one prompt, one sample
        k = int(n[0])
        fed_h.append(hidden[0, :k]), fed_t.append(tokens[0, :k])
        fed_pos += list(range(int(start[0]), int(start[0]) + k))
    fed_h, fed_t = torch.cat(fed_h), torch.cat(fed_t)
    assert fed_pos == list(range(len(fed_pos))), "pairs must be fed in order, pair j at drafter position j"
    assert len(fed_pos) >= len(seq) - 8                             # all but the last few (still pending)
    (s,) = buf.sequences()
    got_h, got_t, plen = buf.pairs_of(s)
    assert plen == len(prompt) and got_t.tolist() == seq[1:]        # every pair, in order, prompt pairs first
    n = len(fed_pos)
    assert torch.equal(fed_t, got_t[:n]) and torch.equal(fed_h, got_h[:n])    # the stream IS what was fed
    ref = pairs_from_sequences(target, [seq], [len(prompt)])        # a training forward of the whole sequence
    ref_h, ref_t, _ = ref.pairs_of(ref.sequences()[0])
    assert torch.equal(ref_t, got_t)
    torch.testing.assert_close(got_h, ref_h, atol=1e-4, rtol=1e-5)


def test_loss_mask_covers_response_predictions_only():
    m = loss_mask(length=10, prompt_len=4, width=9)
    # pair t predicts x_{t+2} from f_{t+1}; response tokens start at index 4, the last pair (t=8) has no target
    assert m.tolist() == [False, False, True, True, True, True, True, True, False]


def test_training_lowers_the_loss_changes_the_drafter_and_not_the_target():
    target, drafter = _pair(1)
    seqs = [[1] + torch.randint(3, 24, (30,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    data = pairs_from_sequences(target, seqs, [4] * 8)
    before_d = {k: v.clone() for k, v in drafter.state_dict().items()}
    before_t = {k: v.clone() for k, v in target.state_dict().items()}
    batch = data.batch(data.sequences())
    loss0, stats0 = drafter_loss(drafter, batch, DrafterTrainConfig())
    trainer = DrafterTrainer(drafter, DrafterTrainConfig(steps=60, lr=3e-3, warmup_steps=5))
    for _ in range(60):
        stats = trainer.micro_step(batch)
    assert stats["drafter/loss"] < 0.7 * stats0["drafter/loss"]
    assert all(not torch.equal(before_d[k], v) for k, v in drafter.state_dict().items())
    assert all(torch.equal(before_t[k], v) for k, v in target.state_dict().items())
    accs = depth_accuracy(drafter, batch, 3)
    assert len(accs) == 3 and abs(accs[0] - stats["drafter/acc_1"]) < 0.2 and all(0 <= a <= 1 for a in accs)


def test_train_offline_logs_curves():
    target, drafter = _pair(2)
    seqs = [[1] + torch.randint(3, 24, (12,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]
    data = pairs_from_sequences(target, seqs, [3] * 6)
    log = train_offline(drafter, data, DrafterTrainConfig(steps=6, batch_sequences=3, eval_depth=2), data,
                        eval_every=3, on_eval=lambda step, d: {"seen": step}, progress=False)
    assert log["step"] == list(range(1, 7)) and log["eval_step"] == [0, 3, 6]
    assert [len(a) for a in log["eval_acc"]] == [2, 2, 2] and log["eval_extra"][-1] == {"seen": 6}


def test_a_time_budget_cuts_the_step_count_and_the_schedule_with_it():
    """``minutes``: after the probe steps the run is cut to what fits (evaluations counted), never lengthened;
    the learning-rate schedule then ends with the cut run; a negative budget is refused."""
    from dataclasses import replace

    from tltlib.drafting.train import BUDGET_PROBE_STEPS, _budget_steps
    cfg = DrafterTrainConfig(steps=100, minutes=1.0)
    assert _budget_steps(cfg, 5, 10.0, 1.0, 2.0, 10) == 35                   # 60 - 10 - 10 x 2 = 30 more
    assert _budget_steps(replace(cfg, steps=20), 5, 10.0, 1.0, 2.0, 10) == 20    # never beyond steps
    assert _budget_steps(cfg, 5, 70.0, 1.0, 2.0, 10) == 5                      # out of time: stop now
    target, drafter = _pair(2)
    seqs = [[1] + torch.randint(3, 24, (12,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]
    data = pairs_from_sequences(target, seqs, [3] * 6)
    log = train_offline(drafter, data, DrafterTrainConfig(steps=40, batch_sequences=3, eval_depth=2, minutes=1e-6),
                        data, eval_every=4, progress=False)
    assert log["steps"] == BUDGET_PROBE_STEPS == log["step"][-1] and log["eval_step"][-1] == BUDGET_PROBE_STEPS
    with pytest.raises(ValueError, match="minutes must be >= 0"):
        DrafterTrainConfig(minutes=-1)


def test_chunked_head_loss_equals_one_pass_over_all_logits():
    import torch.nn.functional as F

    from tltlib.drafting.pairs import PairBatch
    target, drafter = _pair()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 9, target.config.hidden_size, generator=g)
    batch = PairBatch(h, torch.randint(0, target.config.vocab_size, (3, 9), generator=g),
                      torch.rand(3, 8, generator=g) > 0.3)
    cfg = DrafterTrainConfig()
    grads = []
    for chunk in (3, 10 ** 6):
        drafter.zero_grad()
        loss, stats = drafter_loss(drafter, batch, cfg, chunk=chunk)
        loss.backward()
        grads.append([p.grad.clone() for p in drafter.parameters()])
        # the one-pass reference: [B, T, V] logits, masked mean
        pred, logits = drafter(*batch.inputs)
        p_t = torch.softmax(drafter.logits(h[:, 1:]).float(), -1)
        m = batch.mask.float()
        ref = ((F.smooth_l1_loss(pred, h[:, 1:], reduction="none").mean(-1) * m).sum() + 0.1 * (
            -(p_t * torch.log_softmax(logits, -1)).sum(-1) * m).sum()) / m.sum()
        torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_unrolled_loss_trains_on_the_drafters_own_features():
    """unroll=2: the first step's loss plus 0.7 x the loss of a second step that reads, at position t, the feature
    the drafter predicted from position t-1 (position 0 carries no second-step loss); gradients flow through it."""
    import torch.nn.functional as F

    from tltlib.drafting.pairs import PairBatch
    target, drafter = _pair()
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 7, target.config.hidden_size, generator=g)
    batch = PairBatch(h, torch.randint(0, target.config.vocab_size, (2, 7), generator=g), torch.ones(2, 6, dtype=bool))
    one, _ = drafter_loss(drafter, batch, DrafterTrainConfig())
    two, stats = drafter_loss(drafter, batch, DrafterTrainConfig(unroll=2))

    def ref_step(feats, mask):
        pred = drafter.features(feats, batch.tokens[:, :-1])
        logits = drafter.logits(pred, full=True).float()
        p_t = torch.softmax(drafter.logits(h[:, 1:], full=True).float(), -1)
        m = mask.float()
        return pred, ((F.smooth_l1_loss(pred, h[:, 1:], reduction="none").mean(-1) * m).sum() + 0.1 * (
            -(p_t * torch.log_softmax(logits, -1)).sum(-1) * m).sum()) / m.sum()
    pred1, l1 = ref_step(h[:, :-1], batch.mask)
    second = batch.mask.clone()
    second[:, 0] = False
    _, l2 = ref_step(torch.cat([h[:, :1], pred1[:, :-1]], 1), second)
    torch.testing.assert_close(one, l1, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(two, l1 + 0.7 * l2, atol=1e-6, rtol=1e-5)
    assert stats["drafter/loss"] == pytest.approx(float(two.detach()), rel=1e-6)
    drafter.zero_grad()
    two.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    with pytest.raises(ValueError, match="unroll must be >= 1"):
        DrafterTrainConfig(unroll=0)


def test_subsampled_cross_entropy_is_an_unbiased_estimate_of_the_full_one():
    from dataclasses import replace

    from tltlib.drafting.pairs import PairBatch
    target, drafter = _pair()
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 12, target.config.hidden_size, generator=g)
    batch = PairBatch(h, torch.randint(0, target.config.vocab_size, (4, 12), generator=g),
                      torch.ones(4, 11, dtype=torch.bool))
    cfg = replace(DrafterTrainConfig(), hidden_weight=0.0, token_weight=1.0)
    with torch.no_grad():
        full = drafter_loss(drafter, batch, cfg)[0]
        assert torch.equal(full, drafter_loss(drafter, batch, replace(cfg, ce_positions=44))[0])   # all 44 pairs
        few = [drafter_loss(drafter, batch, replace(cfg, ce_positions=5), generator=torch.Generator().manual_seed(i))[0]
               for i in range(400)]
    assert len({float(x) for x in few}) > 50                     # really subsampled
    assert abs(float(torch.stack(few).mean()) / float(full) - 1) < 0.02


def test_train_drafter_refuses_long_prompts_and_a_drafter_of_another_shape(tmp_path):
    import shutil
    from pathlib import Path

    import pytest

    from tltlib.drafting.warmup import check_context, train_warm_drafter
    from tltlib.model.decoder import preset
    from tltlib.model.weights import save_model
    DATA = Path(__file__).resolve().parent.parent / "data"
    with pytest.raises(ValueError, match=r"data.jsonl: 2 of 3 prompts \(rows \[0, 2\]\) leave no room for a response "
                                         r"in "
                                         r"the context of m \(8 tokens.*longest prompt has 9\)"):
        check_context([[1] * 8, [1] * 3, [1] * 9], 8, "data.jsonl", "m")
    other = tmp_path / "wide"
    save_model(Transformer(preset("tiny-cpu", hidden_size=96, eos_token_ids=(2,))), other)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA / "tiny-reasoner" / f, other / f)
    with pytest.raises(ValueError, match="its hidden size is 192 but the target's is 96"):
        train_warm_drafter(other, tmp_path / "out", init=DATA / "tiny-reasoner-drafter", progress=False)
    assert not (tmp_path / "out").exists()


def test_the_full_vocabulary_loss_ignores_a_draft_vocabulary_and_accuracy_measures_its_proposals():
    """With ``ce_vocab="full"`` the loss (and its gradients) ignore the draft vocabulary: the drafter learns the
    target's whole distribution; depth accuracy measures what it would propose, so excluding tokens the target picks
    lowers it."""
    from tltlib.drafting.pairs import PairBatch
    target, drafter = _pair()
    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, 10, target.config.hidden_size, generator=g)
    batch = PairBatch(h, torch.randint(0, target.config.vocab_size, (3, 10), generator=g),
                      torch.ones(3, 9, dtype=torch.bool))
    cfg = DrafterTrainConfig(ce_vocab="full")
    out = []
    for ids in (None, torch.tensor([0, 1, 2, 3])):
        drafter.set_draft_vocab(ids)
        drafter.zero_grad()
        loss, _ = drafter_loss(drafter, batch, cfg)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in drafter.parameters()], depth_accuracy(drafter, batch, 2)))
    drafter.set_draft_vocab(None)
    (l0, g0, a0), (l1, g1, a1) = out
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert a1[0] < a0[0]


def test_the_draft_vocabulary_loss_is_the_cross_entropy_renormalised_over_it():
    """``ce_vocab="draft"`` (the default): the soft cross-entropy runs over the draft vocabulary against the target's
    distribution renormalised there, equal to a one-pass reference; head rows outside it change nothing; a bad value
    is refused."""
    import torch.nn.functional as F

    from tltlib.drafting.pairs import PairBatch
    target, drafter = _pair()
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 8, target.config.hidden_size, generator=g)
    batch = PairBatch(h, torch.randint(0, target.config.vocab_size, (2, 8), generator=g),
                      torch.rand(2, 7, generator=g) > 0.2)
    ids = torch.tensor([1, 4, 5, 9, 2])
    drafter.set_draft_vocab(ids)
    loss, stats = drafter_loss(drafter, batch, DrafterTrainConfig(), chunk=4)
    pred, _ = drafter(*batch.inputs)
    w = target.head_weight.detach()[drafter.draft_ids]
    p_t = torch.softmax(h[:, 1:] @ w.T, -1)                 # renormalised over the draft vocabulary
    m = batch.mask.float()
    ref = ((F.smooth_l1_loss(pred, h[:, 1:], reduction="none").mean(-1) * m).sum() + 0.1 * (
        -(p_t * torch.log_softmax(pred @ w.T, -1)).sum(-1) * m).sum()) / m.sum()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-5)
    assert loss != drafter_loss(drafter, batch, DrafterTrainConfig(ce_vocab="full"))[0]
    with torch.no_grad():
        target.head_weight[3] += 5.0                        # a token the drafter cannot propose
    assert torch.equal(loss, drafter_loss(drafter, batch, DrafterTrainConfig(), chunk=4)[0])
    with pytest.raises(ValueError, match="ce_vocab must be 'draft'"):
        DrafterTrainConfig(ce_vocab="all")


def test_train_drafter_with_a_draft_vocabulary(tmp_path):
    from tltlib.drafting.warmup import train_warm_drafter
    from tltlib.model.drafter import load_drafter
    from tltlib.model.weights import load_model
    card = train_warm_drafter("data/tiny-reasoner", tmp_path / "d", DrafterTrainConfig(steps=2, batch_sequences=2),
                              n_train=4, n_eval=2, n_accept=1, max_new_tokens=24, progress=False, draft_vocab=12)
    assert "a draft vocabulary of 1" in card and "of the held-out pairs' tokens" in card
    assert "soft CE over the draft vocabulary" in card and "tree-6x4-24: " in card
    d = load_drafter(tmp_path / "d", load_model("data/tiny-reasoner"))
    assert 12 <= d.config.draft_vocab_size <= 13 and 2 in d.draft_ids.tolist()      # the 12 most frequent + EOS
    card = train_warm_drafter("data/tiny-reasoner", tmp_path / "e", DrafterTrainConfig(steps=1, batch_sequences=2),
                              n_train=4, n_eval=2, n_accept=0, max_new_tokens=24, progress=False)
    assert "Accept lengths not measured" in card and "tokens per step" not in card
