"""What the phases of an RL step hand each other (:meth:`tltlib.rl.trainer.GRPOTrainer.step`): the scored
completions (:class:`Completions`), this worker's share of the batch as the update reads it (:class:`UpdateBatch`)
and the update's statistics (:class:`LossStats`).

Departures: none (data).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..model.logprobs import SequenceBatch


@dataclass
class Completions:
    """Per-completion numbers of an RL step, one row per completion (a GRPO group's rows consecutive): this
    worker's after scoring, every worker's after :meth:`World.gather`."""

    reward: torch.Tensor
    """``[N]`` float: the weighted sum of the reward functions."""
    per_func: torch.Tensor
    """``[N, F]`` float: each reward function's value (NaN where it returned None)."""
    length: torch.Tensor
    """``[N]`` int: response tokens."""
    counted: torch.Tensor
    """``[N]`` bool: the completion carries loss (False: truncated, with ``mask_truncated_completions``)."""

    def gather(self, world, what: str) -> "Completions":
        return Completions(**world.gather(asdict(self), what))

    @property
    def counted_tokens(self) -> int:
        """Response tokens that carry loss (the ``dapo`` normaliser)."""
        return int((self.length * self.counted).sum())


@dataclass
class UpdateBatch:
    """This worker's completions as the update reads them, and the whole batch they are normalised by."""

    prompts: list
    """Prompt token ids of each of this worker's completions."""
    responses: list
    """Response token ids of each."""
    advantages: torch.Tensor
    """``[n]`` group advantages (computed over the whole batch)."""
    micro_batches: list
    """Length-bucketed micro-batches: lists of indices into this worker's completions."""
    whole: Completions
    """The whole batch (every worker's completions)."""
    mine: Completions
    """This worker's completions."""

    def sequence_batch(self, index, pad_id: int, device) -> SequenceBatch:
        return SequenceBatch.build(self.prompts, self.responses, index, pad_id, device)

    @property
    def lengths(self) -> list[int]:
        """Prompt + response tokens of each of this worker's completions."""
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]


@dataclass
class LossStats:
    """The update's statistics, averaged over ``num_iterations``: one worker's shares, or the whole batch's."""

    loss: float = 0.0
    kl: float = 0.0
    """Mean per-token KL to the reference policy (0 without one)."""
    clip_frac: float = 0.0
    """Share of counted tokens whose ratio was clipped."""
    grad_norm: float = 0.0
    """Gradient norm of the last iteration, before clipping."""
    moved: float = math.nan
    """Share of the policy's weights that the last iteration's AdamW step changed (a bf16/fp16 policy, whose float32
    master weights move by less than a rounding step at small learning rates; nan for a float32 policy)."""

    def summed(self, world) -> "LossStats":
        """The whole batch's statistics: every worker's shares added (the gradient norm is already global)."""
        sums = world.gather({k: torch.tensor([getattr(self, k)], dtype=torch.float64)
                             for k in ("loss", "kl", "clip_frac")}, "reached the all-gather of the loss statistics")
        return LossStats(**{k: float(v.sum()) for k, v in sums.items()}, grad_norm=self.grad_norm, moved=self.moved)
