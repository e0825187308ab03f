"""A problem and how its answer is checked: the prompt with its ground truth, and the verifier every task and dataset
shares (the final answer of a response: ``\\boxed{x}``, else ``#### x`` / ``#x``; compared as normalised strings).

Paper: TLT §2 (GRPO with rule-based rewards). The verifier follows verl's GSM8K / MATH rule rewards (0/1 exact match
of the extracted final answer).

Departures: none.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """One prompt with its ground truth. ``prompt`` is text or chat messages (``[{"role", "content"}, ...]``)."""

    prompt: str | tuple
    answer: str
    meta: dict = field(default_factory=dict, compare=False)


_BOXED_RE = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_HASH_RE = re.compile(r"#+\s*(?!\"?<)([^\s#]+)")      # not a placeholder echoed from the prompt: #### <number>


def extract_answer(text: str) -> str | None:
    """The final answer in a response: the last ``\\boxed{...}``, else the last ``#### x`` / ``#x``; None if absent.

    A marked placeholder such as ``#### <number>`` is not an answer: small chat models echo the prompt's instruction
    after their answer (SmolLM2: ``#### 10`` then ``The answer is "#### <number>".``), which must not hide it."""
    boxed = _BOXED_RE.findall(text)
    if boxed:
        return normalize_answer(boxed[-1])
    marked = _HASH_RE.findall(text)
    return normalize_answer(marked[-1]) if marked else None


def normalize_answer(ans: str) -> str:
    """Strip spaces, ``$``, thousands separators and a trailing period (GSM8K-style numbers compare as strings)."""
    return ans.strip().strip("$").replace(",", "").rstrip(".").strip()


def reward(response: str, answer: str) -> float:
    """1.0 when the extracted final answer equals the ground truth, else 0.0 (always in [0, 1])."""
    got = extract_answer(response)
    return float(got is not None and got == normalize_answer(answer))
