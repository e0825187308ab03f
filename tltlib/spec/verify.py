"""Exact verification of drafts: the rules that keep speculative decoding lossless.

Verification keeps the output distribution *identical* to plain sampling from the target's processed distribution p
(temperature, top-k, top-p; see :mod:`tltlib.model.sampling`):

* **chains** (drafts sampled from the drafter's distribution q) use Leviathan et al.'s rule: accept draft d with
  probability min(1, p(d)/q(d)); at the first rejection sample from norm(max(0, p - q)); if all are accepted sample
  a bonus token from p (:func:`verify_chain`);
* **chains** verified as a **block** (``chain-D:block``; Sun et al. 2024, "Block Verification Accelerates Speculative
  Decoding"): the longest prefix is kept by a joint rule over the whole block, then the next token drawn from a
  weighted residual (:func:`verify_chain_block`); lossless, and keeps at least as many drafts in expectation;
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


def block_weights(p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """Block verification's running weights ``w_i = min(w_{i-1} p_i(d_i) / q_i(d_i), 1)``, ``w_0 = 1``.

    Args: p_d, q_d: ``[B, G]`` the target's and the drafter's probabilities of the drafts (float64).
    Returns: ``[B, G+1]`` float64 (column i: the weight after the first i drafts)."""
    ratio = p_d / q_d.clamp_min(1e-300)
    w = [torch.ones_like(ratio[:, 0])]
    for i in range(ratio.shape[1]):
        w.append(torch.minimum(w[-1] * ratio[:, i], torch.ones_like(w[-1])))
    return torch.stack(w, 1)


def block_residuals(w: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The unnormalised residuals ``max(w_i p_{i+1} - q_{i+1}, 0)`` after each prefix of i < G drafts.

    Args: w: ``[B, G+1]`` :func:`block_weights`; p: ``[B, G+1, V]``; q: ``[B, G, V]``.
    Returns: ``[B, G, V]`` float64."""
    g = q.shape[1]
    return (w[:, :g, None] * p[:, :g].double() - q.double()).clamp_min(0.0)


def block_stop_probs(w: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Each prefix's chance ``h_i`` to be the one kept if no longer one is: ``mass_i / (mass_i + 1 - w_i)`` for
    i < G (1 where both are 0: ``w_0 = 1`` with p == q), ``w_G`` for the whole block.

    Args: w: ``[B, G+1]``; mass: ``[B, G]`` the residuals' sums. Returns: ``[B, G+1]`` float64 in [0, 1]."""
    g = mass.shape[1]
    den = mass + 1.0 - w[:, :g]
    h = torch.where(den > 0, mass / den.clamp_min(1e-300), torch.ones_like(mass))
    return torch.cat([h, w[:, g:]], 1)


def verify_chain_block(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                       generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding") of a batch of
    drafted chains: the whole block is judged jointly, so a prefix may be kept past a draft that token-wise
    verification would have rejected; lossless, and it keeps at least as many drafts in expectation.

    Each prefix length i gets an independent uniform; the longest i whose uniform is under :func:`block_stop_probs`
    ``h_i`` is kept (i = 0 always qualifies), then the next token is drawn from the normalised residual
    ``max(w_i p_{i+1} - q_{i+1}, 0)`` (:func:`block_residuals`), or from the bonus distribution when the whole block
    is kept. With one draft this is Leviathan's rule.

    Args / Returns: as :func:`verify_chain` (``p [B, G+1, V]``, ``q [B, G, V]``, ``drafts [B, G]``; ``(accepted
    [B], next [B])``)."""
    b, g = drafts.shape
    p_d = p[:, :g].gather(-1, drafts[..., None])[..., 0].double()
    q_d = q.gather(-1, drafts[..., None])[..., 0].double()
    w = block_weights(p_d, q_d)
    res = block_residuals(w, p, q)
    h = block_stop_probs(w, res.sum(-1))
    u = uniforms(b, g, generator=generator, device=p.device)
    ok = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=p.device), u < h[:, 1:]], 1)      # [B, G+1]
    accepted = (ok.long() * torch.arange(g + 1, device=p.device)).amax(-1)                      # the longest kept
    rows = torch.arange(b, device=p.device)
    at = accepted.clamp(max=g - 1)
    r = res[rows, at]
    mass = r.sum(-1, keepdim=True)
    dist = torch.where(mass > 0, r / mass.clamp_min(1e-300), p[rows, at].double())
    dist = torch.where((accepted == g)[:, None], p[:, g].double(), dist)
    return accepted, sample(dist, generator)


def expected_accepted(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, rule: str = "token") -> torch.Tensor:
    """The expected number of drafts kept by ``rule`` ("token": :func:`verify_chain`; "block":
    :func:`verify_chain_block`) on these very drafts, exactly (no sampling): what the two rules are compared by on
    the same drafts.

    Args: p ``[B, G+1, V]``, q ``[B, G, V]``, drafts ``[B, G]`` as :func:`verify_chain`. Returns: ``[B]`` float64."""
    g = drafts.shape[1]
    p_d = p[:, :g].gather(-1, drafts[..., None])[..., 0].double()
    q_d = q.gather(-1, drafts[..., None])[..., 0].double()
    if rule == "token":
        return torch.minimum(p_d / q_d.clamp_min(1e-300), torch.ones_like(p_d)).cumprod(-1).sum(-1)
    w = block_weights(p_d, q_d)
    h = block_stop_probs(w, block_residuals(w, p, q).sum(-1))
    # P(tau = j) = h_j * prod_{i > j} (1 - h_i) for j >= 1 (tau = 0 takes the rest)
    later = torch.cat([torch.flip(torch.cumprod(torch.flip(1 - h[:, 1:], [1]), 1), [1])[:, 1:],
                       torch.ones_like(h[:, :1])], 1)                         # [B, G]: prod_{i > j} (1 - h_i)
    return (h[:, 1:] * later * torch.arange(1, g + 1, dtype=torch.float64, device=p.device)).sum(-1)


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
