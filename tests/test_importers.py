"""GGUF import: a synthetic Llama GGUF converts into a folder tltlib loads with transformers' logits; bad files
(another architecture, no tokenizer, not GGUF) are refused before anything is written; the logits check refuses."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tltlib.model import importers  # noqa: E402
from tltlib.model.loading import load  # noqa: E402

H, L, V, F = 32, 2, 40, 64


def write_gguf(path, arch="llama", tokenizer=True):
    """A tiny random model in GGUF (float32 tensors, llama.cpp names) with a byte-free BPE tokenizer."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L), w.add_context_length(128), w.add_embedding_length(H), w.add_feed_forward_length(F)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        toks = (["<unk>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)]
                + ["Ġ", "Ġa", "ab", "bc", "Ġb", "cd", ".", ",", "?", "!", "Ġt"])
        w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(toks)
        w.add_token_types([3, 3, 3] + [1] * (V - 3)), w.add_token_merges(["Ġ a", "a b", "b c", "Ġ b", "c d", "Ġ t"])
        w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0)
    g = np.random.default_rng(0)

    def t(name, *shape):
        w.add_tensor(name, (g.standard_normal(shape) * 0.1).astype(np.float32))
    t("token_embd.weight", V, H)
    for i in range(L):
        t(f"blk.{i}.attn_norm.weight", H), t(f"blk.{i}.ffn_norm.weight", H), t(f"blk.{i}.attn_q.weight", H, H)
        t(f"blk.{i}.attn_k.weight", H // 2, H), t(f"blk.{i}.attn_v.weight", H // 2, H)
        t(f"blk.{i}.attn_output.weight", H, H), t(f"blk.{i}.ffn_gate.weight", F, H)
        t(f"blk.{i}.ffn_up.weight", F, H), t(f"blk.{i}.ffn_down.weight", H, F)
    t("output_norm.weight", H), t("output.weight", V, H)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    rec = importers.import_gguf(write_gguf(d / "tiny.gguf"), d / "out")
    return d / "out", rec


def test_import_writes_a_folder_tltlib_and_transformers_load_with_equal_logits(imported):
    from transformers import AutoModelForCausalLM
    out, rec = imported
    assert rec["architecture"] == "llama" and rec["logits_max_abs_diff"] <= importers.LOGITS_TOLERANCE
    assert importers.is_imported(out) and json.loads((out / importers.RECORD).read_text())["sha256"] == rec["sha256"]
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    model, tok, _ = load(out, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tok("ab bc cd a b").input_ids])
    assert tok.unk_token_id not in ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=0)


def test_compare_logits_sees_a_changed_tensor(imported, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, _ = imported
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    state = load_file(bad / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"] += 0.05
    save_file(state, str(bad / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert importers.compare_logits(bad, hf, AutoTokenizer.from_pretrained(out)) > 1e-3


def test_a_failed_logits_check_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(importers, "LOGITS_TOLERANCE", -1.0)
    with pytest.raises(ValueError, match="logits differ from transformers'.*nothing was written"):
        importers.import_gguf(write_gguf(tmp_path / "m.gguf"), tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


@pytest.mark.parametrize("case,match", [
    ("gpt2", "GGUF architecture 'gpt2' is not supported: tltlib runs Llama-family"),
    ("no-tokenizer", "holds no tokenizer"),
    ("not-gguf", "is not a readable GGUF file"),
    ("missing", "no GGUF file at"),
])
def test_bad_gguf_files_are_refused_before_anything_is_written(tmp_path, case, match):
    f = tmp_path / "m.gguf"
    if case == "gpt2":
        write_gguf(f, arch="gpt2")
    elif case == "no-tokenizer":
        write_gguf(f, tokenizer=False)
    elif case == "not-gguf":
        f.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        importers.import_gguf(f, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_model_name_lists_the_known_ones_and_import_gguf():
    with pytest.raises(ValueError, match="unknown model 'smollm3'.*smollm2-135m.*import-gguf FILE OUT"):
        importers.get_model("smollm3")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TLTLIB_CACHE", str(tmp_path))
    assert importers.cache_dir() == tmp_path / "models"


@pytest.mark.slow
def test_get_model_smollm2_is_idempotent_and_matches_transformers(tmp_path):
    out = importers.get_model("smollm2-135m", tmp_path, progress=False)
    rec = json.loads((out / importers.RECORD).read_text())
    assert rec["architecture"] == "llama" and rec["logits_max_abs_diff"] <= importers.LOGITS_TOLERANCE
    mtime = (out / "model.safetensors").stat().st_mtime
    assert importers.get_model("smollm2-135m", tmp_path) == out and (out / "model.safetensors").stat().st_mtime == mtime
    model, tok, _ = load(out, device="cpu")
    assert model.config.num_layers == 30 and model.config.vocab_size == 49152 and tok.chat_template


def test_cli_import_gguf_and_get_model_list(tmp_path, monkeypatch, capsys):
    from tltlib.cli import main
    monkeypatch.setenv("TLTLIB_NO_VENV", "1")
    monkeypatch.setenv("TLTLIB_CACHE", str(tmp_path / "cache"))
    assert main(["import-gguf", str(write_gguf(tmp_path / "m.gguf")), str(tmp_path / "out")]) == 0
    assert "imported" in capsys.readouterr().out and importers.is_imported(tmp_path / "out")
    assert main(["import-gguf", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 1      # exists: --overwrite
    assert "already holds a model import" in capsys.readouterr().err
    assert main(["get-model", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "smollm2-135m" in listing and "not imported yet" in listing


SHIPPED_SMOL_DRAFTER = Path(__file__).resolve().parent.parent / "data" / "smollm2-135m-drafter"


def test_shipped_smollm2_drafter_fits_smollm2():
    """The drafter in data/ was trained for SmolLM2-135M-Instruct (checked without the model, which is not shipped)."""
    from tltlib.model.drafter import DrafterConfig
    cfg = DrafterConfig.from_dict(json.loads((SHIPPED_SMOL_DRAFTER / "drafter_config.json").read_text()))
    t = cfg.target
    assert (t.architecture, t.hidden_size, t.num_heads, t.num_kv_heads, t.vocab_size, t.intermediate_size) == (
        "llama", 576, 9, 3, 49152, 1536)
    assert 0 < cfg.draft_vocab_size < t.vocab_size
    assert "tokens per step" in (SHIPPED_SMOL_DRAFTER / "README.md").read_text()


@pytest.mark.slow
def test_shipped_smollm2_drafter_is_lossless_and_accepts_on_smollm2():
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    from tltlib.spec.strategy import SpecStrategy
    from tltlib.tasks.datasets import generate_task
    from tltlib.tasks.prompts import encode_prompts
    path = importers.get_model("smollm2-135m", progress=False)
    target, tok, drafter = load(path, SHIPPED_SMOL_DRAFTER, device="cpu")
    prompts = encode_prompts(generate_task("words", 2, seed=123), tok)
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=48)), drafter=drafter)
    plain = eng.generate(prompts)
    spec = eng.generate(prompts, strategy=SpecStrategy("chain", 4))
    assert torch.equal(plain.tokens, spec.tokens)
    assert spec.stats["spec/accept_len_mean"] > 1.5


@pytest.mark.parametrize("missing", [("gguf",), ("accelerate",), ("gguf", "accelerate")])
def test_a_missing_gguf_reader_is_one_error_naming_the_wheel_and_nothing_is_installed(missing, tmp_path, monkeypatch,
                                                                                      capsys):
    """No pip at run time (an offline GPU node has no PyPI): one error names what is missing, ``tltlib setup`` and
    the wheel to carry with its offline install; nothing runs, nothing is written."""
    import importlib.util
    import subprocess

    from tltlib.cli import main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name in missing
                        else real(name, *a, **k))

    def no_process(*a, **k):
        raise AssertionError(f"a process was started: {a}")
    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, no_process)
    monkeypatch.setenv("TLTLIB_NO_VENV", "1")
    f = write_gguf(tmp_path / "m.gguf")
    assert main(["import-gguf", str(f), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert "python3 -m tltlib setup" in err and "pip install --no-index" in err
    assert all(importers.GGUF_READER_WHEELS[m] in err for m in missing), err
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    with pytest.raises(ImportError, match="nothing was installed or written"):
        importers.get_model("smollm2-135m", tmp_path / "models")
    assert not (tmp_path / "models").exists()


def test_the_wheels_named_for_a_machine_without_pypi_are_versions_pyproject_allows():
    import tomllib

    from packaging.requirements import Requirement
    root = Path(__file__).resolve().parent.parent
    deps = {r.name: r for r in map(Requirement, tomllib.loads((root / "pyproject.toml").read_text())["project"]
                                   ["dependencies"])}
    for module, wheel in importers.GGUF_READER_WHEELS.items():
        name, version = wheel.split("-")[:2]
        assert name == module and wheel.endswith("-py3-none-any.whl")
        assert deps[name].specifier.contains(version), (wheel, str(deps[name]))
