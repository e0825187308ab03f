"""Exactness of the verification rules on a toy Markov target and a deliberately poor drafter.

The joint distribution of the first three emitted tokens must equal the target's (chi-square), for chains
(Leviathan) and trees (target-only), with temperature, top-k and top-p; the same tests run with the residual step
broken must fail — proof that they can."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from conftest import chi2_pvalue
from tltlib.model.sampling import probs_from_logits
from tltlib.spec import acceptance, trees, verify
from tltlib.spec import strategy as S

V = 5
TARGET_LOGITS = torch.tensor([[2.0, 1.0, 0.2, -1.0, 0.5], [0.1, 1.5, 1.4, 0.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0],
                              [-1.0, 0.3, 2.5, 0.2, 0.0], [0.5, -0.5, 0.0, 2.0, 1.2]])
# a poor drafter: mostly wrong about the target, so rejections happen at every depth
DRAFT_LOGITS = torch.tensor([[0.0, 0.0, 2.0, 1.0, -1.0], [2.0, -1.0, 0.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0],
                             [1.0, 1.0, -1.0, 1.0, 2.0], [0.0, 2.0, 1.0, -1.0, 0.0]])
SETTINGS = [(1.0, 0, 1.0), (0.8, 4, 1.0), (1.1, 0, 0.85), (0.9, 3, 0.9)]


def exact_joint(temperature, top_k, top_p, start=0, n=3):
    p = probs_from_logits(TARGET_LOGITS, temperature, top_k, top_p).double().numpy()
    joint = np.zeros([V] * n)
    for seq in itertools.product(range(V), repeat=n):
        prob, prev = 1.0, start
        for tok in seq:
            prob *= p[prev, tok]
            prev = tok
        joint[seq] = prob
    return joint.ravel()


def run_chain(rows, gamma, temperature, top_k, top_p, seed, n=3):
    """Batched SD on the Markov toy until every row has n tokens; chains drafted by sampling from q."""
    g = torch.Generator().manual_seed(seed)
    out = [[] for _ in range(rows)]
    last = torch.zeros(rows, dtype=torch.long)
    while min(map(len, out)) < n:
        q_tab = probs_from_logits(DRAFT_LOGITS, temperature, top_k, top_p)
        drafts, qs, prev = [], [], last
        for _ in range(gamma):
            q = q_tab[prev]
            d = torch.multinomial(q, 1, generator=g)[:, 0]
            drafts.append(d), qs.append(q)
            prev = d
        drafts = torch.stack(drafts, 1)
        ctx = torch.cat([last[:, None], drafts], 1)                     # token before each verify position
        p = probs_from_logits(TARGET_LOGITS[ctx], temperature, top_k, top_p)
        acc, nxt = verify.verify_chain(p, torch.stack(qs, 1), drafts, g)
        for r in range(rows):
            out[r] += drafts[r, : acc[r]].tolist() + [int(nxt[r])]
        last = nxt
    return np.array([o[:n] for o in out])


def topk_tree(last, depth, k):
    """Deterministic top-k tree over the toy drafter: every node keeps its k most likely children."""
    rows = last.shape[0]
    tokens, parents, depths = [last], [torch.full((rows,), -1)], [torch.zeros(rows, dtype=torch.long)]
    frontier = [(0, last)]
    for level in range(1, depth + 1):
        new = []
        for node, tok in frontier:
            kids = torch.topk(DRAFT_LOGITS[tok], k, dim=-1).indices
            for j in range(k):
                tokens.append(kids[:, j]), parents.append(torch.full((rows,), node))
                depths.append(torch.full((rows,), level))
                new.append((len(tokens) - 1, kids[:, j]))
        frontier = new
    return trees.DraftTree(torch.stack(tokens, 1), torch.stack(parents, 1), torch.stack(depths, 1))


def run_tree(rows, depth, k, temperature, top_k, top_p, seed, n=3, verify=verify.verify_tree):
    g = torch.Generator().manual_seed(seed)
    out = [[] for _ in range(rows)]
    last = torch.zeros(rows, dtype=torch.long)
    while min(map(len, out)) < n:
        tree = topk_tree(last, depth, k)
        logits = TARGET_LOGITS[tree.tokens]                             # node i's logits: after its token
        path, acc, nxt = verify(logits, tree, temperature, top_k, top_p, g)
        for r in range(rows):
            out[r] += tree.tokens[r, path[r, : acc[r]]].tolist() + [int(nxt[r])]
        last = nxt
    return np.array([o[:n] for o in out])


def joint_counts(samples):
    idx = np.ravel_multi_index(samples.T, [V] * samples.shape[1])
    return np.bincount(idx, minlength=V ** samples.shape[1])


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_chain_verification_is_exact(temperature, top_k, top_p):
    samples = run_chain(20000, 3, temperature, top_k, top_p, seed=1)
    assert chi2_pvalue(joint_counts(samples), exact_joint(temperature, top_k, top_p)) > 1e-3


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_tree_verification_is_exact(temperature, top_k, top_p):
    samples = run_tree(20000, 2, 2, temperature, top_k, top_p, seed=2)
    assert chi2_pvalue(joint_counts(samples), exact_joint(temperature, top_k, top_p)) > 1e-3


def test_chain_test_fails_without_the_residual(monkeypatch):
    monkeypatch.setattr(verify, "residual", lambda p, q: p)               # resample from p instead of norm(p - q)+
    samples = run_chain(20000, 3, 1.0, 0, 1.0, seed=1)
    assert chi2_pvalue(joint_counts(samples), exact_joint(1.0, 0, 1.0)) < 1e-6


def test_tree_test_fails_without_the_residual(monkeypatch):
    monkeypatch.setattr(verify, "drop_children", lambda p, tree, is_child: p)
    samples = run_tree(20000, 2, 2, 1.0, 0, 1.0, seed=2)
    assert chi2_pvalue(joint_counts(samples), exact_joint(1.0, 0, 1.0)) < 1e-6


def test_greedy_chain_and_tree_follow_the_argmax():
    greedy = [0]
    for _ in range(3):
        greedy.append(int(TARGET_LOGITS[greedy[-1]].argmax()))
    tree_out = run_tree(4, 3, 2, 0.0, 0, 1.0, seed=0)
    assert (tree_out == greedy[1:]).all()
    drafts = torch.tensor([[greedy[1], greedy[2], 4]])
    acc, nxt = verify.verify_chain_greedy(TARGET_LOGITS[torch.tensor([[0, greedy[1], greedy[2], 4]])].argmax(-1),
                                          drafts)
    assert acc.item() == 2 and nxt.item() == greedy[3]


def test_tree_helpers():
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    m = trees.ancestor_mask(parents)[0].int().tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    t = trees.chain_tree(torch.tensor([7]), torch.tensor([[1, 2]]))
    assert t.parents.tolist() == [[-1, 0, 1]] and t.depth.tolist() == [[0, 1, 2]]
    # candidates: two depth-1 nodes (scores -0.1, -0.5) and their children; budget 3 keeps a closed subtree
    scores = torch.tensor([[-0.1, -0.5, -0.3, -0.2, -0.9]])
    par = torch.tensor([[-1, -1, 0, 0, 1]])
    dep = torch.tensor([[1, 1, 2, 2, 2]])
    assert trees.select_nodes(scores, par, dep, 3).tolist() == [[0, 3, 2]]


def test_strategy_validation_and_names():
    assert S.SpecStrategy("tree", 6, 4, 32).name == "tree-6x4-32"
    assert S.SpecStrategy("chain", 5).verify_tokens == 5 and S.SpecStrategy("tree", 3, 2).verify_tokens == 10
    for kw, match in [(dict(kind="tree", depth=0), "depth must be >= 1"), (dict(kind="tree", branch=0), "branch"),
                      (dict(kind="tree", depth=5, branch=2, budget=3), "budget .* must be >= the draft depth"),
                      (dict(kind="beam"), "unknown speculative strategy")]:
        with pytest.raises(ValueError, match=match):
            S.SpecStrategy(**kw)


def test_leviathan_formula_and_inverse():
    assert acceptance.leviathan_speedup(0.8, 8, 0.05) == pytest.approx(3.09,
                                                                       abs=0.01)   # the paper-peers note's numbers
    assert acceptance.leviathan_speedup(0.9, 8, 0.05) == pytest.approx(4.38, abs=0.01)
    a = acceptance.alpha_from_accept_length((1 - 0.7 ** 5) / 0.3, 4)
    assert a == pytest.approx(0.7, abs=1e-6)


def run_point_chain(rows, gamma, temperature, top_k, top_p, seed, n=3):
    """Deterministic drafts (the toy drafter's argmax chain, like an n-gram proposal) verified by the point rule."""
    g = torch.Generator().manual_seed(seed)
    out = [[] for _ in range(rows)]
    last = torch.zeros(rows, dtype=torch.long)
    while min(map(len, out)) < n:
        drafts, prev = [], last
        for _ in range(gamma):
            prev = DRAFT_LOGITS[prev].argmax(-1)
            drafts.append(prev)
        drafts = torch.stack(drafts, 1)
        ctx = torch.cat([last[:, None], drafts], 1)
        p = probs_from_logits(TARGET_LOGITS[ctx], temperature, top_k, top_p)
        acc, nxt = verify.verify_chain_point(p, drafts, g)
        for r in range(rows):
            out[r] += drafts[r, : acc[r]].tolist() + [int(nxt[r])]
        last = nxt
    return np.array([o[:n] for o in out])


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_point_chain_verification_is_exact(temperature, top_k, top_p):
    samples = run_point_chain(20000, 3, temperature, top_k, top_p, seed=3)
    assert chi2_pvalue(joint_counts(samples), exact_joint(temperature, top_k, top_p)) > 1e-3


def test_point_chain_test_fails_without_the_residual(monkeypatch):
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    samples = run_point_chain(20000, 3, 1.0, 0, 1.0, seed=3)
    assert chi2_pvalue(joint_counts(samples), exact_joint(1.0, 0, 1.0)) < 1e-6


def test_strategy_names_round_trip_and_bad_names():
    for st in [S.SpecStrategy(), S.SpecStrategy("chain", 7), S.SpecStrategy("ngram", 5),
               S.SpecStrategy("tree", 8, 4, 32), S.SpecStrategy("tree", 3, 2)]:
        assert S.SpecStrategy.parse(st.name) == st or S.SpecStrategy.parse(st.name).name == st.name
    assert S.SpecStrategy.parse("ngram-6").uses_drafter is False and S.SpecStrategy.parse("chain-2").uses_drafter
    for bad in ["chain", "tree-8-32", "beam-3", "chain-x"]:
        with pytest.raises(ValueError, match="cannot read speculative strategy|unknown speculative"):
            S.SpecStrategy.parse(bad)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        S.SpecStrategy.parse("ngram-0")
    block = S.SpecStrategy.parse("chain-4:block")
    assert block == S.SpecStrategy("chain", 4, rule="block") and block.name == "chain-4:block"
    assert block != S.SpecStrategy("chain", 4) and hash(block) != hash(S.SpecStrategy("chain", 4))
    assert S.SpecStrategy.parse(" chain-2 : block ").name == "chain-2:block"


@pytest.mark.parametrize("name, words", [
    ("tree-4x2-8:block", "tree-4x2-8:block: block verification judges a chain .* does not apply to a tree"),
    ("hybrid-3x2-6:block", "does not apply to a tree"),
    ("suffix-4-8:block", "does not apply to a tree"),
    ("ngram-4:block", "does not apply to ngram drafts \\(not sampled from a drafter's distribution\\)"),
    ("chain-4:fast", "unknown verification rule 'fast'; choose token .* or block"),
    ("chain-x:block", "cannot read speculative strategy 'chain-x'"),
])
def test_a_verification_rule_that_does_not_exist_or_apply_is_one_clear_error(name, words):
    with pytest.raises(ValueError, match=words):
        S.SpecStrategy.parse(name)
