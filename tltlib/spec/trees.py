"""Draft trees: a batch of trees in verification order (:class:`DraftTree`), their attention masks (a node sees
itself and its ancestors), a chain as a tree, and the choice of the ``budget`` best nodes closed under ancestors.

Paper: TLT §5 (EAGLE-style tree drafting). Reference implementation: SGLang's EAGLE tree construction (top-k
expansion per level, the best nodes by cumulative draft probability).

Departures: none.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A batch of draft trees in verification order. Node 0 of every row is the root (the last committed token,
    already known); nodes ``1..N`` are drafts, parents before children.

    Attributes:
        tokens: ``[B, N+1]`` token of each node (the root's is the committed token).
        parents: ``[B, N+1]`` parent node index (-1 for the root).
        depth: ``[B, N+1]`` depth below the root (root 0).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def mask(self) -> torch.Tensor:
        """``[B, N+1, N+1]`` bool: node i may attend to node j iff j is i or one of its ancestors."""
        return ancestor_mask(self.parents, int(self.depth.max()))


def ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """``[B, N, N]`` reflexive ancestor relation from ``parents [B, N]`` (root -1): one pointer-jumping pass per
    tree level (``max_depth``; default: computed, one device sync)."""
    b, n = parents.shape
    dev = parents.device
    if max_depth is None:
        max_depth = n
    m = torch.eye(n, dtype=torch.bool, device=dev).expand(b, n, n).clone()
    rows, cols = torch.arange(b, device=dev)[:, None].expand(b, n), torch.arange(n, device=dev)[None].expand(b, n)
    cur = parents
    for _ in range(max_depth):
        up = cur >= 0
        m[rows[up], cols[up], cur[up]] = True
        cur = torch.where(up, parents.gather(1, cur.clamp_min(0)), -1)
    return m


def chain_tree(root: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """A chain as a tree: root ``[B]`` then drafts ``[B, G]``, each the child of the previous node."""
    b, g = drafts.shape
    idx = torch.arange(g + 1, device=drafts.device)
    return DraftTree(torch.cat([root[:, None], drafts], 1), (idx - 1).expand(b, g + 1).clone(),
                     idx.expand(b, g + 1).clone())


def select_nodes(scores: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices ``[B, budget]`` of the ``budget`` best candidate nodes, closed under ancestors, in verification
    order (by depth, then score).

    Args:
        scores: ``[B, M]`` cumulative draft log-probabilities of candidates (a child never scores above its parent).
        parents: ``[B, M]`` candidate index of each candidate's parent (-1 for children of the root).
        depth: ``[B, M]`` candidate depth (1 for children of the root).
    """
    m = scores.shape[1]
    budget = min(budget, m)
    # ties: the shallower node first, so a parent is never cut while its equally scored child is kept
    key = scores - depth.to(scores.dtype) * 1e-6
    top = torch.topk(key, budget, dim=1).indices                 # sorted by key, best first
    order = torch.argsort(depth.gather(1, top) * (budget + 1) + torch.arange(budget, device=top.device), dim=1)
    return top.gather(1, order)
