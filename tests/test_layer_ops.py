"""A decoder layer's one-pass small ops on a CPU (tltlib.kernels.layer_ops): RMSNorm, the residual add with the norm
after it and SiLU-and-multiply compute PyTorch's functions up to float rounding on one thread and on several, the
greedy pick torch's argmax and log-softmax (NaN and infinities: torch's answer); they run in a CPU rollout and give
its tokens unchanged; autograd, torch.compile, other dtypes and strided inputs keep PyTorch's ops."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tltlib.kernels import layer_ops as L
from tltlib.model import decoder as D

pytestmark = pytest.mark.skipif(L._module() is None, reason="the CPU kernels cannot be built here")


@pytest.mark.parametrize("rows,width", [(1, 64), (3, 37), (16, 576), (200, 576)])   # 200 x 576 > SERIAL_FLOATS
def test_the_norms_equal_pytorch_up_to_rounding(rows, width):
    g = torch.Generator().manual_seed(rows)
    x, d = torch.randn(2, rows, width, generator=g).mul(3).unbind(0)
    w = torch.rand(width, generator=g) + 0.5
    torch.testing.assert_close(L.rms_norm(x, w, 1e-5), F.rms_norm(x, (width,), w, 1e-5), atol=2e-6, rtol=2e-6)
    h, s = L.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, x + d)                                         # the residual sum itself is exact
    torch.testing.assert_close(h, F.rms_norm(x + d, (width,), w, 1e-6), atol=2e-6, rtol=2e-6)
    tiny = torch.full((rows, width), 1e-4)                               # eps matters where the mean square is small
    torch.testing.assert_close(L.rms_norm(tiny, w, 1e-5), F.rms_norm(tiny, (width,), w, 1e-5), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 3, 70), (5, 1536 * 2), (64, 3072)])
def test_silu_and_mul_equals_pytorch_up_to_rounding(shape):
    gu = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 6
    gate, up = gu.split(shape[-1] // 2, dim=-1)
    got = L.silu_mul(gu)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert torch.equal(D.silu_and_mul(gu), got)                         # the decoder's activation takes it


@pytest.mark.parametrize("rows,vocab", [(1, 74), (1, 49152), (3, 1001), (5, 151936)])
def test_the_greedy_pick_is_torchs_argmax_and_log_softmax(rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=g) * 4
    x[0, vocab // 3] = x[0, vocab - 2] = x[0].max() + 1                  # a tie: the first index, as torch's
    x[-1, 7] = float("-inf")                                             # a masked-out token is simply improbable
    tok, logp = L.argmax_logprob(x)
    assert tok.dtype == torch.long and tok.tolist() == x.argmax(-1).tolist()
    assert tok[0] == vocab // 3
    want = torch.log_softmax(x, -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=1e-5)
    from tltlib.model.sampling import SamplingConfig, sample_from_logits
    got = sample_from_logits(x, SamplingConfig(temperature=0), None)     # greedy decoding takes it on a CPU
    assert torch.equal(got[0], tok) and torch.equal(got[1], logp)


def test_a_nan_or_an_infinite_logit_gets_torchs_answer_not_a_finite_guess():
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 17] = bad
        tok, logp = L.argmax_logprob(y)
        assert tok.tolist() == y.argmax(-1).tolist() and tok[1] == 17
        want = torch.log_softmax(y, -1).gather(-1, tok[:, None])[:, 0]
        assert torch.equal(logp.isnan(), want.isnan())
        torch.testing.assert_close(logp[~want.isnan()], want[~want.isnan()])
    assert torch.isnan(L.argmax_logprob(torch.full((1, 9), float("nan")))[1]).all()


def test_inputs_the_ops_cannot_take_are_one_clear_error_not_a_wrong_read():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="the gain has 7 values for rows of 8"):
        L.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="x, delta and the gain do not match"):
        L.add_rms_norm(x, torch.randn(3, 7), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="must hold gate and up, an even size"):
        L.silu_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensors"):
        L.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match=r"argmax_logprob: logits \[rows, V\] with V > 0"):
        L.argmax_logprob(torch.randn(2, 3, 4))
    with pytest.raises(RuntimeError, match=r"argmax_logprob: logits \[rows, V\] with V > 0"):
        L.argmax_logprob(torch.randn(2, 0))


def test_pytorch_keeps_autograd_compile_other_dtypes_and_strided_inputs(monkeypatch):
    x = torch.randn(4, 32)
    assert L.usable(x, x)
    assert not L.usable(x.t())                                           # strided
    assert not L.usable(x.bfloat16())
    p = torch.randn(4, 32, requires_grad=True)
    assert not L.usable(p) and L.usable(p.detach())
    with torch.no_grad():
        assert L.usable(p)                                               # nothing records under no_grad
    y = D.silu_and_mul(p)                                                # autograd: PyTorch's ops, gradient kept
    y.sum().backward()
    assert p.grad is not None and p.grad.abs().sum() > 0
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not L.usable(x)


def test_a_cpu_rollout_runs_them_and_gives_the_same_tokens(monkeypatch):
    """The shipped tiny reasoner, greedy and sampled (a rollout's default generator is seeded): the tokens with the
    one-pass ops equal those with PyTorch's (the ops ran: counted)."""
    from tltlib.model.loading import load
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems
    from tltlib.tasks.prompts import encode_prompts
    model, tok, _ = load("data/tiny-reasoner", None)
    prompts = encode_prompts(generate_problems(ChainTaskConfig(), 4, seed=2), tok)
    calls = {"rms_norm": 0, "add_rms_norm": 0, "silu_mul": 0, "argmax_logprob": 0}
    real = {name: getattr(L, name) for name in calls}

    def counting(name):
        def run(*a):
            calls[name] += 1
            return real[name](*a)
        return run
    for name in calls:
        monkeypatch.setattr(L, name, counting(name))
    for temperature in (0.0, 0.9):
        calls.update(dict.fromkeys(calls, 0))
        if temperature:
            del calls["argmax_logprob"]                                  # greedy decoding's pick only
        config = RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=40), num_generations=2)
        with monkeypatch.context() as off:
            off.setattr(L, "usable", lambda *t: False)
            want = RolloutEngine(model, config).generate(prompts).tokens
        assert sum(calls.values()) == 0
        got = RolloutEngine(model, config).generate(prompts).tokens
        assert torch.equal(got, want), temperature
        assert all(calls.values()), calls
