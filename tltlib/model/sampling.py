"""Logits -> sampling distribution (temperature, top-k, top-p) and sampling with an explicit ``torch.Generator``.

The distribution built here is *the* target distribution p of speculative decoding: plain sampling draws from it, and
lossless verification must reproduce it exactly, so both paths call :func:`probs_from_logits`.

Paper: TLT samples at temperature 0.9 in RL (§6.1); the reference engine's verification applies temperature, then
top-k and top-p renormalisation, in that order — as transformers' logits processors and this module do.

Departures: none.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import BadInput
from ..kernels import layer_ops


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn. ``temperature=0`` means greedy decoding."""

    temperature: float = 0.9
    """Softmax temperature; 0 selects the argmax (greedy)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = off); must be in (0, 1]."""
    max_new_tokens: int = 512
    """Most tokens generated per response (EOS included)."""

    def __post_init__(self):
        if not self.temperature >= 0:
            raise BadInput(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise BadInput(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.max_new_tokens <= 0:
            raise BadInput(f"max_new_tokens must be > 0, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution ``[..., V]`` (float32, rows sum to 1) from logits ``[..., V]``.

    Temperature first, then top-k, then top-p (nucleus; the most likely token always survives). ``temperature`` must
    be > 0; greedy decoding does not build a distribution."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_k and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) >= top_p * cum[..., -1:]      # mass before this token already reaches top_p
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    if top_k or top_p < 1.0:
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def uniforms(*shape: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """float64 uniforms in [0, 1) of ``shape`` (53 random bits each): what every sampler of the rollout draws on."""
    return torch.rand(*shape, dtype=torch.float64, generator=generator, device=device)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``probs [B, V]`` -> ``[B]`` int64, by :func:`inverse_cdf` on a float64 uniform."""
    return inverse_cdf(probs, uniforms(probs.shape[0], 1, generator=generator, device=probs.device))[:, 0]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens ``[B, K]`` from ``probs [B, V]`` (rows need not sum to 1) and float64 uniforms ``u [B, K]`` in [0, 1).

    The cumulative sum and the search run in float64. On a float32 CDF (or with float32 uniforms) every token's
    probability moves to a multiple of 2^-24 — tokens below it are never drawn, others over-drawn: a total variation
    from ``probs`` that grows with the vocabulary (``bench sampling``: 6e-7 per draw at 74 tokens, 3e-4 at 49,152,
    7e-4 at 151,936). In float64 a token's share of [0, 1) is off by its boundaries' rounding to the 2^-53 grid of
    uniforms: about V x 2^-53 / 6 in all (3e-12 at 151,936 tokens).

    Token i is drawn when ``cum[i-1] <= u * total < cum[i]`` (a right-side search), so a token of zero probability
    is never drawn, also at ``u = 0`` and when rounding lifts ``u * total`` to the total (it is clamped just below
    it)."""
    if u.dtype != torch.float64:
        raise BadInput(f"inverse_cdf needs float64 uniforms (tltlib.model.sampling.uniforms), got {u.dtype}: float32 "
                       "ones round every token's probability to a multiple of 2^-24")
    cum = probs.double().cumsum(-1)
    total = cum[:, -1:]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, x, right=True)


def sample_from_logits(logits: torch.Tensor, cfg: SamplingConfig,
                       generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``[B]`` tokens from ``logits [B, V]``; also return their log-probabilities ``[B]``.

    Log-probabilities are under the distribution actually sampled from (after temperature, top-k, top-p); with
    ``temperature=0`` the token is the argmax and the log-probability is that of the unscaled softmax."""
    if cfg.greedy:
        if logits.dim() == 2 and layer_ops.usable(logits):
            return layer_ops.argmax_logprob(logits)          # the same, in one C++ call on a CPU
        tokens = logits.argmax(-1)
        return tokens, token_logprobs(logits, tokens, cfg)
    probs = probs_from_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    tokens = sample(probs, generator)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Log-probability of ``tokens [...]`` under the sampling distribution of ``logits [..., V]`` (the unscaled
    softmax when greedy), as :func:`sample_from_logits` reports them."""
    if cfg.greedy:
        return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    probs = probs_from_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    return probs.gather(-1, tokens[..., None])[..., 0].log()
