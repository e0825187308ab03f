"""A model-free n-gram drafter: propose the tokens that followed the current suffix earlier in the same sequence or
in its GRPO siblings (other responses to the same prompt, finished or still running).

GRPO samples G responses per prompt, and responses to one prompt share much of their text (the same sub-results,
the same phrasing), so a sibling that is further along often already wrote what a row is about to write. The
proposer keeps, per prompt group, a hash index from every n-gram (``min_n <= n <= max_n``) to the places it occurred;
a proposal is the continuation after the longest suffix of the row's text that occurred before, taken from the
occurrence with the most text after it. Proposals are a function of earlier tokens only, so verifying them with the
point-mass rule (:func:`tltlib.spec.strategy.verify_chain_point`) keeps sampling exact.

Paper: TLT §5 "model-free drafter" (the fallback without a learned drafter; all of TLT-Base); the idea of drafting
from sibling rollouts is RhymeRL's and Seer's. Reference: SGLang/vLLM n-gram ("prompt lookup") decoding, which
looks only at the row's own text.

Departures: the index is host-side Python (dict per group, updated lazily from the engine's output buffer), so
its cost grows with the number of rows per step; the engine uses it in the tail, where rows are few.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import BadInput


@dataclass(frozen=True)
class NgramConfig:
    """How the n-gram drafter matches."""

    max_n: int = 4
    """Longest suffix matched (tried first)."""
    min_n: int = 2
    """Shortest suffix matched; below it the row gets no proposal (its draft repeats the last token)."""
    siblings: bool = True
    """Also match the other responses of the row's GRPO group (False: the row's own text only, like prompt lookup)."""
    occurrences: int = 4
    """Most recent occurrences kept per n-gram and group."""

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise BadInput(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if self.occurrences < 1:
            raise BadInput(f"occurrences must be >= 1, got {self.occurrences}")


def grow_texts(text: list[list[int]], prompt_len: list[int], members: Sequence[int], tokens: torch.Tensor,
               counts) -> None:
    """Extend each ``text[s]`` (prompt + response so far) of ``members`` with what the engine wrote since:
    ``tokens [N, max_new]`` with ``counts [N]`` tokens per sequence. Only rows that grew are copied (one transfer
    from a GPU)."""
    counts = counts.cpu().numpy() if isinstance(counts, torch.Tensor) else np.asarray(counts)
    stale = [s for s in members if int(counts[s]) > len(text[s]) - prompt_len[s]]
    if stale:
        rows = tokens.index_select(0, torch.tensor(stale, device=tokens.device)).cpu()
        for r, s in enumerate(stale):
            text[s].extend(rows[r, len(text[s]) - prompt_len[s]:int(counts[s])].tolist())


class NgramDrafter:
    """Per-rollout n-gram index over the prompts and the responses generated so far.

    Args:
        prompts: the rollout's tokenized prompts (sequence ``i`` answers prompt ``i // num_generations``).
        num_generations: G.
        config: :class:`NgramConfig`.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], num_generations: int, config: NgramConfig | None = None):
        self.config = config or NgramConfig()
        self.num_generations = num_generations
        n = len(prompts) * num_generations
        self.prompt_len = [len(prompts[i // num_generations]) for i in range(n)]
        self.text: list[list[int]] = [list(prompts[i // num_generations]) for i in range(n)]
        self.indexed = [0] * n                        # positions e < indexed have their n-grams ending at e indexed
        self.index: list[dict] = [dict() for _ in range(len(prompts) if self.config.siblings else n)]
        self.proposed = 0                             # rows given a proposal / rows asked (stats)
        self.asked = 0

    def _group_of(self, s: int) -> int:
        return s // self.num_generations if self.config.siblings else s

    def _index_upto(self, s: int) -> None:
        """Index the n-grams of sequence ``s`` that end before its last token (so each has a continuation)."""
        text, cfg = self.text[s], self.config
        start = self.indexed[s]
        if start == 0 and cfg.siblings and s % self.num_generations:   # the group's first sequence indexed the prompt
            start = self.prompt_len[s]
        idx = self.index[self._group_of(s)]
        for e in range(max(start, cfg.min_n), len(text)):
            for n in range(cfg.min_n, min(cfg.max_n, e) + 1):
                key = tuple(text[e - n:e])
                occ = idx.get(key)
                if occ is None:
                    idx[key] = [(s, e)]
                else:
                    occ.append((s, e))
                    if len(occ) > cfg.occurrences:
                        del occ[0]
        self.indexed[s] = max(self.indexed[s], len(text))

    def update(self, seqs: Sequence[int], tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Bring sequences ``seqs`` (and, with ``siblings``, their whole groups) up to date from the engine's
        output buffer ``tokens [N, max_new]`` with ``counts [N]`` tokens written per sequence."""
        size = self.num_generations
        groups = sorted({int(s) // size for s in seqs}) if self.config.siblings else None
        members = ([g * size + j for g in groups for j in range(size)] if groups is not None
                   else sorted({int(s) for s in seqs}))
        grow_texts(self.text, self.prompt_len, members, tokens, counts)
        for s in members:
            if len(self.text[s]) > self.indexed[s]:
                self._index_upto(s)

    def propose_one(self, s: int, depth: int) -> list[int]:
        """Up to ``depth`` tokens that followed the longest earlier occurrence of sequence ``s``'s suffix."""
        text, cfg = self.text[s], self.config
        idx = self.index[self._group_of(s)]
        for n in range(min(cfg.max_n, len(text)), cfg.min_n - 1, -1):
            occ = idx.get(tuple(text[-n:]))
            if not occ:
                continue
            best, best_len = None, 0
            for src, e in reversed(occ):              # most recent first; keep the longest continuation
                if src == s and e >= len(text):
                    continue
                avail = min(depth, len(self.text[src]) - e)
                if avail > best_len:
                    best, best_len = (src, e), avail
                    if avail == depth:
                        break
            if best is not None:
                src, e = best
                return self.text[src][e:e + best_len]
        return []

    def propose(self, seqs: Sequence[int], depth: int, device=None) -> torch.Tensor:
        """Drafts ``[B, depth]`` for sequences ``seqs``: each row's continuation, padded by repeating its last
        proposed token (or the row's last token when nothing matched)."""
        out = np.empty((len(seqs), depth), dtype=np.int64)
        for r, s in enumerate(seqs):
            s = int(s)
            prop = self.propose_one(s, depth)
            self.asked += 1
            self.proposed += bool(prop)
            fill = prop[-1] if prop else self.text[s][-1]
            out[r, : len(prop)] = prop
            out[r, len(prop):] = fill
        return torch.from_numpy(out).to(device) if device is not None else torch.from_numpy(out)
