"""Responses files: sampled in batches and appended (a stopped run continues), read back with refusals, and
trained on by train-drafter --responses."""
from __future__ import annotations

import json

import pytest
import torch

from tltlib.drafting.responses import sample_responses
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.tasks.datasets import read_responses
from tltlib.tasks.problem import Problem

CFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  eos_token_ids=(2,), pad_token_id=0, max_position_embeddings=96)


class _Tok:
    """A stand-in tokenizer: a prompt's characters as ids 3 + (ord % 20)."""
    pad_token_id = 0
    chat_template = None

    def __call__(self, texts, add_special_tokens=True):
        class Out:
            pass
        o = Out()
        o.input_ids = [[3 + ord(c) % 20 for c in t] for t in texts]
        return o


def test_responses_are_appended_per_batch_and_a_rerun_continues(tmp_path, monkeypatch):
    import tltlib.tasks.prompts
    monkeypatch.setattr(tltlib.tasks.prompts, "encode_prompts", lambda probs,
                        tok: [[1] + [3 + ord(c) % 20 for c in p.prompt]
                                                                  for p in probs])
    torch.manual_seed(0)
    target = Transformer(CFG, init_std=0.4).eval()
    probs = [Problem(f"q{i}", "1") for i in range(5)]
    out = tmp_path / "r.jsonl"
    st = sample_responses(target, _Tok(), probs[:3], out, max_new_tokens=6, batch=2, progress=False)
    assert st["rows"] == 3 and len(read_responses(out, CFG.vocab_size)) == 3
    st = sample_responses(target, _Tok(), probs, out, max_new_tokens=6, batch=2, progress=False)
    rows = read_responses(out)
    assert st["rows"] == 2 and len(rows) == 5                      # only the two problems not yet sampled
    assert [p for p, _ in rows] == [[1, 3 + ord("q") % 20, 3 + ord(str(i)) % 20] for i in range(5)]
    assert all(1 <= len(r) <= 6 for _, r in rows) and st["tokens"] == sum(len(r) for _, r in rows[3:])
    with pytest.raises(ValueError, match="batch and max_new_tokens must be >= 1"):
        sample_responses(target, _Tok(), probs, out, batch=0)


def test_read_responses_refusals(tmp_path):
    f = tmp_path / "r.jsonl"
    with pytest.raises(FileNotFoundError, match="sample-responses"):
        read_responses(f)
    f.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [5, 30]}) + "\n")
    with pytest.raises(ValueError, match="row 1: token id 30 is outside this model's vocabulary of 24"):
        read_responses(f, 24)
    f.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [5]}) + "\n" + '{"prompt_ids": [1, ')
    with pytest.raises(ValueError, match="row 2: expected .* cut short"):
        read_responses(f)
    f.write_text(json.dumps({"prompt_ids": [], "response_ids": [5]}) + "\n")
    with pytest.raises(ValueError, match="non-empty lists of token ids"):
        read_responses(f)
    f.write_text("\n")
    with pytest.raises(ValueError, match="holds no responses"):
        read_responses(f)


def test_response_pairs_hold_out_the_last_rows_and_refuse_too_few(tmp_path):
    from tltlib.drafting.warmup import response_pairs
    torch.manual_seed(0)
    target = Transformer(CFG, init_std=0.4).eval()
    f = tmp_path / "r.jsonl"
    rows = [([1, 4, 5], [6 + i, 7, 2]) for i in range(4)]
    f.write_text("".join(json.dumps({"prompt_ids": p, "response_ids": r}) + "\n" for p, r in rows))
    train, held, source = response_pairs(target, _Tok(), f, n_train=2, n_eval=1)
    assert (len(train), len(held)) == (2, 1) and train.num_pairs == 2 * 5 and "r.jsonl" in source
    assert held.tok[: held.size].tolist() == [4, 5, 9, 7, 2]             # the last row's next tokens
    with pytest.raises(ValueError, match="4 responses cannot hold 4 held-out"):
        response_pairs(target, _Tok(), f, n_train=2, n_eval=4)


def test_a_gzipped_responses_file_reads_the_same(tmp_path):
    import gzip
    rows = "".join(json.dumps({"prompt_ids": [1, 2], "response_ids": [3 + i, 2]}) + "\n" for i in range(3))
    (tmp_path / "r.jsonl").write_text(rows)
    (tmp_path / "r.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    assert read_responses(tmp_path / "r.jsonl.gz") == read_responses(tmp_path / "r.jsonl")
