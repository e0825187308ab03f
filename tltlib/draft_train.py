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

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


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

    def __post_init__(self):
        if self.steps < 1 or self.batch_sequences < 1 or self.eval_depth < 1:
            raise ValueError("steps, batch_sequences and eval_depth must be >= 1")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        if self.lr <= 0 or self.hidden_weight < 0 or self.token_weight < 0:
            raise ValueError("lr must be > 0 and the loss weights >= 0")


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


@torch.no_grad()
def target_hidden(target, sequences: list[list[int]], pad_id: int = 0, chunk: int = 16) -> list[torch.Tensor]:
    """The target's final hidden states of each (prompt + response) sequence, by one training forward."""
    out = []
    dev = target.embed.weight.device
    for i in range(0, len(sequences), chunk):
        part = sequences[i: i + chunk]
        width = max(map(len, part))
        x = torch.full((len(part), width), pad_id, dtype=torch.long)
        for j, s in enumerate(part):
            x[j, : len(s)] = torch.tensor(s)
        _, h = target(x.to(dev), return_hidden=True)       # right padding: causal, so real positions are exact
        out += [h[j, : len(s)].detach() for j, s in enumerate(part)]
    return out


def pairs_from_sequences(target, sequences: list[list[int]], prompt_lens: list[int], pad_id: int = 0,
                         config=None):
    """A :class:`tltlib.pairs.PairBuffer` of given token sequences (prompt + response), their hidden states from one
    training forward of the target (for data that was not streamed by a rollout, e.g. a dataset's responses)."""
    from .pairs import PairBuffer, PairBufferConfig
    if not sequences:
        raise ValueError("no sequences to train the drafter on")
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
    w = target.embed.weight
    total = sum(len(s) - 1 for s in sequences)
    buf = PairBuffer(target.config.hidden_size, config or PairBufferConfig(max_tokens=max(2, total)), w.dtype,
                     w.device)
    for seq, plen, h in zip(sequences, prompt_lens, target_hidden(target, sequences, pad_id)):
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


def drafter_loss(drafter, batch: PairBatch, cfg: DrafterTrainConfig) -> tuple[torch.Tensor, dict]:
    """EAGLE loss of one batch; returns (loss, ``drafter/*`` stats)."""
    hid_in, tok_in = batch.inputs
    pred, logits = drafter(hid_in, tok_in)
    target_f = batch.hidden[:, 1:]
    with torch.no_grad():
        p_target = torch.softmax(drafter.logits(target_f).float(), -1)
    m = batch.mask.float()
    denom = m.sum().clamp_min(1.0)
    vloss = F.smooth_l1_loss(pred.float(), target_f.float(), reduction="none").mean(-1)
    ploss = -(p_target * torch.log_softmax(logits.float(), -1)).sum(-1)
    loss = (cfg.hidden_weight * (vloss * m).sum() + cfg.token_weight * (ploss * m).sum()) / denom
    with torch.no_grad():
        acc = ((logits.argmax(-1) == p_target.argmax(-1)).float() * m).sum() / denom
    return loss, {"drafter/loss": float(loss.detach()), "drafter/vloss": float((vloss.detach() * m).sum() / denom),
                  "drafter/ploss": float((ploss.detach() * m).sum() / denom), "drafter/acc_1": float(acc)}


@torch.no_grad()
def depth_accuracy(drafter, batch: PairBatch, depth: int) -> list[float]:
    """Top-1 agreement with the target's argmax at draft depths 1..depth (predicted features, true tokens)."""
    hid_in, tok_in = batch.inputs
    target_arg = drafter.logits(batch.hidden[:, 1:]).argmax(-1)
    feats, accs = hid_in, []
    for d in range(1, depth + 1):
        pred, logits = drafter(feats, tok_in)
        valid = batch.mask.clone()
        valid[:, : d - 1] = False                        # needs d-1 earlier predicted features
        hit = (logits.argmax(-1) == target_arg) & valid
        accs.append(float(hit.sum() / valid.sum().clamp_min(1)))
        feats = torch.cat([hid_in[:, :1], pred[:, :-1]], 1)   # pair t now reads f̂_t predicted from pair t-1
    return accs


class DrafterTrainer:
    """AdamW over the drafter's own parameters; :meth:`step` is one preemptible micro-step."""

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

    def step(self, batch: PairBatch) -> dict:
        self.drafter.train()
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.steps_done)
        with autocast_to_target(self.drafter):
            loss, stats = drafter_loss(self.drafter, batch, self.cfg)
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
        stats = trainer.step(data.sample(cfg.batch_sequences))
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
    from .pairs import PairBuffer, PairBufferConfig
    from .rollout import RolloutConfig, RolloutEngine
    from .sampling import SamplingConfig
    from .tasks import encode_prompts
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
    from .rollout import RolloutConfig, RolloutEngine
    from .sampling import SamplingConfig
    from .tasks import encode_prompts
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens)),
                        drafter=drafter)
    g = torch.Generator(device=target.embed.weight.device).manual_seed(seed)
    res = eng.generate(encode_prompts(problems, tokenizer), g, strategy=strategy)
    return {k: v for k, v in res.stats.items() if k.startswith("spec/")}


WARM_CARD = """# {name}

An EAGLE-1-style one-layer drafter ({params_k:.0f} K trainable parameters: fc 2H->H + one decoder layer; the
embedding and LM head are the target's, shared and frozen, not stored here) for `{target}`.

## How it was made
`{command}` — offline warm-up on the target's own rollouts: {n_train} sampled responses
(temperature 0.9) of chain problems{mix}, {pairs} training pairs; {steps} AdamW steps (lr {lr}, batch {batch}
sequences, loss = SmoothL1(hidden) + 0.1 x soft CE), {minutes:.1f} minutes on {where}.

## Quality on {n_eval} held-out responses
Top-1 agreement with the target's argmax by draft depth (predicted features, true tokens):
{depth_table}

Measured in speculative rollouts of {n_accept} held-out prompts (temperature 0.9; accepted length includes the
bonus token): {accept_lines}
"""


def train_warm_drafter(model_path, out_dir, cfg: DrafterTrainConfig | None = None, n_train: int = 512,
                       n_eval: int = 64, seed: int = 0, progress: bool = True, overwrite: bool = False,
                       task_max_steps: int = 52, command: str = "python -m tltlib train-drafter",
                       device: str = "cpu", dtype: str = "auto") -> str:
    """Build, train and save the warm drafter for a local target; returns its card.

    ``task_max_steps`` < 52 trains on short chain problems only (a drafter warmed on another problem mix than the
    one RL then produces: the drift notebook 05 measures).

    The output folder is checked before any work (writable; an existing drafter is replaced only with
    ``overwrite``; anything else is never replaced) and written as a whole in one atomic step: weights, config,
    card (README.md) and train_log.json. ``dtype`` is the target's (``auto``: bfloat16 on CUDA, else float32); the
    drafter trains in float32 under autocast to it, then is measured and saved in it."""
    import json
    from pathlib import Path

    from .checkpoint import load_model
    from .drafter import Drafter, DrafterConfig, is_drafter_folder, save_drafter
    from .fileio import check_output_folder
    from .speculative import SpecStrategy
    from .tasks import ChainTaskConfig, generate_problems
    from .tokenizer import load_tokenizer
    check_output_folder(out_dir, overwrite, is_drafter_folder, "drafter")
    cfg = cfg or DrafterTrainConfig()
    from .checkpoint import parse_dtype
    dtype = parse_dtype(("bfloat16" if str(device).startswith("cuda") else "float32") if dtype == "auto" else dtype)
    target, tok = load_model(model_path, dtype=dtype, device=device), load_tokenizer(model_path)
    mix = dict(max_steps=task_max_steps)
    train_probs = (generate_problems(ChainTaskConfig(**mix), n_train * 3 // 4, seed=seed + 1000)
                   + generate_problems(ChainTaskConfig(zipf_exponent=0.3, **mix), n_train // 4, seed=seed + 2000))
    eval_probs = generate_problems(ChainTaskConfig(zipf_exponent=0.6), n_eval, seed=seed + 3000)
    data = rollout_dataset(target, tok, train_probs, seed=seed, progress=progress)
    eval_data = rollout_dataset(target, tok, eval_probs, seed=seed + 1)
    torch.manual_seed(seed)
    drafter = Drafter(DrafterConfig.from_target(target.config)).to(device).attach(target)
    log = train_offline(drafter, data, cfg, eval_data, eval_every=max(1, cfg.steps // 10), progress=progress)
    drafter.to(dtype)
    accept_probs = generate_problems(ChainTaskConfig(), 32, seed=seed + 4000)
    accept = {st.name: measure_acceptance(target, drafter, tok, accept_probs, st)
              for st in (SpecStrategy("chain", 4), SpecStrategy("tree", 6, 4, 24))}
    accs = log["eval_acc"][-1]
    card = WARM_CARD.format(
        name=f"{Path(out_dir).name}: EAGLE drafter", target=Path(model_path).name, command=command,
        mix=f" of at most {task_max_steps} steps" if task_max_steps < 52 else "",
        params_k=sum(p.numel() for p in drafter.parameters()) / 1e3, n_train=len(data), pairs=data.num_pairs,
        steps=cfg.steps, lr=cfg.lr, batch=cfg.batch_sequences, minutes=log["train_seconds"] / 60,
        where=(torch.cuda.get_device_name(device) if str(device).startswith("cuda")
               else f"{torch.get_num_threads()} CPU threads"), n_eval=len(eval_data),
        depth_table="| depth | " + " | ".join(str(d + 1) for d in range(len(accs))) + " |\n|---|"
                    + "---|" * len(accs) + "\n| top-1 | " + " | ".join(f"{a:.1%}" for a in accs) + " |",
        n_accept=len(accept_probs),
        accept_lines="; ".join(f"{name}: {s['spec/accept_len_mean']:.2f} tokens per step" for name, s in
                               accept.items()))
    train_log = json.dumps({"recipe": cfg.__dict__, "log": log, "acceptance": accept}, indent=1) + "\n"
    save_drafter(drafter, out_dir, extra_files={"README.md": card, "train_log.json": train_log})
    return card
