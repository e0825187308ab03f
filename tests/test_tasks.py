"""The chain task (generator, verifier, reward, long tail) and dataset IO with its errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tltlib.tasks.chain import ChainTaskConfig, generate_problems, solve
from tltlib.tasks.datasets import load_problems, save_problems
from tltlib.tasks.problem import Problem, extract_answer, reward
from tltlib.tasks.prompts import encode_prompts, prompt_text


def test_generator_is_seeded_and_solutions_are_correct():
    a = generate_problems(ChainTaskConfig(), 50, seed=7)
    assert a == generate_problems(ChainTaskConfig(), 50, seed=7)
    assert a != generate_problems(ChainTaskConfig(), 50, seed=8)
    for p in a:
        x, z = (int(v) for v in p.prompt.split()[:2])
        digits = lambda v: [v // 10, v % 10]
        for _ in range(p.meta["steps"]):
            x, z = z, int("".join(str((i + j) % 10) for i, j in zip(digits(x), digits(z))))
        assert p.answer == f"{z:02d}"
        assert reward(solve(p.prompt), p.answer) == 1.0
        assert len(solve(p.prompt)) == 11 * p.meta["steps"] + 3


def test_solve_example_from_the_docs():
    assert solve("47 18 c?") == "a:47+18=55 b:18+55=63 c:55+63=18 #18"


def test_reference_lengths_are_long_tailed():
    lengths = np.array([len(solve(p.prompt)) + 1 for p in generate_problems(ChainTaskConfig(), 512, seed=0)])
    med = np.median(lengths)
    assert np.percentile(lengths, 99) / med >= 4
    assert lengths.max() / med >= 8


@pytest.mark.parametrize("text,ans", [("a:01+02=03 #03", "03"), ("blah #### 1,234.", "1234"),
                                      ("so \\boxed{\\frac{1}{2}} and #7", "\\frac{1}{2}"), ("no answer", None),
                                      ("#12 then #13", "13")])
def test_extract_answer(text, ans):
    assert extract_answer(text) == ans


def test_reward_is_binary_and_in_range():
    assert reward("a:00+00=00 #00", "00") == 1.0
    assert reward("a:00+00=00 #01", "00") == 0.0
    assert reward("", "00") == 0.0


def test_config_errors():
    with pytest.raises(ValueError, match="max_steps <= 52"):
        ChainTaskConfig(max_steps=60)
    with pytest.raises(ValueError, match="zipf_exponent"):
        ChainTaskConfig(zipf_exponent=-1)
    with pytest.raises(ValueError, match="not a chain-task prompt"):
        solve("what is 2+2?")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_roundtrip(tmp_path, suffix):
    probs = generate_problems(ChainTaskConfig(), 20, seed=1)
    path = save_problems(probs, tmp_path / f"d{suffix}")
    back = load_problems(path)
    assert [prompt_text(p) for p in back] == [p.prompt for p in probs]
    assert [p.answer for p in back] == [p.answer for p in probs]
    assert [f.name for f in tmp_path.iterdir()] == [f"d{suffix}"]        # no temporary file left behind


def test_user_formats_gsm8k_math_and_verl_chat(tmp_path):
    rows = [{"question": "Tom has 3 apples...", "answer": "He has 3+4=7 #### 7"},
            {"problem": "Compute 1/2.", "solution": "It is \\boxed{\\frac{1}{2}}."},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "reward_model": {"style": "rule", "ground_truth": "4"}, "data_source": "x"}]
    path = tmp_path / "user.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    probs = load_problems(path)
    assert [p.answer for p in probs] == ["7", "\\frac{1}{2}", "4"]
    assert prompt_text(probs[2]) == "Be brief.\n2+2?"
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([rows[2]]), tmp_path / "verl.parquet")
    (p,) = load_problems(tmp_path / "verl.parquet")
    assert p.answer == "4" and p.prompt[1]["content"] == "2+2?"


def test_chat_template_is_used_when_the_tokenizer_has_one():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "|".join(m["content"] for m in messages) + ("<gen>" if add_generation_prompt else "")

    p = Problem(({"role": "user", "content": "hi"},), "1")
    assert prompt_text(p, Tok()) == "hi<gen>"


def test_chat_prompts_for_a_tokenizer_without_a_chat_template_are_refused():
    from tltlib.model.loading import load
    _, tok, _ = load("data/tiny-reasoner", None)
    assert not getattr(tok, "chat_template", None)
    chat = Problem(({"role": "user", "content": "A:01+02=03"},), "03")
    with pytest.raises(ValueError, match="the prompts are chat messages but this model's tokenizer has no chat "
                                         "template.*WordTaskConfig\\(chat=False\\)"):
        encode_prompts([chat], tok)
    assert prompt_text(chat) == "A:01+02=03"                    # without a tokenizer: for display
    assert encode_prompts([Problem("A:01+02=03", "03")], tok)  # plain text is fine


def test_dataset_errors_name_file_row_and_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_problems(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_problems(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl, row 2: not valid JSON"):
        load_problems(bad)
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"nofield.jsonl, row 2: no ground truth"):
        load_problems(nofield)
    noprompt = tmp_path / "noprompt.jsonl"
    noprompt.write_text('{"text": "a", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"row 1: no prompt field"):
        load_problems(noprompt)
    badchat = tmp_path / "badchat.jsonl"
    badchat.write_text('{"prompt": [{"role": "user"}], "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"row 1: field 'prompt' is a list but not chat messages"):
        load_problems(badchat)
    with pytest.raises(ValueError, match="unsupported dataset format"):
        (tmp_path / "d.csv").write_text("a,b\n")
        load_problems(tmp_path / "d.csv")


def test_text_the_tokenizer_cannot_encode_is_refused_naming_dataset_and_characters(tmp_path):
    from tltlib.tasks.prompts import encode_prompts
    from tltlib.tasks.tokenizer import load_tokenizer
    tok = load_tokenizer("data/tiny-reasoner")
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "Natalia sold clips to 48 of her friends.\nHow much, in $?",
                                "answer": "48/2 = 24\n#### 72"}) + "\n")
    with pytest.raises(ValueError, match=r"gsm8k.jsonl: \d+ of \d+ prompt tokens \(\d+\.\d%, in 1 of 1 prompts\) are "
                                         r"unknown to the tokenizer, which has no token for .*'\\n', '\$', ',', '\.'"):
        encode_prompts(load_problems(path), tok)
    path.write_text(json.dumps({"prompt": "12 34 c?", "answer": "7.5"}) + "\n")   # readable prompt, unwritable answer
    with pytest.raises(ValueError, match=r"answers hold characters the tokenizer cannot produce \('\.'\)"):
        encode_prompts(load_problems(path), tok)
    ok = encode_prompts(generate_problems(ChainTaskConfig(), 4, seed=0), tok)
    assert len(ok) == 4 and all(tok.unk_token_id not in row for row in ok)


@pytest.mark.parametrize("row,match", [
    ({"prompt": [{"role": "user", "content": ""}], "answer": "1"}, "'content' must be strings, not all empty"),
    ({"prompt": [{"role": "user", "content": None}], "answer": "1"}, "'content' must be strings"),
    ({"prompt": "   ", "answer": "1"}, "must be a non-empty string"),
])
def test_empty_prompts_are_refused(tmp_path, row, match):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="d.jsonl, row 1: .*" + match):
        load_problems(path)


def test_non_utf8_dataset_and_bad_limit_are_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError, match="d.jsonl: not UTF-8 text"):
        load_problems(path)
    path.write_text(json.dumps({"prompt": "12 34 a?", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="limit must be >= 1"):
        load_problems(path, limit=0)


def test_problems_for_generates_or_reads_rows_with_an_offset(tmp_path):
    from tltlib.tasks.datasets import problems_for
    assert problems_for("", 3, seed=5) == generate_problems(ChainTaskConfig(), 3, seed=5)
    path = save_problems(generate_problems(ChainTaskConfig(), 5, seed=1), tmp_path / "d.jsonl")
    rows = load_problems(path)
    got = problems_for(str(path), 4, seed=0, skip=3)
    assert [p.prompt for p in got] == [rows[i].prompt for i in (3, 4, 0, 1)]    # wraps around a short file


def test_split_problems_keeps_held_out_prompts_out_of_training(tmp_path):
    from tltlib.tasks.datasets import save_problems, split_problems
    rows = generate_problems(ChainTaskConfig(), 20, seed=4)
    save_problems(rows, tmp_path / "d.jsonl")
    train, held = split_problems(tmp_path / "d.jsonl", 16, 8, seed=0)
    assert len(train) == 16 and len(held) == 8
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert [p.prompt for p in held] == [p.prompt for p in rows[12:]]
    with pytest.raises(ValueError, match="20 rows cannot hold 20 held-out problems .* lower eval_problems"):
        split_problems(tmp_path / "d.jsonl", 4, 20, seed=0)
    gen_train, gen_held = split_problems("", 5, 3, seed=1)
    assert len(gen_train) == 5 and len(gen_held) == 3


def test_ground_truths_that_are_prose_are_refused_naming_the_rows(tmp_path):
    rows = [{"question": "q1", "answer": "the result is 93"}, {"question": "q2", "answer": "17"},
            {"question": "q3", "answer": "x^2 + 1"}, {"question": "q4", "answer": "so she has 4 apples"}]
    path = tmp_path / "prose.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError, match=r"ground truth of 2 of 4 rows is text, not a final answer \(rows 1, 4; "
                                         r"row 1: 'answer': 'the result is 93'\)"):
        load_problems(path)
    path.write_text("\n".join(json.dumps(r) for r in rows[1:3]) + "\n")
    assert [p.answer for p in load_problems(path)] == ["17", "x^2 + 1"]      # a formula is an answer


@pytest.mark.parametrize("row", [{"question": "q", "answer": "93 apples"}, {"question": "q", "answer": "Answer: 93"},
                                 {"prompt": "q", "ground_truth": "93 apples"},
                                 {"prompt": "q", "reward_model": {"ground_truth": "Answer: 93"}}])
def test_a_word_beside_the_answer_is_refused_as_the_reward_reads_it(tmp_path, row):
    """One word beside the number slipped past the prose check (two words or more) and trained on reward 0: the
    reward reads '#### 93 apples' as 93. Every key is checked as the reward reads it."""
    from tltlib.tasks.problem import reward
    truth = row.get("answer") or row.get("ground_truth") or row["reward_model"]["ground_truth"]
    assert reward(f"#### {truth}", truth) == 0.0                          # what training would have seen
    path = tmp_path / "d.jsonl"
    path.write_text(f"{json.dumps(row)}\n{json.dumps({'prompt': 'p', 'answer': 'Paris'})}\n")   # a word alone is fine
    key = "reward_model.ground_truth" if "reward_model" in row else "answer" if "answer" in row else "ground_truth"
    with pytest.raises(ValueError, match=f"ground truth of 1 of 2 rows is text, not a final answer \\(rows 1; "
                                         f"row 1: '{key}': '{truth}'\\)"):
        load_problems(path)


def test_a_corrupt_parquet_file_is_one_clear_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    f = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}] * 50), f)
    f.write_bytes(f.read_bytes()[:-40])                                     # cut: the footer is gone
    with pytest.raises(ValueError, match=r"d.parquet is not a readable parquet file .* write it again"):
        load_problems(f)
