"""The supervised warm start on worked solutions (tltlib.lab.sft): the loss falls and the weights move on a small
model, bad settings refused (the loss on the solution tokens only is reasoner.sft_batch's, tested there)."""
from __future__ import annotations

import string

import pytest
import torch

from tltlib.lab.sft import WarmStartConfig, warm_start
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.tasks.tokenizer import build_tokenizer


def _char_tokenizer():
    """One token per printable ASCII character (the word problems' text), <bos> prepended, an <eos>, and a chat
    template (the word problems are chat messages; a tokenizer without one is refused)."""
    tok = build_tokenizer(string.printable)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tok


def test_warm_start_lowers_the_solution_loss_and_moves_every_trained_weight():
    tok = _char_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2,
                                    num_heads=4, num_kv_heads=2, max_position_embeddings=512,
                                    eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    log = warm_start(model, tok, WarmStartConfig(steps=30, batch=2, lr=3e-3, max_problem_steps=2), progress=False)
    assert len(log["loss"]) == 30 and log["seconds"] > 0
    assert sum(log["loss"][-5:]) / 5 < 0.75 * sum(log["loss"][:5]) / 5
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not model.training


@pytest.mark.parametrize("kwargs,match", [({"steps": 0}, "steps and batch"), ({"lr": 0.0}, "lr must be a finite"),
                                          ({"lr": float("inf")}, "lr must be a finite number > 0 .--lr"),
                                          ({"lr": float("nan")}, "lr must be a finite"),
                                          ({"max_problem_steps": 0}, "min_steps <= max_steps")])
def test_warm_start_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarmStartConfig(**kwargs)


def test_the_command_writes_a_loadable_model_with_the_tokenizer_and_a_card(tmp_path, capsys):
    """``warm-start`` on a model folder: the new folder holds the trained weights (not the source's), the source's
    tokenizer files and the card; an existing output is refused without --overwrite (one error, nothing written)."""
    import json

    from tltlib import load
    from tltlib.cli import main
    from tltlib.model.weights import save_model
    tok = _char_tokenizer()
    torch.manual_seed(0)
    src, out = tmp_path / "src", tmp_path / "out"
    save_model(Transformer(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2,
                                       num_heads=4, num_kv_heads=2, max_position_embeddings=512,
                                       eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)), src)
    tok.save_pretrained(src)
    args = ["warm-start", "--model", str(src), "--out", str(out), "--steps", "3", "--batch", "2", "--lr", "1e-3",
            "--max-problem-steps", "2", "--quiet"]
    assert main(args) == 0
    card = json.loads((out / "tltlib-warm-start.json").read_text())
    assert card["config"]["steps"] == 3 and len(card["loss"]) == 3
    assert (out / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    new, new_tok, _ = load(out)
    old, _, _ = load(src)
    assert new_tok.eos_token_id == tok.eos_token_id
    assert not torch.equal(new.embed.weight, old.embed.weight)
    before = sorted(p.name for p in out.iterdir())
    assert main(args) == 1 and "pass --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before


def _tiny(tok) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2,
                                   num_heads=4, num_kv_heads=2, max_position_embeddings=512,
                                   eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id))


def test_a_learning_rate_that_blows_the_weights_up_stops_the_warm_start():
    from tltlib.errors import NotFinite
    tok = _char_tokenizer()
    with pytest.raises(NotFinite, match="NaN or infinite at step .* lower the learning rate .--lr"):
        warm_start(_tiny(tok), tok, WarmStartConfig(steps=3, batch=1, lr=1e30, max_problem_steps=1),
                   progress=False)


def test_the_command_refuses_bad_outputs_and_rates_before_loading(tmp_path, capsys):
    """``--overwrite`` replaces only a warm start's own folder (never a model or any other folder), an output that
    cannot be written and ``--lr inf`` are refused before the model loads (the model named here does not exist)."""
    from tltlib.cli import main
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    base = ["warm-start", "--model", str(tmp_path / "absent"), "--quiet"]
    for extra, message in ((["--out", str(other), "--overwrite"], "does not hold a warm-started model; refusing"),
                           (["--out", "/proc/x"], "cannot write the warm-started model '/proc/x'"),
                           (["--out", str(tmp_path / "o"), "--lr", "inf"], "lr must be a finite number")):
        assert main(base + extra) == 1
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and message in err and "Traceback" not in err
    assert [p.name for p in other.iterdir()] == ["keep.txt"] and (other / "keep.txt").read_text() == "mine"
