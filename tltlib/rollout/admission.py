"""Admission by memory: a rollout whose rows outgrow the KV budget preempts its newest rows and recomputes them
later, instead of running out of memory mid-rollout (issue 39, step 4).

A paged cache holds pages for the tokens its rows have, so a rollout can start more rows than it could hold at
their longest: most finish early (the long tail). When the pool cannot give every running row the pages its next
iteration writes, admission takes the running rows with the highest sequence ids out of the batch (they
wait; their pages go back to the pool) until the iteration fits (:func:`fit`); when finished rows have given pages back,
:func:`readmit` re-admits the waiting rows, oldest first, by one prefill of each one's prompt and the tokens it had
generated (*recompute*, vLLM's default preemption: no swap space), whose last sampled token then feeds the next
iteration as if the row had never left. Nothing is sampled at re-admission: a row's tokens are the ones it would sample
at its place in the batch, from the same distribution (exact; at a temperature > 0 the random stream is shared by the
rows in the batch, so the draws differ from an unpreempted run's, as they do between batch sizes).

The worst case is bounded before the rollout starts (:meth:`tltlib.kv.paged.PagedKVCache.check_holds`,
``check_prefill``): the longest row fits the pool alone, and the prompts' prefill fits. Then a rollout always
finishes: with one row left running it fits, and SD steps that would not fit even so run plain (see
:func:`fit`).

The SD switch counts running rows (:attr:`tltlib.rollout.engine.Rollout.active`), never waiting ones.

Paper: TLT §5 runs rollouts on SGLang, whose scheduler admits requests by free KV memory and retracts (preempts)
running ones when decode runs out of it.

Departures:
1. Preemption picks the highest sequence ids (the last prompts' samples), not the most recently admitted rows.
2. The room an iteration needs is bounded per row (one token plain; the verify's tokens for SD, plus the drafter's
   backlog and levels on its cache), not counted exactly: a pool within a few pages of full preempts a row early.
3. An SD step that does not fit runs plain when plain fits every running row, instead of preempting rows for it.
"""
from __future__ import annotations

import torch

from ..errors import Refused
from ..model.logprobs import pad_right
from ..spec.strategy import OFF, SpecStrategy

HEADROOM_TOKENS = 64
"""A waiting row is re-admitted only when every running row, itself included, could still write this many more
tokens: without the margin a row re-admitted into a nearly full pool is preempted again at once (thrashing)."""

RECOMPUTE_TOKENS = 8192
"""Most tokens one re-admission prefill forwards at once (at least one row): its activations and attention scores
grow with rows x length^2."""


def _needs(rollout, st: SpecStrategy) -> tuple[int, int]:
    """Slots per row the next iteration may write into the target's cache (the verify's tokens and the root, or one
    token) and into the drafter's (its backlog: a catch-up or a flush; and a learned drafter's levels: ``branch`` per
    level of a tree, one per level of a chain)."""
    step = st.verify_tokens + 1 if st.enabled else 1
    drafts = max(step, st.branch * st.depth) if st.uses_drafter else 0
    return step, rollout.spec.backlog_max + drafts + 1


def pages_short(rollout, st: SpecStrategy, extra: int = 0, rows: int = 0, rows_tokens: int = 0) -> int:
    """Pages the caches lack for the next iteration under ``st`` (each running row ``extra`` tokens more), with
    ``rows`` more rows of ``rows_tokens`` tokens; 0: it fits."""
    target, drafter = _needs(rollout, st)
    short = rollout.cache.pages_short(target + extra, rows, rows_tokens)
    if rollout.spec.cache is not None:
        short += rollout.spec.cache.pages_short(drafter + extra, rows, rows_tokens)
    return short


def fit(rollout, st: SpecStrategy) -> SpecStrategy:
    """Before an iteration under ``st`` (after :func:`readmit` and the strategy's choice): the strategy to run, after
    preempting rows if needed. ``st`` when it fits; else a plain step when that fits every running row (no recompute
    spent on an SD step's drafts); else a plain step after preempting running rows until it fits (one row always
    does: the rollout checked its longest row fits alone)."""
    if not pages_short(rollout, st):
        return st
    if st.enabled and not pages_short(rollout, OFF):
        return OFF                                  # every row keeps running: cheaper than a recompute
    preempt(rollout, OFF)
    st = OFF
    if pages_short(rollout, st):
        raise Refused("admission by memory: one running row cannot hold its next token although the rollout "
                      "checked that its longest row fits the KV budget; this is a bug, please report it")
    return st


def preempt(rollout, st: SpecStrategy) -> None:
    """Drop finished rows, then the running rows with the highest sequence ids, one by one, until the iteration
    fits or one row is left; the preempted rows join :attr:`~tltlib.rollout.engine.Rollout.waiting`."""
    seq, alive = rollout.seq.tolist(), rollout.alive.tolist()
    running = sorted((s, i) for i, (s, a) in enumerate(zip(seq, alive)) if a)
    keep = [i for i, a in enumerate(alive) if a]
    dropped: list[int] = []
    rollout.select(torch.tensor(keep, device=rollout.seq.device))
    while pages_short(rollout, st) and len(running) > 1:
        s, _ = running.pop()
        dropped.append(s)
        ids = rollout.seq.tolist()
        rollout.select(torch.tensor([i for i, x in enumerate(ids) if x != s], device=rollout.seq.device))
    if dropped:
        rollout.waiting.extend(reversed(dropped))          # lowest sequence id first: oldest first back
        rollout.waiting.sort()
        rollout.active -= len(dropped)
        rollout.preempted += len(dropped)
        rollout.uniform_broken()


def readmit(rollout) -> None:
    """Before an iteration's strategy is chosen (so that the SD switch counts the rows that will run): re-admit
    waiting rows, lowest sequence id first, while they fit with :data:`HEADROOM_TOKENS` to spare, in prefills of at
    most :data:`RECOMPUTE_TOKENS` tokens."""
    if int(rollout.seq.numel()) > rollout.active:          # finished rows give their pages back first
        rollout.select(rollout.alive.nonzero()[:, 0])
    while rollout.waiting:
        batch, longest = [], 0
        for s in rollout.waiting:
            n = _recompute_length(rollout, s)
            headroom = HEADROOM_TOKENS if rollout.active or batch else 0   # an empty batch: its first row that fits
            rows = len(batch) + 1
            if rollout.cache.rows + rows > rollout.cache.capacity or (batch and rows * max(longest, n) >
                                                                         RECOMPUTE_TOKENS):
                break
            if pages_short(rollout, OFF, headroom, rows, max(longest, n) + headroom):
                break
            batch.append(s)
            longest = max(longest, n)
        if not batch:
            if not rollout.active:
                raise Refused("admission by memory: no waiting row fits an empty KV pool although the rollout "
                              "checked that its longest row does; this is a bug, please report it")
            return
        del rollout.waiting[: len(batch)]
        _recompute(rollout, batch)


def _recompute_length(rollout, s: int) -> int:
    """Tokens a waiting sequence ``s`` re-admits with: its prompt and its generated tokens but the last (the
    pending one, which the next iteration feeds)."""
    return len(rollout.prompts[s // rollout.engine.config.num_generations]) + int(rollout.n_out[s]) - 1


def _recompute(rollout, seqs: list[int]) -> None:
    """Prefill waiting sequences ``seqs`` into new rows after the running ones (target and drafter caches) and
    make them running again, their pending token next."""
    engine, dev = rollout.engine, rollout.device
    G = engine.config.num_generations
    ids = torch.tensor(seqs, device=dev)
    n_gen = rollout.n_out[ids]
    rows = [rollout.prompts[s // G] + rollout.out_tokens[s, : int(n) - 1].tolist() for s, n in zip(seqs, n_gen)]
    lens = torch.tensor([len(r) for r in rows], device=dev)
    toks = pad_right(rows, engine.pad_id, dev)
    cache, b0 = rollout.cache, rollout.cache.rows
    cache.add_rows(len(seqs))
    sub = cache.view(b0, b0 + len(seqs))
    _, h = engine.model.forward_cached(toks, sub, logits_at=lens - 1)
    sub.advance(lens)
    cache.sync_from_views()
    pending = rollout.out_tokens[ids, n_gen - 1]
    rollout.spec.add_rows(toks, h, lens, h[torch.arange(len(seqs), device=dev), lens - 1], pending)
    rollout.seq = torch.cat([rollout.seq, ids])
    rollout.last = torch.cat([rollout.last, pending])
    rollout.alive = torch.cat([rollout.alive, torch.ones(len(seqs), dtype=torch.bool, device=dev)])
    rollout.n_gen = torch.cat([rollout.n_gen, n_gen])
    rollout.active += len(seqs)
    rollout.recomputed_tokens += int(lens.sum())
    rollout.uniform_broken()
