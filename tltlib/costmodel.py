"""The measured cost model of the adaptive engine: target and drafter forward times on the real models, from which
the tuner predicts each SD strategy's speedup (its prior) and normalises its rewards (:mod:`tltlib.adaptive`).

:func:`measure_costs` times target forwards of B rows x T tokens at a short and a long cached context, a plain
forward over rows of unequal lengths (the masked attention a batch pays once SD steps have left it ragged), and
drafter forwards (draft levels and a catch-up over a backlog); :class:`CostModel` interpolates them (log-log in rows,
linear in tokens and context) and predicts an arm's speedup from its acceptance per draft depth
(:func:`expected_tokens`).
"""
from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .kernel_search import ensure as ensure_kernels
from .kernels import pack_weights, packed_weights
from .profiling import call_times
from .speculative import SpecStrategy

__all__ = ["CATCH_UP_WIDTH", "CostModel", "expected_tokens", "measure_costs"]

CATCH_UP_WIDTH = 64
"""Backlog entries per row of the catch-up :func:`measure_costs` times (wider ones are extrapolated linearly)."""

@dataclass
class CostModel:
    """Measured forward costs. ``target_s[i, j]``: seconds of a target forward of ``batches[i]`` rows x
    ``tokens[j]`` tokens (1 = a plain decode iteration) after ``context`` cached tokens; ``long_s[i]``: a plain
    forward of ``batches[i]`` rows after ``long_context`` (how attention grows with the context); ``draft_s[i, k]``:
    a drafter forward of ``batches[i]`` rows x ``draft_tokens[k]`` tokens; ``catch_up_s[i]``: a drafter catch-up
    over ``catch_up_width`` backlog entries per row (logits at the last only); ``ragged_s[i]``: a plain forward of
    ``batches[i]`` rows at unequal lengths (masked attention: what every plain step costs once an SD step has left the
    rows at different lengths). Between measured sizes it
    interpolates log-log in rows, linearly in tokens and context. Treat it as read-only (it memoises lookups)."""

    batches: np.ndarray
    tokens: np.ndarray
    target_s: np.ndarray
    draft_tokens: np.ndarray = field(default_factory=lambda: np.array([1]))
    draft_s: np.ndarray | None = None
    ngram_s_per_row: float = 2e-5
    context: float = 64.0
    long_context: float = 0.0
    long_s: np.ndarray | None = None
    catch_up_width: float = 0.0
    catch_up_s: np.ndarray | None = None
    ragged_s: np.ndarray | None = None
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _columns(self, name: str, batch) -> list[float]:
        """The seconds of table ``name`` (``target_s``, ``draft_s``, ``catch_up_s``) at ``batch`` rows, one per
        column (log-log between measured batch sizes); kept per table and batch size (the tuner asks every decode
        iteration)."""
        key = (name, batch)
        hit = self._memo.get(key)
        if hit is None:
            table = np.asarray(getattr(self, name), dtype=np.float64).reshape(len(self.batches), -1)
            lb = np.log(np.clip(batch, self.batches[0], self.batches[-1]))
            hit = self._memo[key] = [math.exp(np.interp(lb, np.log(self.batches), np.log(table[:, j])))
                                     for j in range(table.shape[1])]
        return hit

    def context_s(self, batch: int, context: float | None) -> float:
        """Seconds a forward of ``batch`` rows gains (or saves) by attending ``context`` cached tokens instead of
        ``self.context`` (linear between the two measured contexts; 0 without a long-context measurement)."""
        if context is None or self.long_s is None or self.long_context <= self.context:
            return 0.0
        slope = self._memo.get(("slope", batch))
        if slope is None:
            lb = np.log(np.clip(batch, self.batches[0], self.batches[-1]))
            per_token = (np.asarray(self.long_s) - self.target_s[:, 0]) / (self.long_context - self.context)
            slope = self._memo[("slope", batch)] = max(float(np.interp(lb, np.log(self.batches), per_token)), 0.0)
        return slope * (context - self.context)

    def target_time(self, batch: int, tokens: int, context: float | None = None) -> float:
        """Seconds of one target forward over ``batch`` rows x ``tokens`` tokens (after ``context`` cached tokens;
        None: the measured short context)."""
        base = _along(self.tokens, self._columns("target_s", batch), tokens)
        return max(base + self.context_s(batch, context), 0.5 * base)

    def draft_time(self, batch: int, tokens: int = 1) -> float:
        """Seconds of one drafter forward over ``batch`` rows x ``tokens`` tokens (0 without drafter timings)."""
        if self.draft_s is None:
            return 0.0
        return _along(self.draft_tokens, self._columns("draft_s", batch), tokens)

    def catch_up_time(self, batch: int, width: int) -> float:
        """Seconds a drafter catch-up over ``width`` backlog entries per row costs beyond the one-entry catch-up of
        an SD step that follows an SD step (:meth:`iteration_time` counts that one)."""
        if width <= 1 or self.draft_s is None:
            return 0.0
        cols = self._columns("draft_s", batch)
        if self.catch_up_s is None:                    # an older prior file: extrapolate the draft forwards
            return max(_along(self.draft_tokens, cols, width) - cols[0], 0.0)
        wide = self._columns("catch_up_s", batch)[0]
        return max(_along((1.0, self.catch_up_width), (cols[0], wide), width) - cols[0], 0.0)

    def ragged_extra(self, batch: int) -> float:
        """Seconds a plain decode step of ``batch`` rows costs beyond a uniform one once rows are at unequal
        lengths (0 when not measured)."""
        if self.ragged_s is None:
            return 0.0
        return max(self._columns("ragged_s", batch)[0] - self._columns("target_s", batch)[0], 0.0)

    def plain_rate(self, batch: int, context: float | None = None) -> float:
        """Tokens per second of plain decoding at ``batch`` rows (and ``context``)."""
        return batch / self.target_time(batch, 1, context)

    def iteration_time(self, arm: SpecStrategy, batch: int, context: float | None = None) -> float:
        """Predicted seconds of one decode iteration with ``arm`` at ``batch`` rows (and ``context``)."""
        if not arm.enabled:
            return self.target_time(batch, 1, context)
        verify = self.target_time(batch, arm.verify_tokens + 1, context)
        if arm.kind in ("ngram", "suffix"):
            return verify + self.ngram_s_per_row * batch * (arm.verify_tokens if arm.kind == "suffix" else 1)
        levels = arm.depth + 1                          # one catch-up over the backlog + one forward per level
        width = 1 if arm.kind == "chain" else arm.top_k
        return verify + levels * self.draft_time(batch, width)

    def predict(self, arm: SpecStrategy, batch: int, accept: Sequence[float] | float,
                context: float | None = None) -> float:
        """Predicted speedup of ``arm`` over plain decoding at ``batch`` rows (and ``context``), given the
        acceptance ``accept`` (one rate, or the chance of accepting depth d given depth d-1 was, for d = 1, 2, ...)."""
        if not arm.enabled:
            return 1.0
        tokens = expected_tokens(arm, accept)
        return tokens * batch / self.iteration_time(arm, batch, context) / self.plain_rate(batch, context)

    def to_dict(self) -> dict:
        return {"batches": self.batches.tolist(), "tokens": self.tokens.tolist(), "target_s": self.target_s.tolist(),
                "draft_tokens": self.draft_tokens.tolist(),
                "draft_s": None if self.draft_s is None else self.draft_s.tolist(),
                "ngram_s_per_row": self.ngram_s_per_row, "context": self.context, "long_context": self.long_context,
                "long_s": None if self.long_s is None else list(map(float, self.long_s)),
                "catch_up_width": self.catch_up_width,
                "catch_up_s": None if self.catch_up_s is None else list(map(float, self.catch_up_s)),
                "ragged_s": None if self.ragged_s is None else list(map(float, self.ragged_s))}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        arr = (lambda k: None if d.get(k) is None else np.asarray(d[k], dtype=np.float64))
        return cls(arr("batches"), arr("tokens"), arr("target_s"), arr("draft_tokens"), arr("draft_s"),
                   float(d.get("ngram_s_per_row", 2e-5)), float(d.get("context", 64.0)),
                   float(d.get("long_context", 0.0)), arr("long_s"), float(d.get("catch_up_width", 0.0)),
                   arr("catch_up_s"), arr("ragged_s"))


def _along(cols, per_col: list[float], n: float) -> float:
    """Seconds at ``n`` tokens from seconds at the measured token counts ``cols`` (linear; beyond the last, the last
    segment's slope)."""
    if n > cols[-1]:
        slope = (per_col[-1] - per_col[-2]) / (cols[-1] - cols[-2]) if len(cols) > 1 else per_col[-1] / cols[-1]
        return per_col[-1] + slope * (n - cols[-1])
    if n <= cols[0]:
        return per_col[0]
    j = bisect.bisect_left(cols, n)                 # cols[j - 1] < n <= cols[j] (pure Python: asked every iteration)
    f = (n - cols[j - 1]) / (cols[j] - cols[j - 1])
    return per_col[j - 1] + f * (per_col[j] - per_col[j - 1])


def expected_tokens(arm: SpecStrategy, accept: Sequence[float] | float) -> float:
    """Expected tokens emitted per row per step (bonus included): 1 + sum_j prod_{i<=j} a_i, where a tree level
    with w candidates (w = top_k, at most budget / depth) is accepted with 1 - (1 - a)^w."""
    if not arm.enabled:
        return 1.0
    rates = [float(accept)] * arm.depth if np.isscalar(accept) else [float(a) for a in accept]
    rates = (rates + [rates[-1]] * arm.depth)[: arm.depth]
    if arm.kind in ("tree", "hybrid", "suffix"):
        w = max(1, min(arm.top_k, arm.verify_tokens // arm.depth))
        rates = [1 - (1 - a) ** w for a in rates]
    total, run = 1.0, 1.0
    for a in rates:
        run *= a
        total += run
    return total


@torch.no_grad()
def measure_costs(target, drafter=None, batches: Sequence[int] | None = None, max_batch: int = 64,
                  tokens: Sequence[int] = (1, 9, 25), context: int = 64, long_context: int = 512,
                  repeats: int = 2) -> CostModel:
    """Time target forwards of B rows x T tokens at ``context`` cached positions, plain forwards at
    ``long_context`` (0: skip), a plain forward with the rows 0-2 positions apart against a uniform one
    (``4 * repeats`` each, interleaved: a difference of a few percent), and drafter forwards of B x 1, B x 4 (draft
    levels) and B x ``CATCH_UP_WIDTH`` with logits at the last only (a catch-up over a backlog); each the fastest
    of ``repeats`` after one warm-up (the least disturbed run). ``batches`` default: powers of four up to
    ``max_batch``, and ``max_batch`` itself (make it the SD threshold: rewards are normalised by the plain rate up to
    there). ``long_context`` is capped by the model's context. Nothing is committed to any cache."""
    ensure_kernels(target, drafter)                   # the kernels a rollout runs with, chosen before any timing
    if batches is None:
        batches = [4 ** i for i in range(int(math.log(max(1, max_batch), 4) + 1e-9) + 1)]
        if batches[-1] < max_batch:
            batches.append(max_batch)
    dev = target.embed.weight.device
    vocab = target.config.vocab_size
    long_context = min(long_context, target.config.max_position_embeddings - 2)
    long_context = long_context if long_context > context else 0
    g = torch.Generator(device="cpu").manual_seed(0)
    t_tab = np.zeros((len(batches), len(tokens)))
    long_s = np.zeros(len(batches)) if long_context else None
    wide = max(2, min(CATCH_UP_WIDTH, target.config.max_position_embeddings - context - 1))
    draft_tokens = np.array([1, 4])
    d_tab = np.zeros((len(batches), len(draft_tokens))) if drafter is not None else None
    catch_up = np.zeros(len(batches)) if drafter is not None else None
    ragged = np.zeros(len(batches))

    def timed(fn) -> float:                                  # the least disturbed of the repeats
        return float(min(call_times(fn, repeats, dev)))

    with packed_weights(pack_weights(target)):        # what a CPU rollout runs with (RolloutConfig.packed_weights)
        for i, b in enumerate(batches):
            cache = target.new_cache(b, max(context + max(tokens), long_context) + 1)
            prompt = torch.randint(0, vocab, (b, context), generator=g).to(dev)
            last = torch.full((b,), context - 1, device=dev)
            _, h = target.forward_cached(prompt, cache, logits_at=last)
            cache.advance(context)
            for j, n in enumerate(tokens):
                x = torch.randint(0, vocab, (b, n), generator=g).to(dev)
                t_tab[i, j] = timed(lambda x=x: target.forward_cached(x, cache))
            ragged[i] = t_tab[i, 0] * _ragged_ratio(target, cache, b, vocab, g, dev, 4 * repeats)
            if long_context:
                cache.advance(long_context - context)        # attend long_context positions (their values are moot)
                x = torch.randint(0, vocab, (b, 1), generator=g).to(dev)
                long_s[i] = timed(lambda x=x: target.forward_cached(x, cache))
            if drafter is not None:
                dcache = drafter.new_cache(b, context + wide + 1)
                drafter.forward_cached(h[:, :-1], prompt[:, 1:], dcache, logits_at=last - 1)
                dcache.advance(context - 1)
                def draft(n: int, last_only: bool = False) -> float:      # n tokens per row, logits at all or the last
                    f = h[:, -1:].expand(b, n, h.shape[-1]).contiguous()
                    x = torch.randint(0, vocab, (b, n), generator=g).to(dev)
                    at = torch.full((b,), n - 1, device=dev) if last_only else None
                    return timed(lambda: drafter.forward_cached(f, x, dcache, logits_at=at))
                d_tab[i] = [draft(n) for n in draft_tokens.tolist()]
                catch_up[i] = draft(wide, last_only=True)
    return CostModel(np.asarray(batches, dtype=np.float64), np.asarray(tokens, dtype=np.float64), t_tab,
                     draft_tokens.astype(np.float64), d_tab, context=float(context),
                     long_context=float(long_context), long_s=long_s,
                     catch_up_width=float(wide) if drafter is not None else 0.0, catch_up_s=catch_up,
                     ragged_s=ragged)


def _ragged_ratio(target, cache, b: int, vocab: int, g, dev, repeats: int) -> float:
    """How much longer a one-token forward takes with the cache's ``b`` rows 0-2 positions apart than with them at
    one length (the fastest of ``repeats`` each, interleaved); the cache is left as it was."""
    if b == 1:
        return 1.0
    spread = (torch.arange(b) % 3).to(dev)
    x = torch.randint(0, vocab, (b, 1), generator=g).to(dev)
    forward = lambda: target.forward_cached(x, cache)                      # noqa: E731
    best = {False: min(call_times(forward, 1, dev)), True: math.inf}      # the warm-up: call_times' own
    for _ in range(repeats):
        for uneven in (True, False):
            cache.advance(spread if uneven else 0)                   # a tensor advance re-reads the exact bounds
            t = time.perf_counter()
            forward()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best[uneven] = min(best[uneven], time.perf_counter() - t)
            cache.advance(-spread if uneven else 0)
    return best[True] / best[False]
