"""GRPO: the configuration (TRL's GRPOConfig names and semantics), group advantages, the clipped policy loss by
loss type, the KL to a reference policy, and reward functions with TRL's signature.

**Advantages** (TRL): for rewards r of a batch laid out as consecutive groups of G completions of one prompt,
A_i = r_i - mean(group), divided by (std + 1e-4) where std is the group's (``scale_rewards="group"``), the batch's
(``"batch"``) or nothing (``"none"``); std is the unbiased sample standard deviation, as ``torch.std``.

**Loss** per token: ratio rho = exp(logp - logp_old); -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A),
plus beta x KL(pi || pi_ref) estimated per token by exp(ref - logp) - (ref - logp) - 1 (Schulman's k3, as TRL).
Aggregation by ``loss_type``: ``"grpo"`` averages each completion's tokens, then the completions; ``"dapo"`` sums
all tokens and divides by the batch's completion-token count; ``"dr_grpo"`` divides the sum by completions x
``max_completion_length``. With ``num_iterations == 1`` logp_old is logp detached (rho = 1, as TRL).

**Reward functions** have TRL's signature ``f(prompts, completions, **columns) -> list[float | None]``: one value
per completion (None = not applicable: ignored, as TRL's nansum), ``columns`` holding the dataset's columns
repeated per completion (here ``answer`` and the problems' metadata). Several functions are summed with
``reward_weights``.

Paper: TLT §2 (GRPO as the RL algorithm whose rollout TLT accelerates; TLT leaves the algorithm unchanged).
Peers: TRL ``GRPOTrainer`` (names, defaults: loss_type "dapo", beta 0.0, epsilon 0.2, scale_rewards "group",
num_iterations 1), verl ``core_algos``.

Departures:
1. The loss is normalised by the *whole* batch (its completions and completion tokens), whatever the micro-batching,
   so gradient accumulation over length-bucketed micro-batches of unequal size gives exactly the full-batch
   gradient (TRL normalises "grpo" and "dr_grpo" per micro-batch and divides by the accumulation steps, which
   equals this only for equal micro-batches).
2. One optimizer step per iteration over the whole generation batch (TRL's ``steps_per_generation = 1``).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import BadInput, WrongType, kind
from ..tasks.problem import reward

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
MAX_SEED = 2 ** 63 - 1
"""The largest seed: torch's generators take 64-bit seeds, and a worker's or split's seed adds an offset."""


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO training settings, named as TRL's ``GRPOConfig`` (fields TRL lacks are marked "tltlib")."""

    num_generations: int = 8
    """G: completions per prompt (>= 2: the advantage compares a completion with its group)."""
    generation_batch_size: int = 64
    """Completions per RL step (prompts per step = this / num_generations)."""
    max_completion_length: int = 256
    """Most tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature of the rollout (and of the log-probabilities of the loss); > 0: at 0 a group's
    completions are all the greedy one and GRPO has nothing to compare."""
    top_p: float = 1.0
    """Nucleus sampling (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    learning_rate: float = 1e-6
    """AdamW learning rate of the policy (constant)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip (0 = no clipping; the norm is still reported)."""
    beta: float = 0.0
    """KL coefficient to the frozen reference policy (0 = no reference model is loaded)."""
    epsilon: float = 0.2
    """Lower clip range: ratio >= 1 - epsilon."""
    epsilon_high: float | None = None
    """Upper clip range: ratio <= 1 + epsilon_high (None = epsilon; DAPO's clip-higher uses 0.28)."""
    loss_type: str = "dapo"
    """``"grpo"``, ``"dapo"`` or ``"dr_grpo"`` (see the module docstring)."""
    scale_rewards: str = "group"
    """Advantage scaling: ``"group"``, ``"batch"`` or ``"none"``."""
    mask_truncated_completions: bool = False
    """Completions cut at max_completion_length carry no loss (DAPO's overlong filtering)."""
    num_iterations: int = 1
    """Policy updates per generation batch (mu in the GRPO paper)."""
    reward_weights: tuple[float, ...] | None = None
    """Weight of each reward function (None = all 1)."""
    max_steps: int = 10
    """RL steps to train."""
    seed: int = 42
    """Seeds prompt order, sampling and the reference copy (>= 0)."""
    save_steps: int = 0
    """Checkpoint every this many steps into the output folder (0 = only at the end, if one is given)."""
    micro_batch_tokens: int = 4096
    """tltlib: padded tokens per forward/backward micro-batch (length-bucketed; bounds activation memory)."""
    logprob_chunk: int = 2048
    """tltlib: response tokens per chunk of LM-head logits (bounds [chunk, vocab] memory)."""

    def __post_init__(self):
        if self.num_generations < 2:
            raise BadInput(f"num_generations must be >= 2 (GRPO's advantage compares each completion with the "
                           f"others of its group), got {self.num_generations}")
        if self.generation_batch_size < 1 or self.generation_batch_size % self.num_generations:
            raise BadInput(f"generation_batch_size ({self.generation_batch_size}) must be a positive multiple of "
                           f"num_generations ({self.num_generations}): every prompt gets a whole group")
        if self.loss_type not in LOSS_TYPES:
            raise BadInput(f"unknown loss_type {self.loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise BadInput(f"unknown scale_rewards {self.scale_rewards!r}; choose one of "
                           f"{', '.join(SCALE_REWARDS)}")
        for name in ("max_completion_length", "num_iterations", "max_steps", "micro_batch_tokens", "logprob_chunk"):
            if getattr(self, name) < 1:
                raise BadInput(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise BadInput(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0:
            raise BadInput("temperature 0 samples every completion of a group greedily: they are identical, every "
                           "advantage is 0, the loss and gradient are 0 and RL learns nothing; use a sampling "
                           "temperature such as 1.0 (greedy held-out accuracy is measured by evaluate)")
        if not 0 <= self.seed <= MAX_SEED:
            raise BadInput(f"seed must lie in [0, 2**63 - 1] (torch's generators take 64-bit seeds, and each worker's "
                           f"and split's seed is this plus an offset), got {self.seed}; choose a smaller seed such "
                           "as 42")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise BadInput(f"need 0 < top_p <= 1 and top_k >= 0, got top_p={self.top_p}, top_k={self.top_k}")
        if not self.learning_rate > 0:
            raise BadInput(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.max_grad_norm < 0 or self.beta < 0 or self.weight_decay < 0 or self.save_steps < 0:
            raise BadInput("max_grad_norm, beta, weight_decay and save_steps must be >= 0")
        finite = lambda w: isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)  # noqa: E731
        if self.reward_weights is not None and not all(finite(w) for w in self.reward_weights):
            raise BadInput(f"reward_weights must be finite numbers, one per reward function, got "
                           f"{list(self.reward_weights)}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise BadInput(f"adam_beta1 and adam_beta2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")
        if not 0 < self.epsilon < 1 or (self.epsilon_high is not None and not self.epsilon_high > 0):
            raise BadInput(f"need 0 < epsilon < 1 and epsilon_high > 0, got {self.epsilon}, {self.epsilon_high}")

    @property
    def prompts_per_step(self) -> int:
        return self.generation_batch_size // self.num_generations

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


# ------------------------------------------------------------------------------------------------ the maths
def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """``rewards [N]`` (N = groups x G, a group's completions consecutive) -> advantages ``[N]``."""
    if scale_rewards not in SCALE_REWARDS:
        raise BadInput(f"unknown scale_rewards {scale_rewards!r}; choose one of {', '.join(SCALE_REWARDS)}")
    grouped = rewards.view(-1, num_generations)
    adv = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    if scale_rewards == "group":
        adv = adv / (grouped.std(1).repeat_interleave(num_generations) + 1e-4)
    elif scale_rewards == "batch":
        adv = adv / (rewards.std() + 1e-4)
    return adv


def clipped_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, epsilon: float,
                       epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: ``logp, old_logp [B, T]``, ``advantages [B]`` -> (loss ``[B, T]``, bool
    ``[B, T]`` where the clip is active, i.e. the gradient is cut)."""
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    unclipped, clipped = ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * a
    return -torch.min(unclipped, clipped), clipped < unclipped


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, batch_completions: int,
                   batch_tokens: int, max_completion_length: int) -> torch.Tensor:
    """A micro-batch's share of the batch loss (sum the shares of all micro-batches to get the batch loss).

    Args:
        per_token: ``[B, T]`` loss of each token of the micro-batch's completions.
        mask: ``[B, T]`` tokens that count.
        batch_completions, batch_tokens: completions and counted tokens of the *whole* batch.
    """
    m = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / batch_completions
    if loss_type == "dapo":
        return (per_token * m).sum() / max(batch_tokens, 1)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (batch_completions * max_completion_length)
    raise BadInput(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")


# --------------------------------------------------------------------------------------------------- rewards
def accuracy_reward(prompts, completions, answer, **columns) -> list[float]:
    """1.0 when a completion's final answer (``#### x``, ``\\boxed{x}``, ``#x``) equals the ground truth, else 0.0."""
    return [reward(_completion_text(c, i), a) for i, (c, a) in enumerate(zip(completions, answer))]


_ANSWER_LINE_RE = re.compile(r"\S[^\n]*\n\s*####[ \t]*-?[\d,]*\.?\d+[ \t]*\.?\s*$", re.S)


def _completion_text(c, i: int) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, (list, tuple)) and c and isinstance(c[-1], dict) and isinstance(c[-1].get("content"), str):
        return c[-1]["content"]
    raise WrongType(f"completion {i} is {type(c).__name__} {str(c)[:60]!r}: a reward function takes completions as "
                    "text or as chat messages [{'role': 'assistant', 'content': ...}] (TRL's two forms)")


def format_reward(prompts, completions, **columns) -> list[float]:
    """1.0 when a completion reasons first and ends with its answer alone on the last line, ``#### <number>``
    (GSM8K's answer line, what the word task's prompt asks for), else 0.0 — whatever the number: it rewards the
    form that :func:`accuracy_reward` can read, so a model that does not yet answer right still gets a signal
    (TRL's ``format_reward`` recipes score their ``<think>...</think><answer>`` form the same way)."""
    return [float(bool(_ANSWER_LINE_RE.search(_completion_text(c, i)))) for i, c in enumerate(completions)]


REWARD_FUNCS = {"accuracy": accuracy_reward, "format": format_reward}
"""The reward functions a parameter file names (``rewards: [accuracy, format]``)."""


def reward_funcs_named(names: Sequence[str], source: str = "rewards") -> list[Callable]:
    """The reward functions of :data:`REWARD_FUNCS` named in ``names`` (refused: unknown, repeated, none)."""
    if isinstance(names, str) or not names:
        raise BadInput(f"{source}: give a list of reward functions, e.g. [accuracy, format]")
    unknown = [n for n in names if n not in REWARD_FUNCS]
    if unknown:
        raise BadInput(f"{source}: unknown reward function {unknown[0]!r}; choose from {', '.join(REWARD_FUNCS)}")
    if len(set(names)) != len(names):
        raise BadInput(f"{source}: a reward function is named twice in {list(names)}")
    return [REWARD_FUNCS[n] for n in names]


def reward_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def compute_rewards(funcs: Sequence[Callable], prompts: list, completions: list, columns: dict[str, list],
                    weights: Sequence[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Call every reward function on the batch; returns (per function ``[N, F]`` with NaN for None, weighted sum
    ``[N]``). A function that raises, returns the wrong count or a non-number is named in the error, with the
    prompt concerned."""
    n = len(completions)
    if weights is not None and len(weights) != len(funcs):
        raise BadInput(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions")
    table = torch.full((n, len(funcs)), float("nan"))
    for j, fn in enumerate(funcs):
        name = reward_name(fn)
        try:
            out = fn(prompts=prompts, completions=completions, **columns)
        except Exception as e:                        # noqa: BLE001 - re-raised with the function named
            raise BadInput(f"reward function {name} raised {kind(e)}: {e} (batch of {n} completions; "
                           f"first prompt {str(prompts[0])[:80]!r})") from e
        if not isinstance(out, (list, tuple)) or len(out) != n:
            got = len(out) if isinstance(out, (list, tuple)) else type(out).__name__
            raise BadInput(f"reward function {name} returned {got} values for {n} completions; it must return "
                           "one float (or None) per completion, like TRL's reward functions")
        for i, v in enumerate(out):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise BadInput(f"reward function {name} returned {v!r} for completion {i} (prompt "
                               f"{str(prompts[i])[:80]!r}); rewards must be finite numbers or None")
            table[i, j] = float(v)
    w = torch.tensor(weights if weights is not None else [1.0] * len(funcs))
    return table, (table * w).nansum(1)
