"""What a GRPO run will hold in memory, estimated before it starts, and the check that refuses one that cannot fit.

The parts (bytes, on one worker; ``b`` the parameters' element size, P parameters, L layers, h hidden, i the MLP's
width, kv = KV heads x head dim, V vocabulary):

* **gradients** P b and **AdamW's two moments** 2 P b (allocated at the first update; the weights are loaded
  already and not counted); the **reference policy** P b when ``beta > 0``; the drafter's weights' gradients and
  moments likewise (its weights are loaded).
* **rollout KV cache** 2 L kv b per token slot (the drafter's layer too when it drafts), counted as the slots the
  paged cache is expected to hold at its peak (:func:`kv_estimate`): from response lengths measured before
  (:class:`MeasuredLengths`, e.g. notebook 01's), every row at ``max_completion_length`` only when none were measured,
  the estimate saying which. The page pool is given what the other parts leave (:func:`kv_pool_bytes`, at most the
  dense cache's bytes, at least one longest row); a pool smaller than the estimate is not refused: rows wait for
  pages (admission by memory), and a warning says so. The engine keeps the pool between rollouts on a GPU with CUDA
  graphs, so it is counted beside the update's parts.
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

import json
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .fileio import atomic_write_text, read_json
from .machine import available_bytes
from .pages import kv_bytes_per_token, pages_for

HEADROOM = 0.9
"""The share of the available memory an estimate may use."""

KV_PART = "rollout KV cache"
"""The name of the KV cache's part in :func:`grpo_memory`."""


ACTIVATION_SLACK = 1.25
"""What the process holds beyond the activations counted (autograd's temporaries, the allocator's free blocks),
as a factor: SmolLM2's update peaked at 1.20-1.25x the count at 4,096-8,192 tokens (``bench update_memory``)."""


def activation_bytes_per_token(config, elem_bytes: int) -> int:
    """Bytes autograd keeps per padded token of a micro-batch, all layers, with :data:`ACTIVATION_SLACK` (see the
    module docstring)."""
    kv = config.num_kv_heads * (config.head_dim or config.hidden_size // config.num_heads)
    per_layer = 8 * config.hidden_size + 3 * kv + 4 * config.intermediate_size
    return int(ACTIVATION_SLACK * (config.num_layers * per_layer + 4 * config.hidden_size) * elem_bytes)


@dataclass(frozen=True)
class MeasuredLengths:
    """Response lengths measured by an earlier rollout of the same model and sampling settings (notebook 01 writes
    them, :meth:`save`), from which :func:`kv_estimate` predicts the KV a rollout will hold."""

    lengths: tuple[int, ...]
    """One entry per response (tokens, EOS included)."""
    max_new_tokens: int
    """The rollout's cap: a response of this length was cut there and might have run longer."""
    source: str = ""
    """Where they were measured (a file, a run), named in the estimate's assumption."""

    def __post_init__(self):
        if not self.lengths:
            raise ValueError("MeasuredLengths needs at least one length")
        if self.max_new_tokens < 1 or min(self.lengths) < 0 or max(self.lengths) > self.max_new_tokens:
            raise ValueError(f"MeasuredLengths: lengths must lie in [0, max_new_tokens={self.max_new_tokens}], got "
                             f"{min(self.lengths)}..{max(self.lengths)}")

    def save(self, path) -> None:
        """Write ``{"lengths": [...], "max_new_tokens": N}`` to ``path`` (JSON, through a temporary file)."""
        data = {"lengths": list(self.lengths), "max_new_tokens": self.max_new_tokens}
        atomic_write_text(path, json.dumps(data) + "\n")

    @classmethod
    def load(cls, path) -> "MeasuredLengths":
        """Read a file written by :meth:`save`; a file without both keys is refused, naming what writes one."""
        data = read_json(path, "write it with tltlib.memory.MeasuredLengths.save (notebook 01 does)")
        if not isinstance(data, dict) or not isinstance(data.get("lengths"), list) or \
                not isinstance(data.get("max_new_tokens"), int):
            raise ValueError(f"{path}: a measured-lengths file holds {{'lengths': [ints], 'max_new_tokens': int}} "
                             "(tltlib.memory.MeasuredLengths.save writes one; notebook 01 does)")
        return cls(tuple(int(x) for x in data["lengths"]), data["max_new_tokens"], str(path))


@dataclass(frozen=True)
class KVEstimate:
    """The token slots a paged rollout is expected to hold at its peak, their bytes, and what was assumed."""

    tokens: int
    bytes: int
    assumed: str


def survival(lengths) -> tuple[np.ndarray, np.ndarray]:
    """The distinct lengths ``t`` [k] (ascending) and the share of the responses at least that long [k].

    Args: lengths: [n] response lengths (non-negative)."""
    x = np.sort(np.asarray(lengths, dtype=np.int64))
    t = np.unique(x)
    return t, 1.0 - np.searchsorted(x, t, side="left") / len(x)


def peak_held_tokens(lengths, max_new: int, rows: int, group: int, prompt_tokens: int, page_size: int) -> int:
    """Token slots (whole pages) a paged rollout of ``rows`` rows in groups of ``group`` holds at its peak when its
    response lengths follow ``lengths``, rows starting together and giving their pages back when they finish.

    At decode step t the rows still running, ``rows * P(length >= t)`` of them, hold ``ceil((p mod s + t) / s)``
    pages of their own (the prompt's last partial page copied, the tokens they wrote); the ``group`` samples of a
    prompt share its ``floor(p / s)`` whole pages (p the prompt's tokens, s the page size). The peak is the largest
    of these over the measured lengths. ``lengths`` None: every row runs to ``max_new`` (the maximum)."""
    t, alive = (np.array([max_new]), np.array([1.0])) if lengths is None else survival(lengths)
    s, tail = page_size, prompt_tokens % page_size
    own = np.ceil(rows * alive) * (-(-(tail + t) // s)) * s
    shared = -(-rows // group) * (prompt_tokens // s) * s
    return int(own.max()) + shared


def kv_estimate(per_token: int, rows: int, group: int, prompt_tokens: int, max_new: int,
                measured: MeasuredLengths | None = None, page_size: int = 16) -> KVEstimate:
    """:func:`peak_held_tokens` in bytes (``per_token``: every cache's bytes per token slot), from ``measured``
    lengths when given, else every row at ``max_new``; the assumption is spelled out in :attr:`KVEstimate.assumed`.

    Measured responses cut at their rollout's cap (``measured.max_new_tokens``) are assumed to run on to this
    rollout's ``max_new`` when it allows more; longer measured responses are cut at ``max_new``."""
    if measured is None:
        tokens = peak_held_tokens(None, max_new, rows, group, prompt_tokens, page_size)
        return KVEstimate(tokens, tokens * per_token, f"every row runs to max_completion_length ({max_new} tokens): "
                                                      "no measured response lengths were given")
    x = np.asarray(measured.lengths, dtype=np.int64)
    cut = int((x >= measured.max_new_tokens).sum()) if measured.max_new_tokens < max_new else 0
    x = np.where(x >= measured.max_new_tokens, max_new, np.minimum(x, max_new)) if cut else np.minimum(x, max_new)
    tokens = peak_held_tokens(x, max_new, rows, group, prompt_tokens, page_size)
    p50, p99 = np.percentile(x, [50, 99])
    where = f" in {measured.source}" if measured.source else ""
    note = f"; {cut} cut at {measured.max_new_tokens} assumed to run to {max_new}" if cut else ""
    return KVEstimate(tokens, tokens * per_token,
                      f"response lengths as the {len(x)} measured{where} (median {p50:.0f}, p99 {p99:.0f}, max "
                      f"{x.max()} tokens{note})")


def rollout_kv(config, args, prompt_tokens: int, rows: int, elem_bytes: int, drafter_layers: int = 0,
               measured: MeasuredLengths | None = None, page_size: int = 16) -> KVEstimate:
    """:func:`kv_estimate` of a GRPO rollout: ``rows`` completions in groups of ``args.num_generations`` of up to
    ``args.max_completion_length`` tokens after a prompt of ``prompt_tokens``, in the target's cache and, with
    ``drafter_layers`` (1 for an EAGLE drafter that drafts), the drafter's."""
    head = config.head_dim or config.hidden_size // config.num_heads
    per_token = kv_bytes_per_token(config.num_layers + drafter_layers, config.num_kv_heads, head, elem_bytes)
    return kv_estimate(per_token, rows, args.num_generations, prompt_tokens, args.max_completion_length, measured,
                       page_size)


def grpo_memory(config, args, prompt_tokens: int, rows: int, elem_bytes: int, params: int,
                drafter_params: int = 0, buffer_tokens: int = 0, kv: KVEstimate | None = None) -> dict[str, int]:
    """The estimated bytes of each part (module docstring) of a GRPO run on one worker.

    Args:
        config: the policy's :class:`tltlib.model.ModelConfig`; args: :class:`tltlib.grpo.GRPOConfig`.
        prompt_tokens: the longest prompt (tokens); rows: this worker's completions per step.
        elem_bytes: bytes per parameter (4 for float32, 2 for bfloat16); params: the policy's parameters.
        drafter_params: the drafter's trainable parameters (0 without online drafter training).
        buffer_tokens: the drafter pair buffer's cap (0 without one).
        kv: the rollout's KV estimate (default: :func:`rollout_kv` with every row at the maximum length).
    """
    kv = kv or rollout_kv(config, args, prompt_tokens, rows, elem_bytes)
    seq = prompt_tokens + args.max_completion_length
    produced = rows * args.max_completion_length * args.max_steps
    tokens = max(min(args.micro_batch_tokens, rows * seq), seq)      # a micro-batch: at most the batch, >= 1 row
    return {
        "gradients": params * elem_bytes,
        "optimizer": 2 * params * elem_bytes,
        "reference": params * elem_bytes if args.beta > 0 else 0,
        "drafter training": 3 * drafter_params * elem_bytes,
        KV_PART: kv.bytes,
        "update activations": activation_bytes_per_token(config, elem_bytes) * tokens,
        "LM-head chunk": 2 * min(args.logprob_chunk, tokens) * config.vocab_size * 4,
        "pair buffer": min(buffer_tokens, produced) * (config.hidden_size * elem_bytes + 24),
    }


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


POOL_SLACK = 1.25
"""On a CPU the page pool gets this much more than the estimated peak (when the run leaves it): the estimate is an
expectation, and a pool is touched when it is made (on a GPU the pool takes all the run leaves, which would lie
idle otherwise)."""


def kv_pool_bytes(parts: dict[str, int], kv: KVEstimate, minimum: int, available: int, device,
                  where: str = "this GRPO run") -> int:
    """The page pool's budget (bytes) for a run whose other parts are ``parts`` (:data:`KV_PART` is ignored).

    The pool gets what :data:`HEADROOM` of ``available`` leaves after the other parts: all of it on a GPU, at most
    :data:`POOL_SLACK` x the estimate on a CPU. Refused (:func:`check_fits`, the KV cache counted at ``minimum``,
    the pages of the longest row) when that leaves less than ``minimum``; a pool smaller than the estimate is warned
    of, not refused: rows then wait for pages (admission by memory), slower but never out of memory."""
    others = sum(v for k, v in parts.items() if k != KV_PART)
    left = int(HEADROOM * available) - others
    if left < minimum:
        check_fits({**parts, KV_PART: minimum}, available, where)
        left = minimum                           # check_fits rounds differently: never below the minimum
    if left < kv.bytes:
        warnings.warn(f"tltlib: {where}: the KV page pool gets {left / 2 ** 30:.2f} GiB (what the other parts leave "
                      f"of {HEADROOM:.0%} of {available / 2 ** 30:.1f} GiB) but the rollout is expected to hold "
                      f"{kv.bytes / 2 ** 30:.2f} GiB at its peak, assuming {kv.assumed}: rows will wait for pages "
                      "(slower, never out of memory); to avoid it lower grpo.micro_batch_tokens, "
                      "generation_batch_size or max_completion_length", stacklevel=3)
        return left
    return left if torch.device(device).type == "cuda" else max(minimum, min(left, math.ceil(POOL_SLACK * kv.bytes)))


def trainer_shape(trainer, sample: int = 256) -> tuple[int, int, int]:
    """(the longest prompt among the first ``sample`` problems, this worker's rows per step, bytes per parameter) of
    a :class:`tltlib.trainer.GRPOTrainer`."""
    from .tasks import encode_prompts
    args = trainer.args
    prompt = max(len(p) for p in encode_prompts(trainer.problems[:sample], trainer.tokenizer))
    rows = len(range(args.prompts_per_step)[trainer.slice]) * args.num_generations
    return prompt, rows, next(trainer.model.parameters()).element_size()


def trainer_kv(trainer, measured: MeasuredLengths | None = None) -> tuple[KVEstimate, int]:
    """(:func:`rollout_kv` of a :class:`tltlib.trainer.GRPOTrainer`'s rollout, the bytes of its longest row: the
    longest prompt + ``max_completion_length`` + the engine's draft margin, in whole pages)."""
    from .paged_cache import KVConfig
    from .rollout_config import RolloutConfig
    prompt, rows, elem = trainer_shape(trainer)
    args, page = trainer.args, KVConfig.page_size
    drafts = trainer.drafter is not None and trainer.tlt.speculative != "off"     # the drafter's cache: one layer
    kv = rollout_kv(trainer.model.config, args, prompt, rows, elem, int(drafts), measured, page)
    per_token = kv.bytes // kv.tokens
    return kv, pages_for(prompt + args.max_completion_length + RolloutConfig.draft_margin, page) * page * per_token


def trainer_memory(trainer, measured: MeasuredLengths | None = None, kv: KVEstimate | None = None) -> dict[str, int]:
    """:func:`grpo_memory` of a :class:`tltlib.trainer.GRPOTrainer` as built (this worker's share of the batch; the
    KV estimate of :func:`trainer_kv` unless ``kv`` is given)."""
    model, tlt = trainer.model, trainer.tlt
    prompt, rows, elem = trainer_shape(trainer)
    kv = kv or trainer_kv(trainer, measured)[0]
    params = sum(p.numel() for p in model.parameters())
    drafter = sum(p.numel() for p in trainer.drafter.parameters() if p.requires_grad) \
        if trainer.drafter_trainer is not None else 0
    return grpo_memory(model.config, trainer.args, prompt, rows, elem, params, drafter,
                       tlt.buffer_tokens if trainer.buffer is not None else 0, kv)


def check_trainer(trainer, measured: MeasuredLengths | None = None) -> int:
    """The KV page pool's budget in bytes (:func:`kv_pool_bytes`) for a :class:`tltlib.trainer.GRPOTrainer` as
    built, refusing a run that cannot fit (called before its engine is made); on a CPU the workers torchrun started
    on this machine (``LOCAL_WORLD_SIZE``) share its memory equally."""
    share = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torch.device(trainer.device).type == "cpu" else 1
    kv, minimum = trainer_kv(trainer, measured)
    return kv_pool_bytes(trainer_memory(trainer, kv=kv), kv, minimum,
                         available_bytes(trainer.device) // max(share, 1), trainer.device,
                         f"GRPO with {trainer.args.generation_batch_size} completions of up to "
                         f"{trainer.args.max_completion_length} tokens on {trainer.device}")


def grpo_plan(config, args, prompt_tokens: int, rows: int, elem_bytes: int, device_bytes: int, name: str,
              measured: MeasuredLengths | None = None, drafter_layers: int = 0, page_size: int = 16) -> list[str]:
    """The memory plan of a GRPO worker on a device of ``device_bytes`` (the weights, :func:`grpo_memory`'s parts,
    the page pool :func:`kv_pool_bytes` would give), as the comment lines of a parameter file (``name``: the model).
    Refused like the run itself (:func:`check_fits`) when it cannot fit."""
    gib = 2 ** 30
    params = config.num_parameters
    weights = params * elem_bytes
    kv = rollout_kv(config, args, prompt_tokens, rows, elem_bytes, drafter_layers, measured, page_size)
    parts = grpo_memory(config, args, prompt_tokens, rows, elem_bytes, params, kv=kv)
    from .rollout_config import RolloutConfig
    longest = prompt_tokens + args.max_completion_length + RolloutConfig.draft_margin
    minimum = pages_for(longest, page_size) * page_size * (kv.bytes // kv.tokens)
    available = device_bytes - weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pool = kv_pool_bytes(parts, kv, minimum, available, "cuda", f"GRPO of {name}")
    shown = [f"{k} {v / gib:.1f}" for k, v in parts.items() if v and k != KV_PART]
    rows_at_max = pool // (kv.bytes // max(rows, 1))
    return ["Memory of one GRPO worker (tltlib.memory.grpo_plan; tests/test_memory.py renders and checks it):",
            f"{name}, {params / 1e9:.2f} B parameters of {elem_bytes} bytes: weights {weights / gib:.1f} GiB of "
            f"{device_bytes / gib:.0f} GiB;",
            f"of the {available / gib:.1f} GiB left the run may use {HEADROOM:.0%}:",
            ", ".join(shown) + f" GiB (micro_batch_tokens {args.micro_batch_tokens:,});",
            f"the KV page pool gets the other {pool / gib:.1f} GiB. {rows} rows x {prompt_tokens} + "
            f"{args.max_completion_length:,} tokens would hold {kv.bytes / gib:.1f} GiB at their peak, assuming",
            f"{kv.assumed};",
            f"the pool holds {min(rows_at_max, rows)} of the {rows} rows at that length: the others wait for pages "
            "(admission by memory)." if rows_at_max < rows else
            "the pool holds every row at that length."]
