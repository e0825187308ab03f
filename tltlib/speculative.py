"""Speculative decoding maths as pure functions: strategies, draft trees, tree masks and exact verification.

Verification keeps the output distribution *identical* to plain sampling from the target's processed distribution p
(temperature, top-k, top-p; see :mod:`tltlib.sampling`):

* **chains** (drafts sampled from the drafter's distribution q) use Leviathan et al.'s rule: accept draft d with
  probability min(1, p(d)/q(d)); at the first rejection sample from norm(max(0, p - q)); if all are accepted sample
  a bonus token from p (:func:`verify_chain`);
* **trees** (children chosen deterministically, top-k) use target-only inverse-CDF sampling over the siblings: draw
  u ~ U[0, 1), walk the children's target probabilities in order and take the first child whose running sum exceeds
  u; if none, sample from p with the children removed (the residual); at a leaf, sample from p
  (:func:`verify_tree`). Each step is inverse-CDF sampling of p, so the result is exactly p, whatever was drafted.
* at temperature 0 both accept a draft iff it is the target's argmax, which reproduces greedy decoding token for
  token.

Paper: TLT §5 (adaptive rollout engine, EAGLE-style tree drafting, strategies = (depth, top-k, tokens to verify)).
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

from dataclasses import dataclass

import torch

from .sampling import probs_from_logits, sample, uniforms

KINDS = ("off", "chain", "tree", "ngram", "suffix", "hybrid")


@dataclass(frozen=True)
class SpecStrategy:
    """One speculative-decoding strategy (an arm of the tuner).

    ``off`` decodes plainly; ``chain`` drafts ``depth`` tokens one after another; ``tree`` expands the ``top_k``
    best children of the ``top_k`` best nodes per level for ``depth`` levels and verifies the ``budget`` most
    probable nodes (SGLang's ``steps_topk_verifyTokens``); ``ngram`` proposes ``depth`` tokens copied from earlier
    text of the sequence or of its GRPO siblings (:mod:`tltlib.ngram`; model-free, no drafter needed); ``suffix``
    proposes a tree of at most ``budget`` nodes and ``depth`` levels from what followed the row's longest recurring
    suffix in its group and in earlier responses to its prompt (:mod:`tltlib.suffix`; model-free); ``hybrid`` drafts
    both the ``tree`` and a ``suffix`` tree of the same size and verifies, per row, the one with more expected
    accepted tokens (the drafter's path probabilities vs the suffix tree's empirical ones).

    Names round-trip: ``SpecStrategy.parse("tree-8x4-32") == SpecStrategy("tree", 8, 4, 32)``."""

    kind: str = "off"
    """``"off"``, ``"chain"``, ``"tree"``, ``"ngram"``, ``"suffix"`` or ``"hybrid"``."""
    depth: int = 1
    """Draft depth (tokens per chain, levels per tree)."""
    top_k: int = 1
    """Tree branching: children kept per node and nodes kept per level."""
    budget: int = 0
    """Tree: draft tokens verified per step (0 = every drafted node); suffix: at most this many (>= 1). Chains
    verify ``depth``."""

    def __hash__(self) -> int:                  # kept: strategies key the tuner's tables every decode iteration
        return self._hash

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.kind, self.depth, self.top_k, self.budget)))
        if self.kind not in KINDS:
            raise ValueError(f"unknown speculative strategy kind {self.kind!r}; choose one of {KINDS}")
        if self.depth < 1:
            raise ValueError(f"draft depth must be >= 1, got {self.depth}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.kind in ("tree", "hybrid") and self.budget and self.budget < self.depth:
            raise ValueError(f"verify budget ({self.budget}) must be >= the draft depth ({self.depth}) so the "
                             "deepest path fits; raise the budget or lower the depth")
        if self.kind == "suffix" and self.budget < max(self.depth, 1):
            raise ValueError(f"a suffix draft needs a budget of at least its depth ({self.depth}) draft nodes, got "
                             f"{self.budget}; write suffix-DEPTH-BUDGET, e.g. suffix-8-16")
        if self.kind in ("chain", "ngram", "suffix") and self.top_k != 1:
            raise ValueError(f"a {self.kind} draft has top_k == 1; use kind='tree' for branching")

    @classmethod
    def parse(cls, name: str) -> "SpecStrategy":
        """The strategy called ``name``: ``off``, ``chain-D``, ``ngram-D``, ``tree-DxK-N``, ``suffix-D-N`` or
        ``hybrid-DxK-N``."""
        text = str(name).strip()
        try:
            if text == "off":
                return cls()
            kind, _, rest = text.partition("-")
            if kind in ("chain", "ngram"):
                return cls(kind, int(rest))
            if kind == "suffix":
                d, _, budget = rest.partition("-")
                return cls("suffix", int(d), 1, int(budget))
            if kind in ("tree", "hybrid"):
                dk, _, budget = rest.partition("-")
                d, _, k = dk.partition("x")
                return cls(kind, int(d), int(k), int(budget))
        except ValueError as e:
            if "invalid literal" not in str(e):
                raise
        raise ValueError(f"cannot read speculative strategy {name!r}: write off, chain-DEPTH, ngram-DEPTH, "
                         "tree-DEPTHxTOPK-BUDGET, suffix-DEPTH-BUDGET or hybrid-DEPTHxTOPK-BUDGET (e.g. chain-4, "
                         "ngram-8, tree-8x4-32, suffix-8-16, hybrid-6x4-24)")

    @property
    def uses_drafter(self) -> bool:
        """Needs a learned drafter (chain, tree, hybrid); ``ngram``, ``suffix`` and ``off`` do not."""
        return self.kind in ("chain", "tree", "hybrid")

    @property
    def enabled(self) -> bool:
        return self.kind != "off"

    @property
    def max_nodes(self) -> int:
        """Draft nodes the tree expansion produces before the budget cut."""
        if self.kind in ("chain", "ngram"):
            return self.depth
        if self.kind == "suffix":
            return self.budget
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def verify_tokens(self) -> int:
        """Draft tokens sent to the target per step."""
        if self.kind == "off":
            return 0
        if self.kind in ("chain", "ngram"):
            return self.depth
        if self.kind == "suffix":
            return self.budget
        return min(self.budget or self.max_nodes, self.max_nodes)

    @property
    def name(self) -> str:
        if self.kind == "off":
            return "off"
        if self.kind in ("chain", "ngram"):
            return f"{self.kind}-{self.depth}"
        if self.kind == "suffix":
            return f"suffix-{self.depth}-{self.budget}"
        return f"{self.kind}-{self.depth}x{self.top_k}-{self.verify_tokens}"


OFF = SpecStrategy()


class StrategySource:
    """What the rollout asks before every decode iteration: ``choose(iteration, active_rows) -> SpecStrategy``;
    after it, ``observe(...)`` reports what the iteration did (for tuners; the default ignores it). Subclass it, or
    pass a :class:`SpecStrategy` or a function to the engine (:func:`strategy_source` wraps them)."""

    wants_context = False
    """Whether :meth:`observe` needs the running rows' mean context (computing it costs the decode loop a sum)."""
    wants_backlog = False
    """Whether :meth:`choose` takes ``backlog=`` (the widest row's entries the drafter must catch up on before an
    SD step) and ``uniform_left=`` (while the running rows are at one length, the plain steps the longest may still
    take, else 0: an SD step would leave them ragged); host integers, free to pass."""

    def choose(self, iteration: int, active: int) -> SpecStrategy:
        raise NotImplementedError

    def observe(self, strategy: SpecStrategy, active: int, tokens: int, seconds: float, rows: int,
                context: float | None = None, accepted=None) -> None:
        """The iteration just run with ``strategy`` at ``active`` rows took ``seconds``; the ``rows`` of them that
        keep running emitted ``tokens``; ``context``: their mean cached tokens; ``accepted``: for an SD step, its
        histogram of rows by accepted drafts (``[depth + 1]``)."""


class FixedStrategy(StrategySource):
    """The same strategy at every decode iteration."""

    def __init__(self, strategy: SpecStrategy):
        self.strategy = strategy

    def choose(self, iteration: int, active: int) -> SpecStrategy:
        return self.strategy


class StrategyFunction(StrategySource):
    """A function ``(iteration, active_rows) -> SpecStrategy`` as a strategy source."""

    def __init__(self, fn):
        self.fn = fn

    def choose(self, iteration: int, active: int) -> SpecStrategy:
        return self.fn(iteration, active)


def strategy_source(strategy) -> StrategySource:
    """``None`` (off), a :class:`SpecStrategy`, a strategy name (``"chain-4"``), a function ``(iteration, active) ->
    SpecStrategy`` or a :class:`StrategySource` (or any object with ``choose``) -> a StrategySource."""
    if strategy is None:
        return FixedStrategy(OFF)
    if isinstance(strategy, str):
        return FixedStrategy(SpecStrategy.parse(strategy))
    if isinstance(strategy, SpecStrategy):
        return FixedStrategy(strategy)
    if hasattr(strategy, "choose"):
        return strategy
    if callable(strategy):
        return StrategyFunction(strategy)
    raise TypeError(f"strategy must be a SpecStrategy, a strategy name, a function (iteration, active) -> "
                    f"SpecStrategy or an object with choose(iteration, active); got {type(strategy).__name__}")


# ------------------------------------------------------------------------------------------------ chain
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


# ------------------------------------------------------------------------------------------------- trees
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


# ----------------------------------------------------------------------------------------- bookkeeping
def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. Thm 3.8: expected wall-time speedup (1 - a^(g+1)) / ((1 - a)(g c + 1))."""
    if alpha >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def alpha_from_accept_length(mean_len: float, gamma: int, tol: float = 1e-9) -> float:
    """The per-token acceptance rate a whose expected tokens per step (1 - a^(g+1)) / (1 - a) equals
    ``mean_len`` (bonus included), by bisection."""
    target = min(max(mean_len, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        val = (1 - mid ** (gamma + 1)) / (1 - mid) if mid < 1 else gamma + 1.0
        lo, hi = (mid, hi) if val < target else (lo, mid)
    return (lo + hi) / 2
