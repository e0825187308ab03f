"""Packed weights (tltlib.kernels.dispatch.WeightPacks): on a CPU in float32 a rollout's projections run through oneDNN
with the weights laid out once, where the machine's kernel table picks them (forced here: tltlib.kernels.table.Forced).
They must compute what F.linear computes, give the same tokens as an unpacked rollout (greedy, Qwen2 with q/k/v
biases and Llama), follow weight updates between rollouts (optimizer steps, ``.data`` writes, a reloaded model) and
refuse a weight changed during a rollout."""
from __future__ import annotations

import pytest
import torch

import tltlib.kernels.dispatch as K
from conftest import make_hf_model
from tltlib.kernels import table as kt
from tltlib.model.sampling import SamplingConfig
from tltlib.model.weights import load_model
from tltlib.rollout.engine import RolloutConfig, RolloutEngine

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


@pytest.fixture(autouse=True, params=["packed", "mkl-packed"])
def packed_wherever_it_can_run(request):
    """A packed kernel (oneDNN's, MKL's) wherever a packed copy is at hand (PyTorch's default elsewhere), whatever
    this CPU's table would pick."""
    if request.param == "mkl-packed" and not K.mkl_packing_available():
        pytest.skip("no MKL in this torch build")
    with kt.using(kt.Forced(linear=request.param)):
        yield request.param


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def target(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param).save_pretrained(path)
    return load_model(path)


def _prompts(n=6):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 97, (int(k),), generator=g).tolist() for k in torch.randint(2, 9, (n,), generator=g)]


def _engine(model, packed: bool, **kw):
    return RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=24), ignore_eos=True,
                                              packed_weights=packed, **kw))


@pytest.mark.parametrize("rows", [3, 17, 300])
def test_a_packed_projection_equals_f_linear_and_is_used_where_the_table_picks_it(rows, monkeypatch,
                                                                                 packed_wherever_it_can_run):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(40, 24)
    x = torch.randn(rows, 40, generator=g)
    packs = K.pack_weights(lin)
    assert set(packs) == {id(lin.weight)}                       # the bias is not a matrix: not packed
    with torch.inference_mode(), K.packed_weights(packs):
        monkeypatch.setattr(torch, "mm", lambda *a: pytest.fail("weight @ x.T used although the weight is packed"))
        got = K.linear(x.view(1, rows, 40), lin.weight, lin.bias)
    torch.testing.assert_close(got.view(rows, 24), torch.nn.functional.linear(x, lin.weight, lin.bias),
                               atol=1e-5, rtol=1e-5)
    entry = packs[id(lin.weight)]                               # the copy of the kernel picked, and only that one
    assert (entry._onednn is not None, entry._mkl is not None) == (
        (True, False) if packed_wherever_it_can_run == "packed" else (False, True))


def test_a_packed_rollout_gives_the_unpacked_tokens(target):
    ps = _prompts()
    plain = _engine(target, False).generate(ps)
    packed_engine = _engine(target, True, num_generations=2)
    assert torch.equal(packed_engine.generate(ps).tokens[::2], plain.tokens)
    packs = packed_engine.kept.packs.packs
    assert packs, "a CPU float32 rollout made no packed weights"
    assert (id(target.embed.weight) in packs) == (target.lm_head is None)     # an untied embedding is not packed


def test_packs_follow_weight_updates_between_rollouts(target):
    ps = _prompts()
    eng = _engine(target, True)
    eng.generate(ps)
    w = target.layers[0].mlp.down.weight
    saved = w.detach().clone()
    try:
        for update in (lambda: w.data.copy_(w.data.flip(0)),                 # bypasses the version counter
                       lambda: w.data[5].mul_(-3.0),                         # one row, through .data
                       lambda: torch.optim.SGD([w], lr=5.0).step()):         # an optimizer step
            w.grad = torch.randn_like(w)
            update()
            assert torch.equal(eng.generate(ps).tokens, _engine(target, False).generate(ps).tokens)
    finally:
        with torch.no_grad():
            w.copy_(saved)
        w.grad = None


def test_a_weight_changed_during_a_rollout_is_refused(target):
    eng = _engine(target, True)
    w = target.layers[1].attn.o.weight

    def bump(rollout):
        if rollout.iteration == 3:
            with torch.no_grad():
                w.mul_(1.0)                              # any in-place update moves the version counter
    with pytest.raises(RuntimeError, match="changed in place after it was packed"):
        eng.start(_prompts(), hooks=[bump]).finish()


def test_release_drops_the_packed_copies(target):
    eng = _engine(target, True)
    eng.generate(_prompts())
    eng.release()
    assert eng.kept.packs.packs == {}


def test_engines_over_one_model_share_one_packed_copy(target):
    """Two engines over one model (the bench's with and without a drafter) use one packed copy of its weights,
    and the registry does not keep a model alive."""
    import gc
    a, b = _engine(target, True), _engine(target, True)
    a.generate(_prompts())
    assert b.kept.weight_packs() is a.kept.packs.packs and a.kept.packs is b.kept.packs
    other = make_hf_model("llama")
    gc.collect()                                   # entries of models other tests dropped leave first
    n = len(K.WeightPacks._shared)
    K.WeightPacks.of(other)
    assert len(K.WeightPacks._shared) == n + 1
    del other
    gc.collect()
    assert len(K.WeightPacks._shared) == n


def test_the_fingerprints_products_are_the_weights_times_the_probe_by_the_stream_kernel_where_built(monkeypatch):
    """WeightPacks' fingerprint reads every weight once per rollout through the ``stream`` projection (``_stream``, one
    row: ~2x torch.mv's rate where the kernel is built), F.linear otherwise and for a weight that is not contiguous;
    either way weight @ probe, and the same weights give the same bits."""
    g = torch.Generator().manual_seed(0)
    w, v = torch.randn(300, 203, generator=g), torch.rand(203, generator=g) + 0.5
    want = torch.mv(w, v)
    times = lambda weight: K._stream(v[None], weight, None, None, 1)[0]
    torch.testing.assert_close(times(w), want, atol=1e-4, rtol=1e-5)
    assert torch.equal(times(w), times(w.clone()))
    torch.testing.assert_close(times(w.T.contiguous().T), want, atol=1e-4, rtol=1e-5)   # a view
    calls = []
    module = K.ragged_kernel()
    if module is not None:
        class Spy:
            def stream_linear(self, *a):
                calls.append(a[1].shape)
                return module.stream_linear(*a)
        monkeypatch.setattr(K, "ragged_kernel", lambda: Spy())
        times(w)
        times(w.T.contiguous().T)                                         # not contiguous: F.linear
        layer = torch.nn.Linear(203, 300, bias=False)
        K.WeightPacks(layer)._fingerprint()                               # the fingerprint goes this way
        assert calls == [w.shape, w.shape]
    monkeypatch.setattr(K, "ragged_kernel", lambda: None)
    assert torch.equal(times(w), torch.nn.functional.linear(v[None], w)[0])
