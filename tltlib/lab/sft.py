"""A supervised warm start on the word problems' worked solutions, for a real model that cannot yet do the task.

GRPO learns only from groups whose rewards differ: SmolLM2-135M-Instruct answers 0-3% of even one-step word problems
and writes the ``####`` answer line in 4-21% of its responses, so its groups are all zero. A short SFT on worked
solutions (:attr:`tltlib.tasks.wordproblems` ``meta["solution"]``: each operation with its arithmetic, then ``#### N``)
teaches the format and the easy cases and leaves the rest to RL: on this 2-core CPU, 20 steps of 4 solutions
(1.3 min) take its greedy accuracy to 58% / 25% / 8% at 1 / 2 / 4 steps with the answer line in every response. The
default is short on purpose: 60 steps reach 71% / 46% / 21%, but from there 12 GRPO steps gained 1.6 points of
held-out accuracy where from 20 they gained 6.3 (the probes behind issue 23, docs/real-models.md).

The loss is the next-token cross-entropy on the solution tokens only (the prompt is context), the prompt built as
the rollout builds it (:func:`tltlib.tasks.prompts.encode_prompts`: the chat template when the tokenizer has one).

Departure: TRL's ``SFTTrainer`` does the same on a dataset; here the problems are generated (seeded) and the loop is
a few lines, so the warm start needs no dataset download and no second training stack.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import BadInput, NotFinite
from ..fileio import check_output_folder
from ..tasks.wordproblems import WordTaskConfig, generate_word_problems

# torch, tqdm and the tokenizer-facing modules are imported where used: the CLI registers this module's command
# before `python -m tltlib setup` has installed torch


@dataclass(frozen=True)
class WarmStartConfig:
    """The warm start: how many worked solutions, of which problems, at what learning rate."""

    steps: int = 20
    """Optimizer steps (short on purpose: the module docstring)."""
    batch: int = 4
    """Worked solutions per step."""
    lr: float = 3e-5
    """AdamW learning rate (constant; no weight decay)."""
    max_problem_steps: int = 4
    """Longest problems trained on (operations after the start count); longer ones are left to RL."""
    seed: int = 101
    """Seed of the training problems (keep it apart from the held-out problems' seeds)."""

    def __post_init__(self):
        if self.steps < 1 or self.batch < 1:
            raise BadInput(f"steps and batch must be >= 1, got {self.steps} and {self.batch}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise BadInput(f"lr must be a finite number > 0 (--lr; the default is 3e-05), got {self.lr}")
        WordTaskConfig(max_steps=self.max_problem_steps)           # raises naming the allowed range


def warm_start(model, tokenizer, cfg: WarmStartConfig | None = None, progress: bool = True) -> dict:
    """Train ``model`` (a :class:`tltlib.model.decoder.Transformer`, in place) on ``cfg.steps x cfg.batch`` worked
    solutions of generated word problems; returns the log ``{"step": [...], "loss": [...], "seconds": float}``."""
    from tqdm.auto import tqdm

    from ..model.optimizer import MixedPrecisionAdamW
    from ..tasks.prompts import encode_prompts
    from .reasoner import sft_batch, sft_step
    cfg = cfg or WarmStartConfig()
    if tokenizer.eos_token_id is None:
        raise BadInput("the tokenizer has no end-of-sequence token: the warm start must teach the model to stop")
    problems = generate_word_problems(WordTaskConfig(max_steps=cfg.max_problem_steps), cfg.steps * cfg.batch,
                                      seed=cfg.seed)
    prompts = encode_prompts(problems, tokenizer)
    responses = [tokenizer(p.meta["solution"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
                 for p in problems]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    opt = MixedPrecisionAdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)    # float32 masters of a bf16 model
    model.train()
    log, t0 = {"step": [], "loss": []}, time.perf_counter()
    for step in tqdm(range(cfg.steps), desc="warm start", disable=not progress):
        part = slice(step * cfg.batch, (step + 1) * cfg.batch)
        x, y = (t.to(device) for t in sft_batch(list(zip(prompts[part], responses[part])), pad))
        loss = sft_step(model, opt, x, y)
        log["step"].append(step)
        log["loss"].append(loss.item())
        _check_finite(model, log, cfg)
    model.eval()
    log["seconds"] = time.perf_counter() - t0
    return log


def _check_finite(model, log: dict, cfg: WarmStartConfig) -> None:
    """Stop at the first step whose loss or weights are NaN or infinite (a learning rate too high): such a model
    would be written and load as garbage."""
    import torch
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad or not math.isfinite(log["loss"][-1]):
        what = f"{len(bad)} weight tensor(s) ({bad[0]}, ...)" if bad else f"the loss ({log['loss'][-1]})"
        raise NotFinite(f"the warm start made {what} NaN or infinite at step {len(log['loss'])} of {cfg.steps} "
                        f"(lr {cfg.lr}); nothing was written: lower the learning rate (--lr; the default is 3e-05)")


WEIGHT_FILES = ("config.json", "model.safetensors", "tltlib-import.json", "tltlib-warm-start.json")
"""Files of a model folder the warm start does not carry over (it writes new weights and its own card)."""


def check_warm_start_out(out: str | Path, overwrite: bool) -> Path:
    """Before loading anything: ``out`` can be written, and ``overwrite`` replaces only a folder this command wrote
    (its card ``tltlib-warm-start.json``), never, say, the source model or another folder given by mistake."""
    return check_output_folder(out, overwrite, lambda p: (p / "tltlib-warm-start.json").is_file(),
                               "warm-started model")


def write_warm_start(model, source: str | Path, out: str | Path, cfg: WarmStartConfig, log: dict) -> Path:
    """Save the warm-started ``model`` to ``out`` with the tokenizer files of ``source`` (the folder it was loaded
    from) and a card ``tltlib-warm-start.json`` (the settings, the loss curve, the source), in one atomic write."""
    source = Path(source)
    carried = {f.name: f.read_text() for f in sorted(source.iterdir())
               if f.is_file() and f.name not in WEIGHT_FILES and not f.name.startswith("model")
               and f.suffix in (".json", ".jinja", ".txt", ".model", ".py")}
    card = {"format": "tltlib-warm-start", "source": str(source.resolve()), "config": asdict(cfg),
            "loss_first": log["loss"][0], "loss_last": log["loss"][-1], "seconds": log["seconds"],
            "loss": log["loss"]}
    from ..model.weights import save_model
    return save_model(model, out, extra_files={**carried, "tltlib-warm-start.json": json.dumps(card, indent=1)})
