"""What a GRPO run will hold in memory, estimated before it starts, and the check that refuses one that cannot fit.

The parts (bytes, on one worker; ``b`` the parameters' element size, P parameters, L layers, h hidden, i the MLP's
width, kv = KV heads x head dim, V vocabulary):

* **gradients** P b and **AdamW's two moments** 2 P b (allocated at the first update; the weights are loaded
  already and not counted); the **reference policy** P b when ``beta > 0``; the drafter's weights' gradients and
  moments likewise (its weights are loaded).
* **rollout KV cache** 2 L kv b per slot, for every row of the worker's share of the batch and every slot up to the
  longest prompt + ``max_completion_length`` + the engine's draft margin; the engine keeps it between rollouts, so it
  is alive during the update too.
* **update activations**: what autograd keeps for the backward of one micro-batch, per padded token and layer
  ``(8 h + 3 kv + 4 i) b`` (the norms' inputs and outputs, q, k, v and the attention output, the MLP's gate, up,
  activation and product; attention itself is flash-style on both devices, linear in the tokens), over
  ``micro_batch_tokens`` tokens, at most the whole batch's and at least one sequence's.
* **LM-head chunk**: 2 x ``logprob_chunk`` (at most the micro-batch's tokens) x V x 4 bytes (the chunk's float32
  logits and their log-softmax, the gradient reusing the logits' block; the chunking keeps only one chunk alive).
* **drafter pair buffer**: up to ``buffer_tokens`` hidden states (h b + 24 bytes each), or what the run can produce.

``bench/update_memory.py`` measures the peak against this estimate by micro-batch budget and chunk: on SmolLM2
(float32, CPU) the estimate was within -4% to +1% of the measured peak from 512 to 8,192 tokens per micro-batch. The check leaves 10% of what is available for the allocator
and the rest of the process.

Departures: none (tooling; TRL and verl leave an out-of-memory to the allocator, mid-run).
"""
from __future__ import annotations

import os

import torch

from .pages import kv_bytes_per_token

HEADROOM = 0.9
"""The share of the available memory an estimate may use."""


ACTIVATION_SLACK = 1.25
"""What the process holds beyond the activations counted (autograd's temporaries, the allocator's free blocks),
as a factor: SmolLM2's update peaked at 1.20-1.25x the count at 4,096-8,192 tokens (``bench update_memory``)."""


def activation_bytes_per_token(config, elem_bytes: int) -> int:
    """Bytes autograd keeps per padded token of a micro-batch, all layers, with :data:`ACTIVATION_SLACK` (see the
    module docstring)."""
    kv = config.num_kv_heads * (config.head_dim or config.hidden_size // config.num_heads)
    per_layer = 8 * config.hidden_size + 3 * kv + 4 * config.intermediate_size
    return int(ACTIVATION_SLACK * (config.num_layers * per_layer + 4 * config.hidden_size) * elem_bytes)


def grpo_memory(config, args, prompt_tokens: int, rows: int, elem_bytes: int, params: int,
                drafter_params: int = 0, buffer_tokens: int = 0, draft_margin: int = 72) -> dict[str, int]:
    """The estimated bytes of each part (module docstring) of a GRPO run on one worker.

    Args:
        config: the policy's :class:`tltlib.model.ModelConfig`; args: :class:`tltlib.grpo.GRPOConfig`.
        prompt_tokens: the longest prompt (tokens); rows: this worker's completions per step.
        elem_bytes: bytes per parameter (4 for float32, 2 for bfloat16); params: the policy's parameters.
        drafter_params: the drafter's trainable parameters (0 without online drafter training).
        buffer_tokens: the drafter pair buffer's cap (0 without one).
    """
    kv_per_token = kv_bytes_per_token(config.num_layers, config.num_kv_heads,
                                      config.head_dim or config.hidden_size // config.num_heads, elem_bytes)
    seq = prompt_tokens + args.max_completion_length
    produced = rows * args.max_completion_length * args.max_steps
    tokens = max(min(args.micro_batch_tokens, rows * seq), seq)      # a micro-batch: at most the batch, >= 1 row
    return {
        "gradients": params * elem_bytes,
        "optimizer": 2 * params * elem_bytes,
        "reference": params * elem_bytes if args.beta > 0 else 0,
        "drafter training": 3 * drafter_params * elem_bytes,
        "rollout KV cache": kv_per_token * rows * (seq + draft_margin),
        "update activations": activation_bytes_per_token(config, elem_bytes) * tokens,
        "LM-head chunk": 2 * min(args.logprob_chunk, tokens) * config.vocab_size * 4,
        "pair buffer": min(buffer_tokens, produced) * (config.hidden_size * elem_bytes + 24),
    }


def available_bytes(device) -> int:
    """Memory free for this process on ``device``: the GPU's free memory, or the machine's MemAvailable (Linux),
    else the physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(parts: dict[str, int], available: int, where: str = "this GRPO run") -> None:
    """Refuse, naming the largest parts and what shrinks each, when ``sum(parts)`` exceeds :data:`HEADROOM` of
    ``available`` bytes."""
    need = sum(parts.values())
    if need <= HEADROOM * available:
        return
    gib = 1 << 30
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    fixes = {"update activations": "lower grpo.micro_batch_tokens", "rollout KV cache": "lower grpo."
             "generation_batch_size or max_completion_length (or add workers)", "LM-head chunk": "lower "
             "grpo.logprob_chunk", "optimizer": "a smaller model", "gradients": "a smaller model",
             "pair buffer": "lower tlt.buffer_tokens", "reference": "beta 0 (no reference policy)",
             "drafter training": "tlt.online_drafter false"}
    raise MemoryError(f"{where} needs about {need / gib:.1f} GiB beyond the loaded weights but {available / gib:.1f} "
                      f"GiB are available (it may use {HEADROOM:.0%}): "
                      + "; ".join(f"{k} {v / gib:.1f} GiB ({fixes.get(k, '')})" for k, v in top)
                      + ". Change the configuration before the rollout starts")


def trainer_memory(trainer, sample: int = 256) -> dict[str, int]:
    """:func:`grpo_memory` of a :class:`tltlib.trainer.GRPOTrainer` as built (the longest prompt among the first
    ``sample`` problems; this worker's share of the batch)."""
    from .tasks import encode_prompts
    model, args, tlt = trainer.model, trainer.args, trainer.tlt
    prompt = max(len(p) for p in encode_prompts(trainer.problems[:sample], trainer.tokenizer))
    rows = len(range(args.prompts_per_step)[trainer.slice]) * args.num_generations
    elem = next(model.parameters()).element_size()
    params = sum(p.numel() for p in model.parameters())
    drafter = sum(p.numel() for p in trainer.drafter.parameters() if p.requires_grad) \
        if trainer.drafter_trainer is not None else 0
    return grpo_memory(model.config, args, prompt, rows, elem, params, drafter,
                       tlt.buffer_tokens if trainer.buffer is not None else 0,
                       trainer.engine.config.draft_margin)


def check_trainer(trainer) -> None:
    """:func:`check_fits` of :func:`trainer_memory` on the trainer's device (called when the trainer is built); on a
    CPU the workers torchrun started on this machine (``LOCAL_WORLD_SIZE``) share its memory equally."""
    share = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torch.device(trainer.device).type == "cpu" else 1
    check_fits(trainer_memory(trainer), available_bytes(trainer.device) // max(share, 1),
               f"GRPO with {trainer.args.generation_batch_size} completions of up to "
               f"{trainer.args.max_completion_length} tokens on {trainer.device}")
