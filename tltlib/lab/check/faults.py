"""The faults the check is there to catch, injected on purpose (its tests and ``bench check_faults`` show that it
does): a wrong residual distribution, a greedy verify that accepts a wrong draft, a draft vocabulary mapped off by
one, and a drafter the weight sync never reached. The two verify faults patch the SD code while their ``with``
block runs and restore it on exit; the drafter faults return a changed copy.

Paper: Leviathan et al. (the residual and the acceptance rule these break). Departures: none (tooling).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ...model.drafter import Drafter
from ...spec import step, verify


@contextmanager
def swapped_residual():
    """SD samples a rejected position from norm(max(0, q - p)) instead of norm(max(0, p - q)): the arguments of
    Leviathan's residual swapped."""
    right = verify.residual
    verify.residual = lambda p, q: right(q, p)
    try:
        yield
    finally:
        verify.residual = right


@contextmanager
def lenient_greedy_verify():
    """Greedy verification keeps one draft more than agrees with the target (an off-by-one in the accept count),
    and emits that draft."""
    right = step.verify_chain_greedy

    def lenient(target_argmax: torch.Tensor, drafts: torch.Tensor):
        accepted, nxt = right(target_argmax, drafts)
        more = accepted < drafts.shape[1]
        at = accepted.clamp(max=drafts.shape[1] - 1)
        nxt = torch.where(more, drafts.gather(1, at[:, None])[:, 0], nxt)
        return accepted + more.long(), nxt

    step.verify_chain_greedy = lenient
    try:
        yield
    finally:
        step.verify_chain_greedy = right


def off_by_one(drafter: Drafter) -> Drafter:
    """A copy of ``drafter`` whose draft vocabulary maps column j to the next token: the logit computed for token
    ``ids[j]`` proposes ``ids[j + 1]`` (the mapping bug of a reduced draft vocabulary; a drafter without one gets
    the whole vocabulary as one first)."""
    d = Drafter(drafter.config).to(drafter.fc.weight)
    d.load_state_dict(drafter.state_dict())
    d.attach(drafter.target)
    if d.draft_ids is None:
        d.set_draft_vocab(torch.arange(drafter.target.config.vocab_size))
    right = d.draft_logits
    d.draft_logits = lambda h: torch.roll(right(h), 1, -1)
    return d


def unsynced(drafter: Drafter, seed: int = 0) -> Drafter:
    """A drafter of ``drafter``'s shape that never received trained weights (the engine kept a fresh module the
    sync did not reach), attached to the same target."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        d = Drafter(drafter.config)
    return d.to(drafter.fc.weight).attach(drafter.target)
