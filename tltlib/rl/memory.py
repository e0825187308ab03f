"""What a GRPO run will hold in memory, estimated before it starts, and the check that refuses one that cannot fit.

The parts (bytes, on one worker; ``b`` the parameters' element size, P parameters, L layers, h hidden, i the MLP's
width, kv = KV heads x head dim, V vocabulary):

* **gradients** P b and **AdamW's two moments** 2 P 4 (float32; allocated at the first update; the weights are
  loaded already and not counted); with a bf16/fp16 policy also its **float32 master weights** P 4 and their float32
  gradients P 4 (:class:`tltlib.model.optimizer.MixedPrecisionAdamW`); the **reference policy** P b when
  ``beta > 0``; the drafter's training state likewise (its weights are loaded).
* **rollout KV cache** 2 L kv b per token slot (the drafter's layer too when there is one), counted as the slots
  the paged cache is expected to hold at its peak (:func:`kv_estimate`): from response lengths measured before
  (:class:`MeasuredLengths`, e.g. notebook 01's), every row at ``max_completion_length`` only when none were measured,
  the estimate saying which. The page pool gets 1.25x the estimate, or what the other parts leave when that is less
  (:func:`kv_pool_bytes`; at least the longest row, at most a dense cache's bytes); a pool smaller than the
  estimate is not refused: rows wait for pages (admission by memory), and a warning says so. The engine keeps the
  pool between rollouts on a GPU with CUDA graphs, so it is counted beside the update's parts.
* **update activations**: what autograd keeps for the backward of one micro-batch, per padded token and layer
  ``(8 h + 3 kv + 4 i) b`` (the norms' inputs and outputs, q, k, v and the attention output, the MLP's gate, up,
  activation and product; attention itself is flash-style on both devices, linear in the tokens), over
  ``micro_batch_tokens`` tokens, at most the whole batch's and at least one sequence's.
* **LM-head chunk**: 2 x ``logprob_chunk`` (at most the micro-batch's tokens) x V x 4 bytes (the chunk's float32
  logits and their log-softmax, the gradient reusing the logits' block; the chunking keeps only one chunk alive).
* **drafter pair buffer**: up to ``buffer_tokens`` hidden states (h b + 24 bytes each), or what the run can produce.

``bench/update_memory.py`` measures the peak against this estimate by micro-batch budget and chunk: on SmolLM2
(float32, CPU) the estimate was within -4% to +1% of the measured peak from 512 to 8,192 tokens per micro-batch. The
check leaves 10% of what is available for the allocator and the rest of the process.

Departures: none (tooling; TRL and verl leave an out-of-memory to the allocator, mid-run).
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..errors import BadInput, NoRoom
from ..fileio import atomic_write_text, read_json
from ..kv.pages import kv_bytes_per_token, pages_for
from ..machine import available_bytes

HEADROOM = 0.9
"""The share of the available memory an estimate may use."""

KV_PART = "rollout KV cache"
"""The name of the KV cache's part in :func:`grpo_memory`."""
LONGEST_ROW = "rollout KV cache (the longest row)"
""":func:`check_fits`'s name for the pool's minimum: one row of the longest prompt and max_completion_length."""


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
        where = f"{self.source}: " if self.source else "MeasuredLengths: "
        fix = "; measure them again (notebook 01 writes them)" if self.source else ""
        if not self.lengths:
            raise BadInput(f"{where}needs at least one length{fix}")
        if self.max_new_tokens < 1 or min(self.lengths) < 1 or max(self.lengths) > self.max_new_tokens:
            raise BadInput(f"{where}lengths must lie in [1, max_new_tokens={self.max_new_tokens}] (every response "
                           f"holds at least its EOS token; max_new_tokens >= 1), got "
                           f"{min(self.lengths)}..{max(self.lengths)}{fix}")

    def save(self, path) -> None:
        """Write ``{"lengths": [...], "max_new_tokens": N}`` to ``path`` (JSON, through a temporary file)."""
        data = {"lengths": list(self.lengths), "max_new_tokens": self.max_new_tokens}
        atomic_write_text(path, json.dumps(data) + "\n")

    @classmethod
    def load(cls, path) -> "MeasuredLengths":
        """Read a file written by :meth:`save`; a file without both keys is refused, naming what writes one."""
        data = read_json(path, "write it with tltlib.rl.memory.MeasuredLengths.save (notebook 01 does)")
        if not isinstance(data, dict) or not isinstance(data.get("lengths"), list) or \
                not isinstance(data.get("max_new_tokens"), int) or \
                not all(isinstance(x, int) and not isinstance(x, bool) for x in data["lengths"]):
            raise BadInput(f"{path}: a measured-lengths file holds {{'lengths': [ints], 'max_new_tokens': int}} "
                           "(tltlib.rl.memory.MeasuredLengths.save writes one; notebook 01 does)")
        return cls(tuple(data["lengths"]), data["max_new_tokens"], str(path))


@dataclass(frozen=True)
class KVEstimate:
    """The token slots a paged rollout is expected to hold at its peak, their bytes, and what was assumed."""

    tokens: int
    bytes: int
    assumed: str


@dataclass(frozen=True)
class KVPlan:
    """What the memory check gave a trainer's KV page pool, and why (:func:`check_trainer`)."""

    pool_bytes: int
    estimate: KVEstimate

    def describe(self) -> str:
        """One line: the pool, the estimated peak, and what the estimate assumed."""
        return (f"KV page pool {self.pool_bytes / 2 ** 30:.2f} GiB for an estimated peak of "
                f"{self.estimate.bytes / 2 ** 30:.2f} GiB, assuming {self.estimate.assumed}")


def survival(lengths) -> tuple[np.ndarray, np.ndarray]:
    """The distinct lengths ``t`` [k] (ascending) and how many of the ``n`` responses are at least that long [k]
    (integers: a share would round 10 x 3/10 up to 4 rows).

    Args: lengths: [n] response lengths (non-negative)."""
    x = np.sort(np.asarray(lengths, dtype=np.int64))
    t = np.unique(x)
    return t, len(x) - np.searchsorted(x, t, side="left")


def peak_held_tokens(lengths, max_new: int, rows: int, num_generations: int, prompt_tokens: int, page_size: int) -> int:
    """Token slots (whole pages) a paged rollout of ``rows`` rows in groups of ``num_generations`` holds at its peak
    when its response lengths follow ``lengths``, rows starting together and giving their pages back when they finish.

    At decode step t the rows still running, ``rows * P(length >= t)`` of them, hold ``ceil((p mod s + t) / s)``
    pages of their own (the prompt's last partial page copied, the tokens they wrote); the ``num_generations`` samples
    of a prompt share its ``floor(p / s)`` whole pages (p the prompt's tokens, s the page size). The peak is the largest
    of these over the measured lengths. ``lengths`` None: every row runs to ``max_new`` (the maximum)."""
    t, alive = (np.array([max_new]), np.array([1])) if lengths is None else survival(lengths)
    n = 1 if lengths is None else len(lengths)
    s, tail = page_size, prompt_tokens % page_size
    own = -(-rows * alive // n) * (-(-(tail + t) // s)) * s          # ceil(rows x alive / n) rows, exactly
    shared = -(-rows // num_generations) * (prompt_tokens // s) * s
    return int(own.max()) + shared


def kv_estimate(per_token: int, rows: int, num_generations: int, prompt_tokens: int, max_new: int,
                measured: MeasuredLengths | None = None, page_size: int = 16) -> KVEstimate:
    """:func:`peak_held_tokens` in bytes (``per_token``: every cache's bytes per token slot), from ``measured``
    lengths when given, else every row at ``max_new``; the assumption is spelled out in :attr:`KVEstimate.assumed`.

    Measured responses cut at their rollout's cap (``measured.max_new_tokens``) are assumed to run on to this
    rollout's ``max_new`` when it allows more; longer measured responses are cut at ``max_new``."""
    if measured is None:
        tokens = peak_held_tokens(None, max_new, rows, num_generations, prompt_tokens, page_size)
        return KVEstimate(tokens, tokens * per_token, f"every row runs to max_completion_length ({max_new} tokens): "
                                                      "no measured response lengths were given")
    x, cap = np.asarray(measured.lengths, dtype=np.int64), measured.max_new_tokens
    cut = int((x >= cap).sum()) if cap < max_new else 0
    x = np.where(x >= cap, max_new, x) if cut else np.minimum(x, max_new)
    tokens = peak_held_tokens(x, max_new, rows, num_generations, prompt_tokens, page_size)
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


def adamw_bytes(params: int, elem_bytes: int) -> dict[str, int]:
    """AdamW's training state of ``params`` parameters of ``elem_bytes`` bytes each: their gradients, the two float32
    moments, and for bf16/fp16 parameters their float32 master weights with float32 gradients
    (:class:`tltlib.model.optimizer.MixedPrecisionAdamW`)."""
    master = 4 if elem_bytes < 4 else 0
    return {"gradients": params * (elem_bytes + master), "master weights": params * master, "optimizer": 8 * params}


def grpo_memory(config, args, prompt_tokens: int, rows: int, elem_bytes: int, params: int,
                drafter_params: int = 0, buffer_tokens: int = 0, kv: KVEstimate | None = None) -> dict[str, int]:
    """The estimated bytes of each part (module docstring) of a GRPO run on one worker.

    Args:
        config: the policy's :class:`tltlib.model.decoder.ModelConfig`; args: :class:`tltlib.rl.grpo.GRPOConfig`.
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
        **adamw_bytes(params, elem_bytes),
        "reference": params * elem_bytes if args.beta > 0 else 0,
        "drafter training": sum(adamw_bytes(drafter_params, elem_bytes).values()),
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
             "master weights": "a smaller model (float32 copies of a bf16/fp16 policy's weights)",
             "pair buffer": "lower tlt.buffer_tokens", "reference": "beta 0 (no reference policy)",
             LONGEST_ROW: "lower max_completion_length or the prompts' length",
             "drafter training": "tlt.online_drafter false"}
    raise NoRoom(f"{where} needs about {need / gib:.1f} GiB beyond the loaded weights but {available / gib:.1f} "
                 f"GiB are available (it may use {HEADROOM:.0%}): "
                 + "; ".join(f"{k} {v / gib:.1f} GiB ({fixes.get(k, '')})" for k, v in top)
                 + ". Change the configuration before the rollout starts")


POOL_SLACK = 1.25
"""The page pool gets this much more than the estimated peak, when the run leaves it: the estimate is an
expectation (and responses grow as RL trains). Not all the memory the run leaves: a pool is made whole when the
rollout starts (touched on a CPU), and other trainers or engines of the same process (notebook 05's baseline and
TLT runs) need theirs."""



def kv_pool_bytes(parts: dict[str, int], kv: KVEstimate, minimum: int, available: int,
                  where: str = "this GRPO run") -> int:
    """The page pool's budget (bytes) for a run whose other parts are ``parts`` (:data:`KV_PART` is ignored).

    The pool gets :data:`POOL_SLACK` x the estimate, or what :data:`HEADROOM` of ``available`` leaves after the
    other parts when that is less. Refused (:func:`check_fits`, the KV cache counted at ``minimum``, the pages of
    the longest row) when that leaves less than ``minimum``; a pool smaller than the estimate is warned of, not
    refused: rows then wait for pages (admission by memory), slower but never out of memory."""
    others = {k: v for k, v in parts.items() if k != KV_PART}
    left = int(HEADROOM * available) - sum(others.values())
    if left < minimum:
        check_fits({**others, LONGEST_ROW: minimum}, available, where)
        left = minimum                           # check_fits rounds differently: never below the minimum
    if left < kv.bytes:
        measured = "" if kv.assumed.startswith("response lengths as") else (
            "give measured response lengths (train-grpo's lengths:, notebook 01's lengths.json), or ")
        warnings.warn(f"tltlib: {where}: the KV page pool gets {left / 2 ** 30:.2f} GiB (what the other parts leave "
                      f"of {HEADROOM:.0%} of {available / 2 ** 30:.1f} GiB) but the rollout is expected to hold "
                      f"{kv.bytes / 2 ** 30:.2f} GiB at its peak, assuming {kv.assumed}: rows will wait for pages "
                      f"(slower, never out of memory); to avoid it {measured}lower grpo.micro_batch_tokens, "
                      "generation_batch_size or max_completion_length", stacklevel=3)
        return left
    return max(minimum, min(left, math.ceil(POOL_SLACK * kv.bytes)))


@dataclass(frozen=True)
class WorkerShape:
    """What one GRPO worker's memory depends on beside the model and its :class:`tltlib.rl.grpo.GRPOConfig` (a
    :class:`tltlib.rl.trainer.GRPOTrainer` reports its own: :meth:`~tltlib.rl.trainer.GRPOTrainer.worker_shape`)."""

    prompt_tokens: int
    """The longest prompt (tokens)."""
    rows: int
    """Completions this worker rolls out per RL step."""
    elem_bytes: int
    """Bytes per parameter of the policy (and per KV value)."""
    params: int
    """The policy's parameters."""
    drafter: bool = False
    """A drafter drafts in the rollout (its one-layer cache shares the page pool)."""
    drafter_trainable: int = 0
    """Parameters the online drafter trains (0: it does not train)."""
    buffer_tokens: int = 0
    """Pairs the online drafter's buffer holds (0: no buffer)."""


def longest_row_bytes(prompt_tokens: int, max_new: int, kv: KVEstimate, page_size: int) -> int:
    """The pool's minimum: the pages of one row of ``prompt_tokens`` + ``max_new`` + the engine's draft margin, at
    ``kv``'s bytes per token, and a page more (the pool's split between the target's and the drafter's caches
    rounds down)."""
    from ..rollout.config import RolloutConfig
    longest = pages_for(prompt_tokens + max_new + RolloutConfig.draft_margin, page_size)
    return (longest + 1) * page_size * (kv.bytes // kv.tokens)


def worker_kv(config, args, shape: WorkerShape, measured: MeasuredLengths | None = None) -> tuple[KVEstimate, int]:
    """(:func:`rollout_kv` of a worker's rollout, :func:`longest_row_bytes`): ``config`` the policy's
    :class:`tltlib.model.decoder.ModelConfig`, ``args`` its :class:`tltlib.rl.grpo.GRPOConfig`."""
    from ..kv.paged import KVConfig
    page = KVConfig.page_size
    kv = rollout_kv(config, args, shape.prompt_tokens, shape.rows, shape.elem_bytes, int(shape.drafter), measured,
                    page)
    return kv, longest_row_bytes(shape.prompt_tokens, args.max_completion_length, kv, page)


def worker_memory(config, args, shape: WorkerShape, kv: KVEstimate) -> dict[str, int]:
    """:func:`grpo_memory` of one worker (its share of the batch), with the KV estimate ``kv``
    (:func:`worker_kv`)."""
    return grpo_memory(config, args, shape.prompt_tokens, shape.rows, shape.elem_bytes, shape.params,
                       shape.drafter_trainable, shape.buffer_tokens, kv)


def plan_worker(config, args, shape: WorkerShape, device, measured: MeasuredLengths | None = None) -> KVPlan:
    """The KV page pool's budget (:func:`kv_pool_bytes`) of one GRPO worker on ``device``, with the estimate it came
    from; a run that cannot fit is refused (the trainer calls it before its engine is made). On a CPU the workers
    torchrun started on this machine (``LOCAL_WORLD_SIZE``) share its memory equally."""
    share = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torch.device(device).type == "cpu" else 1
    kv, minimum = worker_kv(config, args, shape, measured)
    return KVPlan(kv_pool_bytes(worker_memory(config, args, shape, kv), kv, minimum,
                                available_bytes(device) // max(share, 1),
                                f"GRPO with {args.generation_batch_size} completions of up to "
                                f"{args.max_completion_length} tokens on {device}"), kv)


def eagle_params(config) -> int:
    """About the parameters of a one-layer EAGLE drafter for ``config``'s model: one decoder layer and the 2h -> h
    projection (the embedding and head shared with the target)."""
    layer = replace(config, num_layers=1)
    emb = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return layer.num_parameters - emb - config.hidden_size + 2 * config.hidden_size ** 2


def grpo_plan(config, args, prompt_tokens: int, rows: int, elem_bytes: int, device_bytes: int, name: str,
              measured: MeasuredLengths | None = None, buffer_tokens: int = 0, page_size: int = 16,
              trainers: int = 1) -> list[str]:
    """The memory plan of a GRPO worker with TLT's online drafter (:func:`eagle_params`, its pair buffer of
    ``buffer_tokens``) on a device of ``device_bytes`` shared equally by ``trainers`` trainers side by side (notebook
    05 alternates a baseline's steps with TLT's): the weights, :func:`grpo_memory`'s parts and the page pool
    :func:`kv_pool_bytes` gives, as the comment lines of a parameter file (``name``: the model). Refused like the
    run itself (:func:`check_fits`) when it cannot fit."""
    gib = 2 ** 30
    params, drafter = config.num_parameters, eagle_params(config)
    weights = (params + drafter) * elem_bytes
    kv = rollout_kv(config, args, prompt_tokens, rows, elem_bytes, 1, measured, page_size)
    parts = grpo_memory(config, args, prompt_tokens, rows, elem_bytes, params, drafter, buffer_tokens, kv)
    minimum = longest_row_bytes(prompt_tokens, args.max_completion_length, kv, page_size)
    available = device_bytes // trainers - weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pool = kv_pool_bytes(parts, kv, minimum, available, f"GRPO of {name}")
    shown = [f"{k} {v / gib:.1f}" for k, v in parts.items() if v and k != KV_PART]
    rows_at_max = pool // (kv.bytes // max(rows, 1))
    share = f"{device_bytes / gib:.0f} GiB" if trainers == 1 else \
        f"{device_bytes / trainers / gib:.0f} GiB ({device_bytes / gib:.0f} GiB / {trainers} trainers)"
    return ["Memory of one GRPO worker (tltlib.rl.memory.grpo_plan; tests/test_memory.py renders and checks it):",
            f"{name} ({params / 1e9:.2f} B parameters) and its drafter ({drafter / 1e6:.0f} M) in {elem_bytes}-byte "
            f"weights: {weights / gib:.1f} GiB", f"of {share};",
            f"of the {available / gib:.1f} GiB left the run may use {HEADROOM:.0%}: " + ", ".join(shown[:3]) + ",",
            ", ".join(shown[3:]) + f" GiB (micro_batch_tokens {args.micro_batch_tokens:,});",
            f"the KV page pool gets {pool / gib:.1f} GiB. {rows} rows x {prompt_tokens} + "
            f"{args.max_completion_length:,} tokens would hold {kv.bytes / gib:.1f} GiB at their peak, assuming",
            f"{kv.assumed};",
            f"the pool holds {min(rows_at_max, rows)} of the {rows} rows at that length: the others wait for pages "
            "(admission by memory)." if rows_at_max < rows else
            "the pool holds every row at that length."]
