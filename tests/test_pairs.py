"""The drafter's pair buffer: bounded in tokens, evicts whole sequences (old steps first), samples by age weight,
batches with the offline alignment, round-trips through its state dict."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tltlib.drafting.pairs import PairBuffer, PairBufferConfig, loss_mask

H = 4


def _stream(buf, prompts, group, lengths, step):
    """Stream one rollout: prompt pairs, then response pairs (hidden = owner id + position/100, token = position)."""
    pids, first = buf.begin(prompts, group, rl_step=step)
    for pid, p in zip(pids, prompts):
        t = torch.arange(len(p) - 1)
        buf.add(torch.full_like(t, pid), t, (pid + t[:, None] / 100.0).expand(-1, H).float(), t + 1)
    for j in range(max(lengths)):                      # one decode step: every running sequence emits a token
        seqs = torch.tensor([first + i for i, n in enumerate(lengths) if n > j])
        pos = torch.full_like(seqs, j)
        buf.add(seqs, pos, (seqs[:, None] + pos[:, None] / 100.0).expand(-1, H).float(), pos + 50)
    return first


def test_pairs_come_back_per_sequence_in_order_prompt_first():
    buf = PairBuffer(H)
    first = _stream(buf, [[1, 2, 3], [1]], 2, [4, 2, 1, 3], step=0)
    assert buf.sequences() == [first, first + 1, first + 2, first + 3]
    h, t, plen = buf.pairs_of(first + 1)
    assert plen == 3 and t.tolist() == [1, 2, 50, 51]                   # 2 prompt pairs, then 2 response pairs
    assert torch.allclose(h[:, 0], torch.tensor([-1.0, -0.99, first + 1, first + 1.01]))
    h, t, plen = buf.pairs_of(first + 2)                                 # a one-token prompt has no prompt pair
    assert plen == 1 and t.tolist() == [50]
    batch = buf.batch([first, first + 3])
    assert batch.hidden.shape == (2, 6, H) and batch.mask.shape == (2, 5)
    assert batch.mask[0].tolist() == loss_mask(7, 3, 5).tolist()
    assert batch.mask[1].tolist() == loss_mask(4, 1, 5).tolist()


def test_the_buffer_never_holds_more_than_its_bound_and_evicts_old_steps_first():
    buf = PairBuffer(H, PairBufferConfig(max_tokens=60, evict_slack=0.0, seed=1))
    old = _stream(buf, [[1, 2, 3, 4]], 4, [5, 5, 5, 5], step=0)         # 3 + 20 pairs
    new = _stream(buf, [[1, 2, 3]], 4, [6, 6, 6, 6], step=1)            # 2 + 24 pairs: 49 held
    assert buf.num_pairs == 49
    _stream(buf, [[1, 2]], 2, [10, 10], step=2)                         # 21 more: step 0 must go first
    assert buf.num_pairs <= 60
    held = buf.sequences()
    assert sum(old <= s < old + 4 for s in held) < 4                    # evictions came from the oldest step
    assert all(s in held for s in range(new, new + 4)) and any(s >= new + 4 for s in held)
    for s in held:                                                       # every survivor is complete
        h, t, plen = buf.pairs_of(s)
        assert t.numel() == plen - 1 + (5 if s < new else 6 if s < new + 4 else 10)


def test_a_rollout_larger_than_the_buffer_keeps_whole_sequences_of_every_length():
    lengths = [3, 40, 5, 35, 4, 30, 6, 45]
    kept_long = []
    for seed in range(20):
        buf = PairBuffer(H, PairBufferConfig(max_tokens=80, evict_slack=0.0, seed=seed))
        first = _stream(buf, [[1, 2]], 8, lengths, step=0)
        assert buf.num_pairs <= 80
        for s in buf.sequences():
            h, t, _ = buf.pairs_of(s)
            assert t.numel() == 1 + lengths[s - first]                   # whole: never cut in the middle
        kept_long.append(any(lengths[s - first] >= 30 for s in buf.sequences()))
    assert np.mean(kept_long) > 0.5                                      # the long tail is not systematically lost


def test_sampling_weights_decay_with_age():
    buf = PairBuffer(H, PairBufferConfig(decay=0.25, seed=0))
    a = _stream(buf, [[1, 2]], 1, [8], step=0)
    b = _stream(buf, [[1, 2]], 1, [8], step=1)
    assert buf.weights([a, b]).tolist() == [0.25, 1.0]
    picks = [int(buf.sample(1).tokens[0, 1]) for _ in range(400)]     # both have 9 pairs: one bucket
    firsts = [buf.sample(1).hidden[0, 1, 0].item() for _ in range(400)]
    share_new = np.mean([abs(f - b) < 0.5 for f in firsts])
    assert 0.7 < share_new < 0.9 and picks                               # expected 1 / 1.25 = 0.8


def test_state_dict_round_trip_continues_identically():
    buf = PairBuffer(H, PairBufferConfig(max_tokens=200, seed=3))
    _stream(buf, [[1, 2, 3]], 3, [5, 9, 2], step=0)
    other = PairBuffer(H, PairBufferConfig(max_tokens=200, seed=99))
    other.load_state_dict(buf.state_dict())
    x, y = buf.sample(2), other.sample(2)
    assert torch.equal(x.hidden, y.hidden) and torch.equal(x.mask, y.mask)
    assert _stream(buf, [[1, 2]], 2, [3, 3], step=1) == _stream(other, [[1, 2]], 2, [3, 3], step=1)
    assert buf.sequences() == other.sequences()
    with pytest.raises(ValueError, match="hidden size 4 cannot load into one of 8"):
        PairBuffer(8).load_state_dict(buf.state_dict())


def test_config_errors():
    with pytest.raises(ValueError, match="max_tokens must be >= 2"):
        PairBufferConfig(max_tokens=1)
    with pytest.raises(ValueError, match="decay must be in"):
        PairBufferConfig(decay=0.0)
    with pytest.raises(ValueError, match="holds no sequence yet"):
        PairBuffer(H).sample(2)


def test_sample_with_max_pairs_bounds_the_batch():
    from tltlib.drafting.pairs import PairBuffer
    buf = PairBuffer(4)
    g = torch.Generator().manual_seed(0)
    pids, first = buf.begin([[1, 2]], num_generations=6, rl_step=0)
    for s in range(first, first + 6):            # six sequences of 100 response pairs each (one length bucket)
        buf.add(torch.tensor([s] * 100), torch.arange(100), torch.randn(100, 4, generator=g), torch.ones(100).long())
    assert buf.sample(4).hidden.shape[0] == 4
    assert buf.sample(4, max_pairs=250).hidden.shape[0] == 2
    assert buf.sample(4, max_pairs=10).hidden.shape[0] == 1       # never empty
