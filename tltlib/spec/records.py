"""What a decode iteration emitted (:class:`Emitted`, plain or SD, per row) and everything one SD step decided
(:class:`SpecTrace`, for teaching and debugging).

Departures: none (data).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .strategy import SpecStrategy
from .trees import DraftTree


@dataclass
class Emitted:
    """What one decode iteration (plain or SD) emitted, per row (the first ``count[r]`` entries are valid).

    Attributes:
        tokens: ``[B, M]`` emitted tokens (accepted drafts, then the sampled token).
        count: ``[B]`` tokens emitted.
        logprobs: ``[B, M]`` their log-probabilities under the sampling distribution.
        hidden: ``[B, M, H]`` the target hidden state that produced each emitted token.
        accepted: ``[B]`` drafts accepted (0 for a plain iteration).
        drafted: draft tokens verified per row (0 for a plain iteration).
        draft_s, verify_s: wall time of drafting (catch-up included) and of the target forward + acceptance.
        catchup_s: the part of ``draft_s`` spent feeding a backlog left by plain iterations (a cost of switching SD
            on, charged when the tuner chooses, not of the arm that pays it, so its reward leaves it out); 0 when the
            iteration before was an SD step: feeding that step's tokens is part of every SD step's cost.
    """

    tokens: torch.Tensor
    count: torch.Tensor
    logprobs: torch.Tensor
    hidden: torch.Tensor
    accepted: torch.Tensor
    drafted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    catchup_s: float = 0.0


@dataclass
class SpecTrace:
    """Everything one SD step decided, for teaching and debugging (row-batched tensors).

    Attributes:
        strategy: the strategy used.
        tree: the verified draft tree (node 0 = the root, the last emitted token).
        q: ``[B, N+1]`` drafter probability of each node's token given its parent (root: 1).
        p: ``[B, N+1]`` target probability of each node's token given the path to it (root: 1).
        path, accepted, next: the verification result (see :func:`tltlib.spec.strategy.verify_tree`).
        final_dist: ``[B, V]`` the distribution the token after the accepted drafts was drawn from
            (the residual after a rejection, or the target's p after a fully accepted path).
        bonus: ``[B]`` bool, the whole path was accepted (a bonus token, not a residual sample).
        target_dist: ``[B, V]`` the target's p after the accepted path (what the residual is cut from).
    """

    strategy: SpecStrategy
    tree: DraftTree
    q: torch.Tensor
    p: torch.Tensor
    path: torch.Tensor
    accepted: torch.Tensor
    next: torch.Tensor
    final_dist: torch.Tensor
    bonus: torch.Tensor
    target_dist: torch.Tensor
