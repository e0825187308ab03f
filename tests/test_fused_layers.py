"""Compiled decoder layers (:mod:`tltlib.model.fused`): the same tokens as the eager layers (greedy and SD, the
shipped tiny reasoner and its drafter), the same logits within float rounding, weights updated in place seen without
a recompile, the eager layers refactored without a change (bit-identical to the modules' maths), the switch, a
failing compiler and a compile cache of another torch version answered in one line each."""
from __future__ import annotations

import warnings
import weakref
from dataclasses import replace

import pytest
import torch

from tltlib.errors import BadInput
from tltlib.model import fused
from tltlib.model.decoder import _STACK, ModelConfig, Transformer
from tltlib.model.loading import load
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.tasks.chain import ChainTaskConfig, generate_problems
from tltlib.tasks.prompts import encode_prompts


@pytest.fixture
def fresh_state(monkeypatch):
    """A process state without a recorded failure or compiled families (restored after the test; the custom ops,
    registered once per process, and each model's compiled stack stay)."""
    state = {k: v for k, v in fused._STATE.items() if k == "ops"}
    monkeypatch.setattr(fused, "_STATE", state)
    return state


@pytest.fixture(scope="module")
def reasoner():
    model, tok, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter")
    prompts = encode_prompts(generate_problems(ChainTaskConfig(), 3, seed=5), tok)
    return model, drafter, prompts


@pytest.mark.long
def test_compiled_layers_decode_the_same_tokens_plain_and_speculative(reasoner, fresh_state):
    """Greedy rollouts of the tiny reasoner, plain and chain-4 SD with its drafter (decode and verify forwards through
    the compiled stack, the drafter's eager): the same tokens as the eager layers; the first calls compiled."""
    model, drafter, prompts = reasoner
    config = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=40), num_generations=2)
    for strategy in (None, "chain-4"):
        eager = RolloutEngine(model, config, drafter=drafter).generate(prompts, strategy=strategy)
        compiled = RolloutEngine(model, replace(config, compile_layers=True), drafter=drafter).generate(
            prompts, strategy=strategy)
        assert torch.equal(eager.tokens, compiled.tokens), strategy
    families = {f[1:] for f in fresh_state.get("compiled", ())}
    assert (False, True) in families and (False, False) in families and fused.compile_seconds() > 0
    assert "unavailable" not in fresh_state


def _cached_logits(model, tokens, steps):
    """Logits of a prefill of ``tokens`` then ``steps`` one-token forwards (each feeding back the argmax)."""
    cache = model.new_cache(tokens.shape[0], tokens.shape[1] + steps + 4)
    out = []
    logits, _ = model.forward_cached(tokens, cache)
    cache.advance(tokens.shape[1])
    out.append(logits[:, -1])
    for _ in range(steps):
        logits, _ = model.forward_cached(out[-1].argmax(-1)[:, None], cache)
        cache.advance(1)
        out.append(logits[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize("rows", [1, 5])
def test_the_compiled_stack_computes_the_eager_forward_within_rounding(fresh_state, rows):
    """A random Qwen2-style model (q/k/v biases) through a cache: prefill of three tokens, then one-token forwards;
    compiled against eager, equal within float32 rounding; then a weight changed in place (as an optimizer step
    does) is used by the compiled stack at once, without a recompile."""
    cfg = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      architecture="qwen2")
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, 50, (rows, 3))
    with torch.no_grad():
        want = _cached_logits(model, tokens, 3)
        with fused.compiled_layers():
            got = _cached_logits(model, tokens, 3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        model.layers[1].mlp.down.weight.mul_(-2.0)
        model.layers[0].attn.qkv.bias.add_(0.5)
        want = _cached_logits(model, tokens, 3)
        with fused.compiled_layers(), torch._dynamo.config.patch(error_on_recompile=True):
            got = _cached_logits(model, tokens, 3)           # the same graphs (a recompile raises), the new weights
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_refactored_eager_layer_is_the_modules_maths_bit_for_bit(monkeypatch):
    """The layer's eager path (the segments with the dispatch's projections) against the maths written out with
    F.linear: bit-identical with PyTorch's small ops (the same ops in the same order; PyTorch's default kernels),
    equal up to float rounding with the CPU's one-pass small ops (tltlib.kernels.layer_ops)."""
    import torch.nn.functional as F

    from tltlib.kernels import layer_ops
    from tltlib.model.decoder import apply_rope, rms_norm
    with_ops = layer_ops.usable(torch.zeros(1))
    monkeypatch.setattr(layer_ops, "usable", lambda *t: False)
    cfg = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2)
    torch.manual_seed(1)
    layer = Transformer(cfg).layers[0]
    x = torch.randn(2, 7, 64)
    pos = torch.arange(7).expand(2, 7)
    from tltlib.model.decoder import rope_cos_sin, rope_inv_freq
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), pos, torch.float32)
    with torch.no_grad():
        got = layer(x, cos, sin)
        a, m = layer.attn, layer.mlp
        qkv = F.linear(rms_norm(x, layer.input_norm.weight, layer.eps), a.qkv.weight).view(2, 7, 8, 16)
        qk = apply_rope(qkv[:, :, :6], cos, sin)
        out = F.scaled_dot_product_attention(qk[:, :, :4].transpose(1, 2), qk[:, :, 4:].transpose(1, 2),
                                             qkv[:, :, 6:].transpose(1, 2), is_causal=True, enable_gqa=True)
        h = x + F.linear(out.transpose(1, 2).reshape(2, 7, 64), a.o.weight)
        gate, up = F.linear(rms_norm(h, layer.post_norm.weight, layer.eps), m.gate_up.weight).split(96, -1)
        want = h + F.linear(F.silu(gate) * up, m.down.weight)
    assert torch.equal(got, want)
    if with_ops:
        monkeypatch.undo()
        with torch.no_grad():
            torch.testing.assert_close(layer(x, cos, sin), want, atol=1e-5, rtol=1e-5)


def test_training_forwards_never_use_the_compiled_stack(reasoner, fresh_state, monkeypatch):
    """Inside compiled_layers a training forward (no cache, autograd) still runs the eager layers."""
    model, _, _ = reasoner
    calls = []
    monkeypatch.setattr(fused, "compiled_stack", lambda: lambda *a: calls.append("stack"))
    with fused.compiled_layers():
        model(torch.tensor([[1, 5, 6, 7]]))
    assert calls == [] and _STACK.get() is None


@pytest.mark.parametrize("text, on", [("0", False), ("off", False), ("no", False), ("1", True), ("yes", True)])
def test_the_switch_reads_the_words_people_write(monkeypatch, text, on):
    monkeypatch.setenv(fused.ENV, text)
    assert fused.enabled() is on


def test_a_switch_setting_that_is_no_setting_is_one_clear_error(monkeypatch, fresh_state):
    monkeypatch.setenv(fused.ENV, "maybe")
    with pytest.raises(BadInput, match=r"TLTLIB_COMPILE='maybe': set it to 0 .* or 1"):
        fused.compiled_stack()


def test_switched_off_the_eager_layers_run(monkeypatch, fresh_state):
    monkeypatch.setenv(fused.ENV, "0")
    assert fused.compiled_stack() is None
    with fused.compiled_layers():
        assert _STACK.get() is None


def test_a_compiler_that_fails_is_one_warning_and_the_eager_layers(reasoner, fresh_state, monkeypatch):
    """torch.compile failing on this machine (no C++ compiler, an Inductor error): one RuntimeWarning naming the
    failure and the switch, the rollout finishes with the eager layers' tokens, and no further compile is tried."""
    import torch as torch_module
    model, _, prompts = reasoner

    def broken(fn, dynamic):
        def call(*a, **k):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore lines")
        return call

    monkeypatch.setattr(torch_module, "compile", broken)
    monkeypatch.setattr(fused, "_COMPILED", weakref.WeakKeyDictionary())     # the model compiles anew
    config = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=20), num_generations=1)
    eager = RolloutEngine(model, config).generate(prompts)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = RolloutEngine(model, replace(config, compile_layers=True)).generate(prompts)
    assert torch.equal(out.tokens, eager.tokens)
    lines = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(lines) == 1 and "torch.compile failed (RuntimeError: InvalidCxxCompiler" in lines[0]
    assert "TLTLIB_COMPILE=0" in lines[0] and "more lines" not in lines[0]
    assert fused.compiled_stack() is None


def _quiet_cache_folder(folder, **kw):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused.cache_folder(folder, **kw)
    return [str(w.message) for w in seen]


def test_a_compile_cache_of_another_torch_version_is_cleared_with_one_line(tmp_path):
    """tltlib's own cache folder stamped by another torch: one warning naming both versions, the old entries gone,
    the folder stamped with this torch; the next call is silent. A fresh folder is stamped silently."""
    folder = tmp_path / "inductor"
    assert _quiet_cache_folder(folder, version="2.13.0+cpu", own=True) == []
    assert (folder / "torch-version").read_text().strip() == "2.13.0+cpu"
    (folder / "fxgraph").mkdir()
    (folder / "fxgraph" / "entry").write_text("compiled by 2.13")
    lines = _quiet_cache_folder(folder, version="2.14.0+cpu", own=True)
    assert len(lines) == 1 and "made by torch 2.13.0+cpu, this is torch 2.14.0+cpu: cleared" in lines[0]
    assert not (folder / "fxgraph").exists() and (folder / "torch-version").read_text().strip() == "2.14.0+cpu"
    assert _quiet_cache_folder(folder, version="2.14.0+cpu", own=True) == []


def test_a_users_compile_cache_of_another_version_is_left_in_place(tmp_path):
    """A folder the user named (TORCHINDUCTOR_CACHE_DIR) with entries and no stamp, or another version's stamp: one
    warning that its entries are not used, nothing deleted, stamped for this torch."""
    folder = tmp_path / "mine"
    (folder / "fxgraph").mkdir(parents=True)
    lines = _quiet_cache_folder(folder, version="2.13.0+cpu", own=False)
    assert len(lines) == 1 and "made by torch (unknown)" in lines[0] and "its entries are not used" in lines[0]
    assert (folder / "fxgraph").is_dir() and (folder / "torch-version").read_text().strip() == "2.13.0+cpu"


def test_a_refusal_inside_the_compiled_stack_is_raised_not_taken_for_a_compiler_failure(fresh_state, monkeypatch):
    """A refusal of ours raised by an opaque call (a stale packed weight, a full cache) reaches the caller as it is:
    no warning, compilation stays on."""
    from tltlib.errors import Refused
    cfg = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()

    def refuse(*a, **k):
        raise Refused("a weight changed in place after it was packed for this rollout")

    monkeypatch.setattr(fused, "linear", refuse)
    with torch.no_grad(), fused.compiled_layers(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(Refused, match="changed in place"):
            model.forward_cached(torch.tensor([[1, 2, 3]]), model.new_cache(1, 8))
    assert "unavailable" not in fresh_state
