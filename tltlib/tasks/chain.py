"""The chain task: the tiny reasoner's long-tailed reasoning task, generated and verified here.

Two start values and the label of the last step; each step adds the two latest values digit by
digit (mod 10, no carries, so 47+18=55), Fibonacci-style, writing its inputs and result, then the answer::

    prompt:    47 18 c?
    response:  a:47+18=55 b:18+55=63 c:55+63=18 #18<eos>

Each step is 11 tokens: a label (a-z, A-Z), the two operands (copies of earlier values), and the sum (the one real
computation). The number of steps is Zipf-distributed (exponent 1.2, 1..52): most problems are short, a few very long
— the long tail of reasoning-RL rollouts in miniature (median ~37 response tokens, p99 ~500). Errors compound with
length, so long problems are also the ones the model gets wrong, as in RL; and most tokens are predictable from
context, as in real reasoning traces, which is what makes speculative decoding pay. Digit-wise Fibonacci sequences
do not repeat within 52 steps for most starts, so a model cannot shortcut the sums by copying an earlier cycle.

Paper: TLT §2 (Fig. 2: a few responses reach the maximum length, with a large gap to the median).

Departures:
1. The paper trains on Eurus-2-RL math/code with real verifiers; this task is synthetic so that a model trained on a
   2-core CPU in minutes shows the same rollout-length shape (real datasets load through
   :mod:`tltlib.tasks.datasets`).
2. Reward is binary exact match of the final answer (verl's GSM8K/MATH rule rewards are also 0/1).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..errors import BadInput
from .problem import Problem
from .tokenizer import LABELS


@dataclass(frozen=True)
class ChainTaskConfig:
    """Shape of the chain task's problem distribution."""

    min_steps: int = 1
    """Fewest steps in a problem."""
    max_steps: int = 52
    """Most steps (at most 52: one label per step, a-z then A-Z)."""
    zipf_exponent: float = 1.2
    """P(n steps) ∝ n^-exponent; smaller means a heavier tail (0 gives uniform)."""
    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps <= len(LABELS):
            raise BadInput(f"need 1 <= min_steps <= max_steps <= {len(LABELS)}, got {self.min_steps}, "
                           f"{self.max_steps}")
        if self.zipf_exponent < 0:
            raise BadInput(f"zipf_exponent must be >= 0, got {self.zipf_exponent}")

    def step_weights(self) -> list[float]:
        """Unnormalised probabilities of min_steps..max_steps."""
        return [n ** -self.zipf_exponent for n in range(self.min_steps, self.max_steps + 1)]


def make_problem(cfg: ChainTaskConfig, rng: random.Random, steps: int | None = None) -> Problem:
    """One chain problem (``steps`` overrides the Zipf draw)."""
    n = steps if steps is not None else rng.choices(range(cfg.min_steps, cfg.max_steps + 1),
                                                    weights=cfg.step_weights())[0]
    if not 1 <= n <= len(LABELS):
        raise BadInput(f"steps must be in 1..{len(LABELS)}, got {n}")
    prompt = f"{rng.randrange(100):02d} {rng.randrange(100):02d} {LABELS[n - 1]}?"
    return Problem(prompt, solve(prompt).rsplit("#", 1)[1], {"steps": n, "source": "chain"})


def generate_problems(cfg: ChainTaskConfig, count: int, seed: int, steps: int | None = None) -> list[Problem]:
    """``count`` problems from a seeded generator (same seed, same problems)."""
    rng = random.Random(seed)
    return [make_problem(cfg, rng, steps) for _ in range(count)]


def digit_sum(x: int, z: int) -> int:
    """Digit-wise sum mod 10 of two two-digit values (no carries): ``digit_sum(47, 18) == 55``."""
    return (x // 10 + z // 10) % 10 * 10 + (x + z) % 10


_PROMPT_RE = re.compile(r"^(\d\d) (\d\d) ([a-zA-Z])\?$")


def solve(prompt: str) -> str:
    """The reference response (without ``<eos>``) of a chain prompt, e.g. ``"a:47+18=55 #55"``."""
    m = _PROMPT_RE.match(prompt)
    if not m:
        raise BadInput(f"not a chain-task prompt: {prompt!r} (expected like '47 18 c?')")
    x, z, last = int(m.group(1)), int(m.group(2)), LABELS.index(m.group(3))
    parts = []
    for i in range(last + 1):
        y = digit_sum(x, z)
        parts.append(f"{LABELS[i]}:{x:02d}+{z:02d}={y:02d}")
        x, z = z, y
    return " ".join(parts) + f" #{z:02d}"
