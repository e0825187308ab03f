"""The tiny reasoner: a Llama-architecture model trained here by SFT on generated chain-task traces.

``python -m tltlib train-reasoner`` builds it from nothing on a 2-core CPU (about 18 minutes) and writes it, with
its tokenizer and a model card, to ``data/tiny-reasoner`` in transformers' format. It is the embedded default
model of the notebooks and benchmarks: small enough for a laptop, 8 layers deep so a one-layer drafter is cheap next
to it, and imperfect enough (accuracy well below 100% at temperature 0.9, worse on long problems) to leave room
for RL.

Paper: TLT §6.1 uses Qwen2.5-7B/32B, DeepSeek-R1-Distill-Qwen-7B and Llama-3.3-70B; this model stands in for them.

Departures:
1. SFT draws 15% of its problems from a flatter step distribution than the evaluation's, so long chains — rare
   under the Zipf tail — are seen too; the rest keep the first steps (where a small model learns slowest) frequent.
2. CPU bf16 autocast for speed (the weights stay float32 and are shipped in float32).
"""
from __future__ import annotations

import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import BadInput
from ..fileio import check_output_folder
from ..model.decoder import Transformer, preset
from ..model.optimizer import MixedPrecisionAdamW
from ..model.sampling import SamplingConfig
from ..model.weights import save_model
from ..rollout.engine import RolloutConfig, RolloutEngine
from ..stats import length_stats
from ..tasks.chain import ChainTaskConfig, generate_problems, make_problem, solve
from ..tasks.prompts import encode_prompts, score_responses
from ..tasks.tokenizer import build_tokenizer


@dataclass(frozen=True)
class ReasonerTrainConfig:
    """SFT recipe of the tiny reasoner."""

    preset: str = "tiny-cpu"
    """Model preset (vocabulary size is taken from the tokenizer)."""
    steps: int = 1400
    """Optimizer steps."""
    minutes: float = 18.0
    """Wall-clock cap: training stops early when it is reached."""
    tokens_per_batch: int = 6000
    """Padded tokens per optimizer step (batches hold problems of similar length)."""
    lr: float = 2e-3
    """Peak learning rate (linear warm-up, cosine decay to 10%)."""
    warmup_steps: int = 100
    """Linear warm-up steps."""
    long_fraction: float = 0.15
    """Share of training problems drawn with the flatter step distribution (exponent 0.3)."""
    bf16_autocast: bool = True
    """Run forward/backward under bf16 autocast (weights stay float32)."""
    seed: int = 0
    """Seeds the training problems and the initial weights."""
    eval_problems: int = 512
    """Held-out problems for the model card's accuracy and length statistics."""
    eval_seed: int = 12345
    """Seed of the held-out problems (disjoint from training draws with overwhelming probability)."""

    def __post_init__(self):
        if self.steps < 1 or self.minutes <= 0 or self.tokens_per_batch < 64:
            raise BadInput("steps must be >= 1, minutes > 0 and tokens_per_batch >= 64")
        if not 0 <= self.long_fraction <= 1:
            raise BadInput(f"long_fraction must be in [0, 1], got {self.long_fraction}")


def sft_example(tokenizer, rng: random.Random, task: ChainTaskConfig, long_task: ChainTaskConfig,
                long_fraction: float) -> tuple[list[int], list[int]]:
    """(prompt ids with BOS, response ids with EOS) of one generated trace."""
    p = make_problem(long_task if rng.random() < long_fraction else task, rng)
    resp = tokenizer(solve(p.prompt), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return tokenizer(p.prompt).input_ids, resp


def sft_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs ``[B, T]`` and next-token targets ``[B, T]`` (-100 outside the response)."""
    t = max(len(a) + len(b) for a, b in examples)
    x = torch.full((len(examples), t), pad_id, dtype=torch.long)
    y = torch.full((len(examples), t), -100, dtype=torch.long)
    for i, (a, b) in enumerate(examples):
        x[i, : len(a) + len(b)] = torch.tensor(a + b)
        y[i, len(a) - 1: len(a) + len(b) - 1] = torch.tensor(b)
    return x, y


def sft_step(model, opt, x: torch.Tensor, y: torch.Tensor, bf16_autocast: bool = False) -> torch.Tensor:
    """One supervised step on ``x, y [B, T]`` (:func:`sft_batch`): next-token cross-entropy (float32 logits, -100
    ignored), gradient clipped to norm 1, ``opt.step()`` (``opt``: a :class:`tltlib.model.optimizer.MixedPrecisionAdamW`
    over ``model``); returns the loss (not synchronised to the host)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16_autocast):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    opt.zero_grad()
    opt.backward(loss)
    opt.clip_grad_norm(1.0)
    opt.step()
    return loss


def lr_at(step: int, cfg: ReasonerTrainConfig) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train_sft(cfg: ReasonerTrainConfig, tokenizer, progress: bool = True,
              device: str = "cpu") -> tuple[Transformer, dict]:
    """Train a fresh model on generated traces (float32 weights, bf16 autocast); return it and the training log."""
    torch.manual_seed(cfg.seed)
    mcfg = preset(cfg.preset, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id)
    model = Transformer(mcfg).to(device)
    opt = MixedPrecisionAdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(cfg.seed)
    task, long_task = ChainTaskConfig(), ChainTaskConfig(zipf_exponent=0.3)
    log = {"step": [], "loss": [], "seconds": []}
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="sft", disable=not progress)
    for step in bar:
        pool = sorted((sft_example(tokenizer, rng, task, long_task, cfg.long_fraction) for _ in range(64)),
                      key=lambda e: len(e[0]) + len(e[1]))
        end = rng.randrange(len(pool)) + 1                     # a run of similar lengths filling the budget
        per = max(1, cfg.tokens_per_batch // (len(pool[end - 1][0]) + len(pool[end - 1][1])))
        x, y = (t.to(device) for t in sft_batch(pool[max(0, end - per): end], tokenizer.pad_token_id))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = sft_step(model, opt, x, y, cfg.bf16_autocast)
        elapsed = time.perf_counter() - t0
        if step % 10 == 0 or step == cfg.steps - 1:          # (a device sync: every 10 steps only)
            log["step"].append(step), log["loss"].append(loss.item()), log["seconds"].append(elapsed)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if elapsed > cfg.minutes * 60:
            break
    bar.close()
    log["steps_done"] = step + 1
    log["train_seconds"] = time.perf_counter() - t0
    return model.eval(), log


def evaluate(model, tokenizer, problems, temperature: float = 0.9, num_generations: int = 1, max_new_tokens: int = 720,
             seed: int = 0, progress: bool = False) -> dict:
    """Accuracy and response-length statistics of the model's own sampling on ``problems``."""
    engine = RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=temperature,
                                                               max_new_tokens=max_new_tokens),
                                                num_generations=num_generations))
    g = torch.Generator(device=model.embed.weight.device).manual_seed(seed)
    res = engine.generate(encode_prompts(problems, tokenizer), g, progress=progress)
    rewards = np.array(score_responses(res.texts(tokenizer), problems, num_generations))
    steps = np.repeat([p.meta.get("steps", 0) for p in problems], num_generations)
    out = {"rl/accuracy": float(rewards.mean()), **length_stats(res.lengths.numpy()),
           "rollout/truncated_frac": res.stats["rollout/truncated_frac"]}
    for lo, hi in ((1, 3), (4, 10), (11, 25), (26, 52)):
        sel = (steps >= lo) & (steps <= hi)
        if sel.any():
            out[f"accuracy_steps_{lo}-{hi}"] = float(rewards[sel].mean())
    return out


CARD = """# {name}

A {params_m:.2f} M-parameter Llama-architecture model ({layers} layers, hidden {hidden}, {heads} heads /
{kv_heads} KV heads, SwiGLU {inter}, tied embeddings, vocabulary {vocab}) trained by tltlib on the embedded chain
task. It loads with `tltlib.model.weights.load_model` and with `transformers.AutoModelForCausalLM.from_pretrained`.

## How it was made
`python -m tltlib train-reasoner --preset {preset} --steps {steps}` — SFT on freshly generated traces: {steps} AdamW
steps of ~{tpb} tokens (lr {lr}, warm-up {warmup}, cosine to 10%, bf16 autocast), loss on response tokens only,
{minutes:.1f} minutes on {where}. Recipe: `tltlib.lab.reasoner.ReasonerTrainConfig` = `{recipe}`.

## The task
Prompt `47 18 c?` = two start values and the label of the last step; each step adds the two latest values digit
by digit mod 10 (Fibonacci-style): `a:47+18=55 b:18+55=63 c:55+63=18 #18` (11 tokens a step). Steps are
Zipf(1.2)-distributed over 1..52.

## Accuracy on {n_eval} held-out problems (seed {eval_seed})
| decoding | accuracy | 1-3 steps | 4-10 | 11-25 | 26-52 |
|---|---|---|---|---|---|
{acc_rows}

## Response lengths under its own sampling (temperature 0.9, {n_eval} samples)
median {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {max:.0f} tokens: p99/median = {p99r:.1f}, max/median = {maxr:.1f};
{trunc:.1%} cut at the token budget.
"""


def _acc_row(name: str, ev: dict) -> str:
    cells = [f"{ev.get(k, float('nan')):.1%}" for k in ("rl/accuracy", "accuracy_steps_1-3", "accuracy_steps_4-10",
                                                          "accuracy_steps_11-25", "accuracy_steps_26-52")]
    return f"| {name} | " + " | ".join(cells) + " |"


def train_reasoner(cfg: ReasonerTrainConfig, out_dir: str | Path, progress: bool = True,
                   overwrite: bool = False, device: str = "cpu") -> str:
    """Train, evaluate and save the tiny reasoner (model + tokenizer + README.md card + eval.json); return the card.

    The output folder is checked first (writable; an existing model is replaced only with ``overwrite``)."""
    check_output_folder(out_dir, overwrite, lambda p: (p / "config.json").is_file(), "model")
    tok = build_tokenizer()
    model, log = train_sft(cfg, tok, progress, device)
    problems = generate_problems(ChainTaskConfig(), cfg.eval_problems, seed=cfg.eval_seed)
    ev_sample = evaluate(model, tok, problems, temperature=0.9, progress=progress)
    ev_greedy = evaluate(model, tok, problems, temperature=0.0, progress=progress)
    mc = model.config
    card = CARD.format(name=Path(out_dir).name, preset=cfg.preset, params_m=mc.num_parameters / 1e6,
                       layers=mc.num_layers, hidden=mc.hidden_size,
                       heads=mc.num_heads, kv_heads=mc.num_kv_heads, inter=mc.intermediate_size, vocab=mc.vocab_size,
                       steps=log["steps_done"], tpb=cfg.tokens_per_batch, lr=cfg.lr, warmup=cfg.warmup_steps,
                       minutes=log["train_seconds"] / 60,
                       where=(torch.cuda.get_device_name(device) if str(device).startswith("cuda")
                              else f"{torch.get_num_threads()} CPU threads"),
                       recipe=json.dumps(asdict(cfg)), n_eval=cfg.eval_problems, eval_seed=cfg.eval_seed,
                       acc_rows=_acc_row("sampling, T=0.9", ev_sample) + "\n" + _acc_row("greedy", ev_greedy),
                       p50=ev_sample["rollout/len_p50"], p90=ev_sample["rollout/len_p90"],
                       p99=ev_sample["rollout/len_p99"], max=ev_sample["rollout/len_max"],
                       p99r=ev_sample["rollout/p99_over_p50"], maxr=ev_sample["rollout/max_over_p50"],
                       trunc=ev_sample["rollout/truncated_frac"])
    report = {"recipe": asdict(cfg), "train": {k: log[k] for k in ("steps_done", "train_seconds")},
              "loss_curve": {k: log[k] for k in ("step", "loss", "seconds")},
              "eval_t0.9": ev_sample, "eval_greedy": ev_greedy}
    files = {"README.md": card, "eval.json": json.dumps(report, indent=1) + "\n"}
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        files.update({f.name: f.read_text() for f in Path(tmp).iterdir()})
    save_model(model, out_dir, extra_files=files)            # one atomic write of everything
    return card
