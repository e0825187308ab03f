"""Block verification (tltlib.spec.verify.verify_chain_block): lossless by exact enumeration, the sampler equal to
the enumeration by a chi-square test, at least as many drafts kept as token-wise verification, and controls with an
injected bug that the same tests catch (they have power).

The enumeration: every draft chain of a small vocabulary with its probability under the drafter, every prefix the
rule may keep with its exact chance, the residual it then samples from; the tokens it emits, completed by the
target's own sampling after them, must have exactly the target's joint distribution.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from tltlib.spec.verify import (
    block_residuals,
    block_stop_probs,
    block_weights,
    expected_accepted,
    verify_chain,
    verify_chain_block,
)

V = 3


def _dists(seed: int, concentration: float = 1.0, close: float = 0.0):
    """Target and drafter distributions of the next token after any prefix (deterministic per prefix); ``close``:
    the drafter's share of the target's distribution in its own (a drafter that has learned something)."""
    cache: dict = {}

    def dist(who: str, prefix: tuple) -> np.ndarray:
        key = (who, prefix)
        if key not in cache:
            g = np.random.default_rng([seed, int(who == "q"), *prefix, len(prefix)])
            cache[key] = g.dirichlet([concentration] * V)
            if who == "q" and close:
                cache[key] = close * dist("p", prefix) + (1 - close) * cache[key]
        return cache[key]
    return dist


def _tensors(dist, drafts: tuple):
    """``p [1, G+1, V]``, ``q [1, G, V]``, ``drafts [1, G]`` for one draft chain."""
    g = len(drafts)
    p = torch.tensor(np.stack([dist("p", drafts[:i]) for i in range(g + 1)]))[None]
    q = torch.tensor(np.stack([dist("q", drafts[:i]) for i in range(g)]))[None]
    return p, q, torch.tensor([drafts])


def _outputs(dist, g: int, stop_probs=block_stop_probs) -> dict:
    """Exact probability of every output ``(kept drafts..., next token)`` of block verification."""
    out: dict = {}
    for drafts in itertools.product(range(V), repeat=g):
        p_draft = np.prod([dist("q", drafts[:i])[drafts[i]] for i in range(g)])
        p, q, d = _tensors(dist, drafts)
        p_d = p[:, :g].gather(-1, d[..., None])[..., 0].double()
        q_d = q.gather(-1, d[..., None])[..., 0].double()
        w = block_weights(p_d, q_d)
        res = block_residuals(w, p, q)
        h = stop_probs(w, res.sum(-1))[0].numpy()
        for tau in range(g + 1):
            keep = (1.0 if tau == 0 else h[tau]) * np.prod([1 - h[i] for i in range(tau + 1, g + 1)])
            if tau == g:
                nxt = p[0, g].numpy()
            else:
                r = res[0, tau].numpy()
                nxt = r / r.sum() if r.sum() > 0 else p[0, tau].numpy()
            for y in range(V):
                key = (*drafts[:tau], y)
                out[key] = out.get(key, 0.0) + p_draft * keep * nxt[y]
    return out


def _completed(dist, outputs: dict, length: int) -> dict:
    """The joint distribution of the first ``length`` tokens: each output continued by the target's sampling."""
    joint: dict = {}
    for z in itertools.product(range(V), repeat=length):
        total = 0.0
        for k in range(1, length + 1):
            prob = outputs.get(z[:k], 0.0)
            if prob:
                total += prob * np.prod([dist("p", z[:i])[z[i]] for i in range(k, length)])
        joint[z] = total
    return joint


def _target_joint(dist, length: int) -> dict:
    return {z: float(np.prod([dist("p", z[:i])[z[i]] for i in range(length)]))
            for z in itertools.product(range(V), repeat=length)}


@pytest.mark.parametrize("g, seed, concentration", [(1, 0, 1.0), (2, 1, 1.0), (3, 2, 0.5), (4, 3, 2.0)])
def test_block_verification_emits_exactly_the_targets_distribution(g, seed, concentration):
    dist = _dists(seed, concentration)
    out = _outputs(dist, g)
    assert sum(out.values()) == pytest.approx(1.0, abs=1e-12)
    got, want = _completed(dist, out, g + 1), _target_joint(dist, g + 1)
    assert max(abs(got[z] - want[z]) for z in want) < 1e-12


def test_an_injected_bug_breaks_the_exact_identity():
    """The control: stopping with the weight alone (h_i = w_i, the residual's mass ignored) is lossy, and the
    enumeration says so."""
    dist = _dists(1)

    def wrong(w, mass):
        return w.clone()
    out = _outputs(dist, 3, stop_probs=wrong)
    got, want = _completed(dist, out, 4), _target_joint(dist, 4)
    assert max(abs(got[z] - want[z]) for z in want) > 1e-3


def _token_wise_expected(dist, g: int) -> float:
    """Expected drafts kept by Leviathan's token-wise rule, exactly."""
    total = 0.0
    for drafts in itertools.product(range(V), repeat=g):
        p_draft = np.prod([dist("q", drafts[:i])[drafts[i]] for i in range(g)])
        run = 1.0
        for i in range(g):
            run *= min(1.0, dist("p", drafts[:i])[drafts[i]] / dist("q", drafts[:i])[drafts[i]])
            total += p_draft * run
    return total


@pytest.mark.parametrize("seed", range(6))
def test_block_verification_keeps_at_least_as_many_drafts_as_token_wise(seed):
    dist = _dists(seed, 0.7)
    g = 4
    out = _outputs(dist, g)
    block = sum(prob * (len(k) - 1) for k, prob in out.items())
    assert block >= _token_wise_expected(dist, g) - 1e-12


def _sampled_vs_exact(sampler, dist, drafts: tuple, n: int, seed: int) -> float:
    """The chi-square p-value of ``sampler``'s outputs on one draft chain (n rows) against the exact conditional
    distribution of block verification's outputs given that chain."""
    g = len(drafts)
    p, q, d = _tensors(dist, drafts)
    accepted, nxt = sampler(p.expand(n, -1, -1), q.expand(n, -1, -1), d.expand(n, -1),
                            torch.Generator().manual_seed(seed))
    # the exact conditional law given the drafts: the enumeration's terms of this chain
    p_d = p[:, :g].gather(-1, d[..., None])[..., 0].double()
    q_d = q.gather(-1, d[..., None])[..., 0].double()
    w = block_weights(p_d, q_d)
    res = block_residuals(w, p, q)
    h = block_stop_probs(w, res.sum(-1))[0].numpy()
    exact = {}
    for tau in range(g + 1):
        keep = (1.0 if tau == 0 else h[tau]) * np.prod([1 - h[i] for i in range(tau + 1, g + 1)])
        r = p[0, g].numpy() if tau == g else res[0, tau].numpy()
        r = r / r.sum() if r.sum() > 0 else p[0, tau].numpy()
        for y in range(V):
            exact[(tau, y)] = keep * r[y]
    counts: dict = {}
    for a, y in zip(accepted.tolist(), nxt.tolist(), strict=True):
        counts[(a, y)] = counts.get((a, y), 0) + 1
    if any(exact.get(c, 0.0) == 0.0 for c in counts):
        return 0.0                                          # an output the rule can never give
    big = [c for c in exact if exact[c] * n >= 5]
    small = [c for c in exact if c not in big and exact[c] > 0]
    observed = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in small)] if small else [])
    expected = [exact[c] * n for c in big] + ([sum(exact[c] for c in small) * n] if small else [])
    expected = np.array(expected) * sum(observed) / sum(expected)
    return float(stats.chisquare(observed, expected).pvalue)


def _likely_chains(dist, g: int, k: int) -> list[tuple]:
    """The ``k`` draft chains the drafter is likeliest to propose (so that long prefixes are at stake)."""
    chains = itertools.product(range(V), repeat=g)
    prob = lambda c: np.prod([dist("q", c[:i])[c[i]] for i in range(g)])      # noqa: E731
    return sorted(chains, key=prob, reverse=True)[:k]


@pytest.mark.parametrize("rank", range(3))
def test_the_sampler_draws_what_the_enumeration_says(rank):
    dist = _dists(7, 1.0, close=0.7)
    drafts = _likely_chains(dist, 3, 3)[rank]
    assert _sampled_vs_exact(verify_chain_block, dist, drafts, 40_000, seed=rank) > 1e-3


def test_the_chi_square_catches_token_wise_verification_in_block_clothing():
    """The control: token-wise verification (a different, also lossless, law of the kept prefix given the drafts)
    is told apart by the same test, so the test has power against a sampler that is not the block rule."""
    dist = _dists(7, 1.0, close=0.7)
    pvals = [_sampled_vs_exact(verify_chain, dist, drafts, 40_000, seed=3) for drafts in _likely_chains(dist, 3, 3)]
    assert min(pvals) < 1e-6


def test_one_draft_is_leviathans_rule_and_greedy_ties_are_kept():
    dist = _dists(11)
    p, q, d = _tensors(dist, (1,))
    n = 20_000
    a_block, y_block = verify_chain_block(p.expand(n, -1, -1), q.expand(n, -1, -1), d.expand(n, -1),
                                          torch.Generator().manual_seed(0))
    a_tok, y_tok = verify_chain(p.expand(n, -1, -1), q.expand(n, -1, -1), d.expand(n, -1),
                                torch.Generator().manual_seed(0))
    assert torch.equal(a_block, a_tok) and torch.equal(y_block, y_tok)      # the same draws, the same law
    # p == q: every draft is kept whatever the uniforms
    same = torch.softmax(torch.randn(1, 4, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64), -1)
    accepted, _ = verify_chain_block(same, same[:, :3], torch.tensor([[0, 1, 2]]), torch.Generator().manual_seed(2))
    assert accepted.item() == 3


@pytest.mark.parametrize("seed", range(3))
def test_the_expected_drafts_kept_are_the_enumerations_for_both_rules(seed):
    """expected_accepted (what bench block_verify compares the two rules by, on the same drafts) equals the exact
    expectation of each rule for every chain, and block's is never below token-wise's."""
    dist = _dists(seed, 1.0, close=0.5)
    g = 3
    for drafts in itertools.product(range(V), repeat=g):
        p, q, d = _tensors(dist, drafts)
        p_d, q_d = (x.gather(-1, d[..., None])[..., 0].double() for x in (p[:, :g], q))
        w = block_weights(p_d, q_d)
        h = block_stop_probs(w, block_residuals(w, p, q).sum(-1))[0].numpy()
        block = sum(j * h[j] * np.prod([1 - h[i] for i in range(j + 1, g + 1)]) for j in range(1, g + 1))
        run, token = 1.0, 0.0
        for i in range(g):
            run *= min(1.0, dist("p", drafts[:i])[drafts[i]] / dist("q", drafts[:i])[drafts[i]])
            token += run
        assert expected_accepted(p, q, d, "block").item() == pytest.approx(block, abs=1e-12)
        assert expected_accepted(p, q, d, "token").item() == pytest.approx(token, abs=1e-12)
    n = 50_000
    p, q, d = _tensors(dist, _likely_chains(dist, g, 1)[0])
    accepted, _ = verify_chain_block(p.expand(n, -1, -1), q.expand(n, -1, -1), d.expand(n, -1),
                                     torch.Generator().manual_seed(seed))
    want = expected_accepted(p, q, d, "block").item()
    assert abs(accepted.double().mean().item() - want) < 5 * accepted.double().std().item() / n ** 0.5 + 1e-9
