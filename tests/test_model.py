"""Our decoder against transformers: same logits (fp32 1e-4), full and incremental; loading, saving, errors."""
from __future__ import annotations

import json

import pytest
import torch

from tltlib.model import ModelConfig, Transformer, load_config, load_model, preset, save_model


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
