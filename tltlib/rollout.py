"""RolloutEngine: batched sampling of G responses per prompt with a shrinking active batch, traced step by step.

One rollout = prefill the unique prompts (in row chunks), copy each prompt's cache row G times (GRPO groups), sample
every row's first token, then decode step by step. Each step is either *plain* (one target forward, one token per
row) or *speculative* (a drafter proposes a chain or tree, one target forward verifies it, several tokens per row;
:mod:`tltlib.specdecode`); the strategy may change from one step to the next. Rows that emit EOS or reach their
token budget retire; the cache is compacted when enough have finished, so later
forwards really run on fewer rows. Every step's wall time, running rows, strategy and acceptance go into a timeline,
every response's finish step and time into a trace — the raw material of the long-tail analysis (notebook 01), the
SD benchmarks and the adaptive switch.

Paper: TLT §2 (rollout dominates the RL step; long-tail responses), §5 (the adaptive rollout engine SD plugs into).

Departures:
1. A single process drives one batch (the data-parallel split across workers is modelled in
   :func:`tltlib.profiling.split_idle_fraction`).
2. Finished rows are compacted away once at least ``compact_fraction`` of the batch has finished (default 1/8);
   until then they stay in the batch (plain and speculative steps alike) without growing their cache.
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

from .ngram import NgramConfig, NgramDrafter
from .profiling import rollout_stats, spec_stats
from .sampling import SamplingConfig, sample_from_logits
from .specdecode import SpecDecoder, StepOut
from .speculative import OFF, SpecStrategy


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
    draft_margin: int = 72
    """Cache slots kept beyond the longest sequence for draft tokens (must exceed a strategy's verify tokens)."""

    def __post_init__(self):
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0 <= self.compact_fraction < 1:
            raise ValueError(f"compact_fraction must be in [0, 1), got {self.compact_fraction}")
        if self.prefill_rows < 1:
            raise ValueError(f"prefill_rows must be >= 1, got {self.prefill_rows}")
        if self.draft_margin < 1:
            raise ValueError(f"draft_margin must be >= 1, got {self.draft_margin}")


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
        timeline: per decode step after the first token: ``time`` (s since start, at step end), ``step_time``
            (s), ``active`` (rows still generating), ``rows`` (rows in the forward, finished-but-not-compacted
            included), ``strategy`` (name), ``tokens`` (emitted), ``accepted`` (drafts accepted), ``drafted``
            (draft tokens verified), ``draft_s`` / ``verify_s`` (s), ``accept_hist`` (``[steps, D+1]`` rows by
            number of accepted drafts).
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


def _strategy_source(strategy):
    """Normalise ``strategy`` to an object with ``choose(step, active)`` (and maybe ``observe``)."""
    if strategy is None or isinstance(strategy, SpecStrategy):
        fixed = strategy or OFF
        return type("Fixed", (), {"choose": staticmethod(lambda step, active: fixed)})()
    if hasattr(strategy, "choose"):
        return strategy
    if callable(strategy):
        return type("Callable", (), {"choose": staticmethod(strategy)})()
    raise TypeError(f"strategy must be a SpecStrategy, a callable (step, active) -> SpecStrategy or an object with "
                    f"choose(step, active); got {type(strategy).__name__}")


class RolloutEngine:
    """Generates GRPO groups of responses with a :class:`tltlib.model.Transformer`.

    Args:
        model: the policy (eval mode is not required; no autograd is used).
        config: :class:`RolloutConfig`.
        eos_ids: ids that end a response (default: the model config's ``eos_token_ids``).
        pad_id: id written after a response ends (default: the config's pad id, else 0).
        drafter: an attached :class:`tltlib.drafter.Drafter` for ``chain``/``tree`` steps (None: plain and
            ``ngram`` steps only).
        ngram: settings of the model-free n-gram drafter used by ``ngram`` steps.
    """

    def __init__(self, model, config: RolloutConfig | None = None, eos_ids: Sequence[int] | None = None,
                 pad_id: int | None = None, drafter=None, ngram: NgramConfig | None = None):
        self.model = model
        self.config = config or RolloutConfig()
        eos = tuple(eos_ids) if eos_ids is not None else tuple(model.config.eos_token_ids)
        if not eos:
            raise ValueError("no end-of-sequence id: the model config has no eos_token_id; pass eos_ids=[...]")
        self.eos_ids = eos
        self.pad_id = pad_id if pad_id is not None else (model.config.pad_token_id or 0)
        if drafter is not None:
            from .drafter import check_compatible
            check_compatible(drafter.config, model.config)
            if not drafter._target or drafter.target is not model:
                drafter.attach(model)
        self.drafter = drafter
        self.ngram_config = ngram or NgramConfig()
        self.last_ngram: NgramDrafter | None = None
        self.record_drafter_pairs = False     # debugging/tests: keep every (hidden, token) pair fed to the drafter
        self.last_spec: SpecDecoder | None = None

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
                 progress: bool = False, strategy=None) -> RolloutResult:
        """Sample ``group_size`` responses for each tokenized prompt.

        Args:
            generator: drives all sampling (default: a new one seeded 0, so a rollout is reproducible); it must
                live on the model's device.
            progress: show a tqdm bar of finished responses.
            strategy: speculative decoding per step: a :class:`SpecStrategy` (default off), a callable
                ``(step, active_rows) -> SpecStrategy``, or a controller with ``choose(step, active_rows)`` and
                optionally ``observe(strategy, active_rows, tokens, seconds, rows)`` (the adaptive engine;
                ``tokens`` = tokens the step produced for the ``rows`` rows that keep running after it: a response's
                last step emits only what was left of it, whatever the strategy, so it says nothing about the arm).
        """
        self._check_prompts(prompts)
        cfg, model = self.config, self.model
        s = cfg.sampling
        source = _strategy_source(strategy)
        dev = model.embed.weight.device
        if generator is None:
            generator = torch.Generator(device=dev).manual_seed(0)
        G, P = cfg.group_size, len(prompts)
        N = P * G
        ctx = model.config.max_position_embeddings
        plen = torch.tensor([len(p) for p in prompts])
        budget = torch.clamp(ctx - plen, max=s.max_new_tokens).repeat_interleave(G).to(dev)
        max_len = int((plen + budget[::G].cpu()).max()) + cfg.draft_margin
        cache = model.new_cache(N, max_len)
        spec = SpecDecoder(model, self.drafter, s, N, max_len, max_emit=cfg.draft_margin)
        if self.record_drafter_pairs:
            spec.fed_pairs = []
        self.last_spec, self.last_ngram, ngram = spec, None, None
        eos = torch.tensor(self.eos_ids, device=dev)

        out_tokens = torch.full((N, s.max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        out_logp = torch.zeros(N, s.max_new_tokens, device=dev)
        hidden = (torch.zeros(N, s.max_new_tokens, model.config.hidden_size, dtype=model.embed.weight.dtype,
                              device=dev) if cfg.keep_hidden else None)
        n_gen = torch.zeros(N, dtype=torch.long, device=dev)
        n_out = torch.zeros(N, dtype=torch.long, device=dev)        # tokens written per sequence (n-gram index)
        lengths = torch.zeros(N, dtype=torch.long, device=dev)
        finish_step = np.zeros(N, dtype=np.int64)
        finish_time = np.zeros(N)
        tl = {k: [] for k in ("time", "step_time", "active", "rows", "strategy", "tokens", "accepted", "drafted",
                              "draft_s", "verify_s", "accept_hist")}
        bar = tqdm(total=N, desc="rollout", unit="seq", disable=not progress, leave=False)

        t0 = time.perf_counter()
        last_logits, last_hidden = [], []
        for c0 in range(0, P, cfg.prefill_rows):
            c1 = min(P, c0 + cfg.prefill_rows)
            sub = cache.view(c0, c1)
            lens = plen[c0:c1].to(dev)
            toks = _pad(prompts[c0:c1], self.pad_id, dev)
            logits, h = model.forward_cached(toks, sub, logits_at=lens - 1)
            sub.advance(lens)
            spec.prefill(slice(c0, c1), toks, h, lens)
            last_logits.append(logits)
            last_hidden.append(h[torch.arange(c1 - c0, device=dev), lens - 1])
        cache.rows = P
        cache.sync_from_views()
        expand = torch.arange(P, device=dev).repeat_interleave(G)
        cache.select_rows(expand)
        spec.after_prefill(P)
        spec.select_rows(expand)
        logits = torch.cat(last_logits).repeat_interleave(G, 0)
        first_hidden = torch.cat(last_hidden).repeat_interleave(G, 0)
        tok, logp = sample_from_logits(logits, s, generator)
        first = StepOut(tok[:, None], torch.ones(N, dtype=torch.long, device=dev), logp[:, None],
                        first_hidden[:, None], torch.zeros(N, dtype=torch.long, device=dev))
        spec.push(first.hidden, first.tokens, first.count, 1)
        prefill_s = time.perf_counter() - t0

        seq = torch.arange(N, device=dev)              # sequence id of each cache row
        alive = torch.ones(N, dtype=torch.bool, device=dev)
        j_idx = torch.arange(s.max_new_tokens + cfg.draft_margin + 1, device=dev)
        step, out, t_prev, st = 0, first, time.perf_counter(), OFF
        while True:
            # ---- record what the step emitted: cut at the first EOS and at the token budget
            m = out.tokens.shape[1]
            j = j_idx[:m]
            valid = (j[None, :] < out.count[:, None]) & alive[:, None]
            keep = torch.minimum(out.count, budget[seq] - n_gen) * alive
            if not cfg.ignore_eos:
                is_eos = torch.isin(out.tokens, eos) & valid
                first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, m)
                keep = torch.minimum(keep, first_eos)
                hit_eos = is_eos.any(1) & (first_eos <= keep)
            else:
                hit_eos = torch.zeros_like(alive)
            write = j[None, :] < keep[:, None]
            r_idx = seq[:, None].expand(-1, m)[write]
            c_idx = (n_gen[:, None] + j[None, :])[write]
            out_tokens[r_idx, c_idx] = out.tokens[write]
            out_logp[r_idx, c_idx] = out.logprobs[write].float()
            if hidden is not None:
                hidden[r_idx, c_idx] = out.hidden[write]
            n_gen += keep
            n_out[seq] = n_gen
            done = alive & (hit_eos | (n_gen >= budget[seq]))
            n_alive_before = int(alive.sum())
            n_done = int(done.sum())
            if n_done:
                lengths[seq[done]] = n_gen[done]
                done_ids = seq[done].cpu().numpy()
                finish_step[done_ids] = step
                finish_time[done_ids] = time.perf_counter() - t0
                alive &= ~done
                bar.update(n_done)
            last = out.tokens.gather(1, (keep - 1).clamp_min(0)[:, None])[:, 0]
            t_now = time.perf_counter()
            if step > 0:
                counted = out.accepted[keep > 0]
                acc = int(counted.sum()) if st.enabled else 0
                hist = (torch.bincount(counted, minlength=out.drafted + 1).cpu().numpy() if st.enabled
                        else np.zeros(1, dtype=np.int64))
                for key, val in (("time", t_now - t0), ("step_time", t_now - t_prev), ("active", n_alive_before),
                                 ("rows", int(seq.numel())), ("strategy", st.name), ("tokens", int(keep.sum())),
                                 ("accepted", acc), ("drafted", out.drafted * n_alive_before),
                                 ("draft_s", out.draft_s), ("verify_s", out.verify_s), ("accept_hist", hist)):
                    tl[key].append(val)
                if hasattr(source, "observe"):                 # alive: the rows that keep running
                    source.observe(st, n_alive_before, int((out.count * alive).sum()), t_now - t_prev,
                                   n_alive_before - n_done)
            t_prev = t_now
            n_alive = n_alive_before - n_done
            if n_alive == 0:
                break
            # ---- choose the next step; compact finished rows once enough have finished
            step += 1
            st = source.choose(step, n_alive)
            if st.uses_drafter and self.drafter is None:
                raise ValueError(f"strategy {st.name} needs a learned drafter: pass drafter=... to RolloutEngine, "
                                 "or use an ngram-DEPTH strategy (model-free)")
            if st.enabled and st.verify_tokens + 1 > cfg.draft_margin:
                raise ValueError(f"strategy {st.name} verifies {st.verify_tokens} tokens but the cache leaves "
                                 f"room for {cfg.draft_margin - 1}; raise RolloutConfig.draft_margin")
            rows = int(seq.numel())
            if rows > n_alive and rows - n_alive >= max(1, cfg.compact_fraction * rows):
                kept = alive.nonzero()[:, 0]
                cache.select_rows(kept)
                spec.select_rows(kept)
                seq, last, alive, n_gen = seq[kept], last[kept], alive[kept], n_gen[kept]
            grow = 1 if bool(alive.all()) else alive.long()
            if st.kind == "ngram":
                if ngram is None:
                    ngram = self.last_ngram = NgramDrafter(prompts, G, self.ngram_config)
                ids = seq.tolist()

                def propose(depth, ids=ids):
                    ngram.update(ids, out_tokens, n_out)
                    return ngram.propose(ids, depth, dev)
                out = spec.step(st, last, cache, generator, propose=propose, grow=grow)
            elif st.enabled:
                out = spec.step(st, last, cache, generator, grow=grow)
            else:
                logits, h = model.forward_cached(last[:, None], cache)
                cache.advance(grow)
                tok, logp = sample_from_logits(logits[:, 0], s, generator)
                out = StepOut(tok[:, None], torch.ones_like(tok), logp[:, None], h,
                              torch.zeros_like(tok))
                spec.push(h, out.tokens, out.count, 1)
        bar.close()

        total = time.perf_counter() - t0
        lengths_cpu = lengths.cpu()
        truncated = ~torch.isin(out_tokens[torch.arange(N, device=dev), lengths - 1], eos).cpu().numpy()
        hists = tl.pop("accept_hist")
        timeline = {k: np.array(v) for k, v in tl.items()}
        width = max((len(h) for h in hists), default=1)
        timeline["accept_hist"] = np.array([np.pad(h, (0, width - len(h))) for h in hists]).reshape(len(hists),
                                                                                                     width)
        stats = rollout_stats(lengths_cpu.numpy(), timeline["step_time"], timeline["active"], N, truncated,
                              total, prefill_s)
        stats.update(spec_stats(timeline))
        if ngram is not None:
            stats["spec/ngram_match_rate"] = ngram.proposed / max(ngram.asked, 1)
        return RolloutResult([list(p) for p in prompts], G, out_tokens, lengths_cpu, out_logp, hidden,
                             finish_step, finish_time, truncated, timeline, stats)
