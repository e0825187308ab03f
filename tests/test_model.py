"""Our decoder against transformers: same logits (fp32 1e-4), full and incremental; loading, saving, errors."""
from __future__ import annotations

import json

import pytest
import torch

from tltlib.model.decoder import ModelConfig, Transformer, preset
from tltlib.model.weights import load_config, load_model, save_model


def _tokens(vocab=97, rows=3, length=40, seed=1):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_full_forward_matches_transformers(hf_checkpoint):
    hf, path = hf_checkpoint
    ours = load_model(path)
    x = _tokens()
    with torch.no_grad():
        ref = hf(x).logits
        got = ours(x)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_incremental_forward_matches_transformers(hf_checkpoint):
    hf, path = hf_checkpoint
    ours = load_model(path)
    x = _tokens()
    with torch.no_grad():
        ref = hf(x).logits
        cache = ours.new_cache(3, 64)
        outs = []
        for a, b in [(0, 7), (7, 8), (8, 20), *[(t, t + 1) for t in range(20, 40)]]:   # prefill, 1, chunk, 1s
            logits, _ = ours.forward_cached(x[:, a:b], cache)
            cache.advance(b - a)
            outs.append(logits)
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-4, rtol=0)


def test_hidden_states_are_transformers_last_hidden(hf_checkpoint):
    hf, path = hf_checkpoint
    ours = load_model(path)
    x = _tokens(length=12)
    with torch.no_grad():
        ref = hf(x, output_hidden_states=True).hidden_states[-1]
        _, hidden = ours(x, return_hidden=True)
    torch.testing.assert_close(hidden, ref, atol=1e-5, rtol=0)


def test_sharded_checkpoint_loads(tmp_path):
    from conftest import make_hf_model
    hf = make_hf_model("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path)
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-4, rtol=0)


def test_bf16_load_runs_close_to_transformers_bf16(tmp_path):
    from conftest import make_hf_model
    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    assert ours.embed.weight.dtype == torch.bfloat16
    x = _tokens()
    with torch.no_grad():
        ref = hf.to(torch.bfloat16)(x).logits.float()
        got = ours(x).float()
        cache = ours.new_cache(3, 48)
        inc, _ = ours.forward_cached(x, cache)
    scale = ref.abs().max()
    assert (got - ref).abs().max() < 0.03 * scale
    assert (inc.float() - got).abs().max() < 0.03 * scale


def test_save_model_roundtrips_through_transformers(tmp_path):
    from transformers import AutoModelForCausalLM
    cfg = preset("tiny-cpu", vocab_size=50, num_layers=2, hidden_size=64, intermediate_size=96, num_heads=4,
                 num_kv_heads=2, eos_token_ids=(2,))
    torch.manual_seed(0)
    ours = Transformer(cfg)
    save_model(ours, tmp_path / "m", extra_files={"README.md": "card"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    x = _tokens(vocab=50)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-4, rtol=0)
    assert (tmp_path / "m" / "README.md").read_text() == "card"
    # saving again over an existing folder keeps files we do not write and leaves no temporary folder
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    save_model(ours, tmp_path / "m")
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_training_forward_gradients_flow():
    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      architecture="qwen2")
    torch.manual_seed(0)
    model = Transformer(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _tokens(vocab=40, length=16)
    loss = torch.nn.functional.cross_entropy(model(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    opt.step()
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not change"


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*config.json"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_model(tmp_path)


def test_unsupported_architecture_says_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="gpt2.*supports Llama.*Qwen2"):
        load_config(tmp_path)


def test_missing_weights_is_a_clear_error(tmp_path):
    cfg = preset("tiny-cpu", num_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_config_errors_and_presets():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2,
                    rope_scaling=(("rope_type", "yarn"),))
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        preset("nope")
    assert preset("qwen2.5-7b").num_parameters == pytest.approx(7.6e9, rel=0.02)
    assert preset("llama-3.3-70b").num_parameters == pytest.approx(70.6e9, rel=0.02)


# ------------------------------------------------------------------ strict loading: nothing silently different
TINY = "data/tiny-reasoner"


def _copy_checkpoint(tmp_path, edit=None, tensors=None):
    """A copy of the shipped tiny reasoner with config.json edited by ``edit(dict)`` and/or tensors replaced."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    src = Path(__file__).resolve().parent.parent / TINY
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    if edit:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_unsupported_activation_is_refused(hf_checkpoint, tmp_path, act):
    _, path = hf_checkpoint
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_act"] = act
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"config.json: hidden_act '{act}' is not implemented"):
        load_config(tmp_path)


def test_swish_is_silu_and_loads(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint
    cfg = json.loads((path / "config.json").read_text())
    assert load_config(path).architecture in ("llama", "qwen2")
    cfg["hidden_act"] = "swish"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load_config(tmp_path)


@pytest.mark.parametrize("field,value,match", [
    ("quantization_config", {"quant_method": "gptq"}, "quantised \\(gptq\\)"),
    ("architectures", ["LlamaForSequenceClassification"], "not a causal LM"),
    ("layer_types", ["full_attention", "sliding_attention"], "only full attention"),
])
def test_config_fields_that_change_the_maths_are_refused(tmp_path, field, value, match):
    path = _copy_checkpoint(tmp_path, lambda c: c.update({field: value}))
    with pytest.raises(ValueError, match=match):
        load_model(path)


def test_fewer_layers_in_config_than_in_weights_is_refused(tmp_path):
    path = _copy_checkpoint(tmp_path, lambda c: c.update(num_hidden_layers=6))
    with pytest.raises(ValueError, match="hold 18 tensors the config does not use.*"
                                         "The weights hold 8 layers but config.json's num_hidden_layers is 6"):
        load_model(path)


def test_more_layers_in_config_than_in_weights_is_refused(tmp_path):
    path = _copy_checkpoint(tmp_path, lambda c: c.update(num_hidden_layers=9))
    with pytest.raises(ValueError, match="lack 9 tensors the config needs \\(model.layers.8"):
        load_model(path)


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path):
    path = _copy_checkpoint(tmp_path / "a", tensors=lambda s: s.pop("model.norm.weight"))
    with pytest.raises(ValueError, match="lack 1 tensors the config needs \\(model.norm.weight\\)"):
        load_model(path)
    path = _copy_checkpoint(tmp_path / "b", tensors=lambda s: s.update({"score.weight": torch.zeros(2, 192)}))
    with pytest.raises(ValueError, match="1 tensors the config does not use \\(score.weight\\)"):
        load_model(path)
    path = _copy_checkpoint(tmp_path / "c", lambda c: c.update(intermediate_size=256))
    with pytest.raises(ValueError, match="do not have the shape.*mlp.down_proj.weight is \\[192, 512\\], "
                                         "expected \\[192, 256\\]"):
        load_model(path)


def test_stale_rotary_buffers_are_ignored_and_tied_head_checked(tmp_path):
    def add(s):
        s["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
        s["lm_head.weight"] = s["model.embed_tokens.weight"].clone()
    ref = load_model(TINY)
    got = load_model(_copy_checkpoint(tmp_path / "a", tensors=add))
    assert torch.equal(got.head_weight, ref.head_weight)
    path = _copy_checkpoint(tmp_path / "b", tensors=lambda s: s.update(
        {"lm_head.weight": s["model.embed_tokens.weight"] + 1}))
    with pytest.raises(ValueError, match="ties the LM head.*set tie_word_embeddings to false"):
        load_model(path)


def test_non_finite_weights_are_refused_at_load(tmp_path):
    def poison(s):
        s["model.layers.3.mlp.up_proj.weight"][5, 7] = float("nan")
        s["model.layers.3.mlp.up_proj.weight"][0, 0] = float("inf")
    path = _copy_checkpoint(tmp_path, tensors=poison)
    with pytest.raises(ValueError, match="tensor model.layers.3.mlp.up_proj.weight holds 2 non-finite values"):
        load_model(path)


def test_broken_files_are_named(tmp_path):
    path = _copy_checkpoint(tmp_path / "a")
    (path / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": 8,,\n}')
    with pytest.raises(ValueError, match="ckpt/config.json is not valid JSON .*line 2 column 20"):
        load_model(path)
    path = _copy_checkpoint(tmp_path / "b")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="ckpt/model.safetensors is not a readable safetensors file.*corrupt"):
        load_model(path)
    path = _copy_checkpoint(tmp_path / "c", lambda c: c.pop("hidden_size"))
    with pytest.raises(ValueError, match="config.json lacks \\['hidden_size'\\]"):
        load_model(path)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(vocab_size="74"), "vocab_size must be an integer, got '74' \\(str\\)"),
    (lambda c: c.update(num_hidden_layers=8.0), "num_hidden_layers must be an integer, got 8.0"),
    (lambda c: c.update(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (lambda c: c.update(rope_scaling={"rope_type": "linear"}), "rope_type 'linear' needs a numeric 'factor'"),
    (lambda c: c.update(rope_theta=500000.0), "rope_theta is 500000.0 at the top level but 10000.0 in "
                                              "rope_parameters"),
])
def test_config_values_of_the_wrong_type_or_conflicting_are_named(tmp_path, edit, match):
    with pytest.raises(ValueError, match="config.json: " + match):
        load_model(_copy_checkpoint(tmp_path, edit))


def test_weights_that_overflow_the_load_dtype_are_refused(tmp_path):
    def big(s):
        s["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e6
    path = _copy_checkpoint(tmp_path, tensors=big)
    load_model(path)                                               # fine in float32
    with pytest.raises(ValueError, match="after conversion to float16.*model.layers.0.mlp.up_proj.weight holds 1 "
                                         "non-finite"):
        load_model(path, dtype=torch.float16)


def test_single_file_beside_a_shard_index_is_ambiguous(tmp_path):
    path = _copy_checkpoint(tmp_path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
        load_model(path)


def test_the_one_loader_resolves_paths_and_checks_device_and_dtype():
    from tltlib.model.loading import load
    from tltlib.model.weights import parse_dtype, pick_device
    model, tok, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter", device="cpu", dtype="float32")
    assert drafter.is_attached_to(model) and tok.eos_token_id in model.config.eos_token_ids
    assert model.device.type == "cpu" and load("data/tiny-reasoner").drafter is None
    assert pick_device("auto") in ("cpu", "cuda") and parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'bf16'; use one of float32, bfloat16, float16"):
        parse_dtype("bf16")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        pick_device("gpu")


def test_casting_keeps_the_rotary_frequencies_float32():
    from tltlib.model.decoder import rope_inv_freq
    from tltlib.model.drafter import Drafter, DrafterConfig
    cfg = preset("tiny-cpu")
    for m in (Transformer(cfg).to(torch.bfloat16), Drafter(DrafterConfig.from_target(cfg)).bfloat16()):
        assert m.inv_freq.dtype == torch.float32 and torch.equal(m.inv_freq, rope_inv_freq(cfg))
        assert m.fc.weight.dtype == torch.bfloat16 if isinstance(m, Drafter) else m.embed.weight.dtype == torch.bfloat16


def test_a_cached_forwards_rotary_table_holds_rope_cos_sin_exactly():
    """The CPU's cached forwards read cos and sin from a table: the values rope_cos_sin computes, at positions past
    the table's first end (it grows) and after a cast (a new table in the weights' dtype)."""
    from tltlib.model.decoder import rope_cos_sin
    m = Transformer(preset("tiny-cpu"))
    for dtype, top in ((torch.float32, 9), (torch.float32, 700), (torch.bfloat16, 700), (torch.float32, 3000)):
        m = m.to(dtype)
        pos = torch.randint(0, top, (3, 5), generator=torch.Generator().manual_seed(top))
        got = m._rope_cached(pos, top)
        want = rope_cos_sin(m.inv_freq, pos, dtype)
        assert all(g.dtype == dtype and g.shape == (3, 5, 1, 32) and torch.equal(g, w) for g, w in zip(got, want))
        assert m._rope_table[2].shape[0] >= top
    tokens, cache = torch.tensor([[5, 6, 7], [8, 9, 10]]), m.new_cache(2, 64)
    with torch.no_grad():                                  # a cached forward reads it: the training forward's logits
        torch.testing.assert_close(m.forward_cached(tokens, cache)[0], m(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [1, 5])
def test_gqa_sdpa_equals_repeated_kv_attention(t):
    from tltlib.kernels.dispatch import gqa_sdpa
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in ((3, 6, t, 8), (3, 2, 11, 8), (3, 2, 11, 8)))
    mask = torch.rand(3, 1, t, 11, generator=g) > 0.3
    mask[..., 0] = True
    for m in (mask, None):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        torch.testing.assert_close(gqa_sdpa(q, k, v, m), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [(7,), (1, 7), (2, 7), (3, 5, 7), (4, 1, 7), (2, 40, 7)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", [None, "linear", "mm", "mm-pad"])
def test_linear_equals_f_linear_and_keeps_autograd(shape, bias, kind, monkeypatch):
    import tltlib.kernels.dispatch as tm
    from tltlib.kernels import table as kt
    from tltlib.kernels.dispatch import linear
    g = torch.Generator().manual_seed(0)
    w = torch.randn(11, 7, generator=g)
    b = torch.randn(11, generator=g) if bias else None
    x = torch.randn(*shape, generator=g)
    want = torch.nn.functional.linear(x, w, b)
    table = kt.Forced(linear=kind) if kind else None        # None: this machine's table
    with torch.inference_mode(), kt.using(table if table is not None else kt.current()):
        if kind in ("mm", "mm-pad"):                        # the table's kernel is the one taken
            with monkeypatch.context() as mp:
                mp.setattr(tm.F, "linear", lambda *a: pytest.fail("F.linear used where the table says " + kind))
                linear(x, w, b)
        got = linear(x, w, b)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # a non-contiguous input (a slice of the last dim) gives the same
        wide = torch.cat([x, x], -1)[..., :7]
        torch.testing.assert_close(linear(wide, w, b), want, atol=1e-5, rtol=1e-5)
    # under autograd the gradient reaches both the input and the weight, equal to F.linear's
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    linear(xg, wg, b).square().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.linear(xr, wr, b).square().sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)
    torch.testing.assert_close(wg.grad, wr.grad)


def test_integer_weights_are_refused_as_a_quantised_model(tmp_path):
    """A cast would turn int8 weights into a model of raw integers, whose training then diverges."""
    def int8(state):
        w = state["model.layers.2.self_attn.q_proj.weight"]
        state["model.layers.2.self_attn.q_proj.weight"] = (w * 100).round().clamp(-127, 127).to(torch.int8)
    path = _copy_checkpoint(tmp_path, tensors=int8)
    with pytest.raises(ValueError, match="1 weight tensors are not floating point "
                                         "\\(model.layers.2.self_attn.q_proj.weight is int8\\): "
                                         "the model is quantised"):
        load_model(path)
