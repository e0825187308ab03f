"""Exact verification of drafts: the rules that keep speculative decoding lossless.

Verification keeps the output distribution *identical* to plain sampling from the target's processed distribution p
(temperature, top-k, top-p; see :mod:`tltlib.model.sampling`):

* **chains** (drafts sampled from the drafter's distribution q) use Leviathan et al.'s rule: accept draft d with
  probability min(1, p(d)/q(d)); at the first rejection sample from norm(max(0, p - q)); if all are accepted sample
  a bonus token from p (:func:`verify_chain`);
* **trees** (children chosen deterministically, top-k) use target-only inverse-CDF sampling over the siblings: draw
  u ~ U[0, 1), walk the children's target probabilities in order and take the first child whose running sum exceeds
  u; if none, sample from p with the children removed (the residual); at a leaf, sample from p
  (:func:`verify_tree`). Each step is inverse-CDF sampling of p, so the result is exactly p, whatever was drafted.
* at temperature 0 both accept a draft iff it is the target's argmax, which reproduces greedy decoding token for
  token.

Paper: TLT §5 (lossless verification of chains and trees).
Reference implementation: SGLang's ``tree_speculative_sampling_target_only`` (the tree rule above) and
``verify_tree_greedy``.

Departures:
1. Chains verify with the drafter's q (Leviathan), which accepts more than the target-only rule when drafts are
   sampled; the reference engine always uses target-only.
2. No acceptance thresholds or greedy fallbacks exist anywhere (the reference has both; both are lossy at T > 0).
3. A residual with no mass left (p == q on the rejected support, a probability-zero event in exact arithmetic) falls
   back to p instead of dividing by zero.
"""
from __future__ import annotations

import torch

from ..model.sampling import probs_from_logits, sample, uniforms
from .trees import DraftTree


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Leviathan's residual norm(max(0, p - q)) over the last dim; rows with no mass left fall back to p."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


def verify_chain(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan rejection sampling of a batch of drafted chains.

    Args:
        p: ``[B, G+1, V]`` target distributions at the G draft positions plus the bonus position.
        q: ``[B, G, V]`` draft distributions the drafts were sampled from.
        drafts: ``[B, G]`` drafted tokens.

    Returns:
        (accepted ``[B]`` number of leading drafts kept, next ``[B]`` the token sampled after them).
    """
    b, g = drafts.shape
    p_d = p[:, :g].gather(-1, drafts[..., None])[..., 0]
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    u = uniforms(b, g, generator=generator, device=p.device)
    ok = u * q_d.double() < p_d.double()                 # u < min(1, p/q) without dividing
    accepted = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(b, device=p.device)
    at = accepted.clamp(max=g - 1)
    dist = residual(p[rows, at], q[rows, at])
    dist = torch.where((accepted == g)[:, None], p[:, g], dist)
    return accepted, sample(dist, generator)


def verify_chain_point(p: torch.Tensor, drafts: torch.Tensor,
                       generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan rejection for *deterministic* drafts (q a point mass on each draft, e.g. n-gram proposals):
    accept draft d with probability p(d); at the first rejection sample from p with d removed; bonus from p.

    Args:
        p: ``[B, G+1, V]`` target distributions at the G draft positions plus the bonus position.
        drafts: ``[B, G]`` proposed tokens (any function of earlier text, never of this step's randomness).

    Returns:
        (accepted ``[B]``, next ``[B]``) as :func:`verify_chain`.
    """
    b, g = drafts.shape
    p_d = p[:, :g].gather(-1, drafts[..., None])[..., 0]
    u = uniforms(b, g, generator=generator, device=p.device)
    accepted = (u < p_d.double()).long().cumprod(-1).sum(-1)
    rows = torch.arange(b, device=p.device)
    at = accepted.clamp(max=g - 1)
    p_at = p[rows, at]
    dist = residual(p_at, torch.zeros_like(p_at).scatter_(1, drafts[rows, at][:, None], 1.0))
    dist = torch.where((accepted == g)[:, None], p[:, g], dist)
    return accepted, sample(dist, generator)


def verify_chain_greedy(target_argmax: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chains: keep drafts while they equal the target's argmax ``[B, G+1]``; next = argmax after them."""
    g = drafts.shape[1]
    accepted = (drafts == target_argmax[:, :g]).long().cumprod(-1).sum(-1)
    return accepted, target_argmax.gather(1, accepted[:, None])[:, 0]


def verify_tree(logits: torch.Tensor, tree: DraftTree, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact verification of a batch of draft trees (target-only inverse-CDF over siblings, residual, bonus).

    Args:
        logits: ``[B, N+1, V]`` target logits at every node (node i's logits give the distribution after it).
        tree: the drafted trees.
        temperature, top_k, top_p: the sampling settings (temperature 0 = greedy acceptance).

    Returns:
        (path ``[B, D]`` accepted node indices in order, -1 padded; accepted ``[B]`` their number; next ``[B]`` the
        token sampled after the last accepted node).
    """
    b, n = tree.tokens.shape
    dev = logits.device
    rows = torch.arange(b, device=dev)
    max_depth = int(tree.depth.max())
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    walking = torch.ones(b, dtype=torch.bool, device=dev)
    path = torch.full((b, max_depth), -1, dtype=torch.long, device=dev)
    nxt = torch.zeros(b, dtype=torch.long, device=dev)
    accepted = torch.zeros(b, dtype=torch.long, device=dev)
    for level in range(max_depth + 1):
        is_child = (tree.parents == cur[:, None]) & walking[:, None]          # [B, N+1]
        lg = logits[rows, cur]                                                  # [B, V]
        if temperature == 0:
            best = lg.argmax(-1)
            hit = is_child & (tree.tokens == best[:, None])
            chosen = hit.any(1)
            child = hit.float().argmax(1)
            token_if_stop = best
        else:
            p = probs_from_logits(lg, temperature, top_k, top_p)
            child_p = torch.where(is_child, p.gather(1, tree.tokens), 0.0)
            u = uniforms(b, generator=generator, device=dev)
            cum = child_p.double().cumsum(1)
            over = (cum > u[:, None]) & is_child
            chosen = over.any(1)
            child = over.float().argmax(1)
            res = drop_children(p, tree, is_child)
            token_if_stop = sample(res, generator)
        stop = walking & ~chosen
        nxt = torch.where(stop, token_if_stop, nxt)
        go = walking & chosen
        if level < max_depth:
            path[:, level] = torch.where(go, child, path[:, level])
        accepted += go.long()
        cur = torch.where(go, child, cur)
        walking = go
        if not bool(walking.any()):
            break
    return path, accepted, nxt


def drop_children(p: torch.Tensor, tree: DraftTree, is_child: torch.Tensor) -> torch.Tensor:
    """p with the children's tokens removed, renormalised; p itself where nothing is left (measure zero)."""
    drop = torch.zeros_like(p).scatter_add_(1, tree.tokens, is_child.to(p.dtype)) > 0   # duplicates add up
    r = p.masked_fill(drop, 0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)
