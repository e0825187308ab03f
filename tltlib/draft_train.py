"""Drafter training: aligned (hidden, token) pairs, the EAGLE loss, a step-wise trainer, offline warm-up.

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

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from .checkpoint import load_model, parse_dtype
from .drafter import Drafter, DrafterConfig, frequent_tokens, is_drafter_folder, load_drafter, save_drafter
from .fileio import check_output_folder, resolve
from .pairs import PairBatch, PairBuffer, PairBufferConfig
from .rollout import RolloutConfig, RolloutEngine
from .sampling import SamplingConfig
from .speculative import SpecStrategy
from .tasks import (ChainTaskConfig, encode_prompts, generate_problems, generate_task, load_problems,
                    read_responses)
from .tokenizer import load_tokenizer


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
    mean; the hidden-state loss keeps every pair); 0 = all. With a 49k vocabulary the LM head is ~90% of a step's
    cost on a CPU, so e.g. 512 makes SmolLM2's drafter trainable there."""

    def __post_init__(self):
        if self.steps < 1 or self.batch_sequences < 1 or self.eval_depth < 1:
            raise ValueError("steps, batch_sequences and eval_depth must be >= 1")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        if self.lr <= 0 or self.hidden_weight < 0 or self.token_weight < 0:
            raise ValueError("lr must be > 0 and the loss weights >= 0")
        if self.unroll < 1 or not 0 < self.unroll_decay <= 1:
            raise ValueError(f"unroll must be >= 1 and unroll_decay in (0, 1], got {self.unroll}, {self.unroll_decay}")
        if self.ce_positions < 0:
            raise ValueError(f"ce_positions must be >= 0 (0: every pair), got {self.ce_positions}")


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
    """A :class:`tltlib.pairs.PairBuffer` of given token sequences (prompt + response), their hidden states from one
    training forward of the target (for data that was not streamed by a rollout, e.g. a dataset's responses)."""
    if not sequences:
        raise ValueError("no sequences to train the drafter on")
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
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


def _soft_ce(drafter, pred: torch.Tensor, target_f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy ``[N]`` of the drafter's next-token distribution (from ``pred [N, H]``) against the
    target's (from ``target_f [N, H]``), and whether their argmaxes agree ``[N]``."""
    with torch.no_grad():
        p_target = torch.softmax(drafter.logits(target_f, full=True).float(), -1)
    logits = drafter.logits(pred, full=True).float()      # trained towards the whole distribution
    return -(p_target * torch.log_softmax(logits, -1)).sum(-1), logits.argmax(-1) == p_target.argmax(-1)


def drafter_loss(drafter, batch: PairBatch, cfg: DrafterTrainConfig, chunk: int = HEAD_CHUNK,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """EAGLE loss of one batch, summed over ``cfg.unroll`` draft steps; returns (loss, ``drafter/*`` stats of the
    first step).

    The soft cross-entropy runs over the pairs that carry loss in chunks of ``chunk``, each under activation
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
        args = (drafter, sel_pred[a: a + chunk], sel_target[a: a + chunk])
        pl, hit = checkpoint(_soft_ce, *args, use_reentrant=False) if grad else _soft_ce(*args)
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
    """AdamW over the drafter's own parameters; :meth:`micro_step` is one preemptible optimizer step."""

    def __init__(self, drafter, cfg: DrafterTrainConfig | None = None):
        self.drafter, self.cfg = drafter, cfg or DrafterTrainConfig()
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=self.cfg.lr, betas=(0.9, 0.95),
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
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.drafter.eval()
        self.drafter.version += 1
        self.steps_done += 1
        return stats


def train_offline(drafter, data, cfg: DrafterTrainConfig, eval_data=None, eval_every: int = 100, on_eval=None,
                  progress: bool = True) -> dict:
    """Train for ``cfg.steps`` on batches sampled from ``data`` (a :class:`tltlib.pairs.PairBuffer`); every
    ``eval_every`` steps record depth accuracies on ``eval_data`` (and call ``on_eval(step, drafter)``, whose dict
    result is logged too). Returns the log."""
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
    bar = tqdm(range(cfg.steps), desc="drafter", disable=not progress)
    for step in bar:
        stats = trainer.micro_step(data.sample(cfg.batch_sequences))
        log["step"].append(step + 1), log["loss"].append(stats["drafter/loss"])
        log["acc_1"].append(stats["drafter/acc_1"])
        bar.set_postfix(loss=f"{stats['drafter/loss']:.3f}", acc=f"{stats['drafter/acc_1']:.2f}")
        if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
            evaluate(step + 1)
    log["train_seconds"] = time.perf_counter() - t0
    return log


# ----------------------------------------------------------------------------------------- offline warm-up
def rollout_dataset(target, tokenizer, problems, group_size: int = 1, temperature: float = 0.9,
                    max_new_tokens: int = 720, seed: int = 0, progress: bool = False, max_tokens: int = 1 << 22):
    """Sample responses from the target, streaming the drafter's pairs into a new
    :class:`tltlib.pairs.PairBuffer` (at most ``max_tokens`` pairs), which is returned."""
    w = target.embed.weight
    buf = PairBuffer(target.config.hidden_size, PairBufferConfig(max_tokens=max_tokens, seed=seed), w.dtype, w.device)
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens),
                                              group_size=group_size))
    eng.generate(encode_prompts(problems, tokenizer), torch.Generator(device=w.device).manual_seed(seed),
                 progress=progress, pairs=buf)
    return buf


def measure_acceptance(target, drafter, tokenizer, problems, strategy, temperature: float = 0.9,
                       max_new_tokens: int = 720, seed: int = 0) -> dict:
    """``spec/*`` stats of a speculative rollout of ``problems`` with ``strategy`` (accepted length etc.)."""
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens)),
                        drafter=drafter)
    g = torch.Generator(device=target.embed.weight.device).manual_seed(seed)
    res = eng.generate(encode_prompts(problems, tokenizer), g, strategy=strategy)
    return {k: v for k, v in res.stats.items() if k.startswith("spec/")}


WARM_CARD = """# {name}

An EAGLE-1-style one-layer drafter ({params_k:.0f} K trainable parameters: fc 2H->H + one decoder layer; the
embedding and LM head are the target's, shared and frozen, not stored here) for `{target}`.

## How it was made
`{command}` — offline warm-up, {start}, on the target's own responses: {n_train} {data_line}, {pairs} training
pairs; {steps} AdamW steps (lr {lr}, batch {batch} sequences, loss = SmoothL1(hidden) + 0.1 x soft CE{unroll_line}),
{minutes:.1f} minutes on {where}.

## Quality on {n_eval} held-out responses
Top-1 agreement with the target's argmax by draft depth (predicted features, true tokens):
{depth_table}

Proposals: {vocab_line}

Measured in speculative rollouts of {n_accept} held-out prompts (temperature {temperature}; accepted length includes
the bonus token): {accept_lines}
"""


def drafter_problems(dataset: str, n_train: int, n_eval: int, n_accept: int, seed: int,
                     task_max_steps: int = 52) -> tuple[list, list, list, str]:
    """(train, eval, acceptance) problems and a description, from a generated task (``""``/``"chain"``: the chain
    mix the shipped drafter was trained on; ``"words"``: word problems) or a JSONL/parquet file (the held-out
    problems are its last ``n_eval`` rows; rows may carry a ``response`` to train on instead of sampling one)."""
    if dataset in ("", "chain"):
        mix = dict(max_steps=task_max_steps)
        train = (generate_problems(ChainTaskConfig(**mix), n_train * 3 // 4, seed=seed + 1000)
                 + generate_problems(ChainTaskConfig(zipf_exponent=0.3, **mix), n_train - n_train * 3 // 4,
                                     seed=seed + 2000))
        held = generate_problems(ChainTaskConfig(zipf_exponent=0.6), n_eval, seed=seed + 3000)
        accept = generate_problems(ChainTaskConfig(), n_accept, seed=seed + 4000)
        return train, held, accept, "chain problems" + (f" of at most {task_max_steps} steps"
                                                         if task_max_steps < 52 else "")
    if dataset == "words":
        return (generate_task("words", n_train, seed + 1000), generate_task("words", n_eval, seed + 3000),
                generate_task("words", n_accept, seed + 4000), "GSM8K-style word problems (tltlib.wordproblems)")
    rows = load_problems(resolve(dataset))
    if len(rows) <= n_eval:
        raise ValueError(f"{dataset}: {len(rows)} rows cannot hold {n_eval} held-out problems and training problems "
                         f"apart; lower --n-eval (at most {len(rows) - 1}) or use a larger dataset")
    held = rows[-n_eval:]
    return rows[:-n_eval][:n_train], held, held[:n_accept], f"the prompts of {Path(dataset).name}"


def check_context(prompts: list[list[int]], context: int, source: str, model: str) -> None:
    """One error for every prompt that leaves no room for a response in the model's context."""
    long = [i for i, p in enumerate(prompts) if len(p) >= context]
    if long:
        worst = max(len(prompts[i]) for i in long)
        more = "..." if len(long) > 5 else ""
        raise ValueError(f"{source}: {len(long)} of {len(prompts)} prompts (rows {long[:5]}{more}) leave no room for "
                         f"a response in the context of {model} ({context} tokens, max_position_embeddings; the "
                         f"longest prompt has {worst}): shorten or drop them")


def training_pairs(target, tokenizer, problems, seed: int, temperature: float, max_new_tokens: int,
                   progress: bool = False) -> PairBuffer:
    """The drafter's pairs for ``problems``: their own ``response`` fields when every problem has one (hidden states
    from one forward), else the target's sampled responses (hidden states from the generation pass)."""
    ctx = target.config.max_position_embeddings
    if problems and all(isinstance(p.meta.get("response"), str) for p in problems):
        prompts = encode_prompts(problems, tokenizer)
        eos = target.config.eos_token_ids[0]
        seqs = [p + tokenizer(pr.meta["response"], add_special_tokens=False).input_ids + [eos]
                for p, pr in zip(prompts, problems)]
        return pairs_from_sequences(target, [s[:ctx] for s in seqs], [len(p) for p in prompts],
                                    tokenizer.pad_token_id or 0)
    return rollout_dataset(target, tokenizer, problems, temperature=temperature, max_new_tokens=max_new_tokens,
                           seed=seed, progress=progress)


def response_pairs(target, tokenizer, path, n_train: int, n_eval: int,
                   progress: bool = False) -> tuple[PairBuffer, PairBuffer, str]:
    """(training pairs, held-out pairs, description) of a responses file (:func:`tltlib.draft_data.read_responses`):
    its last ``n_eval`` rows held out, at most ``n_train`` of the others trained on; hidden states from one forward
    of the target."""
    rows = read_responses(path, target.config.vocab_size)
    if len(rows) <= n_eval:
        raise ValueError(f"{path}: {len(rows)} responses cannot hold {n_eval} held-out ones and training ones apart; "
                         f"lower --n-eval (at most {len(rows) - 1}) or sample more")
    train = rows[:-n_eval][:n_train]
    return (rows_pairs(target, tokenizer, train, progress), rows_pairs(target, tokenizer, rows[-n_eval:], progress),
            f"{Path(path).name} (python -m tltlib sample-responses)")


def rows_pairs(target, tokenizer, rows: list[tuple[list[int], list[int]]], progress: bool = False) -> PairBuffer:
    """The drafter's pairs of ``(prompt_ids, response_ids)`` rows (cut at the target's context), hidden states from
    one forward of the target."""
    ctx = target.config.max_position_embeddings
    return pairs_from_sequences(target, [(p + r)[:ctx] for p, r in rows], [len(p) for p, _ in rows],
                                tokenizer.pad_token_id or 0, progress=progress)


def _vocab_line(drafter, eval_data: PairBuffer) -> str:
    """What the drafter proposes from, for its card (with the held-out tokens a draft vocabulary covers)."""
    if drafter.draft_ids is None:
        return "the whole vocabulary"
    held = eval_data.tok[: eval_data.size].to(drafter.draft_ids.device)
    covered = float(torch.isin(held, drafter.draft_ids).float().mean()) if held.numel() else float("nan")
    return (f"a draft vocabulary of {drafter.config.draft_vocab_size} tokens (the most frequent in the training "
            f"pairs), covering {covered:.1%} of the held-out pairs' tokens")


def _card(drafter, out_dir, model_name: str, cfg: DrafterTrainConfig, log: dict, accept: dict, data, eval_data,
          n_accept: int, **about) -> str:
    """The drafter's README.md (:data:`WARM_CARD`); ``about``: command, source, init, temperature, device."""
    accs, device = log["eval_acc"][-1], str(about["device"])
    return WARM_CARD.format(
        name=f"{Path(out_dir).name}: EAGLE drafter", target=model_name, command=about["command"],
        data_line=(f"responses read from {about['source']}" if about.get("from_file") else
                   f"responses (sampled at temperature {about['temperature']}, or the dataset's) to {about['source']}"),
        unroll_line=(f", over {cfg.unroll} draft steps on the drafter's own features, weights x{cfg.unroll_decay} per "
                     "step" if cfg.unroll > 1 else ""),
        start="continued from " + str(about["init"]) if about["init"] else "from a random initialisation",
        temperature=about["temperature"],
        params_k=sum(p.numel() for p in drafter.parameters()) / 1e3, n_train=len(data), pairs=data.num_pairs,
        steps=cfg.steps, lr=cfg.lr, batch=cfg.batch_sequences, minutes=log["train_seconds"] / 60,
        where=(torch.cuda.get_device_name(device) if device.startswith("cuda")
               else f"{torch.get_num_threads()} CPU threads"), n_eval=len(eval_data),
        depth_table="| depth | " + " | ".join(str(d + 1) for d in range(len(accs))) + " |\n|---|"
                    + "---|" * len(accs) + "\n| top-1 | " + " | ".join(f"{a:.1%}" for a in accs) + " |",
        n_accept=n_accept, vocab_line=_vocab_line(drafter, eval_data),
        accept_lines="; ".join(f"{name}: {s['spec/accept_len_mean']:.2f} tokens per step" for name, s in
                               accept.items()))


def train_warm_drafter(model_path, out_dir, cfg: DrafterTrainConfig | None = None, n_train: int = 512,
                       n_eval: int = 64, seed: int = 0, progress: bool = True, overwrite: bool = False,
                       task_max_steps: int = 52, command: str = "python -m tltlib train-drafter",
                       device: str = "cpu", dtype: str = "auto", dataset: str = "", init=None,
                       max_new_tokens: int = 720, n_accept: int = 32, temperature: float = 0.9,
                       draft_vocab: int = 0, responses: str = "") -> str:
    """Build (or continue from ``init``), train and save the warm drafter of any local target; returns its card.

    Data (:func:`drafter_problems`, :func:`training_pairs`): the target's own sampled responses (``temperature``, at
    most ``max_new_tokens``; hidden states taken in the generation pass) to a generated task's or a dataset's
    prompts, or the dataset's own ``response`` fields (hidden states from one forward). ``task_max_steps`` < 52
    trains on short chain problems only (the drift notebook 05 measures).

    The output folder is checked before any work (writable; an existing drafter is replaced only with
    ``overwrite``; anything else is never replaced) and written as a whole in one atomic step: weights, config,
    card (README.md) and train_log.json. ``dtype`` is the target's (``auto``: bfloat16 on CUDA, else float32); the
    drafter trains in float32 under autocast to it, then is measured and saved in it. ``draft_vocab`` > 0 gives the
    drafter a draft vocabulary of that many tokens, the most frequent in the training pairs (plus EOS), and the card
    reports how much of the held-out pairs' tokens it covers (0 keeps ``init``'s, or the whole vocabulary).
    ``responses``: train on a responses file (:mod:`tltlib.draft_data`; its last ``n_eval`` rows held out) instead of
    sampling; the acceptance is still measured on ``dataset``'s held-out prompts."""
    check_output_folder(out_dir, overwrite, is_drafter_folder, "drafter")
    cfg = cfg or DrafterTrainConfig()
    dtype = parse_dtype(("bfloat16" if str(device).startswith("cuda") else "float32") if dtype == "auto" else dtype)
    target, tok = load_model(model_path, dtype=dtype, device=device), load_tokenizer(model_path)
    name = Path(model_path).name
    if init:
        drafter = load_drafter(init, target).float()             # refused here if it belongs to another target
    train_probs, eval_probs, accept_probs, source = drafter_problems(dataset, n_train, n_eval, n_accept, seed,
                                                                     task_max_steps)
    if responses:
        data, eval_data, source = response_pairs(target, tok, responses, n_train, n_eval, progress)
    else:
        for probs in (train_probs, eval_probs):
            check_context(encode_prompts(probs, tok), target.config.max_position_embeddings, dataset or "the task",
                          name)
        data = training_pairs(target, tok, train_probs, seed, temperature, max_new_tokens, progress)
        eval_data = training_pairs(target, tok, eval_probs, seed + 1, temperature, max_new_tokens, progress)
    torch.manual_seed(seed)
    if not init:
        drafter = Drafter(DrafterConfig.from_target(target.config)).to(device).attach(target)
    if draft_vocab:
        drafter.set_draft_vocab(frequent_tokens(data.tok[: data.size], draft_vocab, target.config.vocab_size,
                                                always=target.config.eos_token_ids))
    log = train_offline(drafter, data, cfg, eval_data, eval_every=max(1, cfg.steps // 10), progress=progress)
    drafter.to(dtype)
    accept = {st.name: measure_acceptance(target, drafter, tok, accept_probs, st, temperature, max_new_tokens)
              for st in (SpecStrategy("chain", 4), SpecStrategy("tree", 6, 4, 24))}
    card = _card(drafter, out_dir, name, cfg, log, accept, data, eval_data, len(accept_probs), command=command,
                 source=source, init=init, temperature=temperature, device=device, from_file=bool(responses))
    train_log = json.dumps({"recipe": cfg.__dict__, "data": {"dataset": dataset or "chain", "source": source},
                            "log": log, "acceptance": accept}, indent=1) + "\n"
    save_drafter(drafter, out_dir, extra_files={"README.md": card, "train_log.json": train_log})
    return card
