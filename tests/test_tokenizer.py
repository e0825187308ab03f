"""The embedded tokenizer: one id per character, BOS added, loads through AutoTokenizer from a folder."""
from __future__ import annotations

import pytest

from tltlib.tasks.tokenizer import CHARS, SPECIALS, build_tokenizer, load_tokenizer


def test_roundtrip_and_specials(tmp_path):
    tok = build_tokenizer()
    assert len(tok) == len(SPECIALS) + len(CHARS)
    text = "47 18 c?a:47+18=55 #55"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok("€").input_ids[1] == tok.unk_token_id
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again(text).input_ids == ids and again.eos_token_id == tok.eos_token_id


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer in"):
        load_tokenizer(tmp_path)


def test_broken_tokenizer_file_is_named(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match="the tokenizer in .* cannot be loaded .*copy tokenizer.json"):
        load_tokenizer(tmp_path)
