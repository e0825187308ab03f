"""One speculative-decoding (SD) step over a ragged batch: draft with the drafter, verify in one target forward, commit.

State between decode iterations, per row: the last emitted token x_n (not yet run through the target) and the
drafter's *backlog* — the (target hidden f_t, token x_{t+1}) inputs emitted but not yet fed to the drafter, the
last of which ends in x_n. The rollout hands every emitted token to :meth:`SpecDecoder.record` (plain and SD iterations
alike), so the backlog is the SD state's own business. An SD step (:meth:`SpecDecoder.draft_and_verify`):

1. **catch up** — one drafter forward over the backlog (ragged) commits it to the drafter's cache; its output at
   the last entry gives f̂_n and q(x_{n+1});
2. **draft** — a chain (``depth`` tokens sampled from q, or argmax at T=0) or a tree (top-k children of the top-k
   nodes per level, ``depth`` levels, the ``budget`` most probable nodes kept), with one drafter forward per level
   whose entries stay uncommitted (tree masks keep branches apart);
3. **verify** — one target forward over [x_n, drafts] (a tree mask for trees), exact acceptance
   (:mod:`tltlib.spec.strategy`), then the accepted path is lined up in the target cache and committed; the target's
   hidden states along it are what the rollout records next, so the drafter always sees true target features.

While SD is off the backlog grows by one entry per iteration and is fed to the drafter only when it must be: by the
next SD step's catch-up, or when a row's backlog would exceed ``flush_at`` (all but the last entry, which the next SD
step needs to propose its first draft), which bounds its memory. By default ``flush_at`` is as wide as
:data:`BACKLOG_BYTES` of hidden states allow (up to the cache length): rows that end while SD is off, most rows of a
long-tailed rollout, never cost a drafter forward, and a plain iteration costs the same with a drafter as without. An
``ngram`` step takes its chain from a model-free proposer instead (:mod:`tltlib.spec.ngram`) and verifies it with the
point-mass rule (:func:`tltlib.spec.strategy.verify_chain_point`); it needs no drafter, and with one the backlog simply
grows. The verify and draft forwards go through :attr:`SpecDecoder.replay` (captured CUDA graphs on a GPU,
:mod:`tltlib.model.cudagraph`).

Paper: TLT §5 (adaptive rollout engine). Reference: SGLang's ``EAGLEWorker`` (draft extend, tree draft, verify).

Departures:
1. Switching SD on needs no re-prefill: the drafter catches up from its backlog (the reference re-prefills every
   running request).
2. The drafter's KV entries for drafted tokens are dropped after each step and rebuilt from the target's true
   hidden states (EAGLE keeps the draft-time entries of accepted tokens, which were computed from drafted features).
"""
from __future__ import annotations

import time

import torch

from ..errors import BadInput
from ..kv.dense import KVCache
from ..model.cudagraph import Replay
from ..model.decoder import rope_cos_sin
from ..model.sampling import SamplingConfig, inverse_cdf, probs_from_logits, token_logprobs, uniforms
from .records import Emitted, SpecTrace
from .strategy import SpecStrategy
from .trees import DraftTree, chain_tree, select_nodes
from .verify import (
    drop_children,
    residual,
    verify_chain,
    verify_chain_block,
    verify_chain_greedy,
    verify_chain_point,
    verify_tree,
)

BACKLOG_BYTES = 256 << 20
"""Hidden states a rollout's drafter backlog may hold before plain iterations feed it (see ``SpecDecoder``)."""


class SpecDecoder:
    """The drafter side of a rollout: its cache, its backlog, and the SD step.

    Args:
        target, drafter: the policy and an attached :class:`tltlib.model.drafter.Drafter` (None: n-gram steps only).
        sampling: the rollout's sampling settings (the distribution SD must reproduce).
        rows, max_len: the target cache's shape (max_len must leave room for the deepest draft).
        max_emit: the most tokens one step may emit per row (deepest chain + 1; ``RolloutConfig.draft_margin``).
        flush_at: backlog entries per row above which they are fed to the drafter while SD is off (None: as many
            as :data:`BACKLOG_BYTES` of hidden states hold for ``rows`` rows, at least 32, at most ``max_len``).
        replay: the :class:`tltlib.model.cudagraph.Replay` every draft and verify forward goes through (the rollout's: a
            graph pool on CUDA).

    Attributes:
        keep_trace: set True to keep the last SD step's :class:`SpecTrace` in :attr:`trace`.
    """

    def __init__(self, target, drafter, sampling: SamplingConfig, rows: int, max_len: int, max_emit: int,
                 flush_at: int | None = None, replay: Replay | None = None, kv=None,
                 budget_bytes: int | None = None):
        w = target.embed.weight
        if flush_at is None:
            per_entry = max(1, rows) * target.config.hidden_size * w.element_size()
            flush_at = max(32, min(max_len, BACKLOG_BYTES // per_entry))
        if flush_at < 2:
            raise BadInput(f"flush_at must be >= 2 (a flush keeps each row's last backlog entry), got {flush_at}")
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.catchup_s = 0.0                      # the last catch-up's seconds, if it followed plain iterations
        self._after_sd = False                    # whether the last recorded iteration was an SD step
        self.flush_at = flush_at
        # widest backlog: flush_at, or one kept entry + one step's max_emit entries
        self.cap = max(flush_at, max_emit + 1) if drafter is not None else 0
        # the drafter writes a whole backlog after its shortest row's entries: room for one more backlog
        self.cache: KVCache | None = (drafter.new_cache(rows, max_len + self.cap, kv, budget_bytes)
                                      if drafter is not None else None)
        self.backlog_h = torch.zeros(rows, self.cap, target.config.hidden_size, dtype=w.dtype, device=w.device)
        self.backlog_tok = torch.zeros(rows, self.cap, dtype=torch.long, device=w.device)
        self.backlog_n = torch.zeros(rows, dtype=torch.long, device=w.device)
        self._row_base = torch.arange(rows, device=w.device) * self.cap     # flat index of each row's first slot
        self.backlog_max = 0
        self.replay = replay or Replay()
        self.keep_trace = False
        self.trace: SpecTrace | None = None

    def reset(self, rows: int) -> None:
        """Forget every row (reuse the buffers for a new rollout of ``rows`` rows)."""
        if self.cache is not None:
            self.cache.reset(rows)
        self.backlog_n.zero_()
        self.backlog_max = 0
        self.trace = None
        self._after_sd = False

    # --------------------------------------------------------------------------------------------- backlog
    def prefill(self, rows: slice, prompt_tokens: torch.Tensor, prompt_hidden: torch.Tensor,
                lengths: torch.Tensor) -> None:
        """Feed the prompt pairs (f_t, x_{t+1}), t < len - 1, of prompts prefilled into cache rows ``rows``."""
        if self.drafter is None:
            return
        sub = self.cache.view(rows.start, rows.stop)
        n = lengths - 1
        width = int(n.max())
        if width > 0:
            self._feed(sub, prompt_hidden[:, :width], prompt_tokens[:, 1: width + 1], n)
        sub.advance(n)

    def after_prefill(self, prompts: int) -> None:
        if self.drafter is None:
            return
        self.cache.rows = prompts
        self.cache.sync_from_views()

    def record(self, out: Emitted) -> None:
        """Add what an iteration emitted (``out.count[r]`` (hidden, token) entries per row) to the backlog."""
        if self.drafter is None:
            return
        b, m = out.tokens.shape
        if self.backlog_max + m > self.flush_at:   # no-op right after an SD step (its catch-up emptied it)
            self.flush()
        # every emitted column goes to the row's next slots (those past out.count are overwritten later: the backlog
        # is read up to backlog_n only); the flush above leaves room for m more
        if m == 1:                                 # a plain iteration: one flat slot per row (fewer small ops)
            flat = self._row_base[:b] + self.backlog_n[:b]
            self.backlog_h.view(-1, self.backlog_h.shape[-1]).index_copy_(0, flat, out.hidden[:, 0])
            self.backlog_tok.view(-1).index_copy_(0, flat, out.tokens[:, 0])
        else:
            rows = torch.arange(b, device=out.tokens.device)[:, None]
            slots = self.backlog_n[:b, None] + torch.arange(m, device=out.tokens.device)
            self.backlog_h[rows, slots] = out.hidden
            self.backlog_tok[rows, slots] = out.tokens
        self.backlog_n[:b] += out.count
        # a plain iteration adds at most one entry per row: an upper bound without a device sync (a wider catch-up
        # reads padding only); an SD step's counts vary with acceptance, so read the true widest row
        self.backlog_max = self.backlog_max + 1 if m == 1 else int(self.backlog_n[:b].max())
        self._after_sd = m > 1

    def flush(self) -> None:
        """Feed every row's backlog but its last entry to the drafter (keeps its cache current while SD is off).

        The last entry (f_{n-1}, x_n) stays: the next SD step's catch-up runs it to get q(x_{n+1})."""
        if self.backlog_max < 2:
            return
        b, width = self.cache.rows, self.backlog_max - 1
        n = self.backlog_n[:b]
        fed = (n - 1).clamp_min(0)
        self._feed(self.cache, self.backlog_h[:b, :width], self.backlog_tok[:b, :width], fed)
        self.cache.advance(fed)
        rows = torch.arange(b, device=n.device)
        self.backlog_h[:b, 0] = self.backlog_h[rows, fed]
        self.backlog_tok[:b, 0] = self.backlog_tok[rows, fed]
        self.backlog_n[:b] = n.clamp(max=1)
        self.backlog_max = 1

    def _feed(self, cache: KVCache, hidden, tokens, n):
        """Run ``n[r]`` backlog entries of each row through the drafter, after its committed entries."""
        return self.drafter.forward_cached(hidden, tokens, cache, logits_at=(n - 1).clamp_min(0))

    def _catch_up(self):
        """Feed the whole backlog; return (logits of q(x_{n+1}) ``[B, V]``, f̂_n ``[B, H]``)."""
        b, width = self.cache.rows, self.backlog_max
        n = self.backlog_n[:b].clone()
        t0 = time.perf_counter()
        logits, feat = self._feed(self.cache, self.backlog_h[:b, :width], self.backlog_tok[:b, :width], n)
        self.cache.advance(n)
        self.backlog_n.zero_()
        self.backlog_max = 0
        self.catchup_s = 0.0 if self._after_sd else time.perf_counter() - t0
        return logits, feat

    def select_rows(self, index: torch.Tensor) -> None:
        if self.drafter is None:
            return
        self.cache.select_rows(index)
        n, w = index.numel(), self.backlog_max    # only the used width: the buffers span the whole rollout
        if w:
            self.backlog_h[:n, :w] = self.backlog_h[index, :w]
            self.backlog_tok[:n, :w] = self.backlog_tok[index, :w]
        self.backlog_n[:n] = self.backlog_n[index]
        self.backlog_max = int(self.backlog_n[:n].max()) if n and w else 0   # exact again (rows dropped)

    def add_rows(self, tokens: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor,
                 last_hidden: torch.Tensor, last_tokens: torch.Tensor) -> None:
        """Rows re-admitted after the active ones (:mod:`tltlib.rollout.admission`): the pairs of their recomputed
        ``tokens [n, T]`` (``lengths`` real) and target ``hidden [n, T, H]`` fed to the drafter as a prefill, and
        the pair that produced their pending token, ``(last_hidden [n, H], last_tokens [n])``, left in the backlog,
        as after the rollout's own prefill."""
        if self.drafter is None:
            return
        b0, n = self.cache.rows, tokens.shape[0]
        self.cache.add_rows(n)
        self.prefill(slice(b0, b0 + n), tokens, hidden, lengths)
        self.cache.sync_from_views()
        self.backlog_h[b0: b0 + n, 0] = last_hidden
        self.backlog_tok[b0: b0 + n, 0] = last_tokens
        self.backlog_n[b0: b0 + n] = 1
        self.backlog_max = max(self.backlog_max, 1)

    # ------------------------------------------------------------------------------------------- the step
    def draft_and_verify(self, strategy: SpecStrategy, root: torch.Tensor, tcache: KVCache,
                         generator: torch.Generator | None, commit_mask=1, propose=None) -> Emitted:
        """One SD step for every row. ``root [B]``: each row's last emitted token (the backlog ends with it).
        ``commit_mask``: 1, or a ``[B]`` 0/1 mask; rows with 0 (finished, not yet compacted away) are computed but
        commit nothing and emit nothing. ``propose(strategy)``: the drafts from earlier text (``ngram``: a
        ``[B, depth]`` chain; ``suffix``: a :class:`DraftTree` with ``root`` as node 0; ``hybrid``: such a tree the
        size of the drafter's, and its expected accepted drafts ``[B]``)."""
        t0 = time.perf_counter()
        if strategy.kind in ("ngram", "suffix", "hybrid") and propose is None:
            raise BadInput(f"a {strategy.kind} step needs propose=...: run it through RolloutEngine.generate")
        if self.keep_trace and strategy.rule == "block":
            raise BadInput(f"a trace shows token-wise verification, draft by draft; {strategy.name} judges the "
                           "chain jointly: trace chain-D")
        if self.keep_trace and strategy.kind in ("ngram", "suffix", "hybrid"):
            raise BadInput(f"a trace shows the learned drafter's chain or tree step; {strategy.name} has no "
                           "drafter probabilities for every node: trace a chain-D or tree-DxK-N step")
        if strategy.kind == "ngram":
            return self._verify_point(root, tcache, generator, propose(strategy), commit_mask, t0)
        tree, drafts, qs, scores = self._draft(strategy, root, generator, propose)
        probs = None
        t1 = time.perf_counter()
        positions = tcache.lengths[: tcache.rows, None] + tree.depth
        tree_mask = None if strategy.kind == "chain" else tree.mask()
        logits, hidden = self._verify_forward(strategy.kind, tree.tokens, tcache, positions, tree_mask)
        s = self.sampling
        if strategy.kind == "chain":
            if s.greedy:
                accepted, nxt = verify_chain_greedy(logits.argmax(-1), drafts)
            else:
                p = probs_from_logits(logits, s.temperature, s.top_k, s.top_p)
                verify = verify_chain_block if strategy.rule == "block" else verify_chain
                accepted, nxt = verify(p, qs, drafts, generator)
                probs = p
            path = _chain_path(drafts)
        else:
            path, accepted, nxt = verify_tree(logits, tree, s.temperature, s.top_k, s.top_p, generator)
        if self.keep_trace:
            node_q = (qs.gather(-1, drafts[..., None])[..., 0] if strategy.kind == "chain"
                      else (scores[:, 1:] - scores.gather(1, tree.parents[:, 1:].clamp_min(0))).exp())
            self.trace = self._trace(strategy, tree, node_q, qs, path, accepted, nxt, logits)
        out = self._commit(tree, path, accepted, nxt, logits, hidden, tcache, strategy.kind != "chain", commit_mask,
                           probs)
        out.drafted = tree.size - 1
        out.draft_s, out.verify_s = t1 - t0, time.perf_counter() - t1
        out.catchup_s, self.catchup_s = self.catchup_s, 0.0
        return out

    def _draft(self, strategy: SpecStrategy, root, generator, propose):
        """The step's draft tree and what verifying or tracing it needs: (tree, chain drafts ``[B, D]`` or None,
        their q ``[B, D, V]`` or None, the tree nodes' cumulative log q ``[B, N+1]`` or None). A ``suffix`` tree
        comes from ``propose`` alone (the drafter's backlog waits for its next step); a ``hybrid`` one is the
        drafter's or the suffix tree per row (:func:`_pick_trees`)."""
        if strategy.kind == "suffix":
            return propose(strategy), None, None, None
        if self.drafter is None:
            raise BadInput(f"strategy {strategy.name} needs a learned drafter; pass drafter=... or use ngram-D or "
                           "suffix-D-N")
        q_logits, feat = self._catch_up()
        if strategy.kind == "chain":
            drafts, qs = self._draft_chain(strategy.depth, q_logits, feat, generator)
            return chain_tree(root, drafts), drafts, qs, None
        tree, scores = self._draft_tree_replayed(strategy, root, q_logits, feat)
        if strategy.kind == "hybrid":
            tree = _pick_trees(tree, scores, *propose(strategy))
        return tree, None, None, scores

    def _verify_point(self, root, tcache, generator, drafts, commit_mask, t0) -> Emitted:
        """Verify deterministic drafts ``[B, D]`` (a chain whose q is a point mass) and commit."""
        t1 = time.perf_counter()
        tree = chain_tree(root, drafts)
        positions = tcache.lengths[: tcache.rows, None] + tree.depth
        logits, hidden = self._verify_forward("chain", tree.tokens, tcache, positions, None)
        s, probs = self.sampling, None
        if s.greedy:
            accepted, nxt = verify_chain_greedy(logits.argmax(-1), drafts)
        else:
            probs = probs_from_logits(logits, s.temperature, s.top_k, s.top_p)
            accepted, nxt = verify_chain_point(probs, drafts, generator)
        out = self._commit(tree, _chain_path(drafts), accepted, nxt, logits, hidden, tcache, False, commit_mask,
                           probs)
        out.drafted = drafts.shape[1]
        out.draft_s, out.verify_s = t1 - t0, time.perf_counter() - t1
        return out

    def _verify_forward(self, kind, tokens, tcache, positions, tree_mask):
        """The target forward over the drafts."""
        def forward(tok, pos, mask=None):
            return self.target.forward_cached(tok, tcache, positions=pos, tree_mask=mask)
        inputs = (tokens, positions) if tree_mask is None else (tokens, positions, tree_mask)
        return self.replay(f"verify-{kind}", forward, tcache, tokens.shape[1], *inputs)

    def _q(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        return probs_from_logits(logits, s.temperature if not s.greedy else 1.0, s.top_k, s.top_p)

    def _draft_chain(self, depth, q_logits, feat, generator):
        """``depth`` drafts sampled from q (argmax when greedy); returns (drafts [B, D], q [B, D, V] or None).

        Sampling is inverse-CDF with uniforms drawn once per step (one kernel instead of a multinomial per depth), so
        the whole chain is a function of its inputs: one captured graph on CUDA."""
        greedy = self.sampling.greedy
        u = None if greedy else uniforms(feat.shape[0], depth, 1, generator=generator, device=feat.device)
        inputs = (q_logits, feat) if greedy else (q_logits, feat, u)
        trace = self.keep_trace                   # a static argument: a traced chain also returns q when greedy

        def draft(*x):
            return tuple(t for t in self._chain(depth, *x) if t is not None)
        out = self.replay(f"chain-{depth}" + ("-traced" if trace else ""), draft, self.cache, depth - 1, *inputs)
        return out[0], (out[1] if len(out) > 1 else None)

    def _chain(self, depth, q_logits, feat, u=None):
        b, dev = feat.shape[0], feat.device
        greedy = u is None
        pos = self.cache.lengths[:b, None] + torch.arange(depth, device=dev)
        # per depth [B, 1, D] contiguous (the C++ layers read the tables flat): depth-major, made once per step
        cos, sin = (t.transpose(0, 1).contiguous()[:, :, None]
                    for t in rope_cos_sin(self.drafter.inv_freq, pos, self.drafter.fc.weight.dtype))
        drafts, qs = [], []
        for i in range(depth):
            if greedy:                                    # greedy verification never reads q (traces show it)
                d = q_logits.argmax(-1)
                if self.keep_trace:
                    qs.append(self._q(q_logits))
            else:
                q = self._q(q_logits)
                d = inverse_cdf(q, u[:, i])[:, 0]
                qs.append(q)
            drafts.append(d)
            if i + 1 < depth:
                q_logits, out = self.drafter.forward_cached(feat[:, None], d[:, None], self.cache, offset=i,
                                                            rope=(cos[i], sin[i]))
                q_logits, feat = q_logits[:, 0], out[:, 0]
        return (torch.stack(drafts, 1), torch.stack(qs, 1)) if qs else (torch.stack(drafts, 1), None)

    def _draft_tree_replayed(self, st: SpecStrategy, root, q_logits, feat):
        """:meth:`_draft_tree` through :attr:`replay` (it draws no random numbers: one captured graph on CUDA)."""
        def draft(r, ql, f):
            tree, scores = self._draft_tree(st, r, ql, f)
            return tree.tokens, tree.parents, tree.depth, scores
        tok, par, dep, scores = self.replay(st.name, draft, self.cache, st.branch * (st.depth - 1), root, q_logits,
                                            feat)
        return DraftTree(tok, par, dep), scores

    def _draft_tree(self, st: SpecStrategy, root, q_logits, feat) -> tuple[DraftTree, torch.Tensor]:
        """EAGLE-2-style dynamic tree: top-k expansion per level, best ``budget`` nodes by cumulative log q."""
        b, k, dev = root.shape[0], st.branch, root.device
        logq = torch.log_softmax(q_logits.float(), -1)
        score, tok = logq.topk(k, dim=-1)                                         # depth-1 candidates
        cand_tok, cand_score = [tok], [score]
        cand_par = [torch.full((b, k), -1, device=dev)]
        cand_dep = [torch.ones(b, k, dtype=torch.long, device=dev)]
        front_idx = torch.arange(k, device=dev).expand(b, k)                      # candidate index of frontier
        front_feat = feat[:, None].expand(b, k, feat.shape[-1])                   # parent feature of each node
        front_anc = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)    # ancestry over written entries
        n_cand = k
        for level in range(2, st.depth + 1):
            offset = k * (level - 2)
            ftok = torch.cat(cand_tok, 1).gather(1, front_idx)
            fscore = torch.cat(cand_score, 1).gather(1, front_idx)
            positions = self.cache.lengths[:b, None] + (level - 2)
            lg, out = self.drafter.forward_cached(front_feat, ftok, self.cache, positions=positions.expand(b, k),
                                                  tree_mask=front_anc, offset=offset)
            logq = torch.log_softmax(lg.float(), -1)                              # [B, k, V]
            s2, t2 = logq.topk(k, dim=-1)                                         # [B, k, k]
            s2 = (s2 + fscore[..., None]).reshape(b, k * k)
            cand_tok.append(t2.reshape(b, k * k)), cand_score.append(s2)
            cand_par.append(front_idx.repeat_interleave(k, dim=1))
            cand_dep.append(torch.full((b, k * k), level, dtype=torch.long, device=dev))
            best = s2.topk(k, dim=1).indices                                      # next frontier among new ones
            parent_slot = best // k                                               # which frontier node
            front_idx = n_cand + best
            front_feat = out.gather(1, parent_slot[..., None].expand(b, k, out.shape[-1]))
            written = offset + k
            anc = torch.zeros(b, k, written + k, dtype=torch.bool, device=dev)
            par_anc = front_anc.gather(1, parent_slot[..., None].expand(b, k, front_anc.shape[-1]))
            anc[:, :, : front_anc.shape[-1]] = par_anc
            anc[:, :, offset:written] |= torch.nn.functional.one_hot(parent_slot, k).bool()
            anc[:, :, written:] = torch.eye(k, dtype=torch.bool, device=dev)
            front_anc = anc
            n_cand += k * k
        scores, toks = torch.cat(cand_score, 1), torch.cat(cand_tok, 1)
        pars, deps = torch.cat(cand_par, 1), torch.cat(cand_dep, 1)
        keep = select_nodes(scores, pars, deps, st.verify_tokens)               # [B, N] candidate ids
        # parents in verification indices: root = 0, kept candidate i -> 1 + its position in `keep`
        where = torch.full((b, scores.shape[1] + 1), -1, dtype=torch.long, device=dev)
        where[:, 1:].scatter_(1, keep, torch.arange(1, keep.shape[1] + 1, device=dev).expand_as(keep))
        kept_par = pars.gather(1, keep)
        vpar = torch.where(kept_par < 0, 0, where[:, 1:].gather(1, kept_par.clamp_min(0)))
        tokens = torch.cat([root[:, None], toks.gather(1, keep)], 1)
        parents = torch.cat([torch.full((b, 1), -1, device=dev), vpar], 1)
        depth = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), deps.gather(1, keep)], 1)
        node_scores = torch.cat([torch.zeros(b, 1, device=dev), scores.gather(1, keep)], 1)
        return DraftTree(tokens, parents, depth), node_scores

    def _trace(self, strategy, tree, node_q, qs, path, accepted, nxt, logits) -> SpecTrace:
        s = self.sampling
        b, dev = tree.tokens.shape[0], tree.tokens.device
        temp = s.temperature if not s.greedy else 1.0
        probs = probs_from_logits(logits, temp, s.top_k, s.top_p)                  # [B, N+1, V]
        par = tree.parents.clamp_min(0)
        rows = torch.arange(b, device=dev)
        node_p = probs[rows[:, None], par].gather(-1, tree.tokens[..., None])[..., 0]
        node_p[:, 0] = 1.0
        ones = torch.ones(b, 1, device=dev)
        last = torch.where(accepted > 0, path.gather(1, (accepted - 1).clamp_min(0)[:, None])[:, 0], 0)
        p_last = probs[rows, last]
        if strategy.kind == "chain":
            d = qs.shape[1]
            bonus = accepted == d
            q_at = qs[rows, accepted.clamp(max=d - 1)]
            final = torch.where(bonus[:, None], p_last, residual(p_last, q_at))
        else:
            is_child = tree.parents == last[:, None]
            bonus = ~is_child.any(1)
            final = drop_children(p_last, tree, is_child)
        return SpecTrace(strategy, tree, torch.cat([ones, node_q], 1), node_p, path, accepted, nxt, final, bonus,
                         p_last)

    def _commit(self, tree, path, accepted, nxt, logits, hidden, tcache, is_tree, commit_mask,
                probs=None) -> Emitted:
        """Line the accepted path up in the target cache and commit it (``commit_mask`` rows only)."""
        b, dev = accepted.shape[0], accepted.device
        m = path.shape[1] + 1
        nodes = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), path.clamp_min(0)], 1)  # [B, M]
        count = (accepted + 1) * commit_mask
        j = torch.arange(m, device=dev)
        emitted = tree.tokens.gather(1, nodes[:, 1:].clamp(max=tree.size - 1))
        emitted = torch.cat([emitted, torch.zeros(b, 1, dtype=torch.long, device=dev)], 1)
        emitted = torch.where(j[None, :] == accepted[:, None], nxt[:, None], emitted)
        if is_tree:
            tcache.gather_uncommitted(nodes)
        tcache.advance(count)
        rows = torch.arange(b, device=dev)[:, None]
        h = hidden[rows, nodes]                                                   # [B, M, H]
        if probs is not None:                     # the verify step's p, already computed (chains)
            lp = probs[rows, nodes].gather(-1, emitted[..., None])[..., 0].log()
        else:
            lp = token_logprobs(logits[rows, nodes], emitted, self.sampling)
        return Emitted(emitted, count, lp, h, accepted)


def _pick_trees(eagle: DraftTree, scores: torch.Tensor, suffix: DraftTree, expected: torch.Tensor) -> DraftTree:
    """Per row, the drafter's tree or the suffix tree (same size), whichever expects more accepted tokens: the sum
    of its nodes' path probabilities (the drafter's cumulative q, ``scores [B, N+1]`` log, node 0 the root; the
    suffix tree's empirical ones, ``expected [B]``). Both are functions of earlier text, so the choice keeps
    target-only verification exact."""
    if suffix.tokens.shape != eagle.tokens.shape:
        raise BadInput(f"hybrid trees differ in size: drafter {tuple(eagle.tokens.shape)}, suffix "
                       f"{tuple(suffix.tokens.shape)}")
    mine = scores[:, 1:].exp().sum(1)
    use = (expected > mine)[:, None]
    pick = (lambda a, b: torch.where(use, a, b))
    return DraftTree(pick(suffix.tokens, eagle.tokens), pick(suffix.parents, eagle.parents),
                     pick(suffix.depth, eagle.depth))


def _chain_path(drafts: torch.Tensor) -> torch.Tensor:
    """The verification path of a chain ``[B, D]``: nodes 1..D in order."""
    b, d = drafts.shape
    return torch.arange(1, d + 1, device=drafts.device).expand(b, d)
