"""The drafter's training data: a token-bounded buffer of the (hidden, token) pairs the rollout streams into it.

**What is stored.** For a sequence x_0 .. x_{n-1} (prompt then response) the drafter consumes, at inference, pair
t = (f_t, x_{t+1}) at drafter position t, where f_t is the target's final hidden state at position t (the one that
produced x_{t+1}'s distribution). The rollout streams exactly those pairs (:class:`tltlib.rollout.engine.Rollout`): the
prompt pairs (t < L_p - 1) from the prefill, once per prompt (a GRPO group shares them), and each response token's
pair from the decode iteration that produced it (plain or an SD step: the verify forward's hidden states along the
accepted path are what the drafter is fed). No dense [rows, max_new, H] tensor is ever allocated: pairs go into one
pool of at most ``max_tokens`` entries.

**Bounded.** When the pool is full, whole sequences are evicted: older RL steps first, then, within the running
rollout, those with the lowest random priority (drawn when the sequence starts, independent of its length, so the
long tail is kept in proportion rather than cut). A prompt's pairs go when its last sequence goes.

**Sampling.** :meth:`PairBuffer.sample` draws training batches of whole sequences: a length bucket (powers of two)
with probability proportional to its weighted pair count, then sequences in it by weight ``decay ** age`` (age in RL
steps since the sequence was generated), so older policies' data fades and long responses are trained on as much as
their tokens weigh. Batches are :class:`PairBatch`: position t holds pair (f_t, x_{t+1}), and pairs whose f_{t+1}
predicts a prompt token or lies past the end carry no loss (:func:`loss_mask`).

Paper: TLT §4 (the adaptive drafter trains on the rollout's own hidden states; the spot trainer's data buffer).
Reference: ``eagle_background_trainer`` collects hidden states per request after the rollout (see
shared/reference: misaligned by one position and padded with prompt padding).

Departures:
1. Pairs are streamed during the rollout (no second forward over the sequences and no dense hidden tensor).
2. Eviction is by whole sequences, and sampling is weighted by age instead of a FIFO of fixed size.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import BadInput


@dataclass
class PairBatch:
    """Padded training pairs of B sequences: position t holds pair (f_t, x_{t+1}) and its targets.

    Attributes:
        hidden: ``[B, T+1, H]`` target hidden states f_0 .. f_T (inputs are [:, :-1], targets [:, 1:]).
        tokens: ``[B, T+1]`` tokens x_1 .. x_{T+1} aligned so that ``tokens[:, t]`` is x_{t+1}.
        mask: ``[B, T]`` bool, pairs that carry loss.
    """

    hidden: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hidden[:, :-1], self.tokens[:, :-1]


def loss_mask(length: int, prompt_len: int, width: int) -> torch.Tensor:
    """``[width]`` bool: pair t carries loss iff f_{t+1} predicts a response token (t + 1 >= prompt_len - 1) and
    exists inside the sequence (t + 1 <= length - 2)."""
    t = torch.arange(width)
    return (t + 1 >= prompt_len - 1) & (t + 1 <= length - 2)


@dataclass(frozen=True)
class PairBufferConfig:
    """Capacity and sampling of the drafter's pair buffer."""

    max_tokens: int = 1 << 20
    """Pairs held at most (prompt pairs included); the pool grows to this size and then evicts whole sequences."""
    decay: float = 0.5
    """Sampling weight of a sequence generated ``a`` RL steps ago: ``decay ** a`` (1 = no down-weighting)."""
    evict_slack: float = 0.1
    """When full, evict until this share of the capacity is free (fewer, larger evictions)."""
    seed: int = 0
    """Seeds eviction priorities and batch sampling."""

    def __post_init__(self):
        if self.max_tokens < 2:
            raise BadInput(f"max_tokens must be >= 2 pairs, got {self.max_tokens}")
        if not 0.0 < self.decay <= 1.0:
            raise BadInput(f"decay must be in (0, 1], got {self.decay}")
        if not 0.0 <= self.evict_slack < 1.0:
            raise BadInput(f"evict_slack must be in [0, 1), got {self.evict_slack}")


class PairBuffer:
    """Whole sequences of (hidden, token) pairs, streamed in by rollouts, sampled into training batches.

    Owners: prompts (ids ``-1, -2, ...``) and sequences (ids ``0, 1, ...``, one per response). Entry e of the pool
    holds ``hidden[e]`` (f_t), ``token[e]`` (x_{t+1}), ``owner[e]`` and ``pos[e]`` (t for a prompt pair, the response
    index j for a response pair, which is t = L_p - 1 + j)."""

    def __init__(self, hidden_size: int, config: PairBufferConfig | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.config = config or PairBufferConfig()
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, torch.device(device)
        self.rng = np.random.default_rng(self.config.seed)
        self.h = torch.zeros(0, hidden_size, dtype=dtype, device=self.device)
        self.tok = torch.zeros(0, dtype=torch.long, device=self.device)
        self.owner = torch.zeros(0, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self.size = 0
        # per sequence (index = sequence id)
        self.seq_prompt: list[int] = []       # owner id of its prompt's pairs
        self.seq_step: list[int] = []         # RL step that generated it
        self.seq_prio: list[float] = []
        self.seq_live: list[bool] = []
        self.prompt_len: dict[int, int] = {}  # prompt owner id -> L_p
        self.rl_step = 0                      # the current RL step (set by begin)
        self._order: torch.Tensor | None = None
        self._span: dict[int, tuple[int, int]] = {}
        self._current: set[int] = set()       # sequences of the rollout being streamed
        self._dead: torch.Tensor | None = None   # owners evicted while their rollout still streams
        self._next_prompt = -1

    # ------------------------------------------------------------------------------------------ streaming
    def begin(self, prompts: list[list[int]], num_generations: int, rl_step: int | None = None) -> tuple[list[int],
                                                                                                         int]:
        """Register a rollout of ``prompts`` x ``num_generations`` (at RL step ``rl_step``, default: :attr:`rl_step`);
        returns (prompt owner ids, first sequence id)."""
        if rl_step is not None:
            self.rl_step = rl_step
        pids = [self._next_prompt - i for i in range(len(prompts))]
        self._next_prompt -= len(prompts)
        for pid, p in zip(pids, prompts):
            self.prompt_len[pid] = len(p)
        first = len(self.seq_prompt)
        for i in range(len(prompts) * num_generations):
            self.seq_prompt.append(pids[i // num_generations])
            self.seq_step.append(self.rl_step)
            self.seq_prio.append(float(self.rng.random()))
            self.seq_live.append(True)
        self._current = set(range(first, len(self.seq_prompt)))
        self._order, self._dead = None, None
        return pids, first

    def add(self, owner: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append K pairs: ``owner [K]``, ``pos [K]``, ``hidden [K, H]``, ``tokens [K]`` (pairs of evicted owners
        are dropped)."""
        if self._dead is not None:
            keep = ~torch.isin(owner, self._dead)
            owner, pos, hidden, tokens = owner[keep], pos[keep], hidden[keep], tokens[keep]
        k = int(tokens.numel())
        if k and self.size + k > self.config.max_tokens:
            self._evict(self.size + k - int(self.config.max_tokens * (1 - self.config.evict_slack)))
            if self._dead is not None:
                keep = ~torch.isin(owner, self._dead)
                owner, pos, hidden, tokens = owner[keep], pos[keep], hidden[keep], tokens[keep]
            k = min(int(tokens.numel()), self.config.max_tokens - self.size)   # beyond what eviction freed: cut
            owner, pos, hidden, tokens = owner[:k], pos[:k], hidden[:k], tokens[:k]
        if k == 0:
            return
        self._reserve(self.size + k)
        sl = slice(self.size, self.size + k)
        self.h[sl] = hidden.to(self.dtype)
        self.tok[sl], self.owner[sl], self.pos[sl] = tokens, owner, pos
        self.size += k
        self._order = None

    def _reserve(self, n: int) -> None:
        cap = self.h.shape[0]
        if n <= cap:
            return
        new = min(self.config.max_tokens, max(n, 2 * cap, 1024))
        for name in ("h", "tok", "owner", "pos"):
            old = getattr(self, name)
            grown = torch.zeros((new, *old.shape[1:]), dtype=old.dtype, device=old.device)
            grown[: self.size] = old[: self.size]
            setattr(self, name, grown)

    def _evict(self, need: int) -> None:
        """Drop whole sequences (oldest step first, then lowest priority) until ``need`` entries are free."""
        counts = torch.bincount(self.owner[: self.size] - self._min_owner(), minlength=1).tolist()
        base = self._min_owner()
        per_owner = {o + base: c for o, c in enumerate(counts) if c}
        live = [s for s, ok in enumerate(self.seq_live) if ok]
        live.sort(key=lambda s: (s in self._current, self.seq_step[s], self.seq_prio[s]))
        freed, victims = 0, set()
        users: dict[int, int] = {}
        for s in live:
            users[self.seq_prompt[s]] = users.get(self.seq_prompt[s], 0) + 1
        for s in live:
            if freed >= need:
                break
            victims.add(s)
            self.seq_live[s] = False
            freed += per_owner.get(s, 0)
            p = self.seq_prompt[s]
            users[p] -= 1
            if users[p] == 0:
                victims.add(p)
                freed += per_owner.get(p, 0)
                del self.prompt_len[p]
        victims_t = torch.tensor(sorted(victims), dtype=torch.long, device=self.device)
        current_prompts = {self.seq_prompt[c] for c in self._current}
        gone_now = victims_t[[v in self._current or v in current_prompts for v in victims_t.tolist()]]
        if gone_now.numel():
            self._dead = gone_now if self._dead is None else torch.cat([self._dead, gone_now])
        keep = ~torch.isin(self.owner[: self.size], victims_t)
        idx = keep.nonzero()[:, 0]
        n = int(idx.numel())
        for name in ("h", "tok", "owner", "pos"):
            t = getattr(self, name)
            t[:n] = t[idx]
        self.size = n
        self._order = None

    def _min_owner(self) -> int:
        return int(self.owner[: self.size].min()) if self.size else 0

    # --------------------------------------------------------------------------------------------- reading
    def _index(self) -> None:
        """Sort entries by (owner, pos) once after changes: each owner's pairs become a span of ``_order``."""
        if self._order is not None:
            return
        own, pos = self.owner[: self.size], self.pos[: self.size]
        key = (own - self._min_owner()) * (int(pos.max()) + 1 if self.size else 1) + pos
        self._order = torch.argsort(key, stable=True)
        sorted_own = own[self._order]
        uniq, counts = torch.unique_consecutive(sorted_own, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        self._span = {int(o): (int(s), int(c)) for o, s, c in zip(uniq.tolist(), starts.tolist(), counts.tolist())}

    def sequences(self) -> list[int]:
        """Ids of the sequences held (live and with at least one response pair)."""
        self._index()
        return [s for s, ok in enumerate(self.seq_live) if ok and s in self._span]

    def pairs_of(self, seq: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(hidden ``[n-1, H]``, tokens ``[n-1]``, prompt length) of one sequence, prompt pairs first, in order."""
        self._index()
        p = self.seq_prompt[seq]
        idx = torch.cat([self._order[a: a + c] for a, c in (self._span.get(p, (0, 0)), self._span[seq])])
        return self.h[idx], self.tok[idx], self.prompt_len[p]

    def seq_pairs(self, seq: int) -> int:
        """Pairs of one sequence (prompt pairs included)."""
        self._index()
        return self._span.get(self.seq_prompt[seq], (0, 0))[1] + self._span[seq][1]

    def __len__(self) -> int:
        return len(self.sequences())

    def batch(self, seqs) -> PairBatch:
        """The training batch of sequences ``seqs`` (right-padded; see :class:`PairBatch`)."""
        seqs = list(seqs)
        parts = [self.pairs_of(s) for s in seqs]
        width = max(h.shape[0] for h, _, _ in parts)
        hidden = torch.zeros(len(seqs), width, self.hidden_size, dtype=self.dtype, device=self.device)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(seqs), max(width - 1, 1), dtype=torch.bool, device=self.device)
        for j, (h, t, plen) in enumerate(parts):
            n = h.shape[0]
            hidden[j, :n], tokens[j, :n] = h, t
            mask[j, : width - 1] = loss_mask(n + 1, plen, width - 1).to(self.device)
        return PairBatch(hidden, tokens, mask[:, : width - 1])

    def weights(self, seqs: list[int]) -> np.ndarray:
        """Sampling weight of each sequence: ``decay ** (current step - its step)``."""
        age = self.rl_step - np.asarray([self.seq_step[s] for s in seqs], dtype=np.float64)
        return self.config.decay ** age

    def sample(self, batch_sequences: int, max_pairs: int = 0) -> PairBatch:
        """A training batch: a length bucket by weighted pair count, then up to ``batch_sequences`` of its
        sequences by weight, without replacement (and, with ``max_pairs``, no more than fit in that many pairs;
        at least one)."""
        seqs = self.sequences()
        if not seqs:
            raise BadInput("the pair buffer holds no sequence yet: stream a rollout into it first")
        lengths = np.asarray([self.seq_pairs(s) for s in seqs])
        w = self.weights(seqs)
        bucket = np.floor(np.log2(np.maximum(lengths, 1))).astype(int)
        mass = np.bincount(bucket, weights=w * lengths)
        b = int(self.rng.choice(len(mass), p=mass / mass.sum()))
        members = np.flatnonzero(bucket == b)
        k = min(batch_sequences, len(members))
        if max_pairs:
            k = max(1, min(k, max_pairs // int(lengths[members].max())))
        pick = self.rng.choice(members, size=k, replace=False, p=w[members] / w[members].sum())
        return self.batch([seqs[i] for i in sorted(pick)])

    # ----------------------------------------------------------------------------- exchange between workers
    def export_step(self, step: int) -> dict:
        """The sequences generated at RL step ``step`` with their prompts' pairs (CPU tensors), for :meth:`ingest`
        into another worker's buffer."""
        self._index()
        seqs = [s for s in self.sequences() if self.seq_step[s] == step]
        prompts = sorted({self.seq_prompt[s] for s in seqs})
        spans = [self._span[o] for o in prompts + seqs if o in self._span]
        idx = torch.cat([self._order[a: a + c] for a, c in spans]) if spans else torch.zeros(0, dtype=torch.long)
        return {"step": step, "h": self.h[idx].cpu(), "tok": self.tok[idx].cpu(), "owner": self.owner[idx].cpu(),
                "pos": self.pos[idx].cpu(), "seq_prompt": {s: self.seq_prompt[s] for s in seqs},
                "prompt_len": {p: self.prompt_len[p] for p in prompts}}

    def ingest(self, part: dict) -> None:
        """Add the sequences of another buffer's :meth:`export_step` (new ids here; their RL step is kept)."""
        remap = {}
        for pid, length in part["prompt_len"].items():
            remap[pid] = self._next_prompt
            self.prompt_len[self._next_prompt] = length
            self._next_prompt -= 1
        for seq, pid in part["seq_prompt"].items():
            remap[seq] = len(self.seq_prompt)
            self.seq_prompt.append(remap[pid])
            self.seq_step.append(part["step"])
            self.seq_prio.append(float(self.rng.random()))
            self.seq_live.append(True)
        if part["tok"].numel():
            owner = torch.tensor([remap[o] for o in part["owner"].tolist()], dtype=torch.long, device=self.device)
            self.add(owner, part["pos"].to(self.device), part["h"].to(self.device), part["tok"].to(self.device))
        self._order = None

    @property
    def num_pairs(self) -> int:
        """Pairs held (prompt pairs counted once per prompt)."""
        return self.size

    # ------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Everything needed to resume (tensors on CPU)."""
        n = self.size
        return {"config": self.config.__dict__, "hidden_size": self.hidden_size, "step": self.rl_step,
                "h": self.h[:n].cpu(), "tok": self.tok[:n].cpu(), "owner": self.owner[:n].cpu(),
                "pos": self.pos[:n].cpu(), "seq_prompt": list(self.seq_prompt), "seq_step": list(self.seq_step),
                "seq_prio": list(self.seq_prio), "seq_live": list(self.seq_live),
                "prompt_len": {str(k): v for k, v in self.prompt_len.items()}, "next_prompt": self._next_prompt,
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, d: dict) -> None:
        if d["hidden_size"] != self.hidden_size:
            raise BadInput(f"pair buffer of hidden size {d['hidden_size']} cannot load into one of "
                           f"{self.hidden_size}: the checkpoint is from another model")
        n = d["h"].shape[0]
        self.size = 0
        self._reserve(n)
        self.h[:n] = d["h"].to(self.device, self.dtype)
        for name in ("tok", "owner", "pos"):
            getattr(self, name)[:n] = d[name].to(self.device)
        self.size, self.rl_step = n, d["step"]
        self.seq_prompt, self.seq_step = list(d["seq_prompt"]), list(d["seq_step"])
        self.seq_prio, self.seq_live = list(d["seq_prio"]), list(d["seq_live"])
        self.prompt_len = {int(k): v for k, v in d["prompt_len"].items()}
        self.rng.bit_generator.state = d["rng"]
        self._next_prompt = d["next_prompt"]
        self._order, self._current, self._dead = None, set(), None
