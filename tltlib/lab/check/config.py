"""What ``python -m tltlib check`` measures and how much: :class:`CheckConfig` (the user's sampling settings, the
sample sizes of each test, the rows and arms whose speed is measured) and the verdict every part returns
(:class:`Verdict`).

Paper: TLT §5 rests on SD being lossless and on a drafter that keeps up with the policy; this checks both on the
user's own model, drafter, sampling settings and machine.
Departures: none (tooling).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ...errors import BadInput
from ...spec.strategy import SpecStrategy

MIN_PROMPTS = 4
"""Fewest prompts the χ² test and the length test accept: the joint of the first tokens is compared prompt by
prompt, and a test over fewer prompts would say more about those prompts than about the sampler."""
MIN_CHI2_SAMPLES = 256
"""Fewest samples per arm (prompts x samples per prompt) of the χ² test of the first tokens."""


@dataclass(frozen=True)
class CheckConfig:
    """The settings of one check: the sampling the user's RL run uses and the size of each test."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts checked (GRPOConfig.temperature); must be > 0: at 0 there is no
    distribution to compare and greedy identity, which the check always runs, is what applies."""
    top_p: float = 1.0
    """Nucleus sampling (GRPOConfig.top_p)."""
    top_k: int = 0
    """Top-k sampling, 0 = off (GRPOConfig.top_k)."""
    max_new_tokens: int = 256
    """Longest response of the length test and of the drafter's responses (GRPOConfig.max_completion_length)."""
    prompts: int = 8
    """Prompts every test samples from (at least :data:`MIN_PROMPTS`)."""
    samples: int = 64
    """Samples per prompt and arm of the χ² test of the first tokens."""
    first_tokens: int = 3
    """Response tokens whose joint the χ² test compares (>= 2: the first is sampled before any SD step)."""
    windows: int = 2
    """Contexts per prompt of the χ² test: a sampled response cut where its next tokens carry the most entropy,
    this many places apart (where a sampler's error shows; the first tokens of a reasoning task are often fixed)."""
    length_samples: int = 8
    """Responses per prompt and arm of the response-length test."""
    greedy_tokens: int = 64
    """Tokens per prompt of the greedy identity test."""
    strategy: str = ""
    """The SD strategy the losslessness tests run at every decode iteration ("": chain-4 with a drafter, ngram-4
    without)."""
    arms: tuple = ()
    """Strategies whose speed is measured ((): chain-4 and tree-4x2-8 with a drafter, ngram-4, suffix-4-8)."""
    rows: tuple = (1, 4, 16)
    """Running rows at which each arm's speed is measured against plain decoding."""
    pay_tokens: int = 32
    """Tokens each row decodes in a speed measurement (EOS ignored)."""
    alpha: float = 1e-3
    """A losslessness test fails at p < alpha (each test's false-alarm rate on a lossless sampler)."""
    seed: int = 0
    """Seeds every sampler (the two arms of a test get different streams: they are independent samples)."""
    parts: tuple = ("lossless", "pays", "drafter")
    """Which parts run: ``lossless`` (greedy identity, χ², lengths, log-probs), ``pays`` (speed, the recommended
    threshold and arms, the tuner prior file), ``drafter`` (top-1 by depth, accept length)."""

    def __post_init__(self):
        if self.temperature == float("inf") or self.temperature != self.temperature:
            raise BadInput(f"check: temperature {self.temperature} is not a sampling temperature (at inf every token "
                           "is equally likely, whatever the model): give the temperature your RL rollouts sample at "
                           "(--temperature, GRPOConfig.temperature; e.g. 1.0)")
        if not self.temperature > 0:
            raise BadInput(f"check: temperature {self.temperature} samples greedily, so there is no distribution for "
                           "a χ² test to compare; greedy identity is what applies at temperature 0, and the check "
                           "runs it at any temperature: give the temperature your RL rollouts sample at "
                           "(--temperature, GRPOConfig.temperature; e.g. 1.0)")
        if self.prompts < MIN_PROMPTS:
            raise BadInput(f"check: {self.prompts} prompts are fewer than the χ² and length tests need: give at least "
                           f"{MIN_PROMPTS} (--prompts {MIN_PROMPTS}, default 8)")
        if self.prompts * self.samples < MIN_CHI2_SAMPLES:
            need = -(-MIN_CHI2_SAMPLES // self.prompts)
            raise BadInput(f"check: {self.prompts} prompts x {self.samples} samples = {self.prompts * self.samples} "
                           f"samples per arm, fewer than the χ² test needs ({MIN_CHI2_SAMPLES}): raise --samples to "
                           f"{need} or --prompts")
        if self.first_tokens < 2:
            raise BadInput(f"check: first_tokens={self.first_tokens}: the first response token is sampled by the "
                           "prefill, before any SD step; compare at least 2 (--first-tokens 3)")
        for name in ("windows", "length_samples", "greedy_tokens", "pay_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise BadInput(f"check: {name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.alpha < 0.5:
            raise BadInput(f"check: alpha is a significance level in (0, 0.5), got {self.alpha}")
        if not self.rows or min(self.rows) < 1:
            raise BadInput(f"check: rows must be running-row counts >= 1, got {self.rows}")
        unknown = set(self.parts) - {"lossless", "pays", "drafter"}
        if unknown or not self.parts:
            raise BadInput(f"check: unknown parts {sorted(unknown) or '(none given)'}; choose among lossless, pays, "
                           "drafter")
        for name in (self.strategy, *self.arms):
            if name:
                SpecStrategy.parse(name)            # raises with the syntax

    def settings(self) -> dict:
        return asdict(self)


@dataclass
class Verdict:
    """One test's outcome: ``status`` is ``pass``, ``fail`` (a losslessness failure makes the check exit non-zero),
    ``warn`` (SD does not pay, a drafter below its card) or ``info``; ``line`` says it in words with the numbers."""

    part: str
    name: str
    status: str
    line: str
    numbers: dict = field(default_factory=dict)
