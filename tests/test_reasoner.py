"""The SFT recipe's pieces, and the shipped tiny reasoner: loads both ways, long-tailed under its own sampling."""
from __future__ import annotations

import json
import random

import pytest
import torch

from tltlib.lab.notebook import ROOT
from tltlib.lab.reasoner import ReasonerTrainConfig, lr_at, sft_batch, sft_example, train_sft
from tltlib.tasks.chain import ChainTaskConfig
from tltlib.tasks.tokenizer import build_tokenizer

SHIPPED = ROOT / "data" / "tiny-reasoner"


def test_sft_batch_targets_are_the_response_shifted_by_one():
    x, y = sft_batch([([1, 5, 6], [7, 8, 2]), ([1, 9], [3, 2])], pad_id=0)
    assert x.tolist() == [[1, 5, 6, 7, 8, 2], [1, 9, 3, 2, 0, 0]]
    assert y.tolist() == [[-100, -100, 7, 8, 2, -100], [-100, 3, 2, -100, -100, -100]]


def test_sft_examples_are_prompt_plus_reference_response():
    tok = build_tokenizer()
    p, r = sft_example(tok, random.Random(0), ChainTaskConfig(), ChainTaskConfig(), 0.0)
    text = tok.decode(p + r, skip_special_tokens=True)
    assert p[0] == tok.bos_token_id and r[-1] == tok.eos_token_id and "#" in text


def test_lr_schedule():
    cfg = ReasonerTrainConfig(steps=200, warmup_steps=10, lr=1.0)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(199, cfg) == pytest.approx(0.1, abs=1e-3)


def test_a_few_sft_steps_lower_the_loss_and_change_every_parameter():
    tok = build_tokenizer()
    cfg = ReasonerTrainConfig(preset="tiny-cpu", steps=12, tokens_per_batch=600, warmup_steps=1, lr=3e-3,
                              bf16_autocast=False)
    model, log = train_sft(cfg, tok, progress=False)
    assert log["steps_done"] == 12 and log["loss"][-1] < log["loss"][0]
    torch.manual_seed(cfg.seed)
    from tltlib.model.decoder import Transformer
    init = Transformer(model.config)
    for (name, p), q in zip(model.named_parameters(), init.parameters()):
        assert not torch.equal(p, q), name


needs_model = pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="data/tiny-reasoner not built")


@needs_model
def test_shipped_model_loads_with_transformers_and_matches():
    from transformers import AutoModelForCausalLM

    from tltlib.model.weights import load_model
    ours = load_model(SHIPPED)
    hf = AutoModelForCausalLM.from_pretrained(SHIPPED).eval()
    x = torch.randint(3, ours.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-4, rtol=0)
    assert ours.config.num_layers >= 8
    size = sum(f.stat().st_size for f in SHIPPED.iterdir())
    assert size <= 20e6, f"shipped model is {size / 1e6:.1f} MB"
    card = (SHIPPED / "README.md").read_text()
    assert "accuracy" in card.lower() and "p99" in card


@needs_model
def test_shipped_model_card_numbers_meet_the_brief():
    ev = json.loads((SHIPPED / "eval.json").read_text())["eval_t0.9"]
    assert 0.3 <= ev["rl/accuracy"] <= 0.8
    assert ev["rollout/p99_over_p50"] >= 4 and ev["rollout/max_over_p50"] >= 8


@needs_model
@pytest.mark.long
def test_shipped_model_is_long_tailed_under_its_own_sampling():
    """The brief's requirement, measured afresh: 512 samples at T=0.9, p99/p50 >= 4 and max/median >= 8."""
    from tltlib.lab.reasoner import evaluate
    from tltlib.model.weights import load_model
    from tltlib.tasks.chain import generate_problems
    from tltlib.tasks.tokenizer import load_tokenizer
    model, tok = load_model(SHIPPED), load_tokenizer(SHIPPED)
    ev = evaluate(model, tok, generate_problems(ChainTaskConfig(), 64, seed=99), temperature=0.9, num_generations=8,
                  seed=1)
    assert ev["rollout/p99_over_p50"] >= 4 and ev["rollout/max_over_p50"] >= 8
    assert 0.2 <= ev["rl/accuracy"] <= 0.9
