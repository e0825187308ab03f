"""The word-problem task for real models: templated, seeded, verifiable multi-step arithmetic in GSM8K's format.

A problem is a short story about one person and one kind of item: a start count, then ``steps`` operations (buys
some more, gives some away, buys boxes of several, shares equally and keeps a share, ...), then the question. The
prompt is a chat message that asks for step-by-step reasoning ending in ``#### N`` (GSM8K's answer line), so
:func:`tltlib.tasks.prompts.prompt_text` applies the tokenizer's chat template and :func:`tltlib.tasks.problem.reward`
scores it
with the same verifier as the chain task and GSM8K::

    Mia has 14 marbles. She buys 3 bags with 6 marbles in each. Then she gives 9 marbles to her brother.
    How many marbles does Mia have now? Reason step by step, then give the final answer on its own line as
    "#### <number>".                                            -> answer 23

Every intermediate count stays a non-negative integer below 1000 (divisions are exact), so the answer is
unambiguous. ``meta["solution"]`` is a worked solution in the same format (each operation with its arithmetic, then
``#### N``), the target of a supervised warm start for a model that cannot yet do the task. Steps are
Zipf-distributed (exponent 1.0 over 1..8 by default): most problems are short, a few long — and a model's responses
grow with them, which is the long tail the rollout engine must handle.

Departure: GSM8K's problems are written by people and need varied reasoning; these are generated from a dozen
templates, so a model can learn them quickly (room for RL) while staying checkable without a dataset download.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ..errors import BadInput
from .problem import Problem

NAMES = (("Mia", "She", "her"), ("Tom", "He", "his"), ("Ava", "She", "her"), ("Leo", "He", "his"),
         ("Zoe", "She", "her"), ("Sam", "He", "his"), ("Lily", "She", "her"), ("Max", "He", "his"))
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells")
RELATIVES = ("brother", "sister", "friend", "cousin", "neighbour", "teacher")
INSTRUCTION = ('Reason step by step, then give the final answer on its own line as "#### <number>".')
LIMIT = 1000


@dataclass(frozen=True)
class WordTaskConfig:
    """Shape of the word-problem distribution."""

    min_steps: int = 1
    """Fewest operations after the start count."""
    max_steps: int = 8
    """Most operations."""
    zipf_exponent: float = 1.0
    """P(n steps) ∝ n^-exponent (0: uniform)."""
    chat: bool = True
    """Prompts as chat messages (the tokenizer's chat template applies); False: plain text."""

    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps <= 20:
            raise BadInput(f"need 1 <= min_steps <= max_steps <= 20, got {self.min_steps}, {self.max_steps}")
        if self.zipf_exponent < 0:
            raise BadInput(f"zipf_exponent must be >= 0, got {self.zipf_exponent}")


def _operation(rng: random.Random, count: int, he: str, his: str, item: str) -> tuple[str, int, str]:
    """One sentence changing ``count``, the new count (always an integer in [0, LIMIT)) and the arithmetic that
    gives it (``"14 + 3 * 6 = 32"``, for worked solutions)."""
    kinds = ["buy", "find", "boxes"]
    if count >= 2:
        kinds += ["give", "lose", "share"]
    if 0 < count < LIMIT // 3:
        kinds.append("double")
    while True:
        kind = rng.choice(kinds)
        if kind == "buy":
            n = rng.randint(2, 30)
            text, new = f"{he} buys {n} more {item}.", count + n
            work = f"{count} + {n} = {new}"
        elif kind == "find":
            n = rng.randint(1, 15)
            text, new = f"{he} finds {n} {item} under the table.", count + n
            work = f"{count} + {n} = {new}"
        elif kind == "boxes":
            n, m = rng.randint(2, 6), rng.randint(2, 12)
            text, new = f"{he} buys {n} bags with {m} {item} in each.", count + n * m
            work = f"{count} + {n} * {m} = {count} + {n * m} = {new}"
        elif kind == "give":
            n = rng.randint(1, count - 1)
            text, new = f"Then {he.lower()} gives {n} {item} to {his} {rng.choice(RELATIVES)}.", count - n
            work = f"{count} - {n} = {new}"
        elif kind == "lose":
            n = rng.randint(1, max(1, count // 3))
            text, new = f"{he} loses {n} of {his} {item}.", count - n
            work = f"{count} - {n} = {new}"
        elif kind == "share":
            ways = [k for k in range(2, 7) if count % k == 0]
            if not ways:
                continue
            k = rng.choice(ways)
            text = (f"{he} shares {his} {item} equally among {k} people, {his} {k - 1} friends and "
                    f"{'herself' if he == 'She' else 'himself'}, and keeps one share.")
            new = count // k
            work = f"{count} / {k} = {new}"
        else:
            text, new = f"The number of {his} {item} doubles.", 2 * count
            work = f"2 * {count} = {new}"
        if 0 <= new < LIMIT:
            return text, new, work


def make_word_problem(cfg: WordTaskConfig, rng: random.Random, steps: int | None = None) -> Problem:
    """One word problem (``steps`` overrides the Zipf draw); ``meta`` holds the steps and every intermediate count."""
    n = steps if steps is not None else rng.choices(range(cfg.min_steps, cfg.max_steps + 1),
                                                    weights=[k ** -cfg.zipf_exponent for k in
                                                             range(cfg.min_steps, cfg.max_steps + 1)])[0]
    name, he, his = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    count = rng.randint(3, 40)
    counts, sentences, work = [count], [f"{name} has {count} {item}."], []
    for _ in range(n):
        text, count, arithmetic = _operation(rng, count, he, his, item)
        sentences.append(text)
        counts.append(count)
        work.append(arithmetic)
    question = " ".join(sentences) + f" How many {item} does {name} have now? {INSTRUCTION}"
    prompt = ({"role": "user", "content": question},) if cfg.chat else question
    solution = "\n".join([f"{name} starts with {counts[0]} {item}."]
                          + [f"{text} {arithmetic}." for text, arithmetic in zip(sentences[1:], work)]
                          + [f"{name} has {count} {item} now.", f"#### {count}"])
    return Problem(prompt, str(count), {"steps": n, "source": "words", "counts": counts, "solution": solution})


def generate_word_problems(cfg: WordTaskConfig, count: int, seed: int, steps: int | None = None) -> list[Problem]:
    """``count`` word problems from a seeded generator (same seed, same problems)."""
    rng = random.Random(seed)
    return [make_word_problem(cfg, rng, steps) for _ in range(count)]
