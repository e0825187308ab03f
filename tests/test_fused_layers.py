"""Compiled decoder layers (:mod:`tltlib.model.fused`): the same tokens as the eager layers (greedy and SD, the
shipped tiny reasoner and its drafter), the same logits within float rounding, the eager layers refactored without
a change (bit-identical to the modules' maths), the switch and a failing compiler answered in one line each."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from tltlib.errors import BadInput
from tltlib.model import fused
from tltlib.model.decoder import _SEGMENTS, ModelConfig, Transformer, post_attention, pre_attention
from tltlib.model.loading import load
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.tasks.chain import ChainTaskConfig, generate_problems
from tltlib.tasks.prompts import encode_prompts


@pytest.fixture
def fresh_state(monkeypatch):
    """A process state without compiled segments or a recorded failure (restored after the test)."""
    monkeypatch.setattr(fused, "_STATE", {})
    return fused._STATE


@pytest.fixture(scope="module")
def reasoner():
    model, tok, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter")
    prompts = encode_prompts(generate_problems(ChainTaskConfig(), 3, seed=5), tok)
    return model, drafter, prompts


def test_compiled_layers_decode_the_same_tokens_plain_and_speculative(reasoner, fresh_state):
    """Greedy rollouts of the tiny reasoner, plain and chain-4 SD with its drafter (decode, verify and draft forwards
    all through the compiled segments): the same tokens as the eager layers; the first call compiled."""
    model, drafter, prompts = reasoner
    config = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=40), num_generations=2)
    for strategy in (None, "chain-4"):
        eager = RolloutEngine(model, config, drafter=drafter).generate(prompts, strategy=strategy)
        compiled = RolloutEngine(model, replace(config, compile_layers=True), drafter=drafter).generate(
            prompts, strategy=strategy)
        assert torch.equal(eager.tokens, compiled.tokens), strategy
    assert fresh_state.get("compiled") == {"pre", "pre-drafter", "post"} and fused.compile_seconds() > 0
    assert "unavailable" not in fresh_state


def test_compiled_segments_compute_the_eager_layer_within_rounding(fresh_state):
    """One layer's segments, compiled against eager, on random weights with biases (Qwen2's q/k/v bias), 1 and 5
    rows, one and three new tokens: equal within float32 rounding."""
    cfg = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                      architecture="qwen2")
    torch.manual_seed(0)
    layer = Transformer(cfg).layers[0]
    pre, post, lin = fused.compiled_segments()
    a, m = layer.attn, layer.mlp
    for rows, t in ((1, 1), (5, 1), (5, 3)):
        x = torch.randn(rows, t, 64)
        cos, sin = torch.randn(rows, t, 1, 16), torch.randn(rows, t, 1, 16)
        args = (x, layer.input_norm.weight, layer.eps, a.qkv.weight, a.qkv.bias, cos, sin, a.h, a.kvh, a.d)
        with torch.no_grad():
            for got, want in zip(pre(*args, lin=lin), pre_attention(*args)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            attn = torch.randn(rows, a.h, t, a.d)
            pargs = (x, attn, a.o.weight, a.o.bias, layer.post_norm.weight, layer.eps, m.gate_up.weight,
                     m.gate_up.bias, m.down.weight, m.down.bias)
            torch.testing.assert_close(post(*pargs, lin=lin), post_attention(*pargs), rtol=1e-5, atol=1e-5)


def test_the_refactored_eager_layer_is_the_modules_maths_bit_for_bit():
    """The layer's eager path (the segments with the dispatch's projections) against the maths written out with
    F.linear: bit-identical (the same ops in the same order; PyTorch's default kernels)."""
    import torch.nn.functional as F

    from tltlib.model.decoder import apply_rope, rms_norm
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


def test_training_forwards_never_use_the_compiled_segments(reasoner, fresh_state, monkeypatch):
    """Inside compiled_layers a training forward (no cache, autograd) still runs the eager layers."""
    model, _, _ = reasoner
    calls = []
    monkeypatch.setattr(fused, "compiled_segments", lambda: (lambda *a, **k: calls.append("pre"),
                                                             lambda *a, **k: calls.append("post"), None))
    with fused.compiled_layers():
        model(torch.tensor([[1, 5, 6, 7]]))
    assert calls == [] and _SEGMENTS.get() is None


@pytest.mark.parametrize("text, on", [("0", False), ("off", False), ("no", False), ("1", True), ("yes", True)])
def test_the_switch_reads_the_words_people_write(monkeypatch, text, on):
    monkeypatch.setenv(fused.ENV, text)
    assert fused.enabled() is on


def test_a_switch_setting_that_is_no_setting_is_one_clear_error(monkeypatch, fresh_state):
    monkeypatch.setenv(fused.ENV, "maybe")
    with pytest.raises(BadInput, match=r"TLTLIB_COMPILE='maybe': set it to 0 .* or 1"):
        fused.compiled_segments()


def test_switched_off_the_eager_layers_run(monkeypatch, fresh_state):
    monkeypatch.setenv(fused.ENV, "0")
    assert fused.compiled_segments() is None
    with fused.compiled_layers():
        assert _SEGMENTS.get() is None


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
    config = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=20), num_generations=1)
    eager = RolloutEngine(model, config).generate(prompts)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = RolloutEngine(model, replace(config, compile_layers=True)).generate(prompts)
    assert torch.equal(out.tokens, eager.tokens)
    lines = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(lines) == 1 and "torch.compile failed (RuntimeError: InvalidCxxCompiler" in lines[0]
    assert "TLTLIB_COMPILE=0" in lines[0] and "more lines" not in lines[0]
    assert fused.compiled_segments() is None
