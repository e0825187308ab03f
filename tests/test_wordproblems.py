"""The word-problem task: seeded, every count a non-negative integer that the story implies, GSM8K's answer format
scored by the shared verifier, chat prompts through the tokenizer's template, Zipf-distributed steps."""
from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from tltlib.tasks.datasets import problems_for, task_config
from tltlib.tasks.problem import reward
from tltlib.tasks.prompts import encode_prompts, prompt_text
from tltlib.tasks.wordproblems import LIMIT, WordTaskConfig, generate_word_problems, make_word_problem


def _replay(text: str, start: int) -> int:
    """Recompute the answer from the story's sentences alone (an independent reading of the templates)."""
    count = start
    for s in re.split(r"(?<=\.) ", text.split(" How many")[0])[1:]:
        n = [int(x) for x in re.findall(r"\d+", s)]
        if "buys" in s and "bags" in s:
            count += n[0] * n[1]
        elif "buys" in s or "finds" in s:
            count += n[0]
        elif "gives" in s or "loses" in s:
            count -= n[0]
        elif "shares" in s:
            count //= n[0]
        elif "doubles" in s:
            count *= 2
        else:
            raise AssertionError(f"unknown sentence {s!r}")
    return count


def test_problems_are_seeded_and_their_answers_follow_from_the_story():
    a = generate_word_problems(WordTaskConfig(), 300, seed=3)
    assert a == generate_word_problems(WordTaskConfig(), 300, seed=3) != generate_word_problems(WordTaskConfig(),
                                                                                                300, seed=4)
    for p in a:
        text = p.prompt[0]["content"]
        assert p.prompt[0]["role"] == "user" and text.endswith('"#### <number>".')
        counts = p.meta["counts"]
        assert len(counts) == p.meta["steps"] + 1 and all(0 <= c < LIMIT for c in counts)
        assert str(_replay(text, counts[0])) == p.answer == str(counts[-1])


def test_steps_are_zipf_distributed_and_bounded():
    steps = Counter(p.meta["steps"] for p in generate_word_problems(WordTaskConfig(), 4000, seed=0))
    assert set(steps) == set(range(1, 9))
    assert steps[1] > 2.5 * steps[4] and steps[1] > 5 * steps[8] > 0          # 1/n: 8x between 1 and 8 steps
    assert make_word_problem(WordTaskConfig(), random.Random(0), steps=12).meta["steps"] == 12
    with pytest.raises(ValueError, match="need 1 <= min_steps <= max_steps <= 20"):
        WordTaskConfig(max_steps=30)


def test_gsm8k_answer_line_is_scored_by_the_shared_verifier():
    p = generate_word_problems(WordTaskConfig(), 1, seed=1)[0]
    assert reward(f"First ... then ...\n#### {p.answer}", p.answer) == 1.0
    assert reward(f"#### {int(p.answer) + 1}", p.answer) == 0.0 and reward("no answer", p.answer) == 0.0


def test_chat_prompts_use_the_template_and_plain_prompts_do_not():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "<user>" + messages[0]["content"] + "<assistant>"
    chat = generate_word_problems(WordTaskConfig(), 1, seed=2)[0]
    plain = generate_word_problems(WordTaskConfig(chat=False), 1, seed=2)[0]
    assert prompt_text(chat, Tok()) == "<user>" + plain.prompt + "<assistant>"


def test_task_names_select_the_generator_and_a_character_tokenizer_is_refused():
    from tltlib.tasks.tokenizer import build_tokenizer
    words = problems_for("", 4, seed=0, task="words")
    assert all(p.meta["source"] == "words" for p in words)
    assert problems_for("", 4, seed=0) == problems_for("", 4, seed=0, task="chain")
    with pytest.raises(ValueError, match="unknown task 'gsm8k'; choose one of \\('chain', 'words'\\)"):
        task_config("gsm8k")
    with pytest.raises(ValueError, match="chat messages but this model's tokenizer has no chat template"):
        encode_prompts(words, build_tokenizer())
    plain = problems_for("", 4, seed=0, task=WordTaskConfig(chat=False))
    with pytest.raises(ValueError, match="unknown to the tokenizer.*a real model"):
        encode_prompts(plain, build_tokenizer())


def test_an_echoed_answer_placeholder_does_not_hide_the_answer():
    """SmolLM2 greedy, verbatim: the answer, then the prompt's instruction echoed (it scored 0 before the fix)."""
    from tltlib.tasks.problem import extract_answer, reward
    text = 'She has 10 pencils left over.\n#### 10\nThe answer is "#### <number>".'
    assert extract_answer(text) == "10" and reward(text, "10") == 1.0
    assert extract_answer('The answer is "#### <number>".') is None


def test_worked_solutions_show_every_step_and_end_in_the_answer_line():
    """Each problem carries a worked solution (the SFT warm start's target): the start count, one line per
    operation with arithmetic that evaluates to the next count, and GSM8K's answer line, which the task's verifier
    scores 1; adding it left the problems of a seed as they were."""
    import re

    from tltlib.tasks.problem import reward
    problems = generate_word_problems(WordTaskConfig(), 300, seed=7)
    assert problems[0].prompt[0]["content"].startswith("Ava has 6 cards. She buys 28 more cards. How many cards")
    for p in problems:
        lines = p.meta["solution"].split("\n")
        counts = p.meta["counts"]
        assert len(lines) == p.meta["steps"] + 3 and lines[-1] == f"#### {p.answer}"
        assert reward(p.meta["solution"], p.answer) == 1.0
        for line, before, after in zip(lines[1:-2], counts, counts[1:]):
            parts = line.split(". ", 1)[1].rstrip(".").split(" = ")   # "6 + 5 * 4 = 6 + 20 = 26"
            assert str(before) in parts[0].split() and int(parts[-1]) == after, line
            assert all(re.fullmatch(r"\d+( [-+*/] \d+)*", e) and eval(e.replace("/", "//")) == after
                       for e in parts), line
