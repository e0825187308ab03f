"""Notebook 02's figures, speculative decoding taught: Leviathan's rule on a toy p and q (the overlap a draft keeps,
the residual a rejection resamples, both adding up to p), when SD pays (tokens per step and speedup against the draft
depth for an acceptance rate and the forwards' costs), one traced step of a real model (the draft tree, the rejected
draft, the residual it was resampled from), and the samplers side by side. Each function returns a matplotlib Figure.

Paper: TLT §2.2 (speculative decoding is lossless) and §5 (when SD pays: few running requests); Leviathan et al.
(2023) for the rule and the expected speedup; the p/q overlap picture of the speculative-sampling explainers.

Departures: none.
"""
from __future__ import annotations

import numpy as np

from ..spec.acceptance import chain_speedup, chain_tokens
from .explain import mass_split

BLUE, ORANGE, GREEN, RED, GREY = "#1F77B4", "#DD8452", "#2CA02C", "#D62728", "#BBBBBB"


def _tok(tokenizer, t: int) -> str:
    s = tokenizer.convert_ids_to_tokens(int(t)) if tokenizer is not None else str(int(t))
    return {" ": "␣", "<eos>": "⏎"}.get(s, s)


def pq_bars(p, q, labels=None, title: str | None = None):
    """Leviathan's rule as two panels over the same tokens. Left: the target's p and the drafter's q, with their
    overlap min(p, q) (the mass a draft keeps: alpha in all). Right: p rebuilt as min(p, q) (drafts kept) stacked
    with max(0, p - q) (what the resample after a rejection supplies); the two stack to p exactly."""
    import matplotlib.pyplot as plt
    split = mass_split(p, q)
    p, q, keep, rest = np.asarray(p, dtype=float), np.asarray(q, dtype=float), split["accepted"], split["residual"]
    labels = [str(i) for i in range(len(p))] if labels is None else list(labels)
    x = np.arange(len(p))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10.5, 3.4), sharey=True)
    a.bar(x - 0.2, p, width=0.4, color=BLUE, label="target p")
    a.bar(x + 0.2, q, width=0.4, color=ORANGE, label="drafter q")
    a.bar(x, keep, width=0.8, color="none", edgecolor="black", hatch="//", linewidth=0.8, label="min(p, q)")
    a.set_title(f"p and q overlap in alpha = sum min(p, q) = {keep.sum():.2f}")
    b.bar(x, keep, width=0.6, color=GREEN, label="draft kept: min(p, q)")
    b.bar(x, rest, width=0.6, bottom=keep, color=RED, label="resampled after a rejection: max(0, p - q)")
    b.plot(x, p, "_", color="black", markersize=22, markeredgewidth=2, label="target p")
    b.set_title(f"kept + resampled = p (rejected {1 - keep.sum():.2f} of the time)")
    for ax in (a, b):
        ax.set_xticks(x, labels)
        ax.legend(fontsize=8)
    a.set_ylabel("probability")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def draws_vs_p(p, draws, title: str = "Tokens drawn the speculative way vs the target's p"):
    """Frequencies of tokens drawn by the rule (:func:`tltlib.lab.explain.toy_speculative_draws`) beside p."""
    import matplotlib.pyplot as plt
    p = np.asarray(p, dtype=float)
    freq = np.bincount(np.asarray(draws), minlength=len(p)) / max(len(draws), 1)
    x = np.arange(len(p))
    fig, ax = plt.subplots(figsize=(6.0, 3.0))
    ax.bar(x - 0.2, p, width=0.4, color=BLUE, label="target p")
    ax.bar(x + 0.2, freq, width=0.4, color=GREEN, label=f"speculative draws (n={len(draws):,})")
    ax.set_xticks(x, [str(i) for i in x])
    ax.set_ylabel("probability")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def speedup_curves(alpha: float, draft_cost: float, verify_cost: float = 1.0, max_depth: int = 12):
    """When SD pays: for draft depths 1..``max_depth``, the tokens a chain step emits (:func:`chain_tokens`) and its
    speedup over plain decoding (:func:`chain_speedup`: drafts of ``draft_cost`` each, a verify of ``verify_cost``,
    both in decode forwards); the best depth marked, the break-even line at 1x."""
    import matplotlib.pyplot as plt
    depths = np.arange(1, max_depth + 1)
    tokens = [chain_tokens(alpha, int(k)) for k in depths]
    speed = [chain_speedup(alpha, int(k), draft_cost, verify_cost) for k in depths]
    best = int(np.argmax(speed))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10.5, 3.2))
    a.plot(depths, tokens, "o-", color=BLUE)
    a.set_xlabel("draft depth k")
    a.set_ylabel("tokens per target forward")
    a.set_title(f"(1 - a^(k+1)) / (1 - a) at a = {alpha:.2f}")
    b.plot(depths, speed, "o-", color=GREEN if max(speed) > 1 else RED)
    b.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    b.plot(depths[best], speed[best], "*", color="black", markersize=14)
    b.set_xlabel("draft depth k")
    b.set_ylabel("speedup over plain decoding")
    verdict = f"best k = {depths[best]}: {speed[best]:.2f}x" if speed[best] > 1 else "SD does not pay here"
    b.set_title(f"drafts {draft_cost:.2f}, verify {verify_cost:.2f} decode forwards: {verdict}")
    fig.tight_layout()
    return fig


def _tree_layout(trace, row: int):
    """(tokens, parents, depths, y positions, nodes by depth) of the traced step's draft tree."""
    tree = trace.tree
    toks, par, dep = (x[row].tolist() for x in (tree.tokens, tree.parents, tree.depth))
    y, order = {}, {}
    for i in range(len(toks)):                                        # stack nodes of each depth
        order.setdefault(dep[i], []).append(i)
    for nodes in order.values():
        for k, i in enumerate(nodes):
            y[i] = -(k - (len(nodes) - 1) / 2)
    return toks, par, dep, y, order


def draft_tree(trace, tokenizer=None, row: int = 0, title: str | None = None):
    """One speculative step as a picture: the draft tree (depth left to right), each node with its token, the
    drafter's q and the target's p; the accepted path in green, the drafts the target turned down in red (the
    children of the last accepted node: after them the residual is drawn), drafts never reached in grey, and the
    token drawn after the accepted path (residual sample or bonus) in blue. Readable up to depth 12."""
    import matplotlib.pyplot as plt
    toks, par, dep, y, order = _tree_layout(trace, row)
    acc = int(trace.accepted[row])
    path = [0] + [int(n) for n in trace.path[row, :acc].tolist()]
    turned_down = {i for i in range(1, len(toks)) if par[i] == path[-1]} if not bool(trace.bonus[row]) else set()
    depth = max(dep)
    scale = min(1.0, 6.0 / (depth + 1))                               # smaller nodes and text for deep trees
    fig, ax = plt.subplots(figsize=(min(16.0, 1.9 * (depth + 2)), 0.55 * max(map(len, order.values())) + 1.8))
    for i in range(1, len(toks)):
        ax.plot([dep[par[i]], dep[i]], [y[par[i]], y[i]], color=GREY, zorder=1, linewidth=1)
    for i in range(len(toks)):
        color = GREEN if i in path else RED if i in turned_down else GREY
        ax.scatter(dep[i], y[i], s=520 * scale, color=color, zorder=2)
        ax.text(dep[i], y[i], _tok(tokenizer, toks[i]) if i else f"[{_tok(tokenizer, toks[0])}]", ha="center",
                va="center", color="white", fontsize=10 * max(scale, 0.7), fontweight="bold", zorder=3)
        if i:
            ax.text(dep[i], y[i] - 0.34, f"q={float(trace.q[row, i]):.2f}\np={float(trace.p[row, i]):.2f}",
                    fontsize=7 * max(scale, 0.8), color="#444444", ha="center", va="top")
    last = path[-1]
    nx, ny = dep[last] + 1, y[last] + 0.9
    ax.plot([dep[last], nx], [y[last], ny], color=BLUE, linestyle="--", zorder=1)
    ax.scatter(nx, ny, s=520 * scale, color=BLUE, marker="s", zorder=2)
    ax.text(nx, ny, _tok(tokenizer, trace.next[row]), ha="center", va="center", color="white", fontweight="bold",
            zorder=3)
    ax.text(nx + 0.25, ny, "bonus from p" if bool(trace.bonus[row]) else "residual sample", fontsize=8, color=BLUE,
            va="center")
    ax.set_xticks(range(depth + 2), ["root"] + [f"depth {d}" for d in range(1, depth + 2)],
                  fontsize=9 * max(scale, 0.8))
    ax.set_yticks([])
    ax.set_xlim(-0.5, depth + 2.2)
    ax.set_ylim(min(y.values()) - 1.0, max(y.values()) + 1.4)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    what = f"{acc} drafts accepted + 1 " + ("bonus" if bool(trace.bonus[row]) else "resampled")
    ax.set_title(title or f"{trace.strategy.name}: {what} = {acc + 1} tokens this step")
    fig.tight_layout()
    return fig


def residual_bars(trace, tokenizer=None, row: int = 0, top: int = 8):
    """Where the next token came from: the target's p after the accepted path beside the distribution the token was
    drawn from (the residual: p with the turned-down drafts' mass removed and renormalised; or p itself for a
    bonus)."""
    import matplotlib.pyplot as plt
    acc = int(trace.accepted[row])
    last = 0 if acc == 0 else int(trace.path[row, acc - 1])
    final = trace.final_dist[row].float().cpu().numpy()
    p = trace.target_dist[row].float().cpu().numpy()
    ids = [int(i) for i in np.argsort(-(p + final))[:top]]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    x = np.arange(len(ids))
    ax.bar(x - 0.2, p[ids], width=0.4, color="#7F7F7F", label="target p here")
    ax.bar(x + 0.2, final[ids], width=0.4, color=BLUE, label="drawn from (residual / bonus)")
    ax.set_xticks(x, [_tok(tokenizer, i) for i in ids])
    ax.set_ylabel("probability")
    kind = "bonus: the target's own p" if bool(trace.bonus[row]) else "residual after the turned-down drafts"
    ax.set_title(f"the token after node {last}: {kind}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def acceptance_histogram(accept_hist, title: str = "Drafts accepted per row and step"):
    """Bars of how many drafts were accepted per (row, speculative step), from a rollout timeline's
    ``accept_hist`` (summed over steps)."""
    import matplotlib.pyplot as plt
    h = np.asarray(accept_hist)
    h = h.sum(0) if h.ndim == 2 else h
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    ax.bar(np.arange(h.size), h / max(h.sum(), 1), color="#4C72B0")
    ax.set_xlabel("drafts accepted (tokens emitted = accepted + 1)")
    ax.set_ylabel("share of row-steps")
    mean = float((np.arange(h.size) * h).sum() / max(h.sum(), 1)) + 1
    ax.set_title(f"{title} (mean tokens per step {mean:.2f})")
    fig.tight_layout()
    return fig


def distribution_match(labels, counts_a, counts_b, names=("plain sampling", "speculative decoding"),
                       title: str = "Same distribution", pvalue: float | None = None):
    """Side-by-side frequencies of the same categories from two samplers (with a chi-square p-value if given)."""
    import matplotlib.pyplot as plt
    a = np.asarray(counts_a, dtype=float)
    b = np.asarray(counts_b, dtype=float)
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(labels)), 3.6))
    ax.bar(x - 0.2, a / a.sum(), width=0.4, label=f"{names[0]} (n={int(a.sum())})", color="#4C72B0")
    ax.bar(x + 0.2, b / b.sum(), width=0.4, label=f"{names[1]} (n={int(b.sum())})", color=ORANGE)
    ax.set_xticks(x, labels, rotation=90 if len(labels) > 20 else 0, fontsize=7 if len(labels) > 20 else 9)
    ax.set_ylabel("frequency")
    ax.set_title(title + (f" (chi-square p = {pvalue:.2f})" if pvalue is not None else ""))
    ax.legend()
    fig.tight_layout()
    return fig
