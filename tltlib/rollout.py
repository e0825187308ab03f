"""RolloutEngine: batched sampling of G responses per prompt with a shrinking active batch, traced step by step.

One rollout = prefill the unique prompts (in row chunks), copy each prompt's cache row G times (GRPO groups), then
decode: sample a token for every running row, record it, retire rows that hit EOS or their token budget, compact the
cache when enough rows have finished (so later forwards really run on fewer rows), and run the next forward. Every
step's wall time and active row count goes into a timeline, every response's finish step and time into a trace —
the raw material of the long-tail analysis (notebook 01) and, later, of the adaptive SD switch.

Paper: TLT §2 (rollout dominates the RL step; long-tail responses), §5 (the rollout engine that SD plugs into).

Departures:
1. Plain (non-speculative) decoding only for now; a single process drives one batch (the data-parallel split across
   workers is modelled in :func:`tltlib.profiling.split_idle_fraction`).
2. Finished rows are compacted away only when at least ``compact_fraction`` of the batch has finished (default 1/8),
   trading a little wasted compute on finished rows for fewer cache copies; at small batch every finish compacts.
3. A prompt that fits the context but leaves less room than ``max_new_tokens`` gets a smaller budget (its response
   is cut at the context and counted as truncated) instead of failing the whole rollout.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from .profiling import rollout_stats
from .sampling import SamplingConfig, sample_from_logits


@dataclass(frozen=True)
class RolloutConfig:
    """How a rollout runs."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Temperature, top-k, top-p and max_new_tokens."""
    group_size: int = 1
    """G: responses sampled per prompt (GRPO group size)."""
    compact_fraction: float = 0.125
    """Compact the cache once at least this share of the batch's rows has finished (0 = at every finish)."""
    prefill_rows: int = 64
    """Prompts prefilled per forward (bounds prefill activation memory)."""
    keep_hidden: bool = False
    """Also return the target's final hidden state for every generated token (drafter training data)."""
    ignore_eos: bool = False
    """Keep generating after EOS until max_new_tokens (benchmarks: every row decodes the same number of tokens)."""

    def __post_init__(self):
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0 <= self.compact_fraction < 1:
            raise ValueError(f"compact_fraction must be in [0, 1), got {self.compact_fraction}")
        if self.prefill_rows < 1:
            raise ValueError(f"prefill_rows must be >= 1, got {self.prefill_rows}")


@dataclass
class RolloutResult:
    """Responses and traces of one rollout. Sequence ``i`` answers prompt ``i // group_size``.

    Attributes:
        tokens: ``[N, max_new]`` int64 response ids (EOS included), ``pad_id`` after the end.
        lengths: ``[N]`` response lengths.
        logprobs: ``[N, max_new]`` log-probability of each sampled token under the sampling distribution (0 after
            the end).
        hidden: ``[N, max_new, H]`` or None: ``hidden[i, j]`` is the target's final hidden state that produced the
            distribution of ``tokens[i, j]`` (i.e. at the position of the previous token), when ``keep_hidden``.
        finish_step, finish_time, truncated: per-sequence trace (decode step, seconds since start, cut by budget).
        timeline: per decode step: ``time`` (s since start, at step end), ``step_time`` (s), ``active`` (rows still
            generating), ``rows`` (rows in the forward, finished-but-not-compacted included).
        stats: ``rollout/*`` metrics (see tltlib.profiling.METRICS).
    """

    prompt_ids: list[list[int]]
    group_size: int
    tokens: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor
    hidden: torch.Tensor | None
    finish_step: np.ndarray
    finish_time: np.ndarray
    truncated: np.ndarray
    timeline: dict[str, np.ndarray]
    stats: dict[str, float]

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.numel())

    def response_ids(self, i: int) -> list[int]:
        return self.tokens[i, : int(self.lengths[i])].tolist()

    def texts(self, tokenizer) -> list[str]:
        """Decoded responses (special tokens dropped)."""
        return [tokenizer.decode(self.response_ids(i), skip_special_tokens=True) for i in range(self.num_sequences)]


def _pad(rows: Sequence[Sequence[int]], pad: int, device) -> torch.Tensor:
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out.to(device)


class RolloutEngine:
    """Generates GRPO groups of responses with a :class:`tltlib.model.Transformer`.

    Args:
        model: the policy (eval mode is not required; no autograd is used).
        config: :class:`RolloutConfig`.
        eos_ids: ids that end a response (default: the model config's ``eos_token_ids``).
        pad_id: id written after a response ends (default: the config's pad id, else 0).
    """

    def __init__(self, model, config: RolloutConfig | None = None, eos_ids: Sequence[int] | None = None,
                 pad_id: int | None = None):
        self.model = model
        self.config = config or RolloutConfig()
        eos = tuple(eos_ids) if eos_ids is not None else tuple(model.config.eos_token_ids)
        if not eos:
            raise ValueError("no end-of-sequence id: the model config has no eos_token_id; pass eos_ids=[...]")
        self.eos_ids = eos
        self.pad_id = pad_id if pad_id is not None else (model.config.pad_token_id or 0)

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        ctx, vocab = self.model.config.max_position_embeddings, self.model.config.vocab_size
        if len(prompts) == 0:
            raise ValueError("no prompts: pass at least one tokenized prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: it needs at least one token (e.g. BOS)")
            if len(p) >= ctx:
                raise ValueError(f"prompt {i} has {len(p)} tokens but the model's context is {ctx} "
                                 "(max_position_embeddings): shorten or drop the prompt")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): was it encoded with this "
                                 "model's tokenizer?")

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], generator: torch.Generator | None = None,
                 progress: bool = False) -> RolloutResult:
        """Sample ``group_size`` responses for each tokenized prompt.

        ``generator`` drives all sampling (default: a new one seeded 0, so a rollout is reproducible); it must live
        on the model's device. ``progress`` shows a tqdm bar of finished responses."""
        self._check_prompts(prompts)
        cfg, model = self.config, self.model
        s = cfg.sampling
        dev = model.embed.weight.device
        if generator is None:
            generator = torch.Generator(device=dev).manual_seed(0)
        G, P = cfg.group_size, len(prompts)
        N = P * G
        ctx = model.config.max_position_embeddings
        plen = torch.tensor([len(p) for p in prompts])
        budget = torch.clamp(ctx - plen, max=s.max_new_tokens).repeat_interleave(G).to(dev)
        max_len = int((plen + budget[::G].cpu()).max())
        cache = model.new_cache(N, max_len)
        eos = torch.tensor(self.eos_ids, device=dev)

        out_tokens = torch.full((N, s.max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        out_logp = torch.zeros(N, s.max_new_tokens, device=dev)
        hidden = (torch.zeros(N, s.max_new_tokens, model.config.hidden_size, dtype=model.embed.weight.dtype,
                              device=dev) if cfg.keep_hidden else None)
        lengths = torch.zeros(N, dtype=torch.long, device=dev)
        finish_step = np.zeros(N, dtype=np.int64)
        finish_time = np.zeros(N)
        times, step_times, actives, rows_in = [], [], [], []
        bar = tqdm(total=N, desc="rollout", unit="seq", disable=not progress, leave=False)

        t0 = time.perf_counter()
        last_logits, last_hidden = [], []
        for c0 in range(0, P, cfg.prefill_rows):
            c1 = min(P, c0 + cfg.prefill_rows)
            sub = cache.view(c0, c1)
            lens = plen[c0:c1].to(dev)
            logits, h = model.forward_cached(_pad(prompts[c0:c1], self.pad_id, dev), sub, logits_at=lens - 1)
            sub.advance(lens, max_n=int(lens.max()))
            last_logits.append(logits)
            if hidden is not None:
                last_hidden.append(h[torch.arange(c1 - c0, device=dev), lens - 1])
        cache.rows = P
        cache.sync_from_views()
        cache.select_rows(torch.arange(P, device=dev).repeat_interleave(G))
        logits = torch.cat(last_logits).repeat_interleave(G, 0)
        if hidden is not None:
            hidden[:, 0] = torch.cat(last_hidden).repeat_interleave(G, 0)
        prefill_s = time.perf_counter() - t0

        seq = torch.arange(N, device=dev)              # sequence id of each cache row
        alive = torch.ones(N, dtype=torch.bool, device=dev)
        pos, t_prev = 0, time.perf_counter()
        while True:
            tok, logp = sample_from_logits(logits, s, generator)
            ids = seq[alive]
            out_tokens[ids, pos] = tok[alive]
            out_logp[ids, pos] = logp[alive]
            done = alive & (pos + 1 >= budget[seq])
            if not cfg.ignore_eos:
                done |= alive & torch.isin(tok, eos)
            n_alive_before = int(alive.sum())
            n_done = int(done.sum())
            if n_done:
                done_ids = seq[done]
                lengths[done_ids] = pos + 1
                now = time.perf_counter() - t0
                finish_step[done_ids.cpu().numpy()] = pos
                finish_time[done_ids.cpu().numpy()] = now
                alive &= ~done
                bar.update(n_done)
            n_alive = n_alive_before - n_done
            if n_alive == 0:
                t_now = time.perf_counter()
                times.append(t_now - t0), step_times.append(t_now - t_prev)
                actives.append(n_alive_before), rows_in.append(int(seq.numel()))
                break
            rows = int(seq.numel())
            if rows - n_alive >= max(1, cfg.compact_fraction * rows):
                keep = alive.nonzero()[:, 0]
                cache.select_rows(keep)
                seq, tok, alive = seq[keep], tok[keep], alive[keep]
            logits, h = model.forward_cached(tok[:, None], cache)
            cache.advance(1)
            logits = logits[:, 0]
            if hidden is not None:
                hidden[seq[alive], pos + 1] = h[alive, 0]
            t_now = time.perf_counter()
            times.append(t_now - t0), step_times.append(t_now - t_prev)
            actives.append(n_alive_before), rows_in.append(rows)
            t_prev, pos = t_now, pos + 1
        bar.close()

        total = time.perf_counter() - t0
        lengths_cpu = lengths.cpu()
        truncated = ~torch.isin(out_tokens[torch.arange(N, device=dev), lengths - 1], eos).cpu().numpy()
        timeline = {"time": np.array(times), "step_time": np.array(step_times), "active": np.array(actives),
                    "rows": np.array(rows_in)}
        stats = rollout_stats(lengths_cpu.numpy(), timeline["step_time"], timeline["active"], N, truncated,
                              total, prefill_s)
        return RolloutResult([list(p) for p in prompts], G, out_tokens, lengths_cpu, out_logp, hidden,
                             finish_step, finish_time, truncated, timeline, stats)
