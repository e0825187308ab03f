"""The suffix drafter: model-free draft *trees* from what the group has already written and from earlier RL steps'
responses to the same prompt.

GRPO samples G responses per prompt and revisits its prompts every epoch; responses to one prompt repeat each
other's sub-results and phrasing. The drafter keeps, per prompt, a hash index from every n-gram
(``min_match <= n <= max_match``) of its texts — the prompt, the group's responses so far, and up to ``history``
responses to the same prompt from earlier rollouts (:class:`SuffixHistory`, kept by the engine across rollouts) —
to where it occurred. For a row it finds the longest suffix of the row's text that occurred before, gathers what
followed each occurrence (up to ``depth`` tokens), and merges those continuations into a trie whose node
probability is the share of occurrences that continue through it (the empirical probability of that path). The
``budget`` most probable nodes form the draft tree (:class:`tltlib.spec.strategy.DraftTree`; a node's probability
never exceeds its parent's, so the best nodes are closed under ancestors).

The tree is a function of earlier text only, so target-only tree verification
(:func:`tltlib.spec.strategy.verify_tree`: siblings as point masses, residual sampling, bonus) keeps sampling exact.

Papers: SuffixDecoding (Oliaro et al. 2024: suffix trees over earlier outputs, frequency-scored draft trees),
RhymeRL / Seer (drafting from sibling and earlier rollouts in RL). Departure: a hash index of bounded n-grams
instead of a suffix tree (the same matches up to ``max_match`` tokens; host-side Python, used in the tail where
rows are few).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import BadInput
from .ngram import grow_texts
from .trees import DraftTree


@dataclass(frozen=True)
class SuffixConfig:
    """How the suffix drafter matches and what it remembers."""

    max_match: int = 8
    """Longest suffix matched (tried first)."""
    min_match: int = 2
    """Shortest suffix matched; below it a row gets no draft (its tree is the root alone)."""
    occurrences: int = 32
    """Most recent occurrences kept per n-gram and prompt (the continuations merged into one tree)."""
    history: int = 16
    """Responses per prompt kept from earlier rollouts (0: the group's own text only)."""
    history_tokens: int = 1 << 22
    """Most response tokens kept over all prompts (int32: 16 MB); the prompts visited longest ago go first."""

    def __post_init__(self):
        if not 1 <= self.min_match <= self.max_match:
            raise BadInput(f"need 1 <= min_match <= max_match, got {self.min_match}, {self.max_match}")
        if self.occurrences < 1 or self.history < 0 or self.history_tokens < 0:
            raise BadInput(f"occurrences must be >= 1, history and history_tokens >= 0, got {self.occurrences}, "
                           f"{self.history}, {self.history_tokens}")


class SuffixHistory:
    """Responses to each prompt from earlier rollouts (the newest ``keep`` per prompt, at most ``max_tokens`` over
    all prompts, the least recently visited prompts dropped first): what a prompt's responses looked like the last
    times GRPO visited it."""

    def __init__(self, keep: int = 16, max_tokens: int = 1 << 22):
        self.keep, self.max_tokens = keep, max_tokens
        self.by_prompt: OrderedDict[tuple, deque] = OrderedDict()
        self.tokens = 0

    def add(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        if not self.keep or not self.max_tokens:
            return
        key = tuple(prompt)
        kept = self.by_prompt.setdefault(key, deque(maxlen=self.keep))
        self.by_prompt.move_to_end(key)
        if len(kept) == self.keep:
            self.tokens -= kept[0].size
        kept.append(np.asarray(response, dtype=np.int32))
        self.tokens += kept[-1].size
        while self.tokens > self.max_tokens and len(self.by_prompt) > 1:
            self.tokens -= sum(r.size for r in self.by_prompt.popitem(last=False)[1])

    def add_rollout(self, prompts: Sequence[Sequence[int]], num_generations: int, tokens: torch.Tensor,
                    lengths: torch.Tensor) -> None:
        """Keep a rollout's responses (``tokens [N, max_new]``, ``lengths [N]``; sequence i answers prompt
        i // num_generations)."""
        if not self.keep or not self.max_tokens:
            return
        out = tokens.cpu().numpy()
        for i in range(out.shape[0]):
            self.add(prompts[i // num_generations], out[i, : int(lengths[i])])

    def of(self, prompt: Sequence[int]) -> list[list[int]]:
        return [r.tolist() for r in self.by_prompt.get(tuple(prompt), ())]

    def __len__(self) -> int:
        return sum(len(d) for d in self.by_prompt.values())


def trie_nodes(continuations: Sequence[Sequence[int]], budget: int) -> list[tuple[int, int, float]]:
    """The ``budget`` most probable nodes of the trie of ``continuations`` as (token, parent, probability), parent
    -1 for the root's children, listed parents first (verification order: by depth, then probability).

    A node's probability is the share of continuations that pass through it. Ties go to the shallower node, then to
    the first seen, so a parent is never cut while its equally likely child is kept."""
    total = len(continuations)
    if not total or budget < 1:
        return []
    children: dict[tuple[int, int], int] = {}           # (parent node, token) -> node
    count, token, parent, depth = [], [], [], []
    for cont in continuations:
        at = -1
        for t in cont:
            node = children.get((at, t))
            if node is None:
                node = children[(at, t)] = len(count)
                count.append(0), token.append(int(t)), parent.append(at)
                depth.append(depth[at] + 1 if at >= 0 else 1)
            count[node] += 1
            at = node
    best = sorted(range(len(count)), key=lambda n: (-count[n], depth[n], n))[:budget]
    order = sorted(best, key=lambda n: (depth[n], -count[n], n))
    where = {n: i for i, n in enumerate(order)}
    return [(token[n], where[parent[n]] if parent[n] >= 0 else -1, count[n] / total) for n in order]


class SuffixDrafter:
    """Per-rollout suffix index over each group's prompt, its responses so far and its prompt's history.

    Args:
        prompts: the rollout's tokenized prompts (sequence ``i`` answers prompt ``i // num_generations``).
        num_generations: G.
        config: :class:`SuffixConfig`.
        history: earlier rollouts' responses (:class:`SuffixHistory`), or None.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], num_generations: int, config: SuffixConfig | None = None,
                 history: SuffixHistory | None = None):
        self.config = config or SuffixConfig()
        self.num_generations = num_generations
        n = len(prompts) * num_generations
        self.prompt_len = [len(prompts[i // num_generations]) for i in range(n)]
        self.text: list[list[int]] = [list(prompts[i // num_generations]) for i in range(n)]
        self.group = [i // num_generations for i in range(n)]
        self.indexed = [0] * n
        self.index: list[dict] = [dict() for _ in prompts]
        for g, p in enumerate(prompts):                 # earlier rollouts' responses: indexed once, whole
            for resp in (history.of(p) if history is not None else ()):
                self.text.append(list(p) + resp), self.group.append(g), self.indexed.append(len(p))
                self.prompt_len.append(len(p))
                self._index(len(self.text) - 1)
        self.asked = self.proposed = 0                  # rows asked / given a non-empty tree (stats)
        self.nodes = 0                                  # draft nodes proposed (stats)

    def _index(self, s: int) -> None:
        """Index the n-grams of text ``s`` that end before its last token (so each has a continuation)."""
        text, cfg = self.text[s], self.config
        start = self.indexed[s]
        if start == 0 and s % self.num_generations:          # the group's first sequence indexes the prompt
            start = self.prompt_len[s]
        idx = self.index[self.group[s]]
        for e in range(max(start, cfg.min_match), len(text)):
            for n in range(cfg.min_match, min(cfg.max_match, e) + 1):
                occ = idx.setdefault(tuple(text[e - n:e]), deque(maxlen=cfg.occurrences))
                occ.append((s, e))
        self.indexed[s] = max(self.indexed[s], len(text))

    def update(self, seqs: Sequence[int], tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Bring the groups of sequences ``seqs`` up to date from the engine's output buffer ``tokens [N,
        max_new]`` with ``counts [N]`` tokens written per sequence."""
        groups = sorted({int(s) // self.num_generations for s in seqs})
        members = [g * self.num_generations + j for g in groups for j in range(self.num_generations)]
        grow_texts(self.text, self.prompt_len, members, tokens, counts)
        for s in members:
            if len(self.text[s]) > self.indexed[s]:
                self._index(s)

    def continuations(self, s: int, depth: int) -> list[list[int]]:
        """What followed the earlier occurrences of the longest matching suffix of sequence ``s`` (up to ``depth``
        tokens each; the row's own current end excluded); empty when no suffix of ``min_match`` tokens recurs."""
        text, cfg = self.text[s], self.config
        idx = self.index[self.group[s]]
        for n in range(min(cfg.max_match, len(text)), cfg.min_match - 1, -1):
            occ = idx.get(tuple(text[-n:]))
            conts = [self.text[src][e:e + depth] for src, e in (occ or ()) if not (src == s and e >= len(text))]
            conts = [c for c in conts if c]
            if conts:
                return conts
        return []

    def propose(self, seqs: Sequence[int], root: torch.Tensor, depth: int, budget: int,
                trim: bool = False) -> DraftTree:
        """Draft trees for sequences ``seqs`` (``root [B]``: each row's last token, node 0): at most ``budget``
        nodes of at most ``depth`` levels. Rows with fewer nodes are padded with nodes that hang off no tree node
        (parent -1: never a child of any node the walk reaches, so never accepted). :attr:`expected` ``[B]``: each
        tree's expected accepted drafts under its empirical probabilities (the sum of its nodes'). ``trim``: the
        trees are only as wide as the largest one (at least one node): no verify work on padding."""
        b = len(seqs)
        tok = np.zeros((b, budget + 1), dtype=np.int64)
        par = np.full((b, budget + 1), -1, dtype=np.int64)
        dep = np.ones((b, budget + 1), dtype=np.int64)
        dep[:, 0] = 0
        expected = np.zeros(b)
        for r, s in enumerate(seqs):
            nodes = trie_nodes(self.continuations(int(s), depth), budget)
            self.asked += 1
            self.proposed += bool(nodes)
            self.nodes += len(nodes)
            expected[r] = sum(prob for _, _, prob in nodes)
            for i, (t, p, _) in enumerate(nodes, 1):
                tok[r, i], par[r, i] = t, p + 1 if p >= 0 else 0
                dep[r, i] = dep[r, p + 1] + 1 if p >= 0 else 1
            tok[r, len(nodes) + 1:] = self.text[int(s)][-1]
        if trim:
            width = 1 + max(1, int((par[:, 1:] >= 0).sum(1).max()) if b else 1)
            tok, par, dep = tok[:, :width], par[:, :width], dep[:, :width]
        dev = root.device
        self.expected = torch.from_numpy(expected).to(dev)
        tokens = torch.from_numpy(tok).to(dev)
        tokens[:, 0] = root
        return DraftTree(tokens, torch.from_numpy(par).to(dev), torch.from_numpy(dep).to(dev))
