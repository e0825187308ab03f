"""RolloutEngine: batched sampling of G responses per prompt with a shrinking active batch, traced per iteration.

The engine is a stepper: ``rollout = engine.start(prompts)`` prefills and samples the first tokens, each
``rollout.iterate()`` runs one *decode iteration* (one target forward over the running rows; returns whether rows are
still running), ``rollout.finish()`` returns the :class:`RolloutResult`; ``engine.generate`` is the loop over them.
The adaptive controller, the pair stream into the drafter's buffer, progress bars and ``hooks`` act in between.

One rollout = prefill the unique prompts (in row chunks), copy each prompt's cache row G times (GRPO groups), sample
every row's first token, then decode. Each iteration is either *plain* (one target forward, one token per row) or an
*SD step* (a drafter proposes a chain or tree, one target forward verifies it, several tokens per row;
:mod:`tltlib.spec.step`); the strategy may change from one iteration to the next. Rows that emit EOS or reach their
token budget retire; the cache is compacted when enough have finished, so later forwards really run on fewer rows.
Each iteration's wall time, running rows, strategy and acceptance go into a timeline, each response's finish into a
trace (read by notebook 01, the SD benches and the adaptive switch); a :class:`tltlib.drafting.pairs.PairBuffer`, if
given, receives the drafter's online training pairs (hidden, token) as they are produced.

Paper: TLT §2 (rollout dominates the RL step; long-tail responses), §5 (the adaptive rollout engine SD plugs into).

Departures:
1. A single process drives one batch (data-parallel workers each run their own rollout: :mod:`tltlib.rl.world`).
2. Finished rows are compacted away once at least ``compact_fraction`` of the batch has finished (default 1/8);
   until then they stay in the batch (plain and SD iterations alike) without growing their cache.
3. A prompt that fits the context but leaves less room than ``max_new_tokens`` gets a smaller budget (its response
   is cut at the context and counted as truncated) instead of failing the whole rollout.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import BadInput
from ..kernels.dispatch import packed_weights
from ..kv.paged import kv_stats
from ..model.fused import compiled_layers
from ..model.logprobs import pad_right
from ..model.native import NativePlans, native_layers
from ..model.sampling import sample_from_logits
from ..spec.ngram import NgramConfig, NgramDrafter
from ..spec.records import Emitted
from ..spec.strategy import OFF, SpecStrategy, StrategySource, strategy_source
from ..spec.suffix import SuffixConfig, SuffixDrafter, SuffixHistory
from ..stats import rollout_stats, spec_stats
from . import admission
from .config import RolloutConfig  # noqa: F401  (the engine's config, importable from here too)
from .result import RolloutResult
from .workspace import Kept, kv_share

PREFILL_WASTE = 0.05
"""A prefill chunk ends where padding its rows to the longest would add more than this share of its real tokens.
Each chunk is one forward, but at prefill sizes a forward's cost is its tokens: SmolLM2's words prompts on an Intel
Xeon (2 threads), 64 / 16 prompts, prefill alone: 9.71 / 2.34 s at 0.25 (2 chunks each, 22% / 22% padded tokens),
7.29 / 1.76 s at 0.1, 7.09 / 1.68 s at 0.05 (7 / 5 chunks), 7.32 / 1.81 s at 0.03 (13 / 7 chunks)."""


def prefill_chunks(lengths: Sequence[int], max_rows: int, waste: float = PREFILL_WASTE) -> list[tuple[int, int]]:
    """Row ranges ``[(c0, c1)]`` to prefill prompts of ascending ``lengths`` in: at most ``max_rows`` rows each, and a
    new chunk where padding every row to the longest would exceed ``waste`` of the chunk's real tokens."""
    chunks, c0, real = [], 0, 0
    for j, n in enumerate(lengths):
        if j > c0 and (j - c0 >= max_rows or (j - c0 + 1) * n > (1 + waste) * (real + n)):
            chunks.append((c0, j))
            c0, real = j, 0
        real += n
    return chunks + [(c0, len(lengths))]


class RolloutEngine:
    """Generates GRPO groups of responses with a :class:`tltlib.model.decoder.Transformer`.

    Args:
        model: the policy (eval mode is not required; no autograd is used).
        config: :class:`RolloutConfig`.
        eos_ids: ids that end a response (default: the model config's ``eos_token_ids``).
        pad_id: id written after a response ends (default: the config's pad id, else 0).
        drafter: a :class:`tltlib.model.drafter.Drafter` for ``chain``/``tree`` steps, attached to ``model`` here if it
            is not already (None: plain and ``ngram`` steps only).
        ngram: settings of the model-free n-gram drafter used by ``ngram`` steps.
        suffix: settings of the model-free suffix drafter used by ``suffix`` and ``hybrid`` steps. Given, the engine
            also keeps its rollouts' responses per prompt (:attr:`suffix_history`, bounded by ``suffix.history``
            and ``history_tokens``) for later rollouts of the same prompts (GRPO's epochs); None: defaults, no history.
    """

    def __init__(self, model, config: RolloutConfig | None = None, eos_ids: Sequence[int] | None = None,
                 pad_id: int | None = None, drafter=None, ngram: NgramConfig | None = None,
                 suffix: SuffixConfig | None = None):
        self.model = model
        self.config = config or RolloutConfig()
        eos = tuple(eos_ids) if eos_ids is not None else tuple(model.config.eos_token_ids)
        if not eos:
            raise BadInput("no end-of-sequence id: the model config has no eos_token_id; pass eos_ids=[...]")
        self.eos_ids = eos
        self.pad_id = pad_id if pad_id is not None else (model.config.pad_token_id or 0)
        if drafter is not None and not drafter.is_attached_to(model):
            drafter.attach(model)
        self.drafter = drafter
        self.ngram_config = ngram or NgramConfig()
        c = self.suffix_config = suffix or SuffixConfig()
        self.suffix_history = SuffixHistory(c.history if suffix else 0, c.history_tokens)
        self.kept = Kept(self)                    # buffers (CUDA graphs) and packed weights (CPU)

    def release(self) -> None:
        """Free the KV cache, captured graphs and packed weights kept between rollouts (rebuilt on the next one)."""
        self.kept.release()

    def check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """Clear errors for prompts this model cannot run (empty, too long, ids outside the vocabulary)."""
        ctx, vocab = self.model.config.max_position_embeddings, self.model.config.vocab_size
        if len(prompts) == 0:
            raise BadInput("no prompts: pass at least one tokenized prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise BadInput(f"prompt {i} is empty: it needs at least one token (e.g. BOS)")
            if len(p) >= ctx:
                raise BadInput(f"prompt {i} has {len(p)} tokens but the model's context is {ctx} "
                               "(max_position_embeddings): shorten or drop the prompt")
            if min(p) < 0 or max(p) >= vocab:
                raise BadInput(f"prompt {i} has token ids outside [0, {vocab}): was it encoded with this "
                                 "model's tokenizer?")

    def start(self, prompts: Sequence[Sequence[int]], generator: torch.Generator | None = None,
              progress: bool = False, strategy=None, pairs=None, hooks: Sequence = (), lengths=None) -> "Rollout":
        """Prefill ``prompts`` and sample every row's first token; returns the :class:`Rollout` to step.

        Args: as :meth:`generate`, plus ``hooks``: callables ``hook(rollout)`` run after every decode iteration."""
        return Rollout(self, prompts, generator, progress, strategy, pairs, hooks, lengths)

    def generate(self, prompts: Sequence[Sequence[int]], generator: torch.Generator | None = None,
                 progress: bool = False, strategy=None, pairs=None, lengths=None) -> RolloutResult:
        """Sample ``num_generations`` responses for each tokenized prompt.

        Args:
            generator: drives all sampling (default: a new one seeded 0, so a rollout is reproducible); it must
                live on the model's device.
            progress: show a tqdm bar of finished responses.
            strategy: speculative decoding per decode iteration: a :class:`SpecStrategy` or its name (default off),
                a function ``(iteration, active_rows) -> SpecStrategy``, or a
                :class:`tltlib.spec.strategy.StrategySource` (the adaptive controller: ``choose`` before each
                iteration, ``observe`` after it).
            pairs: a :class:`tltlib.drafting.pairs.PairBuffer` to stream the drafter's (hidden, token) pairs into.
            lengths: benchmarks: every response's exact length (``P x G`` ints, in order), EOS ignored, e.g. the
                lengths of an earlier rollout: policies compared on one schedule of running rows, though their
                samples differ (SD at a temperature > 0 samples other tokens, hence other lengths, than plain).
        """
        return self.start(prompts, generator, progress, strategy, pairs, lengths=lengths).finish()


def _forced_lengths(lengths, budget: torch.Tensor) -> torch.Tensor:
    """``lengths`` as a budget per row, refused unless there is one per row, each in 1..the row's budget."""
    n = torch.as_tensor(lengths).reshape(-1).long()
    if n.numel() != budget.numel():
        raise BadInput(f"lengths has {n.numel()} entries for {budget.numel()} responses (prompts x num_generations); "
                       "give one length per response")
    bad = ((n < 1) | (n > budget.cpu())).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise BadInput(f"lengths[{i}] = {int(n[i])} is outside 1..{int(budget[i])} (max_new_tokens and the "
                       "context leave no more): lengths must be ones this rollout could produce")
    return n.to(budget.device)


class Rollout:
    """One rollout in progress (made by :meth:`RolloutEngine.start`): :meth:`iterate` until it returns False, then
    :meth:`finish`. Between iterations, :attr:`iteration`, :attr:`active` (rows still generating) and
    :attr:`elapsed` say where it stands."""

    @torch.no_grad()
    def __init__(self, engine: RolloutEngine, prompts, generator, progress, strategy, pairs, hooks, lengths=None):
        engine.check_prompts(prompts)
        self.engine, self.prompts = engine, [list(p) for p in prompts]
        cfg, model = engine.config, engine.model
        s = cfg.sampling
        self.source: StrategySource = strategy_source(strategy)
        self.hooks = list(hooks)
        dev = self.device = model.embed.weight.device
        self.generator = generator if generator is not None else torch.Generator(device=dev).manual_seed(0)
        G, P = cfg.num_generations, len(prompts)
        N = self.num_sequences = P * G
        ctx = model.config.max_position_embeddings
        plen = torch.tensor([len(p) for p in prompts])
        self.budget = torch.clamp(ctx - plen, max=s.max_new_tokens).repeat_interleave(G).to(dev)
        self.ignore_eos = cfg.ignore_eos or lengths is not None
        if lengths is not None:
            self.budget = _forced_lengths(lengths, self.budget)
        self.plen_rows = plen.repeat_interleave(G).to(dev)
        max_len = int((plen + self.budget.cpu().view(P, G).amax(1)).max()) + cfg.draft_margin
        self.done = False
        ws = engine.kept.workspace(self, N, max_len)
        self.cache, self.spec, self.replay = ws.cache, ws.spec, ws.replay
        longest = int((plen + self.budget.cpu().view(P, G).amax(1)).max())
        share = kv_share(model, engine.drafter)
        order = sorted(range(P), key=lambda i: len(self.prompts[i]))    # prefilled shortest first, in chunks
        chunks = prefill_chunks([len(self.prompts[i]) for i in order], cfg.prefill_rows)
        chunk_lengths = [[len(self.prompts[i]) for i in order[c0:c1]] for c0, c1 in chunks]
        for cache, part, name in ((self.cache, share, ""), (self.spec.cache, 1 - share, "the drafter's ")):
            if cache is not None:                     # admission's worst case: one row alone, plain (+1: a flush)
                cache.check_holds(longest + 1, " (its prompt, max_new_tokens and one more)", part, name)
                cache.check_prefill(chunk_lengths, part, name)
        self.waiting: list[int] = []                  # preempted sequence ids (tltlib.rollout.admission), lowest first
        self.preempted = self.recomputed_tokens = 0
        self._admit_s = 0.0                           # the iteration's admission seconds, not the strategy's
        self._graph_stats0 = dict(self.replay.pool.stats) if self.replay.pool is not None else {}
        self.ngram, self.suffix = None, None          # the model-free drafters (NgramDrafter, SuffixDrafter), on use
        self.eos = torch.tensor(engine.eos_ids, device=dev)
        self.pairs = pairs

        self.out_tokens = torch.full((N, s.max_new_tokens), engine.pad_id, dtype=torch.long, device=dev)
        self.out_logp = torch.zeros(N, s.max_new_tokens, device=dev)
        self.n_gen = torch.zeros(N, dtype=torch.long, device=dev)
        self.n_out = torch.zeros(N, dtype=torch.long, device=dev)     # tokens written per sequence (n-gram index)
        self.lengths = torch.zeros(N, dtype=torch.long, device=dev)
        self.finish_iter = np.zeros(N, dtype=np.int64)
        self.finish_time = np.zeros(N)
        self.tl = {k: [] for k in ("time", "iter_time", "active", "rows", "strategy", "tokens", "accepted",
                                   "drafted", "draft_s", "verify_s", "accept_hist")}
        self.bar = tqdm(total=N, desc="rollout", unit="seq", disable=not progress, leave=False)

        self.t0 = time.perf_counter()
        self.packs = engine.kept.weight_packs()
        self.compile_layers = engine.config.compile_layers and engine.model.device.type == "cpu"
        self.native = (NativePlans() if engine.config.native_layers and engine.model.device.type == "cpu"
                       else None)
        with packed_weights(self.packs):
            first = self._prefill(plen, order, chunks)
        self.prefill_s = time.perf_counter() - self.t0
        self.seq = torch.arange(N, device=dev)              # sequence id of each cache row
        self.alive = torch.ones(N, dtype=torch.bool, device=dev)
        self._j = torch.arange(s.max_new_tokens + cfg.draft_margin + 1, device=dev)
        self.iteration, self.strategy = 0, OFF
        self._uniform_until = 0 if len({len(p) for p in self.prompts}) > 1 else s.max_new_tokens  # see iterate
        self.active = N
        self.t_prev = time.perf_counter()
        self.spec.record(first)
        self._record(first)

    def _prefill(self, plen: torch.Tensor, order: list[int], chunks: list[tuple[int, int]]) -> Emitted:
        """Prefill the prompts in row chunks (streaming their pairs), copy each cache row G times, sample every
        row's first token. Prompts are prefilled shortest first (cache row j holds prompt ``order[j]``) in
        ``chunks`` of similar length (:func:`prefill_chunks`), so that little of a chunk is padding."""
        engine, model, cfg = self.engine, self.engine.model, self.engine.config
        dev, G, P = self.device, cfg.num_generations, len(self.prompts)
        N = P * G
        if self.pairs is not None:
            prompt_owner, first_seq = self.pairs.begin(self.prompts, G)
            self._pair_owner = torch.arange(first_seq, first_seq + N, device=dev)
        last_logits, last_hidden = [], []
        for c0, c1 in chunks:
            rows = order[c0:c1]
            sub = self.cache.view(c0, c1)
            lens = plen[rows].to(dev)
            toks = pad_right([self.prompts[i] for i in rows], engine.pad_id, dev)
            logits, h = model.forward_cached(toks, sub, logits_at=lens - 1)
            sub.advance(lens)
            self.spec.prefill(slice(c0, c1), toks, h, lens)
            if self.pairs is not None:             # prompt pairs (f_t, x_{t+1}), t < L_p - 1, once per prompt
                t = torch.arange(toks.shape[1] - 1, device=dev)
                m = t[None, :] < (lens - 1)[:, None]
                own = torch.tensor([prompt_owner[i] for i in rows], device=dev)[:, None].expand_as(m)
                self.pairs.add(own[m], t.expand_as(m)[m], h[:, :-1][m], toks[:, 1:][m])
            last_logits.append(logits)
            last_hidden.append(h[torch.arange(c1 - c0, device=dev), lens - 1])
        self.cache.rows = P
        self.cache.sync_from_views()
        where = torch.empty(P, dtype=torch.long)
        where[torch.tensor(order)] = torch.arange(P)          # cache row of each prompt
        expand = where.to(dev).repeat_interleave(G)
        self.cache.select_rows(expand)
        self.spec.after_prefill(P)
        self.spec.select_rows(expand)
        logits = torch.cat(last_logits)[expand]
        tok, logp = sample_from_logits(logits, cfg.sampling, self.generator)
        return Emitted(tok[:, None], torch.ones(N, dtype=torch.long, device=dev), logp[:, None],
                       torch.cat(last_hidden)[expand][:, None], torch.zeros(N, dtype=torch.long, device=dev))

    @property
    def running(self) -> bool:
        """Rows are still generating (or waiting to, preempted for memory)."""
        return self.active > 0 or bool(self.waiting)

    @property
    def elapsed(self) -> float:
        """Seconds since the rollout started (prefill included)."""
        return time.perf_counter() - self.t0

    # ------------------------------------------------------------------------------------------- iterate
    @torch.no_grad()
    def iterate(self, strategy: SpecStrategy | None = None) -> bool:
        """One decode iteration, plain or an SD step as the strategy source chooses (``strategy`` overrides it for
        this iteration); returns :attr:`running`."""
        if not self.running:
            return False
        self.iteration += 1
        t_admit = time.perf_counter()
        if self.waiting:                           # preempted rows back first: the strategy sees them running
            with packed_weights(self.packs):
                admission.readmit(self)
        admit_s = time.perf_counter() - t_admit
        left = max(self._uniform_until - self.iteration, 0)    # plain steps the rows may stay at one length
        st = self.strategy = strategy or (
            self.source.choose(self.iteration, self.active, backlog=self.spec.backlog_max, uniform_left=left)
            if getattr(self.source, "wants_backlog", False) else self.source.choose(self.iteration, self.active))
        self._check(st)
        self._compact_if_due()
        t_fit = time.perf_counter()
        st = self.strategy = admission.fit(self, st)   # admission by memory: preempt rows until it fits
        self._admit_s = admit_s + time.perf_counter() - t_fit
        # rows that finished but are not compacted away yet are computed and commit nothing
        commit = 1 if self.active == int(self.seq.numel()) else self.alive.long()
        with packed_weights(self.packs), native_layers(self.native), compiled_layers(self.compile_layers):
            out = self._decode(commit) if not st.enabled else self._speculate(st, commit)
            if st.enabled:
                self.uniform_broken()
        self.spec.record(out)                     # the drafter's backlog: every emitted (hidden, token)
        self._record(out)
        for hook in self.hooks:
            hook(self)
        return self.running

    def _decode(self, commit) -> Emitted:
        """Plain decoding: one target forward over each row's last token, one sampled token per row."""
        cache = self.cache
        logits, h = self.replay("decode", self._target_forward, cache, 1, self.last[:, None])
        cache.advance(commit)
        tok, logp = sample_from_logits(logits[:, 0], self.engine.config.sampling, self.generator)
        return Emitted(tok[:, None], torch.ones_like(tok), logp[:, None], h, torch.zeros_like(tok))

    def _target_forward(self, tokens):
        return self.engine.model.forward_cached(tokens, self.cache)

    def _speculate(self, st: SpecStrategy, commit) -> Emitted:
        """One SD step: drafts from the learned drafter and/or earlier text (ngram, suffix); one verify forward."""
        propose = self._ngram_proposer() if st.kind == "ngram" else self._suffix_proposer() if st.kind in (
            "suffix", "hybrid") else None
        return self.spec.draft_and_verify(st, self.last, self.cache, self.generator, commit, propose)

    def _suffix_proposer(self):
        """``propose(strategy) -> DraftTree``: trees from the rows' groups and their prompts' earlier responses."""
        self.suffix = self.suffix or SuffixDrafter(self.prompts, self.engine.config.num_generations,
                                                   self.engine.suffix_config, self.engine.suffix_history)
        ids = self.seq.tolist()

        def propose(st):            # suffix: the tree; hybrid: a tree the size of the drafter's, and its value
            self.suffix.update(ids, self.out_tokens, self.n_out)
            tree = self.suffix.propose(ids, self.last, st.depth, st.verify_tokens, trim=st.kind == "suffix")
            return tree if st.kind == "suffix" else (tree, self.suffix.expected)
        return propose

    def _ngram_proposer(self):
        """``propose(strategy) -> [rows, depth]`` drafts copied from the rows' earlier text and their siblings'."""
        self.ngram = self.ngram or NgramDrafter(self.prompts, self.engine.config.num_generations,
                                                self.engine.ngram_config)
        ids = self.seq.tolist()

        def propose(st):
            self.ngram.update(ids, self.out_tokens, self.n_out)
            return self.ngram.propose(ids, st.depth, self.device)
        return propose

    def _check(self, st: SpecStrategy) -> None:
        if st.uses_drafter and self.engine.drafter is None:
            raise BadInput(f"strategy {st.name} needs a learned drafter: pass drafter=... to RolloutEngine, "
                           "or use an ngram-DEPTH strategy (model-free)")
        margin = self.engine.config.draft_margin
        if st.enabled and st.verify_tokens + 1 > margin:
            raise BadInput(f"strategy {st.name} verifies {st.verify_tokens} tokens but the cache leaves "
                           f"room for {margin - 1}; raise RolloutConfig.draft_margin")

    def _compact_if_due(self) -> None:
        """Drop finished rows from the caches once enough have finished (later forwards run on fewer rows)."""
        rows = int(self.seq.numel())
        if rows > self.active and rows - self.active >= max(1, self.engine.config.compact_fraction * rows):
            self.select(self.alive.nonzero()[:, 0])

    def select(self, kept: torch.Tensor) -> None:
        """Keep rows ``kept`` (``[n]`` indices into the batch) of the caches and the per-row state."""
        self.cache.select_rows(kept)
        self.spec.select_rows(kept)
        self.seq, self.last, self.alive, self.n_gen = (self.seq[kept], self.last[kept], self.alive[kept],
                                                       self.n_gen[kept])

    def uniform_broken(self) -> None:
        """The rows are at unequal lengths from now on (an SD step, a preemption, a re-admission)."""
        self._uniform_until = 0

    # ----------------------------------------------------------------------------------------------- record
    def _record(self, out: Emitted) -> None:
        """Write what an iteration emitted (cut at the first EOS and at each row's budget), retire finished rows,
        stream the pairs, extend the timeline and report to the strategy source."""
        seq, alive = self.seq, self.alive
        rows, m = out.tokens.shape
        j = self._j[:m]
        keep = torch.minimum(out.count, self.budget[seq] - self.n_gen) * alive
        if not self.ignore_eos:
            valid = (j[None, :] < out.count[:, None]) & alive[:, None]
            is_eos = torch.isin(out.tokens, self.eos) & valid
            first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, m)
            keep = torch.minimum(keep, first_eos)
            hit_eos = is_eos.any(1) & (first_eos <= keep)
        else:
            hit_eos = torch.zeros_like(alive)
        kept = int(keep.sum())
        if m == 1 and kept == rows:                # a plain step that every row keeps: no masks to select by
            r_idx, c_idx, tokens = seq, self.n_gen.clone(), out.tokens[:, 0]
            logp, hidden = out.logprobs[:, 0], out.hidden[:, 0]
        else:
            write = j[None, :] < keep[:, None]
            r_idx = seq[:, None].expand(-1, m)[write]
            c_idx = (self.n_gen[:, None] + j[None, :])[write]
            tokens, logp, hidden = out.tokens[write], out.logprobs[write], out.hidden[write]
        self.out_tokens[r_idx, c_idx] = tokens
        self.out_logp[r_idx, c_idx] = logp.float()
        if self.pairs is not None:                 # response token j's pair: (the hidden that produced it, it)
            self.pairs.add(self._pair_owner[r_idx], c_idx, hidden, tokens)
        self.n_gen += keep
        self.n_out[seq] = self.n_gen
        done = alive & (hit_eos | (self.n_gen >= self.budget[seq]))
        n_alive_before = self.active
        n_done = int(done.sum())
        if n_done:
            self.lengths[seq[done]] = self.n_gen[done]
            done_ids = seq[done].cpu().numpy()
            self.finish_iter[done_ids] = self.iteration
            self.finish_time[done_ids] = time.perf_counter() - self.t0
            alive &= ~done
            self.bar.update(n_done)
        self.last = out.tokens[:, 0] if m == 1 else out.tokens.gather(1, (keep - 1).clamp_min(0)[:, None])[:, 0]
        t_now = time.perf_counter()
        if self.iteration > 0:
            hist = self._extend_timeline(out, keep, kept, n_alive_before, t_now)
            context = (float(((self.n_gen + self.plen_rows[seq]) * alive).sum()) / max(self.active - n_done, 1)
                       if getattr(self.source, "wants_context", False) else None)
            self.source.observe(self.strategy, n_alive_before, int((out.count * alive).sum()),  # alive: rows kept
                                t_now - self.t_prev - out.catchup_s - self._admit_s, n_alive_before - n_done,
                                context=context,
                                accepted=hist if self.strategy.enabled else None)
        self.t_prev = t_now
        self.active = n_alive_before - n_done

    def _extend_timeline(self, out: Emitted, keep: torch.Tensor, kept: int, active: int,
                         t_now: float) -> np.ndarray:
        """Append the iteration to the timeline (``kept``: the sum of ``keep``, the tokens written); returns its
        histogram of rows by accepted drafts."""
        st = self.strategy
        if st.enabled:
            counted = out.accepted[keep > 0]
            acc = int(counted.sum())
            hist = torch.bincount(counted, minlength=out.drafted + 1).cpu().numpy()
        else:
            acc, hist = 0, np.zeros(1, dtype=np.int64)
        for key, val in (("time", t_now - self.t0), ("iter_time", t_now - self.t_prev), ("active", active),
                         ("rows", int(self.seq.numel())), ("strategy", st.name), ("tokens", kept),
                         ("accepted", acc), ("drafted", out.drafted * active), ("draft_s", out.draft_s),
                         ("verify_s", out.verify_s), ("accept_hist", hist)):
            self.tl[key].append(val)
        return hist

    # ----------------------------------------------------------------------------------------------- finish
    def finish(self) -> RolloutResult:
        """The result (runs the remaining iterations first if the rollout is not done)."""
        while self.iterate():
            pass
        self.done, self.packs = True, None
        if self.native is not None:                   # the C++ plans hold the weights' packed copies: free them now
            self.native.close()
        self.bar.close()
        total = time.perf_counter() - self.t0
        N, dev = self.num_sequences, self.device
        lengths_cpu = self.lengths.cpu()
        truncated = ~torch.isin(self.out_tokens[torch.arange(N, device=dev), self.lengths - 1], self.eos).cpu().numpy()
        tl = dict(self.tl)
        hists = tl.pop("accept_hist")
        timeline = {k: np.array(v) for k, v in tl.items()}
        width = max((len(h) for h in hists), default=1)
        timeline["accept_hist"] = np.array([np.pad(h, (0, width - len(h))) for h in hists]).reshape(len(hists), width)
        stats = rollout_stats(lengths_cpu.numpy(), timeline["iter_time"], timeline["active"], N, truncated,
                              total, self.prefill_s)
        stats.update(spec_stats(timeline))
        stats.update(kv_stats([self.cache, self.spec.cache]))
        stats.update({"rollout/preempted": float(self.preempted),
                      "rollout/recomputed_tokens": float(self.recomputed_tokens)})
        if self.replay.pool is not None:
            g = {k: v - self._graph_stats0.get(k, 0) for k, v in self.replay.pool.stats.items()}
            stats.update({"rollout/graph_replays": float(g["replays"]), "rollout/graph_captures": float(g["captures"]),
                          "rollout/graph_capture_s": g["capture_s"], "rollout/graph_fallbacks": float(g["fallbacks"])})
        if self.ngram is not None:
            stats["spec/ngram_match_rate"] = self.ngram.proposed / max(self.ngram.asked, 1)
        if self.suffix is not None:
            stats["spec/suffix_match_rate"] = self.suffix.proposed / max(self.suffix.asked, 1)
            stats["spec/suffix_nodes"] = self.suffix.nodes / max(self.suffix.asked, 1)
        self.engine.suffix_history.add_rollout(self.prompts, self.engine.config.num_generations, self.out_tokens,
                                               lengths_cpu)
        return RolloutResult(self.prompts, self.engine.config.num_generations, self.out_tokens, lengths_cpu,
                             self.out_logp, self.finish_iter, self.finish_time, truncated, timeline, stats)
