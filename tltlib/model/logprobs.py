"""The RL training forward: per-token log-probabilities of given responses under the rollout's sampling distribution.

GRPO needs, for every response token, log pi(x_t | x_<t) under exactly the distribution the rollout sampled from
(temperature, then top-k, then top-p, renormalised: :func:`tltlib.model.sampling.probs_from_logits`), with gradients for
the policy update (and without them for the old and reference policies). Two costs are avoided:

* **No [B, T, V] logits.** The decoder returns hidden states only (:meth:`Transformer.hidden_states`); the hidden
  states that predict response tokens are gathered ([K, H] for K response tokens), and the LM head plus log-softmax
  run over chunks of ``chunk`` tokens, each under gradient checkpointing (its activations recomputed in the backward)
  when gradients are on, so at most one
  ``[chunk, V]`` block of logits is alive in the forward and in the backward.
* **Little padding.** Sequences are grouped by length into micro-batches of at most ``max_tokens`` padded tokens
  (:func:`micro_batches`); in a long-tailed batch this trains on a fraction of the padding one batch would carry.

Paper: TLT §2 (the RL step: rollout, then log-prob/reference forwards and the update). TRL and verl compute the
same per-token log-probabilities (``selective_log_softmax`` / ``logprobs_from_logits``).

Departures:
1. top-k and top-p are applied here exactly as in the rollout (TRL and verl apply only the temperature, so their
   training log-probabilities differ from the sampler's when top-k/top-p are set). The kept set is treated as a
   constant of the gradient.
2. Padding is bounded by length-bucketed micro-batches rather than packing (packing needs a varlen attention kernel
   that PyTorch's CPU path lacks).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint as gradient_checkpoint

from ..errors import BadInput
from ..kernels.dispatch import linear
from .sampling import SamplingConfig, probs_from_logits


def sampling_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """log-probability of ``tokens [...]`` under the sampling distribution of ``logits [..., V]`` (float32,
    differentiable in ``logits``). Greedy sampling: the unscaled log-softmax (as the rollout reports it)."""
    z = logits.float()
    if sampling.greedy:
        return torch.log_softmax(z, -1).gather(-1, tokens[..., None])[..., 0]
    z = z / sampling.temperature
    if sampling.top_k or sampling.top_p < 1.0:
        with torch.no_grad():
            kept = probs_from_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p) > 0
        z = z.masked_fill(~kept, float("-inf"))
    return torch.log_softmax(z, -1).gather(-1, tokens[..., None])[..., 0]


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of sequences grouped by length so that rows x longest <= ``max_tokens`` (a sequence longer than the
    budget gets a micro-batch of its own). Groups are consecutive runs of the length-sorted order."""
    if max_tokens < 1:
        raise BadInput(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:                                  # ascending: the newest member is the longest
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def pad_right(rows: Sequence[Sequence[int]], pad_id: int, device) -> torch.Tensor:
    """Token rows right-padded with ``pad_id`` into one ``[len(rows), longest]`` int64 tensor on ``device``."""
    out = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
    for j, r in enumerate(rows):
        out[j, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out.to(device)


def padded_tokens(lengths: Sequence[int], groups: list[list[int]]) -> int:
    """Tokens a forward over ``groups`` computes, padding included."""
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


@dataclass
class SequenceBatch:
    """Prompt + response sequences, right-padded into one tensor.

    Attributes:
        tokens: ``[B, T]`` ids.
        prompt_lens: ``[B]`` prompt lengths (response token j sits at ``prompt_lens[b] + j``).
        response_lens: ``[B]`` response lengths.
        index: which sequences of the caller's batch these rows are.
    """

    tokens: torch.Tensor
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    index: list[int]

    @classmethod
    def build(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], index: Sequence[int],
              pad_id: int, device) -> "SequenceBatch":
        rows = [list(prompts[i]) + list(responses[i]) for i in index]
        return cls(pad_right(rows, pad_id, device), torch.tensor([len(prompts[i]) for i in index], device=device),
                   torch.tensor([len(responses[i]) for i in index], device=device), list(index))

    @property
    def width(self) -> int:
        """Longest response (columns of the log-prob tensor)."""
        return int(self.response_lens.max()) if len(self.index) else 0

    def response_mask(self) -> torch.Tensor:
        """``[B, width]`` bool: response token j of row b exists."""
        j = torch.arange(self.width, device=self.tokens.device)
        return j[None, :] < self.response_lens[:, None]


def response_logprobs(model, batch: SequenceBatch, sampling: SamplingConfig, chunk: int = 2048) -> torch.Tensor:
    """``[B, width]`` log-probabilities of the response tokens (0 where the mask is off); differentiable when
    gradients are enabled, with at most ``[chunk, V]`` logits alive at a time."""
    hidden = model.hidden_states(batch.tokens)                              # [B, T, H]
    mask = batch.response_mask()
    rows, cols = mask.nonzero(as_tuple=True)                                # K response tokens
    pos = batch.prompt_lens[rows] + cols                                    # where each token sits
    h = hidden[rows, pos - 1]                                               # the hidden state predicting it
    tok = batch.tokens[rows, pos]
    w = model.head_weight
    grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)

    def chunk_logp(h_c, w_, t_c):
        return sampling_logprobs(linear(h_c, w_), t_c, sampling)

    parts = [gradient_checkpoint(chunk_logp, h[a: a + chunk], w, tok[a: a + chunk], use_reentrant=False) if grad
             else chunk_logp(h[a: a + chunk], w, tok[a: a + chunk]) for a in range(0, h.shape[0], chunk)]
    out = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)
    return out.index_put((rows, cols), torch.cat(parts) if parts else out.new_zeros(0))
