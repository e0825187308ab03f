"""The EAGLE drafter: shared frozen tensors, cached = full forward, save/load, vLLM export, clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.drafter import (
    Drafter,
    DrafterConfig,
    export_vllm_eagle,
    frequent_tokens,
    load_drafter,
    load_vllm_eagle,
    save_drafter,
)

CFG = ModelConfig(vocab_size=30, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,))


@pytest.fixture()
def pair():
    torch.manual_seed(0)
    target = Transformer(CFG, init_std=0.3).eval()
    drafter = Drafter(DrafterConfig.from_target(CFG), init_std=0.3).eval().attach(target)
    return target, drafter


def _inputs(n=2, t=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, t, CFG.hidden_size, generator=g), torch.randint(0, CFG.vocab_size, (n, t), generator=g)


def test_embedding_and_head_are_the_targets_and_never_saved(pair, tmp_path):
    target, drafter = pair
    names = set(drafter.state_dict())
    assert all(n.startswith(("fc.", "layer.")) for n in names), names
    assert not any("embed" in n or "head" in n for n in names)
    assert "layer.input_norm.weight" not in names                     # EAGLE: no input norm
    h, x = _inputs()
    before = drafter(h, x)[1]
    with torch.no_grad():
        target.embed.weight.add_(0.5)                                  # tied head: a policy update ...
    assert not torch.allclose(drafter(h, x)[1], before)               # ... is seen at once
    before_t = [p.clone() for p in target.parameters()]
    loss = drafter(h, x)[1].square().mean()
    loss.backward()
    assert all(p.grad is None for p in target.parameters())           # frozen: no gradient reaches the target
    assert all(torch.equal(a, b) for a, b in zip(before_t, target.parameters()))


def test_cached_forward_equals_training_forward(pair):
    _, drafter = pair
    h, x = _inputs(t=10)
    with torch.no_grad():
        full_h, full_logits = drafter(h, x)
        cache = drafter.new_cache(2, 16)
        lg, out = drafter.forward_cached(h[:, :6], x[:, :6], cache)
        cache.advance(6)
        outs, logits = [out], [lg]
        for t in range(6, 10):
            lg, out = drafter.forward_cached(h[:, t:t + 1], x[:, t:t + 1], cache)
            cache.advance(1)
            outs.append(out), logits.append(lg)
    torch.testing.assert_close(torch.cat(outs, 1), full_h, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(torch.cat(logits, 1), full_logits, atol=1e-4, rtol=1e-5)


def test_save_load_roundtrip(pair, tmp_path):
    target, drafter = pair
    save_drafter(drafter, tmp_path / "d")
    again = load_drafter(tmp_path / "d", target)
    h, x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(again(h, x)[1], drafter(h, x)[1])
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["drafter.safetensors", "drafter_config.json"]


def test_vllm_eagle_export_layout_and_reload(pair, tmp_path):
    target, drafter = pair
    export_vllm_eagle(drafter, tmp_path / "eagle")
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    t = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    h = CFG.hidden_size
    assert t["fc.weight"].shape == (h, 2 * h)
    assert t["embed_tokens.weight"].shape == (CFG.vocab_size, h)
    expected = {f"layers.0.self_attn.{n}_proj.weight" for n in "qkvo"} | {
        f"layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")} | {"layers.0.post_attention_layernorm.weight"}
    assert expected <= set(t) and not any("input_layernorm" in k for k in t)
    assert t["layers.0.self_attn.k_proj.weight"].shape == (CFG.num_kv_heads * CFG.dim_head, h)
    again = load_vllm_eagle(tmp_path / "eagle", target)
    hh, x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(again(hh, x)[0], drafter(hh, x)[0])


@pytest.mark.parametrize("change,match", [(dict(hidden_size=48), "hidden size is 32 but the target's is 48"),
                                          (dict(vocab_size=31), "vocabulary size"),
                                          (dict(architecture="qwen2"), "architecture")])
def test_mismatched_target_is_a_clear_error(pair, tmp_path, change, match):
    from dataclasses import replace
    _, drafter = pair
    save_drafter(drafter, tmp_path / "d")
    other = Transformer(replace(CFG, **change), init_std=0.1)
    with pytest.raises(ValueError, match=match):
        load_drafter(tmp_path / "d", other)
    with pytest.raises(ValueError, match=match):
        Drafter(DrafterConfig.from_target(CFG)).attach(other)


def test_missing_or_corrupt_drafter_files(pair, tmp_path):
    target, drafter = pair
    with pytest.raises(FileNotFoundError, match="no drafter in"):
        load_drafter(tmp_path / "none", target)
    save_drafter(drafter, tmp_path / "d")
    (tmp_path / "d" / "drafter.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="d/drafter.safetensors is not a readable safetensors file.*save it again"):
        load_drafter(tmp_path / "d", target)
    save_drafter(drafter, tmp_path / "e")
    (tmp_path / "e" / "drafter_config.json").write_text("{ broken")
    with pytest.raises(ValueError, match="drafter_config.json is not valid JSON .* line 1 column 3.*retrain"):
        load_drafter(tmp_path / "e", target)


def test_non_finite_or_extra_drafter_tensors_are_refused_at_load(pair, tmp_path):
    from safetensors.torch import load_file, save_file
    target, drafter = pair
    path = save_drafter(drafter, tmp_path / "d")
    state = load_file(path / "drafter.safetensors")
    bad = dict(state)
    bad["layer.mlp.down.weight"] = bad["layer.mlp.down.weight"].clone()
    bad["layer.mlp.down.weight"][0, 0] = float("nan")
    save_file(bad, str(path / "drafter.safetensors"))
    with pytest.raises(ValueError, match="tensor layer.mlp.down.weight holds 1 non-finite values"):
        load_drafter(path, target)
    save_file({**state, "layer.extra": torch.zeros(2)}, str(path / "drafter.safetensors"))
    with pytest.raises(ValueError, match="hold 1 tensors the config does not use \\(layer.extra\\)"):
        load_drafter(path, target)
    save_file({**state, "fc.weight": state["fc.weight"][:, :3].contiguous()}, str(path / "drafter.safetensors"))
    with pytest.raises(ValueError, match="fc.weight is \\[.*\\], expected"):
        load_drafter(path, target)


def test_unattached_drafter_says_how_to_fix():
    d = Drafter(DrafterConfig.from_target(CFG))
    with pytest.raises(RuntimeError, match="attach"):
        d(*_inputs())


# ------------------------------------------------------------------------------------------- draft vocabulary
def test_draft_vocabulary_reads_its_rows_of_the_current_head(pair):
    target, drafter = pair
    h, _ = _inputs()
    full = drafter.logits(h)
    ids = torch.tensor([2, 7, 11, 29])
    drafter.set_draft_vocab(ids)
    sub = drafter.logits(h)
    torch.testing.assert_close(sub[..., ids], full[..., ids])
    others = torch.ones(CFG.vocab_size, dtype=torch.bool)
    others[ids] = False
    assert torch.isinf(sub[..., others]).all() and (sub[..., others] < 0).all()
    assert torch.equal(drafter.logits(h, full=True), full)            # training targets use the whole head
    with torch.no_grad():
        target.head_weight[7].add_(1.0)                                 # a policy update of a draft-vocabulary row
    assert not torch.allclose(drafter.logits(h)[..., 7], sub[..., 7])
    drafter.set_draft_vocab(None)
    assert drafter.config.draft_vocab_size == 0 and "draft_ids" not in drafter.state_dict()


def test_draft_vocabulary_is_saved_and_old_configs_load(pair, tmp_path):
    target, drafter = pair
    save_drafter(drafter, tmp_path / "plain")
    cfg_file = tmp_path / "plain" / "drafter_config.json"
    d = json.loads(cfg_file.read_text())
    del d["draft_vocab_size"]                                           # a drafter saved before the field existed
    cfg_file.write_text(json.dumps(d))
    assert load_drafter(tmp_path / "plain", target).draft_ids is None
    drafter.set_draft_vocab(torch.tensor([9, 3, 2]))
    save_drafter(drafter, tmp_path / "dv")
    again = load_drafter(tmp_path / "dv", target)
    assert again.config.draft_vocab_size == 3 and again.draft_ids.tolist() == [2, 3, 9]
    h, x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(again(h, x)[1], drafter(h, x)[1])


def test_bad_draft_vocabularies_are_refused(pair, tmp_path):
    target, drafter = pair
    for ids, match in (([], "non-empty"), ([3, 30], "lie in 0..29"), ([-1], "lie in 0..29"), ([4, 4], "repeat")):
        with pytest.raises(ValueError, match=match):
            drafter.set_draft_vocab(torch.tensor(ids, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_vocab_size=31 must lie in 0..30"):
        DrafterConfig(CFG, draft_vocab_size=31)
    drafter.set_draft_vocab(torch.tensor([1, 2]))
    save_drafter(drafter, tmp_path / "d")
    from safetensors.torch import save_file
    state = load_file(tmp_path / "d" / "drafter.safetensors")
    state["draft_ids"] = torch.tensor([1, 99])                          # a corrupt file: an id past the vocabulary
    save_file(state, str(tmp_path / "d" / "drafter.safetensors"))
    with pytest.raises(ValueError, match="drafter.safetensors: draft vocabulary"):
        load_drafter(tmp_path / "d", target)


def test_frequent_tokens():
    toks = torch.tensor([[5, 5, 5, 1], [1, 7, 5, 3]])
    assert frequent_tokens(toks, 2, 10).tolist() == [1, 5]
    assert frequent_tokens(toks, 2, 10, always=(9,)).tolist() == [1, 5, 9]
    assert frequent_tokens(toks, 50, 10).tolist() == [1, 3, 5, 7]      # never-seen ids are not added
    with pytest.raises(ValueError, match="positive"):
        frequent_tokens(toks, 0, 10)


@pytest.mark.parametrize("arch,attention_bias,qkv,o", [("qwen2", False, True, False), ("llama", False, False, False),
                                                       ("llama", True, True, True)])
def test_vllm_export_names_each_bias_so_vllm_builds_exactly_the_tensors_in_the_file(tmp_path, arch, attention_bias,
                                                                                      qkv, o):
    """vLLM's Llama layer gives o_proj a bias when ``attention_bias`` is true unless ``qkv_bias`` separates them; a
    Qwen2 drafter (q/k/v biases only) exported with ``attention_bias: true`` got an uninitialised o_proj bias."""
    from dataclasses import replace
    cfg = replace(CFG, architecture=arch, attention_bias=attention_bias)
    torch.manual_seed(0)
    target = Transformer(cfg, init_std=0.3)
    drafter = Drafter(DrafterConfig.from_target(cfg), init_std=0.3).attach(target)
    export_vllm_eagle(drafter, tmp_path / "e")
    hf = json.loads((tmp_path / "e" / "config.json").read_text())
    assert (hf["qkv_bias"], hf["attention_bias"], hf["mlp_bias"]) == (qkv, o, False)
    t = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert all((f"layers.0.self_attn.{n}_proj.bias" in t) == qkv for n in "qkv")
    assert ("layers.0.self_attn.o_proj.bias" in t) == o
    again = load_vllm_eagle(tmp_path / "e", target)
    h, x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(again(h, x)[0], drafter(h, x)[0])
