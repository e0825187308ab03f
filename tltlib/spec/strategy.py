"""Speculative-decoding strategies: what a decode iteration drafts (:class:`SpecStrategy`: ``off``, ``chain-D``,
``tree-DxK-N``, ``ngram-D``, ``suffix-D-N``, ``hybrid-DxK-N``) and what the rollout asks before each iteration
(:class:`StrategySource`: a fixed strategy, a function, or the adaptive controller).

Paper: TLT §5 (adaptive rollout engine; strategies = (depth, top-k, tokens to verify)).
Reference implementation: SGLang's ``steps_topk_verifyTokens`` (the tree strategy's three numbers).

Departures:
1. Model-free strategies (``ngram``, ``suffix``) and the ``hybrid`` of a learned tree and a suffix tree are arms
   beside the learned drafter's; the paper's engine tunes the learned drafter's shapes only.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInput, WrongType

KINDS = ("off", "chain", "tree", "ngram", "suffix", "hybrid")
RULES = ("token", "block")
"""How a chain's drafts are verified: ``token`` (Leviathan et al.'s rule, draft by draft) or ``block`` (Sun et al.
2024: the block judged jointly; lossless too, and keeps at least as many drafts; chains of a learned drafter only)."""


@dataclass(frozen=True)
class SpecStrategy:
    """One speculative-decoding strategy (an arm of the tuner).

    ``off`` decodes plainly; ``chain`` drafts ``depth`` tokens one after another; ``tree`` expands the ``branch``
    best children of the ``branch`` best nodes per level for ``depth`` levels and verifies the ``budget`` most
    probable nodes (SGLang's ``steps_topk_verifyTokens``); ``ngram`` proposes ``depth`` tokens copied from earlier
    text of the sequence or of its GRPO siblings (:mod:`tltlib.spec.ngram`; model-free, no drafter needed); ``suffix``
    proposes a tree of at most ``budget`` nodes and ``depth`` levels from what followed the row's longest recurring
    suffix in its group and in earlier responses to its prompt (:mod:`tltlib.spec.suffix`; model-free); ``hybrid``
    drafts both the ``tree`` and a ``suffix`` tree of the same size and verifies, per row, the one with more expected
    accepted tokens (the drafter's path probabilities vs the suffix tree's empirical ones).

    Names round-trip: ``SpecStrategy.parse("tree-8x4-32") == SpecStrategy("tree", 8, 4, 32)``,
    ``SpecStrategy.parse("chain-4:block") == SpecStrategy("chain", 4, rule="block")``."""

    kind: str = "off"
    """``"off"``, ``"chain"``, ``"tree"``, ``"ngram"``, ``"suffix"`` or ``"hybrid"``."""
    depth: int = 1
    """Draft depth (tokens per chain, levels per tree)."""
    branch: int = 1
    """Tree branching (SGLang's and the paper's "top-k" of a tree; not sampling's top-k): children kept per node
    and nodes kept per level."""
    budget: int = 0
    """Tree: draft tokens verified per step (0 = every drafted node); suffix: at most this many (>= 1). Chains
    verify ``depth``."""
    rule: str = "token"
    """How the drafts are verified (:data:`RULES`): ``token`` for every kind; ``block`` for ``chain`` (named
    ``chain-D:block``)."""

    def __hash__(self) -> int:                  # kept: strategies key the tuner's tables every decode iteration
        return self._hash

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.kind, self.depth, self.branch, self.budget, self.rule)))
        if self.kind not in KINDS:
            raise BadInput(f"unknown speculative strategy kind {self.kind!r}; choose one of {KINDS}")
        if self.rule not in RULES:
            raise BadInput(f"unknown verification rule {self.rule!r}; choose token (draft by draft) or block (the "
                           "chain judged jointly: chain-D:block)")
        if self.rule == "block" and self.kind != "chain":
            raise BadInput(f"{self.name}:block: block verification judges a chain of a learned drafter's sampled "
                           "drafts jointly, and does not apply to " + (
                               "a tree (verified by target-only sampling over its siblings)"
                               if self.kind in ("tree", "hybrid", "suffix") else
                               f"{self.kind} drafts (not sampled from a drafter's distribution)")
                           + ": use chain-D:block, or drop ':block'")
        if self.depth < 1:
            raise BadInput(f"draft depth must be >= 1, got {self.depth}")
        if self.branch < 1:
            raise BadInput(f"a tree's branch must be >= 1, got {self.branch}")
        if self.kind in ("tree", "hybrid") and self.budget and self.budget < self.depth:
            raise BadInput(f"verify budget ({self.budget}) must be >= the draft depth ({self.depth}) so the "
                           "deepest path fits; raise the budget or lower the depth")
        if self.kind == "suffix" and self.budget < max(self.depth, 1):
            raise BadInput(f"a suffix draft needs a budget of at least its depth ({self.depth}) draft nodes, got "
                           f"{self.budget}; write suffix-DEPTH-BUDGET, e.g. suffix-8-16")
        if self.kind in ("chain", "ngram", "suffix") and self.branch != 1:
            raise BadInput(f"a {self.kind} draft has branch == 1; use kind='tree' for branching")

    @classmethod
    def parse(cls, name: "str | SpecStrategy") -> "SpecStrategy":
        """The strategy called ``name``: ``off``, ``chain-D``, ``ngram-D``, ``tree-DxK-N``, ``suffix-D-N`` or
        ``hybrid-DxK-N`` (a strategy is returned as it is)."""
        if isinstance(name, cls):
            return name
        text, _, rule = str(name).strip().partition(":")
        if rule:
            return cls.parse(text).with_rule(rule.strip())
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
        raise BadInput(f"cannot read speculative strategy {name!r}: write off, chain-DEPTH, ngram-DEPTH, "
                       "tree-DEPTHxTOPK-BUDGET, suffix-DEPTH-BUDGET or hybrid-DEPTHxTOPK-BUDGET (e.g. chain-4, "
                       "ngram-8, tree-8x4-32, suffix-8-16, hybrid-6x4-24), a chain with :block for block "
                       "verification (chain-4:block)")

    def with_rule(self, rule: str) -> "SpecStrategy":
        """This strategy verified by ``rule`` (:data:`RULES`; refused where it does not apply)."""
        return SpecStrategy(self.kind, self.depth, self.branch, self.budget, rule)

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
        return self.branch + (self.depth - 1) * self.branch * self.branch

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
            return f"{self.kind}-{self.depth}" + (":block" if self.rule == "block" else "")
        if self.kind == "suffix":
            return f"suffix-{self.depth}-{self.budget}"
        return f"{self.kind}-{self.depth}x{self.branch}-{self.verify_tokens}"


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
    raise WrongType(f"strategy must be a SpecStrategy, a strategy name, a function (iteration, active) -> "
                    f"SpecStrategy or an object with choose(iteration, active); got {type(strategy).__name__}")
