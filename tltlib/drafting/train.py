"""Drafter training: aligned (hidden, token) pairs, the EAGLE loss, a step-wise trainer, offline training
(the warm-up of a new drafter around it: :mod:`tltlib.drafting.warmup`).

**Alignment** (one convention everywhere, pinned by a test against the engine): for a sequence x_0 .. x_{L-1} with
target hidden states f_0 .. f_{L-1} (f_t = final post-norm hidden at position t, which predicts x_{t+1}), pair t is
``(f_t, x_{t+1})`` for t = 0 .. L-2, placed at drafter position t; its targets are f_{t+1} (regression) and the
target's distribution softmax(lm_head(f_{t+1})) over x_{t+2} (soft cross-entropy). Pairs whose f_{t+1} predicts a
prompt token, or lies past the end, carry no loss.

**Loss** = w_v · SmoothL1(f̂_{t+1}, f_{t+1}) (mean over H) + w_p · (−Σ p_target log q), masked means; defaults
1.0 / 0.1 as EAGLE (and the reference, which forces them). **Accuracy at depth k** unrolls the drafter on its own
predicted features for k-1 steps with the true tokens, and compares its argmax with the target's.

Paper: TLT §4 (adaptive drafter, spot trainer). Reference: ``eagle_background_trainer._training_step_impl``.

Departures:
1. The reference trains online on (f_t, x_t) -> f_{t+1} (a misalignment) with hidden states shifted by prompt
   padding; here the pairs are built from unpadded sequences by one target forward and match inference exactly.
2. Depth-k accuracy unrolls predicted features over the whole sequence at once (EAGLE-3's training-time-test
   approximation): the context of earlier positions is also predicted, which is slightly pessimistic.
3. Learning rate 1e-3 (AdamW, warm-up, cosine) for the tiny drafter, not the reference's 1e-6 constant.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as gradient_checkpoint
from tqdm.auto import tqdm

from ..errors import BadInput
from ..model.optimizer import MixedPrecisionAdamW
from .pairs import PairBatch, PairBuffer, PairBufferConfig


@dataclass(frozen=True)
class DrafterTrainConfig:
    """Offline / online drafter training recipe."""

    steps: int = 1500
    """Optimizer steps."""
    lr: float = 1e-3
    """Peak learning rate (linear warm-up, cosine to 10%)."""
    warmup_steps: int = 50
    """Warm-up steps."""
    batch_sequences: int = 16
    """Sequences per step."""
    hidden_weight: float = 1.0
    """w_v: weight of the SmoothL1 loss on the next hidden state."""
    token_weight: float = 0.1
    """w_p: weight of the soft cross-entropy against the target's next-token distribution."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 0.5
    """Gradient-norm clip."""
    eval_depth: int = 5
    """Depths at which top-1 accuracy is reported."""
    schedule: str = "cosine"
    """``"cosine"`` (warm-up, then cosine to 10% over ``steps``: offline) or ``"constant"`` (after the warm-up:
    online training, which has no end)."""
    seed: int = 0
    """Seeds batch sampling."""
    unroll: int = 1
    """Draft steps trained per batch (EAGLE-3's training-time test): step k reads the features the drafter itself
    predicted at step k-1 (as drafting does from depth 2 on) and predicts the same targets; step k's loss weighs
    ``unroll_decay`` ** (k - 1). 1 = EAGLE-1 (true features only). Each step costs one more drafter forward."""
    unroll_decay: float = 0.7
    """Weight ratio of successive unrolled steps' losses."""
    ce_positions: int = 0
    """At most this many randomly chosen pairs per batch carry the soft cross-entropy (an unbiased estimate of its
    mean; the hidden-state loss keeps every pair); 0 = all. Through the whole 49k-token head (``ce_vocab="full"``)
    the head is ~90% of a step's cost on a CPU, so e.g. 512 makes SmolLM2's drafter trainable there; over a
    4,096-token draft vocabulary it costs little (SmolLM2, 2 threads, unroll 3: 1.6 s per 1,444-pair batch with
    every pair, 5.2 s through the whole head with 512)."""
    ce_vocab: str = "draft"
    """Vocabulary of the soft cross-entropy for a drafter with a draft vocabulary: ``"draft"`` (EAGLE-3) trains its
    proposal towards the target's distribution renormalised over the tokens it can propose (the best proposal on
    that support: it accepts with probability p(draft vocabulary)), reading Vd of the head's V rows (4096 of 49,152
    for SmolLM2: the head's cost / 12); ``"full"`` towards the whole distribution through the whole head. The same
    for a drafter without one."""
    minutes: float = 0.0
    """Wall-clock budget of an offline run (:func:`train_offline`, evaluations included; 0: none): after the first
    :data:`BUDGET_PROBE_STEPS` steps, ``steps`` is cut to what fits (never raised), so the schedule still ends with
    the budget. The steps run are logged; the run is then reproducible only on the same machine."""

    def __post_init__(self):
        if self.steps < 1 or self.batch_sequences < 1 or self.eval_depth < 1:
            raise BadInput("steps, batch_sequences and eval_depth must be >= 1")
        if self.schedule not in ("cosine", "constant"):
            raise BadInput(f"schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        if self.lr <= 0 or self.hidden_weight < 0 or self.token_weight < 0:
            raise BadInput("lr must be > 0 and the loss weights >= 0")
        if self.unroll < 1 or not 0 < self.unroll_decay <= 1:
            raise BadInput(f"unroll must be >= 1 and unroll_decay in (0, 1], got {self.unroll}, {self.unroll_decay}")
        if self.ce_positions < 0:
            raise BadInput(f"ce_positions must be >= 0 (0: every pair), got {self.ce_positions}")
        if self.minutes < 0:
            raise BadInput(f"minutes must be >= 0 (0: no time budget), got {self.minutes}")
        if self.ce_vocab not in ("draft", "full"):
            raise BadInput(f"ce_vocab must be 'draft' (the drafter's draft vocabulary) or 'full', got "
                           f"{self.ce_vocab!r}")


@torch.no_grad()
def target_hidden(target, sequences: list[list[int]], pad_id: int = 0, chunk: int = 16,
                  progress: bool = False) -> list[torch.Tensor]:
    """The target's final hidden states of each (prompt + response) sequence, by one training forward without the
    LM head (in chunks of sequences of similar length, so little is computed on padding)."""
    out: list = [None] * len(sequences)
    dev = target.embed.weight.device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for i in tqdm(range(0, len(order), chunk), desc="target hidden states", unit="chunk", disable=not progress):
        part = order[i: i + chunk]
        width = max(len(sequences[k]) for k in part)
        x = torch.full((len(part), width), pad_id, dtype=torch.long)
        for j, k in enumerate(part):
            x[j, : len(sequences[k])] = torch.tensor(sequences[k])
        h = target.hidden_states(x.to(dev))                # right padding: causal, so real positions are exact
        for j, k in enumerate(part):
            out[k] = h[j, : len(sequences[k])].detach()
    return out


def pairs_from_sequences(target, sequences: list[list[int]], prompt_lens: list[int], pad_id: int = 0,
                         config=None, progress: bool = False):
    """A :class:`tltlib.drafting.pairs.PairBuffer` of given token sequences (prompt + response), their hidden states
    from one training forward of the target (for data that was not streamed by a rollout, e.g. a dataset's
    responses)."""
    if not sequences:
        raise BadInput("no sequences to train the drafter on")
    if len(sequences) != len(prompt_lens):
        raise BadInput(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
    w = target.embed.weight
    total = sum(len(s) - 1 for s in sequences)
    buf = PairBuffer(target.config.hidden_size, config or PairBufferConfig(max_tokens=max(2, total)), w.dtype,
                     w.device)
    for seq, plen, h in zip(sequences, prompt_lens, target_hidden(target, sequences, pad_id, progress=progress)):
        (pid,), first = buf.begin([seq[:plen]], 1)
        n, dev = len(seq) - 1, w.device
        t = torch.arange(n, device=dev)
        owner = torch.where(t < plen - 1, pid, first)
        pos = torch.where(t < plen - 1, t, t - (plen - 1))
        buf.add(owner, pos, h[:n], torch.tensor(seq[1:], device=dev))
    return buf


def autocast_to_target(drafter):
    """A bf16/fp16 autocast context when the drafter's weights are float32 but its target's are not (float32 master
    weights trained against a bf16 target on a GPU); a no-op context otherwise."""
    low = drafter.target.embed.weight.dtype
    dev = drafter.fc.weight.device.type
    enabled = drafter.fc.weight.dtype == torch.float32 and low in (torch.bfloat16, torch.float16)
    return torch.autocast(dev, dtype=low if enabled else torch.bfloat16, enabled=enabled)


HEAD_CHUNK = 1024
"""Pairs per LM-head chunk in the drafter's loss and accuracies (at vocabulary 49152: 200 MB of float32 logits)."""


def _soft_ce(drafter, pred: torch.Tensor, target_f: torch.Tensor, full: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy ``[N]`` of the drafter's next-token distribution (from ``pred [N, H]``) against the
    target's (from ``target_f [N, H]``), and whether their argmaxes agree ``[N]``; over the whole vocabulary
    (``full``) or over the draft vocabulary, the target's distribution renormalised there."""
    head = (lambda x: drafter.logits(x, full=True)) if full else drafter.draft_logits
    with torch.no_grad():
        p_target = torch.softmax(head(target_f).float(), -1)
    logits = head(pred).float()
    return -(p_target * torch.log_softmax(logits, -1)).sum(-1), logits.argmax(-1) == p_target.argmax(-1)


def drafter_loss(drafter, batch: PairBatch, cfg: DrafterTrainConfig, chunk: int = HEAD_CHUNK,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """EAGLE loss of one batch, summed over ``cfg.unroll`` draft steps; returns (loss, ``drafter/*`` stats of the
    first step).

    The soft cross-entropy runs over the pairs that carry loss in chunks of ``chunk``, each under gradient
    checkpointing when gradients are on: at most one chunk's ``[chunk, V]`` logits exist at a time (the same maths
    as one pass over ``[B, T, V]``). With ``cfg.ce_positions`` it runs on that many pairs drawn without replacement
    (``generator``) and is scaled to the mean over all pairs. Unrolled step k reads at position t the feature the
    drafter predicted at step k-1 from position t-1 (positions before k-1 carry no loss there: they have no such
    feature)."""
    hid_in, tok_in = batch.inputs
    feats, total, stats = hid_in, 0.0, {}
    for k in range(cfg.unroll):
        pred = drafter.features(feats, tok_in)
        mask = batch.mask.clone()
        mask[:, :k] = False
        loss, st = _step_loss(drafter, pred, batch.hidden[:, 1:], mask, cfg, chunk, generator)
        total = total + cfg.unroll_decay ** k * loss
        stats = stats or st
        if k + 1 < cfg.unroll:
            feats = torch.cat([hid_in[:, :1], pred[:, :-1]], 1)
    if cfg.unroll > 1:
        stats["drafter/loss"] = float(total.detach())
    return total, stats


def _step_loss(drafter, pred: torch.Tensor, target_f: torch.Tensor, m: torch.Tensor, cfg: DrafterTrainConfig,
               chunk: int, generator) -> tuple[torch.Tensor, dict]:
    """One draft step's loss: SmoothL1 to the target's features ``target_f [B, T, H]`` of ``pred`` plus the soft
    cross-entropy, over the pairs ``m [B, T]``."""
    denom = m.sum().clamp_min(1).float()
    vloss = F.smooth_l1_loss(pred.float(), target_f.float(), reduction="none").mean(-1)
    sel_pred, sel_target = pred[m], target_f[m]
    n_pairs = sel_pred.shape[0]
    if cfg.ce_positions and n_pairs > cfg.ce_positions:
        pick = torch.randperm(n_pairs, generator=generator, device=generator.device if generator else "cpu")
        pick = pick[: cfg.ce_positions].to(sel_pred.device)
        sel_pred, sel_target = sel_pred[pick], sel_target[pick]
    scale = n_pairs / max(sel_pred.shape[0], 1)
    grad = torch.is_grad_enabled() and sel_pred.requires_grad
    ploss, hits = [], []
    for a in range(0, sel_pred.shape[0], chunk):
        args = (drafter, sel_pred[a: a + chunk], sel_target[a: a + chunk], cfg.ce_vocab == "full")
        pl, hit = gradient_checkpoint(_soft_ce, *args, use_reentrant=False) if grad else _soft_ce(*args)
        ploss.append(pl), hits.append(hit)
    ploss_sum = (torch.cat(ploss).sum() if ploss else pred.sum() * 0.0) * scale
    vloss_sum = (vloss * m).sum()
    loss = (cfg.hidden_weight * vloss_sum + cfg.token_weight * ploss_sum) / denom
    acc = torch.cat(hits).float().sum() * scale / denom if hits else torch.zeros(())
    return loss, {"drafter/loss": float(loss.detach()), "drafter/vloss": float(vloss_sum.detach() / denom),
                  "drafter/ploss": float(ploss_sum.detach() / denom), "drafter/acc_1": float(acc)}


def _head_argmax(drafter, x: torch.Tensor, chunk: int = HEAD_CHUNK, full: bool = False) -> torch.Tensor:
    """argmax of the LM head over ``x [B, T, H]`` -> ``[B, T]``, in chunks of positions (``full``: the whole
    vocabulary, else the drafter's draft vocabulary)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.cat([drafter.logits(flat[a: a + chunk], full=full).argmax(-1)
                     for a in range(0, flat.shape[0], chunk)])
    return out.view(x.shape[:-1])


@torch.no_grad()
def depth_accuracy(drafter, batch: PairBatch, depth: int) -> list[float]:
    """Top-1 agreement with the target's argmax at draft depths 1..depth (predicted features, true tokens; the
    drafter proposes from its draft vocabulary, if it has one)."""
    hid_in, tok_in = batch.inputs
    target_arg = _head_argmax(drafter, batch.hidden[:, 1:], full=True)
    feats, accs = hid_in, []
    for d in range(1, depth + 1):
        pred = drafter.features(feats, tok_in)
        valid = batch.mask.clone()
        valid[:, : d - 1] = False                        # needs d-1 earlier predicted features
        hit = (_head_argmax(drafter, pred) == target_arg) & valid
        accs.append(float(hit.sum() / valid.sum().clamp_min(1)))
        feats = torch.cat([hid_in[:, :1], pred[:, :-1]], 1)   # pair t now reads f̂_t predicted from pair t-1
    return accs


class DrafterTrainer:
    """AdamW over the drafter's own parameters (float32 master weights when the drafter computes in bf16/fp16, as an
    online drafter of a bf16 target does); :meth:`micro_step` is one preemptible optimizer step."""

    def __init__(self, drafter, cfg: DrafterTrainConfig | None = None):
        self.drafter, self.cfg = drafter, cfg or DrafterTrainConfig()
        self.opt = MixedPrecisionAdamW(drafter.parameters(), lr=self.cfg.lr, betas=(0.9, 0.95),
                                       weight_decay=self.cfg.weight_decay)
        self.steps_done = 0

    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        if c.schedule == "constant":
            return c.lr
        frac = min(1.0, (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps))
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def micro_step(self, batch: PairBatch) -> dict:
        """One optimizer step on ``batch`` (preemptible between calls); returns its ``drafter/*`` statistics."""
        self.drafter.train()
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.steps_done)
        with autocast_to_target(self.drafter):
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.steps_done)   # resume-exact
            loss, stats = drafter_loss(self.drafter, batch, self.cfg, generator=g)
        self.opt.zero_grad()
        self.opt.backward(loss)
        self.opt.clip_grad_norm(self.cfg.grad_clip)
        self.opt.step()
        self.drafter.eval()
        self.steps_done += 1
        return stats


BUDGET_PROBE_STEPS = 5
"""Steps timed before a time budget (``DrafterTrainConfig.minutes``) sets the step count."""


def _budget_steps(cfg: DrafterTrainConfig, done: int, elapsed: float, step_s: float, eval_s: float,
                  evals_left: int) -> int:
    """Steps that fit ``cfg.minutes`` after ``done`` steps in ``elapsed`` seconds (``step_s`` each, ``evals_left``
    evaluations of ``eval_s`` still to come): at least ``done``, at most ``cfg.steps``."""
    left = cfg.minutes * 60 - elapsed - evals_left * eval_s
    return max(done, min(cfg.steps, done + int(left / max(step_s, 1e-9))))


def train_offline(drafter, data, cfg: DrafterTrainConfig, eval_data=None, eval_every: int = 100, on_eval=None,
                  progress: bool = True) -> dict:
    """Train for ``cfg.steps`` (fewer with a time budget, ``cfg.minutes``) on batches sampled from ``data`` (a
    :class:`tltlib.drafting.pairs.PairBuffer`); every ``eval_every`` steps (scaled with a cut step count) record depth
    accuracies on ``eval_data`` (and call ``on_eval(step, drafter)``, whose dict result is logged too). Returns the
    log (``steps``: the steps run)."""
    trainer = DrafterTrainer(drafter, cfg)
    log: dict[str, list] = {"step": [], "loss": [], "acc_1": [], "eval_step": [], "eval_acc": [], "eval_extra": []}
    eval_batch = eval_data.batch(eval_data.sequences()) if eval_data is not None else None
    t0 = time.perf_counter()

    def evaluate(step):
        if eval_batch is None:
            return
        log["eval_step"].append(step)
        with autocast_to_target(drafter):
            log["eval_acc"].append(depth_accuracy(drafter, eval_batch, cfg.eval_depth))
        log["eval_extra"].append(on_eval(step, drafter) if on_eval else {})

    evaluate(0)
    eval_s, steps = time.perf_counter() - t0, cfg.steps
    bar = tqdm(total=steps, desc="drafter", disable=not progress)
    step = 0
    while step < steps:
        stats = trainer.micro_step(data.sample(cfg.batch_sequences))
        step += 1
        log["step"].append(step), log["loss"].append(stats["drafter/loss"])
        log["acc_1"].append(stats["drafter/acc_1"])
        # refresh=False: the bar redraws at tqdm's own interval, not at every step (in JupyterLab a widget message
        # per step, 10 a second, kept the browser busy on the cores the training needs)
        bar.set_postfix(loss=f"{stats['drafter/loss']:.3f}", acc=f"{stats['drafter/acc_1']:.2f}", refresh=False)
        bar.update(1)
        if cfg.minutes and step == BUDGET_PROBE_STEPS:
            elapsed = time.perf_counter() - t0
            evals_left = -(-(cfg.steps - step) // eval_every) if eval_batch is not None else 0
            steps = _budget_steps(cfg, step, elapsed, (elapsed - eval_s) / step, eval_s, min(evals_left, 10))
            if steps < cfg.steps:                   # the schedule ends with the budget
                eval_every = max(1, round(eval_every * steps / cfg.steps))
                trainer.cfg = replace(cfg, steps=steps)
                bar.total = steps
        if step % eval_every == 0 or step == steps:
            evaluate(step)
    bar.close()
    drafter.version += 1                             # a new drafter (metrics.METRICS "drafter/version")
    log["steps"] = steps
    log["train_seconds"] = time.perf_counter() - t0
    return log
